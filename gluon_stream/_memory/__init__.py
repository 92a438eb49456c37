"""Memory a loader holds, bounded by ``memory_budget``: the gate that admits each part of a shard
before it is allocated (``gate``), and the tuner that sizes prefetch, producers and workers
within it (``tuner``). Below the stages: it imports none of them."""
