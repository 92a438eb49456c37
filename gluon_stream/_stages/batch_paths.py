"""Planned batches into data: the loader's two batch paths, over the units of a feed.

* :class:`SlicePath` (no ``batchify_fn``, no ``sample_transform``): each unit's samples are in
  one NDArray per array, copied (and put in their shuffled order) once, in the background: by
  the producer thread for a shard, by the feed for a mixed unit; batches are slices of it.
* :class:`SamplePath`: per-sample work on workers (:mod:`gluon_stream._mx.workers`); batches
  are submitted ahead, across unit boundaries, so rotating to the next shard does not drain the
  workers.

Both take a :class:`~gluon_stream._stages.feed.UnitFeed` (units in order, each with its plan) and
the :class:`~gluon_stream._stages.feed.Carry`, and yield ``(planned batch, data)``.
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import itertools
import threading
import time
from typing import Any, Callable, Iterator, cast

import numpy as np

from .. import _mx as mx_arrays
from .._mx import shm as mx_shm
from .._mx.consumed import consumable
from .._utils.columns import ShapedArrays, check_batchable
from .._utils.lifecycle import ThreadPool
from .batching import Batch, Segment, UnitPlan
from .contracts import Workers
from .feed import Carry, MixedData, UnitFeed
from .produce import Prepare, owned_each

__all__ = ["SMALL_SHARD_BYTES", "Ordered", "SamplePath", "SlicePath"]

#: a shard of at most this many bytes stays in numpy until its batches are joined
SMALL_SHARD_BYTES = 64 << 10


class Ordered(ShapedArrays):
    """A shard's arrays as they were made, and the order to read their rows in (no copy yet):
    :attr:`raw` and :attr:`order` are what a mixed unit gathers from."""

    raw: tuple
    order: np.ndarray | None

    def __new__(cls, raw: tuple, order: np.ndarray | None) -> "Ordered":
        n = len(order) if order is not None else len(raw[0])
        self = super().__new__(cls, [(a.dtype, (n,) + a.shape[1:]) for a in raw])
        self.raw, self.order = raw, order
        return self

    def rows(self, rows: Any) -> np.ndarray:
        """Raw row indices of read rows ``rows``."""
        rows = np.asarray(rows, dtype=np.int64)
        return rows if self.order is None else self.order[rows]


class SlicePath:
    """Batches as slices of a unit's NDArrays (see the module doc).

    Args:
        ctx: The context batches are made in (``cpu``, or ``cpu_pinned`` with ``pin_memory``).
        mixed: Units mix shards (``shuffle_window > 1``): shards stay as made (no copy) until
            their unit gathers its rows straight into its NDArrays.
        batch_size: A shard of fewer rows (and at most :data:`SMALL_SHARD_BYTES`) stays a numpy
            copy until its batch is joined: every batch of it joins several shards (a copy
            anyway), and one NDArray per batch costs less than one per shard and array.
    """

    wait_s = 0.0  # batches are slices: the loop never waits for workers

    def __init__(self, ctx: Any, mixed: bool = False, batch_size: int = 0) -> None:
        self.ctx, self.batch_size = ctx, batch_size
        self._left = 0
        self._feed: UnitFeed | None = None
        # bound methods: the stream compares prepare by identity
        self.prepare: Prepare | None = self._ordered if mixed else self._to_ndarrays
        self._mixer: cf.ThreadPoolExecutor | None = None
        # one shard copied at a time: while a shard is copied its source and its NDArray both
        # exist, and producers copying at once held one such pair each (memory over its bound)
        self._copying = threading.Lock()

    def _to_ndarrays(self, arrays: tuple, order: np.ndarray | None, what: str) -> tuple:
        """Producer side: the shard's rows in ``order`` as NDArrays (one copy, off the loop),
        or a small shard's as a numpy copy (see the class doc)."""
        check_batchable(arrays, what=what)
        rows = len(arrays[0]) if order is None else len(order)
        if not len(arrays[0]):
            return arrays
        if rows < self.batch_size and sum(int(a.nbytes) for a in arrays) <= SMALL_SHARD_BYTES:
            return tuple(np.array(a) if order is None else a[order] for a in arrays)
        consume = _consumed(arrays)
        with self._copying:
            return tuple(mx_arrays.to_ndarray(arrays[i], self.ctx, order, consume=consume[i])
                         for i in range(len(arrays)))

    @staticmethod
    def _ordered(arrays: tuple, order: np.ndarray | None, what: str) -> tuple:
        check_batchable(arrays, what=what)
        return Ordered(tuple(arrays), order)

    def mix(self, mixed: MixedData) -> MixedData:
        """Gather a mixed unit's rows from its shards into its own NDArrays (one copy)."""
        unit = mixed.unit
        if not len(unit):
            return mixed
        shards = sorted(mixed.shards)  # searched: sorted, whatever order they are held in
        which = np.searchsorted(np.asarray(shards), unit.shards)
        raws = [cast(Ordered, mixed.shards[j].arrays) for j in shards]
        rows = np.empty(len(unit), dtype=np.int64)
        for s, ordered in enumerate(raws):  # read rows to the rows the shard was made with
            m = which == s
            rows[m] = ordered.rows(unit.rows[m])
        mixed.arrays = tuple(mx_arrays.gather_to_ndarray([o.raw[f] for o in raws], which, rows,
                                                         self.ctx)
                             for f in range(len(raws[0].raw)))
        mixed.shards = {}  # copied: the unit no longer keeps its shards alive
        return mixed

    def mix_later(self, mixed: MixedData) -> cf.Future:
        """:meth:`mix` in this path's mixing thread, off the loop's path (the gather of a unit
        costs about one shard's copy, as the producer's copy of a shard does)."""
        if self._mixer is None:
            self._mixer = ThreadPool(1, thread_name_prefix="gluon_stream-mixer")
        return self._mixer.submit(self.mix, mixed)

    def cut(self, unit: Any, segment: Segment) -> tuple:
        """Carried rows as a copy: a small leftover must not keep the whole unit alive (a
        small shard kept in numpy is kept whole: it is small, and its batch copies it)."""
        return tuple(a[segment.start:segment.stop] if isinstance(a, np.ndarray)
                     else a[segment.start:segment.stop].copy() for a in unit.arrays)

    def batches(self, feed: UnitFeed, carry: Carry, first: int = 0,
                seed_of: Callable[[int], int] | None = None) -> Iterator[tuple[Batch, Any]]:
        self._feed = feed
        copy = mx_arrays.copier(self.ctx)
        while (item := feed.next()) is not None:
            unit, plan = item
            arrays = unit.arrays
            self._left = len(plan)
            for batch in plan.batches():  # only the joined batch opens with carried samples
                parts = carry.take_all() if batch is plan.joined else []
                own = batch.segments[-1]
                piece = tuple(mx_arrays.slice_rows(a, own.start, own.stop) for a in arrays)
                self._left -= 1
                if not self._left and not parts:
                    # the unit's last batch is a copy: a slice would keep the whole unit alive
                    # while the loop holds the batch and waits for the next shard
                    piece = tuple(a if isinstance(a, np.ndarray) else copy(a) for a in piece)
                parts.append(piece)
                yield batch, _as_batch(_join(parts, self.ctx))
            feed.done(unit, plan)
            del unit, arrays, item
        if feed.final is not None:
            yield feed.final, _as_batch(_join(carry.take_all(), self.ctx))
        if feed.failure is not None:
            raise feed.failure

    def join(self, chunks: list[tuple], seed: int | None = None) -> Any:
        """A batch of carried chunks (rows cut from units), e.g. a resumed batch to repeat."""
        return _as_batch(_join(chunks, self.ctx))

    def ready(self) -> bool:
        """Whether the next batch comes without waiting (for a shard to be produced)."""
        return self._left > 0 or (self._feed is not None and self._feed.ready())

    def close(self) -> None:
        """End the mixing thread (a gather under way finishes first: it is a bounded copy)."""
        mixer, self._mixer = self._mixer, None
        if mixer is not None:
            mixer.shutdown(wait=True, cancel_futures=True)


