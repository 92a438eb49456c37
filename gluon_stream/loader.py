"""StreamLoader: batches over a stream of shards, nothing lost or duplicated at shard boundaries.

The loader wires three parts together: a :class:`~gluon_stream.ShardStream` (shards produced
ahead), the :class:`~gluon_stream.batching.BatchPlanner` (which samples form which batch, where
a resume starts) and one of two ways to turn planned batches into data, chosen automatically:

* **vectorised** (no ``batchify_fn``, no ``sample_transform``): the producer thread copies
  the (already shuffled) shard into one NDArray in the background; batches are contiguous
  slices of it. No per-sample Python work, no worker pool, rotation costs microseconds,
  and the batches are exactly those a ``gluon.data.DataLoader`` would build.
* **DataLoader** (a ``batchify_fn`` or ``sample_transform`` is given): a
  ``gluon.data.DataLoader`` with the user's ``num_workers``/``thread_pool``/``pin_memory``
  iterates each shard's planned batches (see :mod:`gluon_stream._mx.dataloader`).
"""
from __future__ import annotations

import contextlib
import logging
import weakref
from concurrent.futures import Executor
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from . import _validate
from ._closing import Closing
from ._mx import arrays as mx_arrays
from ._mx import dataloader as mx_dataloader
from ._mx import require_mxnet
from .batching import LAST_BATCH_MODES, Batch, BatchPlanner, Position, Segment, UnitPlan
from .errors import LoaderClosed, WorkerDied
from .sources import Source
from .stats import EpochRecord, Stats
from .progress import ProgressBar
from .stream import EpochRun, Shard, ShardStream

__all__ = ["StreamLoader"]

logger = logging.getLogger(__name__)

#: Options of the stream a loader builds; given together with a ShardStream they clash.
STREAM_OPTIONS = ("transform", "shuffle", "seed", "prefetch", "producers", "on_error", "schema",
                  "stats", "num_parts", "part_index", "kvstore", "shard_sizes")


class _Carry:
    """The data of the samples the planner carries, in the planner's segment order.

    Chunks are tuples of NDArrays (vectorised path) or lists of samples (DataLoader path).
    """

    def __init__(self) -> None:
        self.chunks: list = []
        self.segments: list[Segment] = []

    def add(self, segment: Segment, chunk: Any) -> None:
        self.segments.append(segment)
        self.chunks.append(chunk)

    def take_all(self) -> list:
        chunks, self.chunks, self.segments = self.chunks, [], []
        return chunks

    def __len__(self) -> int:
        return sum(s.size for s in self.segments)


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

    def start(self) -> None:
        """Nothing to set up before the first shard."""

    def unit(self, shard: Shard, plan: UnitPlan, carry: _Carry) -> Iterator[tuple[Batch, Any]]:
        arrays = shard.arrays
        for batch in plan.batches():  # only the joined batch opens with carried samples
            parts = carry.take_all() if batch is plan.joined else []
            own = batch.segments[-1]
            parts.append(tuple(a[own.start:own.stop] for a in arrays))
            yield batch, _as_batch(_join(parts))

    def tail(self, batch: Batch, carry: _Carry) -> Any:
        return _as_batch(_join(carry.take_all()))

    def close(self) -> None:
        """Nothing owned."""


