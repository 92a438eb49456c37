"""StreamLoader: batches over a stream of shards, nothing lost or duplicated at shard boundaries.

The loader wires three parts together: a :class:`~gluon_stream.ShardStream` (shards produced
ahead), the :class:`~gluon_stream.batching.BatchPlanner` (which samples form which batch, where
a resume starts) and one of two ways to turn planned batches into data, chosen automatically:

* **vectorised** (no ``batchify_fn``, no ``sample_transform``): the producer thread copies
  the (already shuffled) shard into one NDArray in the background; batches are contiguous
  slices of it. No per-sample Python work, no worker pool, rotation costs microseconds,
  and the batches are exactly those a ``gluon.data.DataLoader`` would build.
* **per-sample** (a ``batchify_fn`` or ``sample_transform`` is given): samples are made and
  batched by workers (:mod:`gluon_stream._mx.workers`): in the loop's thread
  (``num_workers=0``), in threads (``thread_pool=True``), or, by default for
  ``num_workers > 0`` as in Gluon, in worker processes forked once per loader and fed each shard
  through shared memory. Batches are submitted ahead, across shard boundaries.
"""
from __future__ import annotations

import collections
import itertools
import logging
import weakref
from concurrent.futures import Executor
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from . import _validate
from ._closing import Closing
from ._lifecycle import check_owner, track
from ._mx import arrays as mx_arrays
from ._mx import require_mxnet
from ._mx import shm as mx_shm
from ._mx import workers as mx_workers
from ._mx.samples import SAMPLE_FORMATS
from .batching import LAST_BATCH_MODES, Batch, BatchPlanner, Position, Segment, UnitPlan
from .errors import LoaderClosed
from .progress import ProgressBar
from .sources import CachingSource, FileSource, Source
from .state import decode_state, encode_state
from .stats import EpochRecord, Stats
from .stream import EpochRun, Shard, ShardStream

__all__ = ["StreamLoader"]

logger = logging.getLogger(__name__)

class _Carry:
    """The data of the samples the planner carries, in the planner's segment order.

    Chunks are tuples of arrays (copies of the carried rows: NDArrays on the vectorised path,
    numpy arrays on the per-sample path), so a small leftover never keeps its shard alive.
    """

    def __init__(self) -> None:
        self.chunks: list[tuple] = []
        self.segments: list[Segment] = []

    def add(self, segment: Segment, chunk: tuple) -> None:
        self.segments.append(segment)
        self.chunks.append(chunk)

    def take_all(self) -> list[tuple]:
        chunks, self.chunks, self.segments = self.chunks, [], []
        return chunks

    def __len__(self) -> int:
        return sum(s.size for s in self.segments)


class _UnitFeed:
    """An epoch's shards in order, each with its batch plan (the one place both paths get them).

    :meth:`next` returns ``(shard, plan)`` until the epoch ends, then None; :attr:`final` is
    then the epoch's short tail (or the samples carried before a failing shard), and
    :attr:`failure` the error to raise after it. :meth:`done` cuts a finished unit's leftover
    rows into the carry.
    """

    def __init__(self, run: EpochRun, planner: BatchPlanner, carry: _Carry, path: Any,
                 record: EpochRecord) -> None:
        self.run, self.planner, self.carry, self.path, self.record = (run, planner, carry,
                                                                      path, record)
        self.final: Batch | None = None
        self.failure: BaseException | None = None
        self.shard_wait_s = 0.0  # time spent waiting for shards to be produced, in total
        self.samples = 0  # samples of the shards handed out
        self._ended = False

    def ready(self) -> bool:
        """Whether :meth:`next` would return without waiting for a shard to be produced."""
        return self._ended or self.run.ready()

    def next(self) -> tuple[Shard, UnitPlan] | None:
        if self._ended:
            return None
        try:
            shard = self.run.next_shard()
        except LoaderClosed:
            raise
        except Exception as exc:  # deliver what earlier shards left over first, then raise
            self._ended, self.failure = True, exc
            self.final = self.planner.flush(self.run.index)
            return None
        finally:
            self.shard_wait_s += self.run.last_wait_s
        if shard is None:
            self._ended = True
            self.final = self.planner.finish()
            return None
        self.record.peak_prefetch = max(self.record.peak_prefetch, self.run.ready_ahead() + 1)
        self.samples += len(shard)
        return shard, self.planner.add(shard.index, len(shard), key=shard.key)

    def done(self, shard: Shard, plan: UnitPlan) -> None:
        for seg in plan.leftover:
            self.carry.add(seg, self.path.cut(shard, seg))