class SamplePath:
    """Per-sample work (``sample_transform``/``batchify_fn``) on workers, ahead of the loop.

    Args:
        workers: What makes the batches (:func:`gluon_stream._mx.workers.make_workers`).
        timeout: Seconds one batch may take.
        pin_ctx: Copy batches to this context (``cpu_pinned``), or None.
    """

    def __init__(self, workers: Workers, timeout: float, pin_ctx: Any = None) -> None:
        self.workers = workers
        self.timeout = timeout
        self.pin = pin_ctx
        self.prepare: Prepare | None = self._to_shared if workers.uses_shared_memory else None
        self._ids = itertools.count()
        self._window: collections.deque = collections.deque()
        self._sids: dict[int, int] = {}  # id(shard arrays) -> source id, while attached
        self.wait_s = 0.0  # seconds the loop waited for (or, inline, made) batches, in total
        self._numbers: Iterator[int] = itertools.count()  # the epoch's batch numbers
        self._seed_of: Callable[[int], int] | None = None
        #: called in the loop's thread after each batch it takes (the memory_budget tuner)
        self.on_batch: Callable[[], None] | None = None

    @staticmethod
    def _to_shared(arrays: tuple, order: np.ndarray | None, what: str) -> tuple:
        """Producer-side: the shard's rows in ``order``, copied into shared memory once (an
        array the loader owns is consumed by its copy)."""
        return mx_shm.SharedArrays.copy_of(arrays, order, consume=_consumed(arrays))

    def mix(self, mixed: MixedData) -> MixedData:
        """A mixed unit needs no copy here: its batches name each sample's shard and row."""
        return mixed

    def mix_later(self, mixed: MixedData) -> cf.Future:
        done: cf.Future = cf.Future()
        done.set_result(self.mix(mixed))
        return done

    def cut(self, unit: Any, segment: Segment) -> tuple:
        if isinstance(unit, MixedData):
            parts = [_rows(unit.shards[j].arrays, rows)
                     for j, rows in unit.sources(segment.start, segment.stop)]
            return tuple(np.concatenate(fields) for fields in zip(*parts))
        return _rows(unit.arrays, range(segment.start, segment.stop))

    def batches(self, feed: UnitFeed, carry: Carry, first: int = 0,
                seed_of: Callable[[int], int] | None = None) -> Iterator[tuple[Batch, Any]]:
        """Batches made ahead by the workers; batch ``first + i`` of the epoch (counted from
        the epoch's start, resumed ones included) is made with the global RNGs seeded from
        ``seed_of(first + i)``, so random augmentation does not depend on the workers."""
        workers = self.workers
        workers.new_epoch()
        self._numbers = itertools.count(first)
        self._seed_of = seed_of
        window = self._window = collections.deque()  # (batch, task id, what, sources)
        live: dict[int, int] = {}  # source id -> batches in flight (and units) that read it
        unit: Any = None
        plan: Any = None
        held: list[int] = []  # the current unit's sources
        planned: Iterator[Batch] = iter(())
        numbers = itertools.count(1)
        ended = complete = False
        try:
            while True:
                while len(window) < workers.depth and not ended:
                    batch = next(planned, None)
                    if batch is None:
                        if unit is not None:
                            feed.done(unit, plan)
                            for sid in held:
                                self._release(live, sid)
                            unit = None
                        if window and not feed.ready():
                            break  # deliver what is in flight rather than wait for a shard
                        item = feed.next()
                        if item is None:
                            ended = True
                            break
                        unit, plan = item
                        held = self._hold(unit, live)
                        planned, numbers = plan.batches(), itertools.count(1)
                        continue
                    refs, sids = self._refs(batch, plan, unit, carry)
                    what = f"batch {next(numbers)} of {len(plan)} of {_name(unit)}"
                    window.append(self._submit(batch, refs, sids, what, unit.key, live))
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
                self._sids.clear()

    def _hold(self, unit: Any, live: dict[int, int]) -> list[int]:
        """Attach the shards a unit reads (once each, shared by the units that read them)."""
        shards = unit.shards.values() if isinstance(unit, MixedData) else [unit]
        sids = []
        for shard in shards:
            sid = self._sids.get(id(shard.arrays))
            if sid is None:
                sid = next(self._ids)
                self._sids[id(shard.arrays)] = sid
                self.workers.attach(sid, shard.arrays)
                live[sid] = 0
            live[sid] += 1
            sids.append(sid)
        return sids

    def _refs(self, batch: Batch, plan: UnitPlan, unit: Any, carry: Carry
              ) -> tuple[list, list[int]]:
        own = batch.segments[-1]
        refs: list = []
        sids: list[int] = []
        if batch is plan.joined:
            refs, sids = self._carry_refs(carry)
        if isinstance(unit, MixedData):
            for j, rows in unit.sources(own.start, own.stop):
                sid = self._sids[id(unit.shards[j].arrays)]
                refs.append((sid, rows))
                sids.append(sid)
        else:
            sid = self._sids[id(unit.arrays)]
            refs.append((sid, range(own.start, own.stop)))
            sids.append(sid)
        return refs, sids

    def join(self, chunks: list[tuple], seed: int | None = None) -> Any:
        """A batch of carried chunks (rows cut from units), made by the workers with the RNGs
        seeded from ``seed``, e.g. a resumed batch to repeat."""
        carry = Carry()
        for chunk in chunks:
            carry.add(Segment(0, 0, 0, len(chunk[0])), chunk)
        refs, sids = self._carry_refs(carry)
        tid = next(self._ids)
        self.workers.submit(tid, refs, "a repeated batch", None, seed=seed)
        try:
            return self.workers.result(tid, self.timeout, "a repeated batch")
        finally:
            for sid in sids:
                self.workers.detach(sid)

    def _carry_refs(self, carry: Carry) -> tuple[list, list[int]]:
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
        number = next(self._numbers)
        seed = self._seed_of(number) if self._seed_of is not None else None
        self.workers.submit(tid, refs, what, key, seed=seed)
        return batch, tid, what, sids

    def _take(self, item: tuple, live: dict[int, int]) -> tuple[Batch, Any]:
        batch, tid, what, sids = item
        start = time.perf_counter()
        try:
            data = self.workers.result(tid, self.timeout, what)
        finally:
            self.wait_s += time.perf_counter() - start
        if self.on_batch is not None:
            self.on_batch()
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
            for key in [k for k, v in self._sids.items() if v == sid]:
                del self._sids[key]

    def ready(self) -> bool:
        """Whether the next batch is made already (taking it would not wait)."""
        return bool(self._window) and self.workers.done(self._window[0][1])

    def close(self) -> None:
        self.workers.close()