class _DataLoaderPath:
    """Per-sample work (``sample_transform``/``batchify_fn``) in a ``gluon.data.DataLoader``."""

    prepare = None  # shards stay numpy arrays, permuted by the stream

    def __init__(self, loader: "StreamLoader") -> None:
        self.sample_transform = loader.sample_transform
        self.batchify = loader.batchify_fn or mx_arrays.default_batchify_fn()
        self.num_workers = loader.num_workers
        self.thread_pool = loader.thread_pool
        self.pin_memory = loader.pin_memory
        self.pin_device_id = loader.pin_device_id
        self.timeout = loader.timeout
        self.retries = loader.stream.error_policy.retries
        self._swap = _SwapDataset()
        self._batch_list = _BatchList()
        self._shared: Any = None
        self._dataloaders: set = set()

    @property
    def shares_dataloader(self) -> bool:
        """Threads or no workers: one DataLoader serves every shard (no fork per shard)."""
        return self.num_workers == 0 or self.thread_pool is None or bool(self.thread_pool)

    def cut(self, shard: Shard, segment: Segment) -> list:
        return [_row(shard.arrays, i) for i in range(segment.start, segment.stop)]

    def start(self) -> None:
        """Build the long-lived DataLoader now: its gc.collect() overlaps the first generation."""
        if self.shares_dataloader:
            self._ensure_shared()

    def unit(self, shard: Shard, plan: UnitPlan, carry: _Carry) -> Iterator[tuple[Batch, Any]]:
        if not len(plan):
            return
        carried = [s for chunk in carry.take_all() for s in chunk]
        first = plan.joined.segments[-1].start if plan.joined is not None else plan.full.start
        dataset = _ShardDataset(carried, shard.arrays, self.sample_transform, start=first)
        batches = list(plan.batches())
        indices = [self._indices(b, len(carried), first, plan) for b in batches]
        with contextlib.closing(self._run(dataset, indices, key=shard.key)) as out:
            for planned, data in zip(batches, out):
                yield planned, data

    @staticmethod
    def _indices(batch: Batch, carried: int, first: int, plan: UnitPlan) -> list[int]:
        """Dataset indices of a planned batch: carried samples first, then the unit's rows."""
        out: list[int] = []
        for seg in batch.segments:
            if seg.unit == plan.unit and seg.epoch == plan.epoch:
                out.extend(range(carried + seg.start - first, carried + seg.stop - first))
            else:
                out.extend(range(len(out), len(out) + seg.size))
        return out

    def tail(self, batch: Batch, carry: _Carry) -> Any:
        dataset = _ShardDataset([s for chunk in carry.take_all() for s in chunk], (),
                                self.sample_transform)
        with contextlib.closing(self._run(dataset, [list(range(len(dataset)))])) as out:
            return next(out)

    def _ensure_shared(self) -> None:
        """Build the long-lived DataLoader once; its constructor runs gc.collect() (~50 ms)."""
        if self._shared is None:
            self._shared = mx_dataloader.make_dataloader(
                self._swap, self._batch_list, batchify_fn=self.batchify,
                num_workers=self.num_workers, thread_pool=True, pin_memory=self.pin_memory,
                pin_device_id=self.pin_device_id, timeout=self.timeout)
            self._dataloaders.add(self._shared)

    def _run(self, dataset: "_ShardDataset", batches: list, key: Any = None) -> Iterator[Any]:
        if self.shares_dataloader:
            self._ensure_shared()
            self._swap.current = dataset
            self._batch_list.batches = batches
            try:
                yield from mx_dataloader.thread_batches(self._shared, self.timeout, key,
                                                        len(batches))
            finally:
                if self._swap.current is dataset:  # a late close must not clear a newer shard
                    self._swap.current = None
            return
        # A process pool (thread_pool=False) is forked per shard and driven by pool_batches,
        # which notices a dead worker (MXNet would wait for its lost batch forever) and a slow
        # batch. With on_error=('retry', n) the undelivered batches are redone in a fresh pool,
        # so every sample is still delivered exactly once.
        done = 0
        for attempt in range(self.retries + 1):
            sampler = _BatchList()
            sampler.batches = batches[done:]
            dataloader = mx_dataloader.make_dataloader(
                dataset, sampler, batchify_fn=self.batchify, num_workers=self.num_workers,
                thread_pool=False, pin_memory=self.pin_memory, pin_device_id=self.pin_device_id,
                timeout=self.timeout)
            self._dataloaders.add(dataloader)
            try:
                for batch in mx_dataloader.pool_batches(dataloader, sampler.batches, self.timeout,
                                                        key, first=done, total=len(batches)):
                    done += 1
                    yield batch
                    del batch  # a kept exception's frames must not pin shared-memory batches
                return
            except WorkerDied as exc:
                if attempt == self.retries:
                    raise
                logger.warning("%s; redoing the %d undelivered batch(es) in a new worker pool "
                               "(retry %d/%d)", str(exc), len(batches) - done, attempt + 1,
                               self.retries)
            finally:
                self._release(dataloader)

    def _release(self, dataloader: Any) -> None:
        self._dataloaders.discard(dataloader)
        mx_dataloader.release_dataloader(dataloader)

    def close(self) -> None:
        """End every DataLoader worker pool."""
        for dataloader in list(self._dataloaders):
            self._release(dataloader)