class _SlicePath:
    """Batches as slices of a shard's NDArrays (copied and shuffled by the producer thread)."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.prepare = self._to_ndarrays  # one bound method: the stream compares it by identity

    def _to_ndarrays(self, arrays: tuple, order: np.ndarray | None) -> tuple:
        """Producer-side: the shard's rows in ``order`` as NDArrays (one copy, off the loop's path)."""
        if not len(arrays[0]):
            return arrays
        return tuple(mx_arrays.to_ndarray(a, self.ctx, order) for a in arrays)

    def cut(self, shard: Shard, segment: Segment) -> tuple:
        """Carried rows as a copy: a small leftover must not keep the whole shard alive."""
        return tuple(a[segment.start:segment.stop].copy() for a in shard.arrays)

    def batches(self, feed: _UnitFeed, carry: _Carry) -> Iterator[tuple[Batch, Any]]:
        while (unit := feed.next()) is not None:
            shard, plan = unit
            arrays = shard.arrays
            for batch in plan.batches():  # only the joined batch opens with carried samples
                parts = carry.take_all() if batch is plan.joined else []
                own = batch.segments[-1]
                parts.append(tuple(a[own.start:own.stop] for a in arrays))
                yield batch, _as_batch(_join(parts))
            feed.done(shard, plan)
            del shard, arrays, unit
        if feed.final is not None:
            yield feed.final, _as_batch(_join(carry.take_all()))
        if feed.failure is not None:
            raise feed.failure

    def cancel(self) -> None:
        """Nothing in flight."""

    def close(self) -> None:
        """Nothing owned."""


class _SamplePath:
    """Per-sample work (``sample_transform``/``batchify_fn``) on workers, ahead of the loop.

    Batches are submitted to the workers (see :mod:`gluon_stream._mx.workers`) as soon as their
    shard is in, up to the workers' depth ahead, also across shard boundaries, so rotating to
    the next shard does not drain the pool.
    """

    def __init__(self, loader: "StreamLoader") -> None:
        maker_args = {"sample_transform": loader.sample_transform,
                      "batchify_fn": loader.batchify_fn, "sample_format": loader.sample_format}
        self.workers = mx_workers.make_workers(loader.num_workers, bool(loader.thread_pool),
                                               maker_args, loader.stream.error_policy.retries)
        self.timeout = loader.timeout
        self.pin = (mx_arrays.batch_context(True, loader.pin_device_id)
                    if loader.pin_memory else None)
        self.prepare = self._to_shared if self.workers.uses_shared_memory else None
        self._ids = itertools.count()

    @staticmethod
    def _to_shared(arrays: tuple, order: np.ndarray | None) -> tuple:
        """Producer-side: the shard's rows in ``order``, copied into shared memory once."""
        return mx_shm.SharedArrays.copy_of(arrays, order)

    def cut(self, shard: Shard, segment: Segment) -> tuple:
        arrays = shard.arrays
        if isinstance(arrays, mx_shm.SharedArrays):  # in shared memory, not mapped here
            return arrays.rows(segment.start, segment.stop)
        return tuple(np.array(a[segment.start:segment.stop]) for a in arrays)

    def batches(self, feed: _UnitFeed, carry: _Carry) -> Iterator[tuple[Batch, Any]]:
        workers = self.workers
        window: collections.deque = collections.deque()  # (batch, task id, what, sources)
        live: dict[int, int] = {}  # source id -> batches in flight that read it
        unit, unit_sid = None, -1
        planned: Iterator[Batch] = iter(())
        numbers = itertools.count(1)
        ended = complete = False
        try:
            while True:
                while len(window) < workers.depth and not ended:
                    batch = next(planned, None)
                    if batch is None:
                        if unit is not None:
                            feed.done(*unit)
                            self._release(live, unit_sid)
                            unit = None
                        if window and not feed.ready():
                            break  # deliver what is in flight rather than wait for a shard
                        unit = feed.next()
                        if unit is None:
                            ended = True
                            break
                        unit_sid = next(self._ids)
                        workers.attach(unit_sid, unit[0].arrays)
                        live[unit_sid] = 1  # held until the unit is done
                        planned, numbers = unit[1].batches(), itertools.count(1)
                        continue
                    shard, plan = unit
                    refs, sids = self._refs(batch, plan, unit_sid, carry)
                    what = f"batch {next(numbers)} of {len(plan)} of shard {shard.key!r}"
                    window.append(self._submit(batch, refs, sids, what, shard.key, live))
                if not window:
                    break
                yield self._take(window.popleft(), live)
            if feed.final is not None:
                refs, sids = self._carry_refs(carry)
                item = self._submit(feed.final, refs, sids, "the epoch's last batch", None, live)
                yield self._take(item, live)
            complete = True
            if feed.failure is not None:
                raise feed.failure
        finally:
            if not complete:  # cut short: forget the batches in flight
                workers.cancel_all()

    def _refs(self, batch: Batch, plan: UnitPlan, unit_sid: int, carry: _Carry
              ) -> tuple[list, list[int]]:
        own = batch.segments[-1]
        refs, sids = [], [unit_sid]
        if batch is plan.joined:
            refs, sids = self._carry_refs(carry)
            sids.append(unit_sid)
        refs.append((unit_sid, range(own.start, own.stop)))
        return refs, sids

    def _carry_refs(self, carry: _Carry) -> tuple[list, list[int]]:
        chunks = carry.take_all()
        if not chunks:
            return [], []
        sid = next(self._ids)
        arrays = tuple(np.concatenate(parts) for parts in zip(*chunks))
        self.workers.attach(sid, arrays)
        return [(sid, range(len(arrays[0])))], [sid]

    def _submit(self, batch: Batch, refs: list, sids: list[int], what: str, key: Any,
                live: dict[int, int]) -> tuple:
        tid = next(self._ids)
        for sid in sids:
            live[sid] = live.get(sid, 0) + 1
        self.workers.submit(tid, refs, what, key)
        return batch, tid, what, sids

    def _take(self, item: tuple, live: dict[int, int]) -> tuple[Batch, Any]:
        batch, tid, what, sids = item
        data = self.workers.result(tid, self.timeout, what)
        for sid in sids:
            self._release(live, sid)
        if self.pin is not None:
            data = mx_arrays.as_in_context(data, self.pin)
        return batch, data

    def _release(self, live: dict[int, int], sid: int) -> None:
        live[sid] -= 1
        if not live[sid]:
            del live[sid]
            self.workers.detach(sid)

    def cancel(self) -> None:
        self.workers.cancel_all()

    def close(self) -> None:
        self.workers.close()


