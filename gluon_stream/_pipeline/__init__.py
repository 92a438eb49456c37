"""The stages of one pass (an epoch), private; :mod:`gluon_stream.loader` wires them.

In the order data flows through them:

* ``keys``: which keys an epoch reads, and the kept keys of an endless iterator;
* ``sizes``: what is known of shard sizes (declared, known to the source, seen in a pass);
* ``producers``: the producer threads of a :class:`~gluon_stream.ShardStream` and their throttle;
* ``context``: the previous keys' last raw rows put before a shard's own (``context_rows``);
* ``shard``: one ready shard, and the ``prepare`` step that puts its arrays in the consumer's form;
* ``run``: one pass's window of shards, handed out in order, and the stream's side it drives;
* ``offsets``: the rows before each shard of a pass, as producers learn them (balanced strides);
* ``feed``: an epoch's shards as the units the planner cuts (one shard, or a window);
* ``batching``: which samples form which batch, the carry, where a resume starts (pure Python);
* ``batch_paths``: planned batches into data (slices of a shard, or per-sample work);
* ``counts``: an epoch's batch counts from declared or known sizes;
* ``starts``: where each pass starts (a loaded state, the last pass's carry, an epoch's samples);
* ``epoch``: one pass, composing the stages' positions into a state after every batch;
* ``provenance``: where each row of a delivered batch came from (``provenance=True``);
* ``state``: resume states, encoded, checksummed and checked;
* ``contracts``: the Protocols between the stages.
"""