class _ShardDataset:
    """Samples carried over from earlier shards, then a shard's rows from ``start`` on."""

    def __init__(self, carry: list, arrays: Sequence[Any],
                 sample_transform: Callable[..., Any] | None, start: int = 0) -> None:
        self.carry = carry
        self.arrays = tuple(arrays)
        self.sample_transform = sample_transform
        self.start = start

    def __len__(self) -> int:
        rows = len(self.arrays[0]) - self.start if self.arrays else 0
        return len(self.carry) + rows

    def __getitem__(self, idx: int) -> Any:
        if idx < len(self.carry):
            item = self.carry[idx]
        else:
            item = tuple(a[self.start + idx - len(self.carry)] for a in self.arrays)
        if self.sample_transform is not None:
            return self.sample_transform(*item)
        return item[0] if len(item) == 1 else item


class _SwapDataset:
    """The dataset a long-lived thread/in-process DataLoader reads; swapped per shard."""

    def __init__(self) -> None:
        self.current: _ShardDataset | None = None

    def __len__(self) -> int:
        return len(self.current) if self.current is not None else 0

    def __getitem__(self, idx: int) -> Any:
        return self.current[idx]


class _BatchList:
    """A batch sampler whose batches are set per shard."""

    def __init__(self) -> None:
        self.batches: list = []

    def __iter__(self) -> Iterator[list]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class _LoaderResources:
    """What a StreamLoader owns: its stream (if it built it) and its batch path's pools."""

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


class _Rotation:
    """Times the switch from one shard to the next, minus the wait for it to be produced."""

    def __init__(self) -> None:
        self.start: float | None = None
        self.wait = 0.0

    def boundary(self, t0: float, waited: float) -> None:
        if self.start is None:
            self.start = t0
        self.wait += waited

    def batch(self, now: float, record: EpochRecord) -> None:
        if self.start is not None:  # first batch after a shard boundary
            record.rotation_s.append(max(0.0, now - self.start - self.wait))
            self.start, self.wait = None, 0.0