class _LoaderResources:
    """What a StreamLoader owns: its stream (if it built it) and its batch path's workers."""

    def __init__(self, stream: ShardStream, owns_stream: bool, path: Any) -> None:
        self.stream = stream
        self.owns_stream = owns_stream
        self.path = path
        self.closed = False

    def close(self) -> None:
        self.closed = True
        self.path.close()
        if self.owns_stream:
            self.stream.close()


class StreamLoader(Closing):
    """Iterate full, shuffled batches over shards produced on demand.

    Args:
        source: A source (``CommandSource``, ``FunctionSource``, ``FileSource``) or a
            :class:`ShardStream`. With a stream, set ``transform``/``shuffle``/``seed``/
            ``prefetch``/``producers``/``on_error``/``schema`` on the stream.
        batch_size: Samples per batch.
        transform: ``transform(raw) -> arrays`` per shard, in a background producer thread.
        sample_transform: ``fn(*sample) -> sample`` per sample (like ``Dataset.transform``);
            selects the per-sample path.
        sample_format: What per-sample code receives: ``'auto'`` (default: numpy rows, or
            NDArrays once MXNet/GluonCV code rejects numpy), ``'numpy'`` or ``'ndarray'`` (see
            :mod:`gluon_stream._mx.samples`).
        shuffle: Shuffle shard order and samples within shards, from ``(seed, epoch)``
            (default False).
        seed: Shuffle seed (None: drawn once, logged).
        last_batch: ``'keep'`` (default, as Gluon), ``'discard'`` or ``'rollover'``; applies at
            the end of the epoch only, leftovers always cross shard boundaries.
        num_workers, thread_pool, batchify_fn, pin_memory, pin_device_id, timeout: As in
            ``gluon.data.DataLoader``: ``num_workers > 0`` forks that many worker processes
            (once, here), ``thread_pool=True`` uses threads instead. Without
            ``batchify_fn``/``sample_transform`` batches are slices and no workers are needed.
        prefetch: Shards produced ahead of the one being consumed (default 2).
        producers: Shards produced in parallel (threads, default 1), or a
            ``concurrent.futures.Executor`` (e.g. a dask client's) that generates them into a
            shared ``cache_dir``.
        on_error: ``'raise'`` (default), ``'skip'`` or ``('retry', n)`` per shard.
        schema: Expected ``[(dtype, trailing_shape), ...]``; default: the first shard's.
        stats: A :class:`Stats` to record into (default: a new one, ``loader.stats``).
        progress: Show a tqdm bar per epoch (samples/s, share of time waiting, shards ahead).
        num_parts, part_index: This rank's part of every epoch's shards (MXNet's names);
            ``'auto'`` reads them from ``kvstore``, Horovod or the launcher's environment.
        kvstore: An MXNet kvstore to read the rank from with ``'auto'``.
        even_batches: Every part yields the same number of full batches per epoch (the
            smallest part's count; the few samples beyond it wait for another epoch, dealt
            differently), so synchronous training never waits on a rank that ran out.
        shard_sizes: Samples per shard after ``transform``, when headers cannot tell (for
            ``len()`` and ``even_batches``): ``{key: samples}``, ``fn(key)``, or one int for
            every shard.
        num_epochs: How many epochs will be run, if known: the last epoch's end then does not
            produce the next epoch's first shards ahead.

    Example:
        >>> import numpy as np
        >>> from gluon_stream import FunctionSource
        >>> src = FunctionSource(range(3), lambda k: np.arange(10.0))
        >>> with StreamLoader(src, batch_size=4) as loader:
        ...     [len(b) for b in loader]
        [4, 4, 4, 4, 4, 4, 4, 2]
    """

    def __init__(self, source: Source | ShardStream, batch_size: int, *,
                 transform: Callable[[Any], Any] | None = _validate.UNSET,
                 sample_transform: Callable[..., Any] | None = None,
                 sample_format: str = "auto", shuffle: bool = _validate.UNSET, seed: int | None = _validate.UNSET,
                 last_batch: str = "keep", num_workers: int = 0,
                 thread_pool: bool = False,
                 batchify_fn: Callable[[list], Any] | None = None, pin_memory: bool = False,
                 pin_device_id: int = 0, timeout: float = 120,
                 prefetch: int = _validate.UNSET, producers: int | Executor = _validate.UNSET,
                 on_error: Any = _validate.UNSET,
                 schema: Sequence[tuple[Any, Sequence[int]]] | None = _validate.UNSET,
                 stats: Stats | None = _validate.UNSET, progress: bool = False,
                 num_parts: int | str = _validate.UNSET, part_index: int | str = _validate.UNSET,
                 kvstore: Any = _validate.UNSET, even_batches: bool = False,
                 shard_sizes: Mapping[Any, int] | Callable[[Any], int] | int | None
                 = _validate.UNSET, num_epochs: int | None = _validate.UNSET) -> None:
        require_mxnet()
        self.batch_size = _validate.integer("batch_size", batch_size, minimum=1)
        self.last_batch = _validate.choice("last_batch", last_batch, LAST_BATCH_MODES)
        self.num_workers = _validate.integer("num_workers", num_workers, minimum=0)
        self.timeout = _validate.seconds("timeout", timeout)
        if even_batches and last_batch == "rollover":
            raise ValueError("even_batches=True delivers only full batches, so last_batch='rollover' "
                             "has nothing to roll over; use last_batch='keep' or 'discard'")
        _validate.callable_or_none("sample_transform", sample_transform)
        _validate.callable_or_none("batchify_fn", batchify_fn)
        self.sample_format = _validate.choice("sample_format", sample_format, SAMPLE_FORMATS)
        given = {name: value for name, value in (
            ("transform", transform), ("shuffle", shuffle), ("seed", seed),
            ("prefetch", prefetch), ("producers", producers), ("on_error", on_error),
            ("schema", schema), ("stats", stats), ("num_parts", num_parts),
            ("part_index", part_index), ("kvstore", kvstore), ("shard_sizes", shard_sizes),
            ("num_epochs", num_epochs)) if _validate.is_set(value)}
        if isinstance(source, ShardStream):
            if given:
                raise ValueError(f"{', '.join(given)} given to StreamLoader together with a "
                                 "ShardStream: set them on the ShardStream instead")
            stream, owns = source, False
        else:
            stream, owns = ShardStream(source, **given), True
        self.even_batches = bool(even_batches)
        self.thread_pool = thread_pool
        self.batchify_fn = batchify_fn
        self.sample_transform = sample_transform
        self.pin_memory = pin_memory
        self.pin_device_id = pin_device_id
        self.stream = stream
        self.progress = progress
        self.vectorised = batchify_fn is None and sample_transform is None
        self._rollover = _Carry()  # the data of the samples an epoch rolled over
        self._position: Position | None = None  # where the epoch in progress stands
        self._delivered = 0  # batches delivered in the epoch in progress
        self._resume: tuple[Position, int] | None = None  # set by load_state_dict
        if self.vectorised:
            path: Any = _SlicePath(mx_arrays.batch_context(pin_memory, pin_device_id))
            if num_workers:
                logger.info("num_workers=%d unused: without batchify_fn/sample_transform, batches "
                            "are slices of a shard prepared in the background", num_workers)
        else:
            path = _SamplePath(self)
        self._path = path
        self._res = _LoaderResources(stream, owns, path)
        self._finalizer = weakref.finalize(self, self._res.close)
        track(self, self._finalizer)

    # -- public API -----------------------------------------------------------------------
    @property
    def stats(self) -> Stats:
        """Per-shard and per-epoch records (see :class:`Stats`)."""
        return self.stream.stats

    @property
    def epoch(self) -> int:
        """The epoch the next iteration will produce."""
        return self.stream.epoch

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch of the next pass (its keys, shuffle order and cache entries)."""
        self.stream.set_epoch(epoch)

    def __len__(self) -> int:
        count = self._num_batches(self.stream.epoch)
        if count is None:
            raise TypeError(f"len(StreamLoader) is unknown for epoch {self.stream.epoch}: "
                            f"{self._unknown_size_reason(self.stream.epoch)}")
        return count

    def _unknown_size_reason(self, epoch: int) -> str:
        """Why this loader cannot count an epoch's samples without producing it, and the fix."""
        stream = self.stream
        _, finite, keys = stream.epoch_keys(epoch)
        if not finite:
            return ("the keys are an endless iterator, so the epoch has no known end (iterate "
                    "with a fixed number of steps instead)")
        unknown = [k for k in keys if stream.shard_size(k, epoch) is None]
        source = stream.source
        why = []
        if stream.transform is not None:
            why.append("a transform may change the sample counts of the files")
        if isinstance(source, CachingSource) and getattr(source, "_cache", None) is None:
            why.append("the shards are made by a function and not cached")
        elif isinstance(source, CachingSource):
            why.append("they are not in the cache yet")
        if source.per_epoch:
            why.append("the command uses {epoch}, so every epoch has new shards")
        if isinstance(source, FileSource):
            why.append("remote files' headers are not read ahead")
        return (f"the sizes of {len(unknown)} of {len(keys)} shards (e.g. {unknown[0]!r}) are not "
                f"known without producing them ({'; '.join(why) or 'they are made on demand'}). "
                "Pass shard_sizes= (a dict, fn(key), or one int for every shard), fill the cache "
                "ahead with gluon-stream generate, or read existing files with FileSource; sizes "
                "of shards seen in an earlier pass are reused when the data cannot change")

    def _num_batches(self, epoch: int) -> int | None:
        total = self.stream.epoch_size(epoch)
        if total is None:
            return None
        full, rest = divmod(total + len(self._rollover), self.batch_size)
        return full + (1 if rest and self.last_batch == "keep" else 0)

    def __iter__(self) -> Iterator[Any]:
        self._check_open()
        resume, self._resume = self._resume, None
        if resume is not None and resume[0].epoch != self.stream.epoch:
            logger.warning("state loaded for epoch %d, but epoch %d starts: iterating it from its "
                           "beginning", resume[0].epoch, self.stream.epoch)
            resume = None
        if resume is not None:
            start, delivered = resume
            carry = self._rebuild_carry(start.carry)
        else:
            start = Position(self.stream.epoch, 0, 0, tuple(self._rollover.segments))
            carry, delivered = self._rollover, 0
        self._rollover = _Carry()
        run = self.stream.start_epoch(skip=start.unit, prepare=self._path.prepare)
        self._position, self._delivered = start, delivered  # until a batch moves it
        return self._epoch(run, start, carry, delivered)

    def _settings(self) -> dict:
        """What decides the batches, stored in a state and checked on load."""
        stream = self.stream
        return {"seed": stream.seed, "shuffle": stream.shuffle, "batch_size": self.batch_size,
                "num_parts": stream.num_parts, "part_index": stream.part_index}

    def state_dict(self) -> dict:
        """Where the stream stands, as a small JSON-serialisable dict (take it between batches).

        A fresh loader with the same arguments continues, after :meth:`load_state_dict`, with
        exactly the batches this one would have produced next. The state also records the keys
        it refers to, so a resume with a changed key list is refused instead of repeating or
        skipping samples.
        """
        if self._position is not None:
            position, delivered = self._position, self._delivered
        elif self._resume is not None:
            position, delivered = self._resume
        else:  # between epochs: the next one starts, with what the last one rolled over
            position = Position(self.stream.epoch, 0, 0, tuple(self._rollover.segments))
            delivered = 0
        return encode_state(position, delivered, self._settings(),
                            self.stream.epoch_keys(position.epoch)[2])

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict` of a loader built with the same arguments.

        Raises:
            ValueError: the state is not a StreamLoader state, a field is out of range, it was
                saved with other settings, or the keys it refers to changed.
        """
        position, delivered = decode_state(state, self._settings(), self.batch_size,
                                           lambda epoch: self.stream.epoch_keys(epoch)[2])
        self._resume = (position, delivered)
        self._position = None
        self._rollover = _Carry()
        self.stream.set_epoch(position.epoch)

    def _rebuild_carry(self, segments: Sequence[Segment]) -> _Carry:
        """Produce the shards that carried samples came from again, and cut the same rows."""
        carry = _Carry()
        key_lists: dict[int, list | None] = {}
        for seg in segments:
            if seg.epoch not in key_lists:
                key_lists[seg.epoch] = self.stream.epoch_keys(seg.epoch)[2]
            keys = key_lists[seg.epoch]
            key = keys[seg.unit] if keys is not None else seg.key
            shard = self.stream.produce_now(key, seg.epoch, self._path.prepare)
            carry.add(seg, self._path.cut(shard, seg))
        return carry

    def close(self) -> None:
        """Stop producers, end worker pools, kill generators, remove temp files; idempotent."""
        self._finalizer()

    # -- one epoch ------------------------------------------------------------------------
    def _check_open(self) -> None:
        check_owner(self, "StreamLoader")
        if self._res.closed:
            raise LoaderClosed("this StreamLoader is closed; create a new one")
        self.stream.check_open()

    def _epoch(self, run: EpochRun, start: Position, carry: _Carry,
               delivered: int) -> Iterator[Any]:
        stats = self.stats
        clock = stats.clock
        record = stats.new_epoch(run.epoch)
        t_start = waiting_since = clock()
        bar = ProgressBar(run.epoch, self._num_batches(run.epoch)) if self.progress else None
        limit = self._even_limit(run.epoch)
        planner = BatchPlanner(self.batch_size, self.last_batch, start)
        feed = _UnitFeed(run, planner, carry, self._path, record)
        self._position, self._delivered = start, delivered
        last_unit, shard_wait = None, 0.0
        run.start()  # producers start on the first shards before anything below can wait
        try:
            for planned, batch in self._path.batches(feed, carry):
                if limit is not None and delivered >= limit:
                    break  # even_batches: every part stops after the same number of batches
                now = clock()
                if record.first_batch_s is None:
                    record.first_batch_s = now - t_start
                record.stall_s += now - waiting_since
                unit = planned.segments[-1].unit
                if last_unit is not None and unit != last_unit:  # the first batch of a shard
                    waited = feed.shard_wait_s - shard_wait  # for production: not rotation
                    record.rotation_s.append(max(0.0, now - waiting_since - waited))
                last_unit, shard_wait = unit, feed.shard_wait_s
                stats.add_span("train", "wait", waiting_since, now)
                record.batches += 1
                record.samples += planned.size
                delivered += 1
                self._position, self._delivered = planned.after, delivered
                if bar is not None:
                    record.wall_s = now - t_start
                    bar.update(record, run.ready_ahead())
                yield batch
                waiting_since = clock()
                stats.add_span("train", "busy", now, waiting_since)
            record.complete = True
            self._rollover = carry if self.last_batch == "rollover" else _Carry()
            self._position = None
            if not record.samples:
                logger.warning("epoch %d delivered no samples: %s", run.epoch,
                               _empty_reason(run, feed, self.batch_size, self.last_batch))
        finally:
            run.cancel()
            record.skipped_shards = run.skipped
            record.wall_s = clock() - t_start
            if bar is not None:
                bar.close(record)

    def _even_limit(self, epoch: int) -> int | None:
        """With even_batches, the batch count every part can deliver this epoch."""
        if not self.even_batches:
            return None
        sizes = self.stream.part_sizes(epoch)
        if sizes is None:
            raise TypeError(
                f"even_batches=True needs every shard's size for epoch {epoch} on every rank: use "
                "FileSource or a shared cache_dir filled ahead (gluon-stream generate), or pass "
                "shard_sizes= (samples after transform)")
        return min(sizes) // self.batch_size


def _empty_reason(run: EpochRun, feed: _UnitFeed, batch_size: int, last_batch: str) -> str:
    """Why an epoch gave no batch, in words (for its one WARNING)."""
    shards = run.index
    if not shards:
        return "it has no keys"
    if run.skipped == shards:
        return f"all {shards} shards were skipped (on_error='skip'; see the warnings above)"
    if feed.samples:
        return (f"its {feed.samples} samples are fewer than batch_size={batch_size} and "
                f"last_batch={last_batch!r} keeps them out of this epoch")
    return (f"its {shards} shard(s) hold no samples (does a transform return 0 rows, e.g. "
            "windows longer than the shard?)")


def _join(parts: list) -> tuple:
    """Arrays of a batch from its parts (tuples of NDArrays), joined along the sample axis."""
    if len(parts) == 1:
        return parts[0]
    return tuple(mx_arrays.concat(list(arrays)) for arrays in zip(*parts))


def _as_batch(arrays: tuple) -> Any:
    return arrays[0] if len(arrays) == 1 else list(arrays)