def _rows(arrays: tuple, rows: Any) -> tuple:
    """Copies of some rows of a shard's arrays (in shared memory, or plain numpy)."""
    if isinstance(arrays, mx_shm.SharedArrays):  # not mapped in this process
        return arrays.take(rows)
    index = mx_arrays.row_index(rows)
    return tuple(a[index] for a in arrays)  # fancy indexing: np.take copies a strided input whole


def _name(unit: Any) -> str:
    if isinstance(unit, MixedData):
        return f"mixed unit {unit.index} (shards {[s.key for s in unit.shards.values()]})"
    return f"shard {unit.key!r}"


def _join(parts: list, ctx: Any) -> tuple:
    """Arrays of a batch from its parts (tuples of NDArrays, or numpy copies of small shards),
    joined along the sample axis: numpy parts are joined in numpy and copied into ``ctx`` once."""
    if len(parts) == 1 and not isinstance(parts[0][0], np.ndarray):  # one slice: as it is
        return parts[0]
    return tuple(_join_one(list(arrays), ctx) for arrays in zip(*parts))


def _join_one(pieces: list, ctx: Any) -> Any:
    if all(isinstance(p, np.ndarray) for p in pieces):
        joined = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        return mx_arrays.to_ndarray(joined, ctx)
    pieces = [mx_arrays.to_ndarray(p, ctx) if isinstance(p, np.ndarray) else p for p in pieces]
    return mx_arrays.concat(pieces)


def _as_batch(arrays: tuple) -> Any:
    return arrays[0] if len(arrays) == 1 else list(arrays)


def _consumed(arrays: tuple) -> list[bool]:
    """Which of a shard's arrays its copy gives back as it goes: those the loader owns
    (the stream says so: :class:`~gluon_stream._stages.produce.Owned`), where they can be."""
    return [owned and consumable(a) for owned, a in zip(owned_each(arrays), arrays)]
