"""What a stream records as it runs: how each shard was produced (:class:`ShardRecord`),
what each pass delivered and waited for (:class:`EpochRecord`), and each setting the
``memory_budget`` tuner changed (:class:`TuningRecord`). Plain data: the stream and
the pass fill them, :class:`~gluon_stream.Stats` keeps them, ``diagnose()`` reads them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["EpochRecord", "ShardRecord", "TuningRecord"]


@dataclass
class ShardRecord:
    """How one shard was produced.

    Attributes:
        key: The shard key.
        epoch: The epoch it was produced for.
        samples: Samples in the shard after the transform.
        cache_hit: Loaded from the cache instead of generated.
        generate_s: Seconds running the generator (or waiting for the cache lock).
        load_s: Seconds reading and validating the file.
        transform_s: Seconds in the transform, the shuffle and the copy into an NDArray.
        producer: The producer that made it (its lane: ``gluon_stream-producer_<place>``).
        error: ``"Type: message"`` for a shard skipped by ``on_error='skip'``, else None.
        source: The name of the source it came from in a :class:`~gluon_stream.MixSource`
            (None for a source used alone, and for a skipped shard).
        nbytes: Bytes of its arrays after the transform (0: not measured).
    """

    key: Any
    epoch: int
    samples: int = 0
    cache_hit: bool = False
    generate_s: float = 0.0
    load_s: float = 0.0
    transform_s: float = 0.0
    producer: str = ""
    error: str | None = None
    source: str | None = None
    nbytes: int = 0


@dataclass
class EpochRecord:
    """What one pass over the stream delivered and how long the consumer waited.

    Attributes:
        epoch: The epoch number.
        batches: Batches yielded.
        samples: Samples yielded.
        wall_s: Seconds from the start of the pass to its end (or to the latest batch).
        stall_s: Seconds the training loop waited for batches (the "wait" spans).
        first_batch_s: Seconds until the first batch (start-up latency), None before it.
        rotation_s: Per shard boundary where the next shard was produced in time, seconds
            the switch to it cost (boundaries that waited for production count as stall).
        peak_prefetch: Most shards held at once (the current one plus those ready ahead).
        skipped_shards: Shards dropped by ``on_error='skip'``.
        complete: The pass ran to its end (not broken out of).
        shard_wait_s: Of ``stall_s``, seconds waiting for shards to be produced (generated,
            loaded, transformed).
        mix_wait_s: Of ``stall_s``, seconds waiting for a shuffle window's unit to be gathered.
        worker_wait_s: Of ``stall_s``, seconds waiting for per-sample workers to make batches
            (with ``num_workers=0``: making them in the loop's thread).
        place_s: Seconds the loop spent placing batches on ``ctx``.
        start_s: When the pass began, in seconds since the :class:`Stats` was created.
        producers: Producers at work when the pass ended (0: not recorded).
    """

    epoch: int
    batches: int = 0
    samples: int = 0
    wall_s: float = 0.0
    stall_s: float = 0.0
    first_batch_s: float | None = None
    rotation_s: list = field(default_factory=list)
    peak_prefetch: int = 0
    skipped_shards: int = 0
    complete: bool = False
    shard_wait_s: float = 0.0
    mix_wait_s: float = 0.0
    worker_wait_s: float = 0.0
    place_s: float = 0.0
    start_s: float | None = None
    producers: int = 0


@dataclass
class TuningRecord:
    """One change the ``memory_budget`` tuner made to a setting.

    Attributes:
        time_s: When, in seconds since the :class:`~gluon_stream.Stats` was created.
        epoch: The epoch of the shard after which it was decided.
        setting: ``'prefetch'`` or ``'producers'``.
        old: The value before.
        new: The value after.
        reason: Why, in words (as logged at INFO).
        limited: The budget stopped the change short of what the measurements asked for.
    """

    time_s: float
    epoch: int
    setting: str
    old: int
    new: int
    reason: str
    limited: bool = False
