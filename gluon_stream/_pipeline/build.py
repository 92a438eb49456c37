"""Building one shard: its raw arrays (read, or generated first), the previous keys' rows
before them (``context_rows``), the transform, this part's rows in their order, and the
consumer's form (``prepare``), each part's memory admitted before it is allocated
(:mod:`gluon_stream._pipeline.admission`). What the production stage runs for every shard,
in a producer thread or the caller's."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

import numpy as np

from .._utils.columns import names_of, normalize_arrays
from ..errors import LoaderClosed, add_note
from ..records import ShardRecord
from .ahead import GenerationsAhead
from .offsets import RowOffsets
from .producers import ProducerPool
from .provenance import ShardOrigin
from .reservations import ShardReservations, copy_bytes
from .shard import Owned, Prepare, Shard

if TYPE_CHECKING:
    import concurrent.futures as cf

    from ..sources import RawShard, Source
    from ..stats import Stats
    from .context import ContextRows
    from .deal import KeyDealer
    from .sizes import ShardSizes

__all__ = ["PassOf", "ShardBuilder", "schema_of"]


class PassOf(Protocol):
    """What a producer reads of the pass it makes a shard for (an
    :class:`~gluon_stream._pipeline.run.KeyPass`)."""

    @property
    def epoch(self) -> int: ...

    @property
    def cancelled(self) -> bool: ...

    @property
    def offsets(self) -> RowOffsets | None: ...  # deal='balanced': the rows before each shard

    @property
    def ahead(self) -> GenerationsAhead: ...  # its generations ahead, and work waiting


def schema_of(arrays: Sequence[Any]) -> list[tuple[str, tuple]]:
    """(dtype, trailing shape) of each array: what must agree between shards to batch them."""
    return [(np.dtype(a.dtype).str, tuple(a.shape[1:])) for a in arrays]


class ShardBuilder:
    """Builds a stream's shards (see the module doc).

    Args:
        source: Where the raw shards come from.
        transform: ``transform(raw) -> arrays`` per shard, or None.
        pool: The stream's producer threads (their throttle names a producer's lane, and
            lets a producer's place go while it waits for the rows before its shard).
        dealer: The keys stage (each shard's rows, the epoch it was made for).
        sizes: What is known of shard sizes (the rows dealt of a remainder's piece).
        stats: Where spans go.
        remote: An executor that generates shards elsewhere, or None.
        context: ``context_rows``: what puts the previous keys' rows before a shard's, or None.
    """

    def __init__(self, source: Source, transform: Callable[[Any], Any] | None,
                 pool: ProducerPool, dealer: KeyDealer, sizes: ShardSizes, stats: Stats,
                 remote: cf.Executor | None, context: ContextRows | None) -> None:
        self.source, self.transform = source, transform
        self._pool, self.dealer, self.sizes, self.stats = pool, dealer, sizes, stats
        self._remote, self.context = remote, context
        self.keep_origins = False  # provenance=True: each shard keeps its ShardOrigin

    @property
    def closed(self) -> bool:
        return self._pool.closed.is_set()

    def build(self, key: Any, epoch: int, index: int, run: PassOf | None,
              prepare: Prepare | None, whole: bool, before: int | None,
              gate: ShardReservations) -> Shard:
        """Shard ``key`` at position ``index`` of pass ``epoch`` for ``run`` (None: in the
        caller's thread), its parts admitted through ``gate`` before they are allocated
        (``whole``: every row in the file's order; ``before``: ``deal='balanced'``, the rows
        before it, where known)."""
        lane = self._pool.throttle.lane()
        clock = self.stats.clock
        t0 = clock()
        made = self.dealer.made_epoch(epoch, index)
        raw = self._raw(key, made, run, gate)
        t1 = clock()
        arrays = raw.arrays
        owned = raw.owned and self.transform is None  # a transform's output is user code's
        if self.transform is not None:
            arrays = self._transformed(raw, key, epoch, gate)
        full_size = len(arrays[0])
        nbytes = sum(int(getattr(a, "nbytes", 0)) for a in arrays)
        if run is not None and run.offsets is not None:  # deal='balanced'
            before = self._rows_before(run, index, full_size)
        order = None if whole else self.dealer.row_order(key, epoch, full_size, index, before)
        if run is not None and run.cancelled:
            raise LoaderClosed("epoch pass cancelled")
        names = names_of(arrays)
        source_nbytes = gate.source_bytes()
        copies = prepare is not None or order is not None
        if copies:  # its exact bytes, before the copy is made
            gate.reserve("copy", copy_bytes(arrays, order))
        if prepare is not None:  # it applies the order while copying (no extra copy)
            what = f"shard {key!r} (file {raw.path!r}, epoch {epoch})"
            # the raw shard's let go; arrays the loader owns are handed over as Owned: their
            # copy may give their memory back (see gluon_stream._mx.consumed)
            arrays, raw.arrays = (Owned if owned else tuple)(list(arrays)), ()
            arrays = prepare(arrays, order, what)
        elif order is not None:
            arrays = tuple(a[order] for a in arrays)  # not np.take: it copies a strided input
        # a form that keeps the source arrays (``raw``: a shuffle window's shards) copied none
        gate.copied(copies and getattr(arrays, "raw", None) is None)
        shard = Shard(key, epoch, index, arrays, names=names, full_size=full_size,
                      rows=int(arrays[0].shape[0]), schema=schema_of(arrays),
                      source_nbytes=source_nbytes)
        if self.keep_origins:  # provenance: the raw row of each row read
            shard.origin = ShardOrigin(key, made, order)
        t2 = clock()
        gen_end = t0 + raw.generate_s
        load_end = gen_end + raw.load_s
        self.stats.add_span(lane, "generate", t0, gen_end, key)
        self.stats.add_span(lane, "load", gen_end, load_end, key)
        self.stats.add_span(lane, "transform", max(load_end, t1), t2, key)
        shard.record = ShardRecord(key, epoch, len(shard), raw.cache_hit, raw.generate_s,
                                   raw.load_s, t2 - t1, lane, source=raw.source, nbytes=nbytes)
        return shard

    def _produce_raw(self, key: Any, epoch: int) -> RawShard:
        """A shard's raw arrays, made as a producer makes them (the context of another)."""
        if self._remote is None:
            return self.source.produce(key, epoch)
        return self.source.produce(key, epoch, executor=self._remote)

    def _rows_before(self, run: PassOf, index: int, full_size: int) -> int:
        """``deal='balanced'``: tell the run this shard's size and wait for the rows before
        it, letting another producer work meanwhile (the shard it waits for may need one)."""
        assert run.offsets is not None
        rows = self.sizes.rows_dealt(run.epoch, index, full_size)  # a remainder's: rows left
        with self._pool.throttle.released():
            return run.offsets.before(index, rows, lambda: run.cancelled or self.closed)

    def _raw(self, key: Any, made: int, run: PassOf | None,
             gate: ShardReservations) -> RawShard:
        """The raw shard (made for epoch ``made``), its bytes admitted first: exact from a
        file's headers where the source can tell (a program's shard, made first), else the
        largest raw shard seen; then the previous keys' rows before it (``context_rows``)."""
        peek = self.source.raw_bytes(key, made) \
            if gate.adm is not None and self._remote is None else None
        gate.reserve("raw", None if peek is None else peek[0])
        raw = self._produce_raw(key, made)
        if peek is not None:  # it was made (or found) by the peek
            raw.cache_hit, raw.generate_s = peek[1], raw.generate_s + peek[2]
        gate.made("raw", raw.arrays)
        if self.context is not None:  # the previous keys' last raw rows, before this shard's
            self.context.extend(raw, made, self._produce_raw, gate,
                                lambda: self.closed or (run is not None and run.cancelled))
        return raw

    def _transformed(self, raw: RawShard, key: Any, epoch: int,
                     gate: ShardReservations) -> tuple:
        """``transform``'s output of ``raw``, admitted as the largest seen before it exists
        (the raw shard's size at first)."""
        transform = self.transform
        assert transform is not None  # called only with one
        gate.reserve("transformed")
        arg = raw.arrays[0] if len(raw.arrays) == 1 else raw.arrays
        try:
            value = transform(arg)
        except Exception as exc:
            add_note(exc, f"gluon_stream: raised by transform on shard {key!r} "
                          f"(file {raw.path!r}, epoch {epoch})")
            raise
        arrays = normalize_arrays(value, what=f"transform output of shard {key!r}")
        del arg, value  # the transform's output is held by ``arrays`` alone
        gate.made("transformed", arrays)
        return arrays