class StreamLoader(Closing):
    """Iterate full, shuffled batches over shards produced on demand.

    Args:
        source: A source (``CommandSource``, ``FunctionSource``, ``FileSource``) or a
            :class:`ShardStream`. With a stream, set ``transform``/``shuffle``/``seed``/
            ``prefetch``/``producers``/``on_error``/``schema`` on the stream.
        batch_size: Samples per batch.
        transform: ``transform(raw) -> arrays`` per shard, in a background producer thread.
        sample_transform: ``fn(*sample) -> sample`` per sample (like ``Dataset.transform``);
            selects the DataLoader path.
        shuffle: Shuffle shard order and samples within shards, from ``(seed, epoch)``
            (default False).
        seed: Shuffle seed (None: drawn once, logged).
        last_batch: ``'keep'`` (default, as Gluon), ``'discard'`` or ``'rollover'``; applies at
            the end of the epoch only, leftovers always cross shard boundaries.
        num_workers, thread_pool, batchify_fn, pin_memory, pin_device_id, timeout: As in
            ``gluon.data.DataLoader``; ``thread_pool=None`` means threads (no fork per shard)
            unless set to False. Without ``batchify_fn``/``sample_transform`` batches are
            slices and no workers are needed.
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
        shard_sizes: ``{key: samples}`` or ``fn(key)`` after ``transform``, when file headers
            cannot tell (for ``len()`` and ``even_batches``).

    Example:
        >>> import numpy as np
        >>> from gluon_stream import FunctionSource
        >>> src = FunctionSource(range(3), lambda k: np.arange(10.0))
        >>> with StreamLoader(src, batch_size=4) as loader:
        ...     [len(b) for b in loader]
        [4, 4, 4, 4, 4, 4, 4, 2]
    """

    STATE_VERSION = 1

    def __init__(self, source: Source | ShardStream, batch_size: int, *,
                 transform: Callable[[Any], Any] | None = _validate.UNSET,
                 sample_transform: Callable[..., Any] | None = None,
                 shuffle: bool = _validate.UNSET, seed: int | None = _validate.UNSET,
                 last_batch: str = "keep", num_workers: int = 0,
                 thread_pool: bool | None = None,
                 batchify_fn: Callable[[list], Any] | None = None, pin_memory: bool = False,
                 pin_device_id: int = 0, timeout: float = 120,
                 prefetch: int = _validate.UNSET, producers: int | Executor = _validate.UNSET,
                 on_error: Any = _validate.UNSET,
                 schema: Sequence[tuple[Any, Sequence[int]]] | None = _validate.UNSET,
                 stats: Stats | None = _validate.UNSET, progress: bool = False,
                 num_parts: int | str = _validate.UNSET, part_index: int | str = _validate.UNSET,
                 kvstore: Any = _validate.UNSET, even_batches: bool = False,
                 shard_sizes: Mapping[Any, int] | Callable[[Any], int] | None = _validate.UNSET
                 ) -> None:
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
        given = {name: value for name, value in (
            ("transform", transform), ("shuffle", shuffle), ("seed", seed),
            ("prefetch", prefetch), ("producers", producers), ("on_error", on_error),
            ("schema", schema), ("stats", stats), ("num_parts", num_parts),
            ("part_index", part_index), ("kvstore", kvstore), ("shard_sizes", shard_sizes))
            if _validate.is_set(value)}
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
        self._finished_epoch: int | None = None
        if self.vectorised:
            path: Any = _SlicePath(mx_arrays.batch_context(pin_memory, pin_device_id))
            if num_workers:
                logger.info("num_workers=%d unused: without batchify_fn/sample_transform, batches "
                            "are slices of a shard prepared in the background", num_workers)
        else:
            path = _DataLoaderPath(self)
        self._path = path
        self._res = _LoaderResources(stream, owns, path)
        self._finalizer = weakref.finalize(self, self._res.close)

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
            raise TypeError("len(StreamLoader) is unknown: the keys are an iterator, or shard sizes "
                            "are not known yet (a transform changes them); iterate one epoch first")
        return count

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
        return self._epoch(run, start, carry, delivered)

    def state_dict(self) -> dict:
        """Where the stream stands, as a small JSON-serialisable dict (take it between batches).

        A fresh loader with the same arguments continues, after :meth:`load_state_dict`, with
        exactly the batches this one would have produced next.
        """
        if self._position is not None:
            position, delivered = self._position, self._delivered
        elif self._resume is not None:
            position, delivered = self._resume
        else:
            epoch = self.stream.epoch
            if epoch == self._finished_epoch:  # set_epoch(e) then a whole pass: e + 1 is next
                epoch += 1
            position, delivered = Position(epoch, 0, 0, tuple(self._rollover.segments)), 0
        return {"epoch": position.epoch, "shard": position.unit, "offset": position.offset,
                "batches": delivered, "carry": [_segment_state(s) for s in position.carry],
                "version": self.STATE_VERSION, "seed": self.stream.seed,
                "shuffle": self.stream.shuffle, "batch_size": self.batch_size,
                "num_parts": self.stream.num_parts, "part_index": self.stream.part_index}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict` of a loader built with the same arguments."""
        expected = {"version": self.STATE_VERSION, "seed": self.stream.seed,
                    "shuffle": self.stream.shuffle, "batch_size": self.batch_size,
                    "num_parts": self.stream.num_parts, "part_index": self.stream.part_index}
        missing = {"epoch", "shard", "offset", "batches", "carry"} - set(state)
        if missing:
            raise ValueError(f"not a StreamLoader state: missing {sorted(missing)}")
        differ = {k: (state.get(k), v) for k, v in expected.items() if state.get(k) != v}
        if differ:
            raise ValueError(f"state was saved by a loader with other settings "
                             f"(saved, this one): {differ}; build the loader as before")
        carry = tuple(Segment(int(s["epoch"]), int(s["index"]), int(s["start"]), int(s["end"]),
                              s.get("key")) for s in state["carry"])
        position = Position(int(state["epoch"]), int(state["shard"]), int(state["offset"]), carry)
        self._resume = (position, int(state["batches"]))
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
        rotation = _Rotation()
        self._position, self._delivered = start, delivered
        run.start()  # producers start on the first shards before anything below can wait
        self._path.start()
        try:
            for planned, batch in self._planned(run, planner, carry, record, rotation):
                if limit is not None and delivered >= limit:
                    break  # even_batches: every part stops after the same number of batches
                now = clock()
                if record.first_batch_s is None:
                    record.first_batch_s = now - t_start
                record.stall_s += now - waiting_since
                rotation.batch(now, record)
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
            self._finished_epoch = run.epoch
        finally:
            run.cancel()
            record.skipped_shards = run.skipped
            record.wall_s = clock() - t_start
            if bar is not None:
                bar.close(record)

    def _planned(self, run: EpochRun, planner: BatchPlanner, carry: _Carry,
                 record: EpochRecord, rotation: _Rotation) -> Iterator[tuple[Batch, Any]]:
        """(planned batch, its data) for the whole epoch, unit by unit."""
        path = self._path
        clock = self.stats.clock
        first = True
        while True:
            t0 = clock()
            try:
                shard = run.next_shard()
            except LoaderClosed:
                raise
            except Exception:  # deliver what earlier shards left over first, then raise
                tail = planner.flush(run.index)
                if tail is not None:
                    yield tail, path.tail(tail, carry)
                raise
            if shard is None:
                break
            record.peak_prefetch = max(record.peak_prefetch, run.ready_ahead() + 1)
            if not first:
                rotation.boundary(t0, run.last_wait_s)
            first = False
            plan = planner.add(shard.index, len(shard), key=shard.key)
            yield from path.unit(shard, plan, carry)
            for seg in plan.leftover:
                carry.add(seg, path.cut(shard, seg))
            del shard
        tail = planner.finish()
        if tail is not None:
            yield tail, path.tail(tail, carry)

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


def _join(parts: list) -> tuple:
    """Arrays of a batch from its parts (tuples of NDArrays), joined along the sample axis."""
    if len(parts) == 1:
        return parts[0]
    return tuple(mx_arrays.concat(list(arrays)) for arrays in zip(*parts))


def _row(arrays: Sequence[Any], i: int) -> tuple:
    """One sample as a tuple of copied rows (a carried sample must not pin its shard)."""
    return tuple(np.array(a[i]) for a in arrays)


def _segment_state(segment: Segment) -> dict:
    """Where carried samples came from, as plain data: enough to produce them again."""
    key = segment.key if isinstance(segment.key, (str, int, float)) else str(segment.key)
    return {"epoch": segment.epoch, "index": segment.unit, "key": key, "start": segment.start,
            "end": segment.stop}


def _as_batch(arrays: tuple) -> Any:
    return arrays[0] if len(arrays) == 1 else list(arrays)
