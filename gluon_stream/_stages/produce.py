"""The production stage: shards made ahead of the consumer, handed out in order.

:class:`~gluon_stream.ShardStream` wires it (with the keys stage) and owns its threads: producer
threads generate, load, transform and put each shard in this part's row order while the
consumer works on the current one; at most ``prefetch`` shards are ever ahead of it. Threads,
not processes: generation runs in external processes or in numpy code that releases the GIL.

A pass over an epoch's keys (:class:`KeyPass`) keeps a window of shards submitted to the
producers and hands them out in order; it drives the stream through :class:`ShardMaker` (public
methods only) and owns only what it submitted. :class:`GenerationsAhead` makes shards into the
cache beyond the window and counts the work waiting for a producer's place, so generations
ahead never hold up the window's shards. A :class:`Producer` submits, places and hands out
shards, and applies the error policy (:class:`ErrorPolicy`, the one place ``on_error`` is
judged); a :class:`ShardBuilder` builds one shard: its raw arrays, the previous keys' rows
before them (``context_rows``, :mod:`.context`), the transform, this part's rows, the
consumer's form (``prepare``), each part's memory admitted before it is allocated
(:class:`ShardReservations` against :mod:`gluon_stream._memory.gate`).

The contract with a consumer such as :class:`~gluon_stream.StreamLoader` is public:
:meth:`ShardStream.start_epoch` returns a :class:`KeyPass` whose :meth:`~KeyPass.next_shard`
hands out :class:`Shard` objects; :mod:`gluon_stream.stream` names them.

A :class:`Producer` owns nothing of a pass: the :class:`KeyPass` that submits a shard owns its
future; the stream owns the producer pool and the gate.
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import enum
import functools
import heapq
import itertools
import logging
import mmap
import threading
import weakref
from dataclasses import dataclass, field
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Collection,
    ContextManager,
    Iterator,
    Literal,
    Mapping,
    Protocol,
    Sequence,
    Tuple,
    Union,
)

import numpy as np

from .._memory.gate import Admission, GiveWay, MemoryGate
from .._memory.tuner import DEFAULT_PREFETCH, Limits, Tuner, start_knobs
from .._mx import import_mxnet
from .._utils import validate as _validate
from .._utils.closing import CLOSE_WAIT_S, WAIT_SLICE_S, Closing, end_thread_pool
from .._utils.columns import names_of, normalize_arrays
from .._utils.lifecycle import ThreadPool, check_owner, track, usable_cores
from .._utils.retry import RetryPolicy, is_permanent
from .._utils.validate import format_bytes
from ..errors import InvalidState, LoaderClosed, MemoryBudgetTooSmall, SchemaMismatch, add_note
from ..records import ShardRecord
from ..sources import Source
from ..stats import Stats
from .context import ContextBreak, ContextRows, context_rows_of
from .keys import END, KeyCursor, KeyDealer, Remainder, ShardSizes, resolve_parts
from .offsets import Deferred, RowOffsets, reaches

if TYPE_CHECKING:
    from ..sources import RawShard

__all__ = ["AheadOf", "GenerationsAhead", "KeyPass", "LANE_PREFIX", "Owned", "PassOf", "Prepare",
           "Producer", "ProducerPool", "RunState", "Shard", "ShardBuilder", "ShardMaker",
           "ShardReservations", "ShardStream", "Throttle", "copy_bytes", "first_knobs",
           "memory_of", "owned_each", "schema_of"]

# the stream's logger: its per-shard lines are filtered by this name (docs/memory-budget.md)
logger = logging.getLogger("gluon_stream.stream")

#: failures no ``on_error`` skips or retries: the loader closed or a pass cancelled, a resumed
#: state that does not fit the data, settings that cannot hold a shard (the settings' fault)
NEVER_SKIPPED = (LoaderClosed, cf.CancelledError, InvalidState, MemoryBudgetTooSmall)

ON_ERROR_MODES = ("raise", "skip")
OnError = Union[Literal["raise", "skip"], Tuple[str, int]]  # ("retry", n) for the tuple


@dataclass(frozen=True)
class ErrorPolicy:
    """What a stream does with a shard that failed: ``on_error='raise'``, ``'skip'`` or
    ``('retry', n)`` (produce it again up to n times, unless :func:`is_permanent`).

    Example:
        >>> ErrorPolicy.parse(("retry", 2))
        ErrorPolicy(mode='retry', retry=RetryPolicy(retries=2, backoff=0.0))
    """

    mode: str = "raise"
    retry: RetryPolicy = RetryPolicy()

    @classmethod
    def parse(cls, on_error: "str | tuple | ErrorPolicy") -> "ErrorPolicy":
        if isinstance(on_error, ErrorPolicy):
            return on_error
        if isinstance(on_error, str) and on_error in ON_ERROR_MODES:
            return cls(on_error)
        if (isinstance(on_error, (tuple, list)) and len(on_error) == 2 and on_error[0] == "retry"
                and isinstance(on_error[1], int) and not isinstance(on_error[1], bool)
                and on_error[1] >= 1):
            return cls("retry", RetryPolicy(on_error[1]))
        raise ValueError(f"on_error must be 'raise', 'skip' or ('retry', n) with n >= 1, "
                         f"got {on_error!r}")

    @property
    def retries(self) -> int:
        """Extra attempts per shard (0 unless ``('retry', n)``)."""
        return self.retry.retries if self.mode == "retry" else 0

    def verdict(self, exc: BaseException, retried: int = 0) -> str:
        """What a shard that failed with ``exc`` (after ``retried`` retries) gets: ``'retry'``,
        ``'skip'`` or ``'raise'``. The one place the policy is applied: a pass waiting for its
        shard, a size counted by producing one, a batch borrowed from one."""
        if not isinstance(exc, Exception) or isinstance(exc, NEVER_SKIPPED):
            return "raise"
        if self.mode == "retry" and retried < self.retries and not is_permanent(exc):
            return "retry"
        return "skip" if self.mode == "skip" else "raise"


class Producer:
    """Makes a stream's shards: submitted to its producer pool for a pass, or in the caller's
    thread (a resume, a size counted by producing the shard).

    Args:
        source: Where the raw shards come from.
        transform: ``transform(raw) -> arrays`` per shard, or None.
        pool: The stream's producer threads and their throttle.
        gate: The ``memory_budget`` admission gate, or None.
        dealer: The keys stage (each shard's rows, the epoch it was made for).
        sizes: What is known of shard sizes (remembered when counted).
        stats: Where spans and shard records go.
        error_policy: What a failing shard does.
        schema: The expected ``[(dtype, trailing shape)]`` (None: the first shard's).
        remote: An executor that generates shards elsewhere, or None.
        check_open: Raises unless the stream is open and used by its owner process.
        tuner: The ``memory_budget`` tuner, told of every shard handed out, or None.
        context: ``context_rows``: what puts the previous keys' rows before a shard's, or None.
    """

    def __init__(self, source: Source, transform: Callable[[Any], Any] | None,
                 pool: ProducerPool, gate: MemoryGate | None, dealer: KeyDealer,
                 sizes: ShardSizes, stats: Stats, error_policy: ErrorPolicy,
                 schema: Sequence[tuple[Any, Sequence[int]]] | None, remote: cf.Executor | None,
                 check_open: Callable[[], None], tuner: Tuner | None = None,
                 context: ContextRows | None = None) -> None:
        self.source, self.transform = source, transform
        self._pool, self.gate, self.dealer, self.sizes = pool, gate, dealer, sizes
        self.stats, self.error_policy = stats, error_policy
        self._schema = ([(np.dtype(d).str, tuple(s)) for d, s in schema]
                        if schema is not None else None)
        self._remote = remote
        #: the stream's check (closed, or used from another process than its owner's)
        self.check_open = check_open
        self.tuner = tuner
        #: what builds one shard's arrays (raw, context, transform, the part's rows, the form)
        self.builder = ShardBuilder(source, transform, pool, dealer, sizes, stats, remote,
                                    context)

    @property
    def context(self) -> ContextRows | None:
        """context_rows: the previous keys' last rows put before a shard's (None: none)."""
        return self.builder.context

    @property
    def keep_origins(self) -> bool:
        """provenance=True: each shard keeps its :class:`ShardOrigin` (set by the loader)."""
        return self.builder.keep_origins

    @keep_origins.setter
    def keep_origins(self, keep: bool) -> None:
        self.builder.keep_origins = keep

    @property
    def closed(self) -> bool:
        return self._pool.closed.is_set()

    def forget_failure(self, key: Any, epoch: int) -> None:
        """Forget a failure of shard ``key`` recorded in the cache, so that a retry makes it
        again (``on_error=('retry', n)``; see :meth:`CachingSource.retry_failures`)."""
        self.source.retry_failures([key], epoch)

    def handed(self, shard: Shard, index: int, wait_s: float, before: int | None) -> None:
        """A good shard at position ``index`` of its pass is handed to the consumer (which
        waited ``wait_s`` for it): recorded, told to the tuner (which may refuse it, before
        any batch of it), its size remembered and checked against a declared one
        (``before``: ``deal='balanced'``, the rows before it)."""
        record, key, epoch = shard.record, shard.key, shard.epoch
        assert record is not None  # _make records every shard it makes
        self.stats.add_shard(record)
        if shard.admission is not None:  # the loop has it: shards after it rank first
            shard.admission.handed()
        if self.tuner is not None:
            self.tuner.shard_ready(key, record.nbytes, record.samples, wait_s,
                                   record.generate_s + record.load_s + record.transform_s,
                                   epoch, shard.source_nbytes)
        self.sizes.remember(key, self.dealer.made_epoch(epoch, index), shard.full_size)
        if self.dealer.remainder_of(epoch) is None:
            self.sizes.check_declared(key, epoch, index, before, len(shard))
        logger.info("shard %r ready: %d samples (generate %.2f s, load %.2f s, "
                    "transform %.2f s%s)", key, len(shard), record.generate_s,
                    record.load_s, record.transform_s, ", cached" if record.cache_hit else "")

    def failed(self, exc: BaseException, key: Any, epoch: int, index: int,
               retried: int) -> str:
        """Shard ``key`` at position ``index`` of pass ``epoch`` failed with ``exc`` after
        ``retried`` retries: ``'retry'`` (its cached failure forgotten) or ``'skip'`` (recorded
        in the stats), by the error policy (:meth:`ErrorPolicy.verdict`); else ``exc`` is
        raised. Logged at WARNING, in full at DEBUG."""
        verdict = self.error_policy.verdict(exc, retried)
        if verdict == "raise":
            raise exc
        summary = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        logger.debug("shard %r failure in full: %s", key, exc)
        if verdict == "retry":
            logger.warning("shard %r failed (%s); retry %d/%d", key, summary, retried + 1,
                           self.error_policy.retries)
            self.forget_failure(key, self.dealer.made_epoch(epoch, index))
        else:
            logger.warning("skipping shard %r (epoch %d): %s", key, epoch, summary)
            self.stats.add_shard(ShardRecord(key, epoch, error=f"{type(exc).__name__}: {exc}"))
        return verdict

    def counted_size(self, key: Any, epoch: int) -> int:
        """A shard's samples after the transform: known ahead or seen (see
        :meth:`ShardSizes.full_size`), else counted by producing it whole in the calling thread
        (a cache hit with a ``cache_dir``), and remembered. An elastic resume of
        ``samples_per_epoch`` walks the ranks' streams by them. A shard that fails with
        ``on_error='skip'`` holds 0 (a pass reading it skips it)."""
        n = self.sizes.full_size(key, epoch)
        if n is not None:
            return n
        try:
            n = self.produce_now(key, epoch, whole=True).full_size
        except Exception as exc:  # as a pass would: skipped, or raised (no retry here)
            if self.error_policy.verdict(exc, self.error_policy.retries) != "skip":
                raise
            logger.warning("shard %r of epoch %d failed while its samples were counted "
                           "(%s: %s): it counts as 0 samples, as a pass skips it", key, epoch,
                           type(exc).__name__, exc)
            return 0
        self.sizes.remember(key, epoch, n)
        return n

    def produce_now(self, key: Any, epoch: int, prepare: Prepare | None = None,
                    index: int = -1, whole: bool = False, before: int | None = None) -> Shard:
        """Produce one shard in the calling thread, exactly as the producers would (for resume;
        ``index``: its position in the epoch, where a remainder's piece is read; ``whole``:
        every row, in the file's order, not this part's rows in its order; ``before``:
        ``deal='balanced'``, the rows of the epoch's shards before it)."""
        self.check_open()
        return self._make(key, epoch, index, None, prepare, whole, before)

    def submit_shard(self, key: Any, epoch: int, index: int, run: PassOf,
                     prepare: Prepare | None) -> cf.Future:
        """Produce shard ``key`` at position ``index`` of ``epoch`` for ``run`` in a producer
        thread: a future of the :class:`Shard`. With a ``memory_budget`` its admission opens
        here, in the order the loop needs the shards (a producer that starts a later shard
        first leaves room for the earlier ones)."""
        adm = self._open_admission(key, epoch, index)
        fut = self._pool.executor.submit(self._produce, key, epoch, index, run, prepare, adm)
        if adm is not None:  # never run, or failed: nothing is held
            fut.add_done_callback(lambda f: adm.release() if f.cancelled() or f.exception()
                                  is not None else None)
        return fut

    def _open_admission(self, key: Any, epoch: int, index: int) -> Admission | None:
        if self.gate is None:
            return None
        return self.gate.open((epoch, index), f"shard {key!r} (epoch {epoch})",
                              self.transform is not None)

    def submit_generation(self, key: Any, epoch: int, index: int, run: PassOf) -> cf.Future:
        """Generate shard ``key`` of ``epoch`` (at position ``index`` of ``run``'s pass) into
        the cache for ``run`` in a producer thread (it waits there for its turn in the window):
        a future of the seconds it took."""
        return self._pool.executor.submit(self._generate, key, epoch, index, run)

    def _produce(self, key: Any, epoch: int, index: int, run: PassOf | None,
                 prepare: Prepare | None, adm: Admission | None = None) -> Shard:
        """Runs in a producer thread: generate/load, transform, shuffle, prepare. A failure
        gives its admission back here: the submitter may never have had the future (a Ctrl-C
        in ``submit``), so its done-callback may not be there to do it."""
        try:
            if run is not None and run.cancelled:
                raise LoaderClosed("epoch pass cancelled")
            if run is None:  # produce_now: in the caller's thread, outside the producers' count
                return self._make(key, epoch, index, run, prepare, adm=adm)
            try:  # made ahead into the cache: only loading is left once its generation is done
                with self._placed(run, index) as generated_s:
                    shard = self._make(key, epoch, index, run, prepare, adm=adm)
            except BaseException:
                if run.offsets is not None:  # the shards after it stop waiting for its size
                    run.offsets.failed(index)
                raise
        except BaseException:
            if adm is not None:
                adm.release()  # idempotent
            raise
        if generated_s and shard.record is not None:
            shard.record.generate_s += generated_s
            shard.record.cache_hit = False
        return shard

    def _generate(self, key: Any, epoch: int, index: int, run: PassOf) -> float:
        """Runs in a producer thread: make a shard in the cache without loading it (it waits
        there, on disk, for its turn in the ``prefetch`` window); the seconds it took, or 0
        when it was cached already."""
        with self._placed(run, index, ahead=True):
            if run.cancelled:
                raise LoaderClosed("epoch pass cancelled")
            lane = self._pool.throttle.lane()
            t0 = self.stats.clock()
            _, hit, seconds = self.source.ensure_file(key, epoch)
            if hit:
                return 0.0
            self.stats.add_span(lane, "generate", t0, t0 + seconds, key)
            return seconds

    @contextlib.contextmanager
    def _placed(self, run: PassOf, index: int, ahead: bool = False) -> Iterator[float]:
        """A producer's place for ``run``'s work on shard ``index``, held for the block: a
        generation ahead (``ahead``), or a shard of the window, which first waits for its
        generation ahead if one runs (the block gets its seconds). Places go in the order the
        loop needs the shards (the pass's epoch, then ``index``: see :class:`Throttle`), and
        until the place is taken the run counts the work as queued (from the end of that
        generation), so no new generation ahead starts while the window's shard waits."""
        if ahead:
            run.ahead.unplaced(1)
        got = 0.0
        try:
            if not ahead:
                got = run.ahead.wait_for(index)  # counts the work as queued once it returns
            self._pool.throttle.take((run.epoch, index))
        finally:
            run.ahead.unplaced(-1)
        try:
            yield got
        finally:
            self._pool.throttle.give()

    def _make(self, key: Any, epoch: int, index: int, run: PassOf | None,
              prepare: Prepare | None, whole: bool = False, before: int | None = None,
              adm: Admission | None = None) -> Shard:
        """Make one shard, its memory admitted against ``memory_budget`` part by part before
        it is allocated (:mod:`gluon_stream._memory.gate`; ``adm``: opened when the
        shard was submitted): the admission is held until the shard is freed."""
        if adm is None:
            adm = self._open_admission(key, epoch, index)
        try:
            if run is not None and run.cancelled:
                raise LoaderClosed("epoch pass cancelled")
            # a producer's place is held only in a pass (produce_now runs in the caller's thread)
            gate = ShardReservations(
                adm, lambda: self.closed or (run is not None and run.cancelled),
                self._pool.throttle.released if run is not None else None)
            shard = self.builder.build(key, epoch, index, run, prepare, whole, before, gate)
        except Deferred as exc:
            if adm is not None:
                adm.release()
            # without the frames that made the shard (nor those of the exception it came from):
            # the future keeps the exception until the loop reaches the shard, and they would
            # keep its arrays alive
            exc.__context__ = exc.__cause__ = None
            raise exc.with_traceback(None) from None
        except BaseException:
            if adm is not None:
                adm.release()
            raise
        if adm is not None:
            shard.admission = adm
            # given back when the memory is: the prepared arrays' owner (shared memory lives
            # while workers hold it), else the shard
            weakref.finalize(getattr(shard.arrays, "memory_owner", shard), adm.release)
        return shard

    def check_schema(self, shard: Shard) -> None:
        """Raise :class:`~gluon_stream.SchemaMismatch` unless ``shard``'s arrays batch with the
        first shard's (or ``schema=``)."""
        found = shard.schema if shard.schema is not None else schema_of(shard.arrays)
        if self._schema is None:
            self._schema = found
        elif found != self._schema:
            raise SchemaMismatch(
                f"shard {shard.key!r} (epoch {shard.epoch}) has arrays {found} as "
                f"[(dtype, trailing shape)], but {self._schema} was expected (from the first "
                "shard or schema=); every shard must batch together")


# -- one shard built -------------------------------------------------------------------------------
# Building one shard: its raw arrays (read, or generated first), the previous keys' rows
# before them (``context_rows``), the transform, this part's rows in their order, and the
# consumer's form (``prepare``), each part's memory admitted before it is allocated
# (:mod:`gluon_stream._memory.gate`). What the production stage runs for every shard,
# in a producer thread or the caller's.
class Places(Protocol):
    """What a producer asks of a pass's generations ahead (a
    :class:`~gluon_stream._stages.produce.GenerationsAhead`): a place in the work waiting."""

    def unplaced(self, change: int) -> None: ...  # work started (+1) or placed (-1)

    def wait_for(self, index: int) -> float: ...  # wait out index's generation ahead: seconds


class PassOf(Protocol):
    """What a producer reads of the pass it makes a shard for (an
    :class:`~gluon_stream._stages.produce.KeyPass`)."""

    @property
    def epoch(self) -> int: ...

    @property
    def cancelled(self) -> bool: ...

    @property
    def offsets(self) -> RowOffsets | None: ...  # deal='balanced': the rows before each shard

    @property
    def ahead(self) -> Places: ...  # its generations ahead, and work waiting


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


# -- the producer threads and their throttle -------------------------------------------------------
# The producer threads a :class:`~gluon_stream.ShardStream` owns, and the throttle that says
# how many of them may work at once (``producers='auto'`` grows it).
logger = logging.getLogger(__name__)


#: a producer's lane in the stats and the timeline: the prefix, then its place
LANE_PREFIX = "gluon_stream-producer_"


class Throttle:
    """How many producers may work at once: fixed, or growing (``producers='auto'``), and which
    work gets a free place first.

    Up to ``bound`` producers; work waits in :meth:`take` until fewer than ``active`` are
    running and no waiting work comes before it. Work comes in the order the loop needs it:
    by ``rank`` (a pass's epoch, then the shard's position in it), so a shard of the window
    the loop waits for takes a place before a generation ahead of a later shard, or of the
    next epoch, however the threads are woken (the thread that just gave a place up would
    otherwise take it again for its next task). :meth:`grow` admits one more; :meth:`set_active`
    (the ``memory_budget`` tuner) sets the count. Each producer at work holds a place
    (0, 1, ...), which names its lane (:meth:`lane`): the threads that run them may be more
    (one waits for a shard that another generates ahead), the producers never are.
    """

    def __init__(self, active: int, bound: int) -> None:
        self.active, self.bound = active, bound
        self.running = 0
        self._cond = threading.Condition()
        self._closed = False
        self._places: dict[int, int] = {}  # thread id -> place
        self._ranks: dict[int, tuple] = {}  # thread id -> the rank of the work it holds for
        self._waiting: list[tuple] = []  # heap of (rank, ticket) waiting for a place
        self._tickets = itertools.count()

    def take(self, rank: tuple = ()) -> None:
        """Wait for a place, after any waiting work of a lower ``rank`` (equal ranks: first
        come, first served), and hold it for this thread."""
        with self._cond:
            if self._waiting or self.running >= self.active:  # else: a free place, now
                self._wait_turn(rank)
            if self._closed:
                self._cond.notify_all()
                raise LoaderClosed("the stream was closed")
            self.running += 1
            taken = set(self._places.values())
            ident = threading.get_ident()
            self._places[ident] = next(p for p in range(len(taken) + 1) if p not in taken)
            self._ranks[ident] = rank
            self._cond.notify_all()  # the next in line may find a place too

    def _wait_turn(self, rank: tuple) -> None:
        entry = (rank, next(self._tickets))
        heapq.heappush(self._waiting, entry)
        try:
            while (self.running >= self.active or self._waiting[0] != entry) \
                    and not self._closed:
                self._cond.wait(WAIT_SLICE_S)
        finally:
            self._waiting.remove(entry)
            heapq.heapify(self._waiting)

    def give(self) -> None:
        """Give this thread's place up."""
        with self._cond:
            self.running -= 1
            ident = threading.get_ident()
            self._places.pop(ident, None)
            self._ranks.pop(ident, None)
            self._cond.notify_all()

    @property
    def waiting(self) -> int:
        """Work waiting for a place now."""
        with self._cond:
            return len(self._waiting)

    def lane(self) -> str:
        """The calling producer's lane: its place, or (outside the throttle: a shard made in
        the loop's thread) the thread's name."""
        place = self._places.get(threading.get_ident())
        return threading.current_thread().name if place is None else f"{LANE_PREFIX}{place}"

    @contextlib.contextmanager
    def released(self) -> Iterator[None]:
        """Give this producer's place to another while the block waits, then take one again
        (in the same rank)."""
        rank = self._ranks.get(threading.get_ident(), ())
        self.give()
        try:
            yield
        finally:
            self.take(rank)

    def grow(self) -> bool:
        """Admit one more producer if the bound allows; whether it did."""
        with self._cond:
            if self.active >= self.bound:
                return False
            self.active += 1
            self._cond.notify_all()
            return True

    def set_active(self, active: int) -> None:
        """Let ``active`` producers work at once (within the bound); those at work beyond it
        finish their shard."""
        with self._cond:
            self.active = max(1, min(active, self.bound))
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class ProducerPool:
    """What a ShardStream owns; closed by ``close()`` or by the garbage collector."""

    def __init__(self, source: Source, throttle: Throttle) -> None:
        self.source = source
        self.throttle = throttle
        # twice the producers: a thread may wait for a shard's generation ahead (or, with
        # balanced strides, for the shards before it) with its producer's place given up, and
        # the place must find a thread to work in meanwhile; ThreadPool: a Ctrl-C in submit
        # cannot leave a thread running that the pool does not count or join
        self.executor = ThreadPool(2 * throttle.bound, thread_name_prefix="gluon_stream-producer")
        self.closed = threading.Event()
        self.runs: weakref.WeakSet = weakref.WeakSet()

    def close(self) -> None:
        self.closed.set()
        self.throttle.close()
        for run in list(self.runs):
            run.cancel()
        self.source.close()  # kills running generator process groups
        for thread in end_thread_pool(self.executor, CLOSE_WAIT_S):
            logger.warning("producer thread %s is still running a transform or a "
                           "FunctionSource fn after close(); it ends when that call returns",
                           thread.name)


def first_knobs(prefetch: int | str, producers: Any, budget: int | None,
                apart: bool) -> tuple[int, Throttle]:
    """A stream's first ``prefetch`` and its producers' :class:`Throttle`, from its arguments
    (``'auto'``, an int, or for ``producers`` an executor that generates shards elsewhere);
    with a ``memory_budget`` they start low and the tuner raises them. ``apart``: shards are
    generated apart from loading (a program into a cache), so the tuner's start differs."""
    start = None if budget is None else start_knobs(apart, usable_cores())
    fixed = not (isinstance(prefetch, str) and prefetch == "auto")
    prefetch = _validate.integer("prefetch", prefetch if fixed else (
        DEFAULT_PREFETCH if start is None else start.prefetch), minimum=0)
    if isinstance(producers, cf.Executor):  # local threads only wait for, load and transform
        return prefetch, Throttle(prefetch + 1, prefetch + 1)
    if producers == "auto" and start is not None:  # the tuner sets the count
        return prefetch, Throttle(start.producers, usable_cores())
    if producers == "auto":
        return prefetch, Throttle(1, max(1, min(prefetch, usable_cores())))
    producers = _validate.integer("producers", producers, minimum=1,
                                  hint="'auto', or a concurrent.futures.Executor")
    return prefetch, Throttle(producers, producers)


# -- a producer's reservations for the shard it makes ----------------------------------------------
# A producer's reservations for the shard it makes, against the stream's
# :class:`~gluon_stream._memory.gate.MemoryGate`: what each part of a shard holds (its
# raw arrays, the transform's output, the copy), counted as memory, and the shard deferred when
# it must give way to the one the loop needs first.
logger = logging.getLogger(__name__)


def memory_of(arrays: Sequence[Any], counted: set[int]) -> int:
    """Bytes of memory ``arrays`` hold, each block once: a view counts the array that owns its
    memory, unless ``counted`` holds it already (a transform's windows over the raw arrays
    cost nothing more); memory-mapped files hold no memory of this process. Adds to
    ``counted``."""
    total = 0
    for a in arrays:
        root = a  # down the views (as_strided's too, through numpy's DummyArray) to the owner
        while (base := getattr(root, "base", None)) is not None \
                and not isinstance(base, (mmap.mmap, bytes, bytearray, memoryview)):
            root = base
        if id(root) in counted:
            continue
        counted.add(id(root))
        if isinstance(getattr(root, "base", None), mmap.mmap):
            continue
        total += int(getattr(root, "nbytes", 0))
    return total


def copy_bytes(arrays: Sequence[Any], order: np.ndarray | None) -> int:
    """Bytes of a copy of ``arrays``'s rows in ``order`` (all of them without)."""
    total = 0
    for a in arrays:
        rows = len(a)
        total += (int(getattr(a, "nbytes", 0)) // rows if rows else 0) * (
            rows if order is None else len(order))
    return total


class ShardReservations:
    """A producer's reservations for one shard (nothing without an admission, i.e. without a
    ``memory_budget``): it waits for room in ``outside()`` (its producer's place given up;
    None where it holds none) and stops once ``closed()``."""

    def __init__(self, adm: Admission | None, closed: Callable[[], bool],
                 outside: Callable[[], ContextManager[Any]] | None) -> None:
        self.adm, self._closed, self._outside = adm, closed, outside
        self._counted: set[int] = set()  # memory blocks counted already (raw, then transformed)

    def reserve(self, part: str, nbytes: int | None = None) -> None:
        """Hold ``nbytes`` for ``part`` (None: not known yet, the largest seen, or the raw
        arrays' for the first transform's output)."""
        adm = self.adm
        if adm is None:
            return
        exact = nbytes is not None
        if nbytes is None:
            nbytes = adm.gate.largest[part] or (adm.held["raw"] if part == "transformed" else 0)
        try:
            adm.reserve(part, nbytes, self._closed, self._outside, exact)
        except GiveWay as exc:
            logger.info("%s: made again when the loop reaches it", exc)
            raise Deferred(f"{exc}: made again when the loop reaches it") from None

    def made(self, part: str, arrays: Sequence[Any]) -> None:
        """``part`` is made: the memory its arrays hold (a transform's views of the raw
        arrays add nothing) is counted at once.

        Raises:
            Deferred: It grew beyond its reservation and leaves too little room for the
                shards the loop needs first: freed, it is made again when the loop reaches it.
        """
        adm = self.adm
        if adm is None:
            return
        nbytes = memory_of(arrays, self._counted)
        if not adm.made(part, nbytes):
            logger.info("%s: its %s arrays (%s) grew beyond the room left within "
                        "memory_budget for the shards before it: made again when the loop "
                        "reaches it", adm.what, part, format_bytes(nbytes))
            raise Deferred(f"{adm.what} deferred: its {part} arrays ({format_bytes(nbytes)}) "
                           "leave too little room within memory_budget for the shards before "
                           "it")

    def largest(self, part: str) -> int:
        """The largest ``part`` seen in the stream, in bytes (0 without a budget)."""
        return 0 if self.adm is None else self.adm.gate.largest[part]

    def replaced(self, part: str, arrays: Sequence[Any]) -> None:
        """``part``'s arrays were replaced by ``arrays`` (made from them, the old ones let
        go: the raw arrays with ``context_rows`` before them): it holds what they hold."""
        if self.adm is not None:
            self.adm.gate.set(self.adm, part, memory_of(arrays, self._counted))

    def drop(self, part: str) -> None:
        """``part`` is freed (a previous key's shard read for context)."""
        if self.adm is not None:
            self.adm.drop(part)

    def source_bytes(self) -> int:
        """The raw and transformed arrays' bytes: alive beside the copy while it is made."""
        return 0 if self.adm is None else self.adm.held["raw"] + self.adm.held["transformed"]

    def copied(self, copied: bool) -> None:
        """The shard is prepared: a copy frees its source; else (no copy, or a form that keeps
        the source arrays: a shuffle window's shards) its arrays are what it holds."""
        if self.adm is None:
            return
        if copied:
            self.adm.drop("raw", "transformed")
        else:
            self.adm.drop("copy")


# -- what the stage hands out: a shard, its origin, the consumer's form ----------------------------
# One ready shard, and the ``prepare`` step that puts its arrays in the consumer's form.
#
# Both are what a :class:`~gluon_stream.ShardStream` hands a pass (:class:`KeyPass`) and what the
# stages after it read; they live below both so that the contracts can name them.
#: ``prepare(arrays, order, what) -> arrays``: run in the producer thread after the transform,
#: it returns the shard's arrays in ``order`` (a permutation or a subset of the rows, or None)
#: in whatever form the consumer wants them (NDArrays, shared memory, ...); ``what`` names the
#: shard (key, file, epoch) for its error messages. ``arrays`` is an :class:`Owned` tuple when
#: the loader owns them: ``prepare`` may then free or reuse their memory (nothing else holds
#: them); any other tuple's arrays belong to user code and must be left as they are.
Prepare = Callable[[tuple, "np.ndarray | None", str], tuple]


class Owned(tuple):
    """A shard's arrays that the loader owns, handed to ``prepare`` (a plain tuple otherwise).

    Ownership is carried as data from where the arrays are made: the loader read them from a
    file itself (a cache, a ``FileSource`` file, a ``CommandSource``'s output; not
    memory-mapped), or a ``FunctionSource(fresh_arrays=True)`` handed its function's result
    over, and no ``transform`` ran (a transform's output is user code's). Nothing infers it
    later: reference counts do not see weak references."""

    __slots__ = ()


def owned_each(arrays: tuple) -> list[bool]:
    """For each array of ``arrays``, whether the loader owns it (the whole tuple is
    :class:`Owned`, or none of it is)."""
    return [isinstance(arrays, Owned)] * len(arrays)


@dataclass(frozen=True)
class ShardOrigin:
    """A shard's rows as read, traced back: its key, the epoch it was made for, and the raw
    row of each row read (``order``; None: read row ``i`` is raw row ``i``)."""

    key: Any
    epoch: int
    order: np.ndarray | None = None

    def raw_rows(self, rows: Any) -> np.ndarray:
        """Raw rows of read rows ``rows`` (a slice or an index array)."""
        if self.order is None:
            if isinstance(rows, slice):
                return np.arange(rows.start, rows.stop, dtype=np.int64)
            return np.asarray(rows, dtype=np.int64)
        return np.asarray(self.order[rows], dtype=np.int64)


@dataclass
class Shard:
    """One ready shard: its key, its position in the epoch and its arrays (samples first)."""

    key: Any
    epoch: int
    index: int
    arrays: tuple
    record: ShardRecord | None = field(repr=False, default=None)
    names: tuple[str, ...] | None = None  # the arrays' names (a dict's keys), if they have any
    full_size: int = -1  # the shard's samples before ranks took their part of them
    #: its rows and ``[(dtype, trailing shape)]``, taken where it was made (a producer thread):
    #: read from NDArrays in the loop's thread, each is a C call that releases the GIL and
    #: may wait for it behind a busy producer, a few hundred us at a shard boundary
    rows: int = -1
    schema: list | None = field(repr=False, default=None)
    #: bytes of its raw and transformed arrays, alive beside its copy while it was made
    source_nbytes: int = 0
    #: its memory admitted against ``memory_budget`` (a ``_memory.gate.Admission``),
    #: given back when the shard is freed; None without a budget
    admission: Any = field(repr=False, default=None)
    #: provenance=True: its key, made-for epoch and raw row of each row read
    #: (a :class:`ShardOrigin`); None otherwise
    origin: Any = field(repr=False, default=None)

    def __len__(self) -> int:
        return self.rows if self.rows >= 0 else int(self.arrays[0].shape[0])

    @property
    def dataset(self) -> Any:
        """A ``gluon.data.ArrayDataset`` over the shard's arrays."""
        return import_mxnet().gluon.data.ArrayDataset(*self.arrays)


# -- generations ahead, and the work waiting for a producer's place --------------------------------
# A pass's generations ahead (shards made into the cache beyond the prefetch window), and
# the count of its work waiting for a producer's place: what tells an idle producer from a
# busy one, so that generations ahead never hold up the window's shards.
class _Generating(Protocol):
    """What generations ahead use of their pass's stream."""

    @property
    def generate_ahead(self) -> int: ...

    @property
    def closed(self) -> bool: ...

    @property
    def next_run(self) -> Any: ...

    @property
    def dealer(self) -> Any: ...  # made_epoch(epoch, index): the epoch a shard is made for

    @property
    def producer(self) -> Any: ...  # submit_generation(key, epoch, index, run) -> Future

    def idle_producers(self) -> int: ...


class AheadOf(Protocol):
    """What :class:`GenerationsAhead` reads of its pass (an
    :class:`~gluon_stream._stages.produce.KeyPass`)."""

    @property
    def stream(self) -> _Generating: ...

    @property
    def epoch(self) -> int: ...

    @property
    def cancelled(self) -> bool: ...

    @property
    def keys(self) -> KeyCursor: ...  # the pass's keys: generations ahead look past its window

    @property
    def preskipped(self) -> Collection[int]: ...  # positions never made (failed before)

    @property
    def lock(self) -> Any: ...  # held while a generation is started

    @property
    def ahead(self) -> GenerationsAhead: ...

    def queued(self) -> int: ...

    def next_epoch_run(self, doing: str) -> Any: ...


class GenerationsAhead:
    """The generations ahead of one pass, by shard position, and its work waiting for a
    place (``unplaced``). Its own lock: the pass fills its window holding the pass's lock, and
    a producer's callback counts here without it."""

    def __init__(self) -> None:
        self._futures: dict[int, cf.Future] = {}  # index -> generation into the cache
        self._unplaced = 0  # work started in a thread, waiting for a producer's place
        self._lock = threading.Lock()
        self._awaited: set[cf.Future] = set()  # generations a window's shard waits for

    def __contains__(self, index: int) -> bool:
        return index in self._futures

    def start_one(self, keys: KeyCursor, depth: int, skip: Collection[int],
                  submit: Callable[[Any, int], cf.Future],
                  on_done: Callable[[cf.Future], None]) -> bool:
        """Submit (``submit(key, index)``) the generation of the first of the next ``depth``
        keys that has none yet (``skip``: positions never made), ``on_done`` called when it
        ends; True when there is none and the keys have ended."""
        ended = not keys.draw_ahead(depth)
        for key, index in keys.lookahead:
            if index not in self._futures and index not in skip:
                fut = self._futures[index] = submit(key, index)
                fut.add_done_callback(on_done)  # after it is known: a done one runs it now
                return False
        return ended

    def queued(self) -> int:
        """Generations not started, and work waiting for a place."""
        futures = list(self._futures.values())
        return self._unplaced + sum(1 for fut in futures if not (fut.running() or fut.done()))

    def unplaced(self, change: int) -> None:
        """Work started (``+1``) or stopped (``-1``) waiting for a producer's place."""
        with self._lock:
            self._unplaced += change

    def wait_for(self, index: int) -> float:
        """Wait for shard ``index``'s generation ahead, if one runs: its seconds (0: none
        ran; a generation not yet started is dropped and the shard made as usual). Its
        failure is raised here, where the shard's error policy applies.

        The caller is then counted as waiting for a place (it says :meth:`unplaced` ``-1``
        once it has one): from the end of the generation it waited for, not before (that
        generation's place is the one it takes next, so it keeps no other producer from work
        meanwhile). The generation's done-callback counts it first when it runs first
        (:meth:`done`), so that the producer finishing the generation sees it."""
        fut = self._futures.pop(index, None)  # one pop: atomic, no lock to wait for
        if fut is None or fut.cancel():
            self.unplaced(1)
            return 0.0
        with self._lock:
            self._awaited.add(fut)
        try:
            return fut.result()
        finally:
            self.done(fut)

    def done(self, fut: cf.Future) -> None:
        """Generation ``fut`` ended: the window's shard that waited for it, if any, now waits
        for a place (counted once, by whichever of it and this callback comes first)."""
        with self._lock:
            if fut in self._awaited:
                self._awaited.discard(fut)
                self._unplaced += 1

    def cancel(self) -> None:
        """Drop the generations not started (those running finish into the cache)."""
        for fut in self._futures.values():
            fut.cancel()
        self._futures.clear()

    def go_on(self, run: AheadOf, fut: Any = None) -> None:
        """Keep idle producers generating ``run``'s shards after its window into the cache:
        called when the window is filled and whenever a producer finishes (``fut``: the
        generation that did, if it was one)."""
        if isinstance(fut, cf.Future):
            self.done(fut)  # a window's shard waited for it: it comes first
        stream = run.stream
        if not stream.generate_ahead or run.cancelled or stream.closed:
            return
        with run.lock:
            self.start(run)

    def start(self, run: AheadOf, busy: int = 0) -> None:
        """Submit one generation ahead for ``run`` if a producer is idle (``busy``: shards an
        earlier pass has queued, which come first). Once every key of the pass is made or
        under way, the next epoch's first shards are generated into the cache (disk, not
        memory: a shuffle window's tail keeps its shards, and the next epoch starts on shards
        already made)."""
        stream = run.stream
        if run.queued() + busy >= stream.idle_producers():
            return  # no producer is idle: the window's shards come first

        def generation(key: Any, index: int) -> cf.Future:
            made = stream.dealer.made_epoch(run.epoch, index)
            return stream.producer.submit_generation(key, made, index, run)

        if not self.start_one(run.keys, stream.generate_ahead, run.preskipped, generation,
                              functools.partial(self.go_on, run)):
            return  # one at a time: the next call sees whether a producer is still idle
        nxt = None if stream.next_run is run else run.next_epoch_run("generating")
        if nxt is not None:  # (a pass made ahead stops at its own end)
            with nxt.lock:
                nxt.ahead.start(nxt, busy=run.queued())


# -- one pass over an epoch's keys: the prefetch window --------------------------------------------
# One pass over an epoch's keys (:class:`KeyPass`), and the contract it drives the stream by.
#
# A pass keeps a window of shards submitted to the producers and hands them out in order, with
# the stream's error policy applied where each is waited for. It drives the stream's producer
# side through :class:`ShardMaker` (public methods only), which
# :class:`~gluon_stream.ShardStream` implements; the stream owns the producer threads, the
# pass only what it submitted.
# the stream's logger: its per-shard lines are filtered by this name (docs/memory-budget.md)
logger = logging.getLogger("gluon_stream.stream")

class ShardMaker(Protocol):
    """The producer side of a :class:`~gluon_stream.ShardStream`, as an :class:`KeyPass`
    drives it: what it reads of the stream's configuration, and how it submits work.

    It lives beside :class:`KeyPass`, not in :mod:`.contracts`: the contracts name the
    feed's types, and the feed names :class:`KeyPass` (an import cycle).

    Attributes:
        prefetch: Shards produced ahead of the one being consumed.
        generate_ahead: Shards generated into the cache beyond the ``prefetch`` window.
        num_epochs: How many epochs will be run, if known.
        error_policy: What a failing shard does (raise, skip, retry).
        stats: Where ready and skipped shards are recorded.
        tuner: The ``memory_budget`` tuner, if any: told of every shard handed out.
        sizes: What is known of the shards' sizes: told of every shard's.
        dealer: The keys stage: a pass's keys, and the epoch each shard was made for.
        producer: The production stage: submits a shard, or its generation ahead.
    """

    prefetch: int
    generate_ahead: int
    num_epochs: int | None
    num_parts: int  # the ranks, and which one this stream is
    part_index: int
    deal: str  # how the ranks split an epoch (see ShardStream)
    error_policy: ErrorPolicy
    stats: Stats
    tuner: Tuner | None
    sizes: ShardSizes
    dealer: KeyDealer  # which keys this part reads, and in which epoch each was made
    producer: Producer  # makes the shards a pass submits

    @property
    def closed(self) -> bool:
        """The stream was closed."""

    @property
    def next_run(self) -> KeyPass | None:
        """The pass of the next epoch, begun early, if any."""

    def check_open(self) -> None:
        """Raise :class:`~gluon_stream.errors.LoaderClosed` if the stream is closed."""

    def idle_producers(self) -> int:
        """Producers free to start a shard now (below 0: more at work than may be)."""

    def waited(self, key: Any, queued: int = 0) -> None:
        """The consumer had to wait for shard ``key`` (``queued``: shards not started)."""

    def run_ahead(self, epoch: int, prepare: Prepare | None) -> KeyPass:
        """The pass of the epoch after this one, begun early."""


class RunState(enum.IntEnum):
    """Where an :class:`KeyPass` is in its life: it submits shards while keys are left
    (``PRODUCING``), then hands out what it submitted (``EXHAUSTED``: no key left, or the key
    iterator failed), until its consumer is done or a newer pass replaces it (``CANCELLED``:
    queued work dropped, running producers finish and are ignored). It only moves forward."""

    PRODUCING = 0
    EXHAUSTED = 1
    CANCELLED = 2


class KeyPass:
    """One pass over an epoch's keys: a window of futures, handed out in order.

    Attributes:
        epoch: The epoch this pass produces.
        index: Position in the epoch of the next shard to be submitted.
        skipped: Shards dropped by ``on_error='skip'`` so far.
        last_wait_s: How long the last :meth:`next_shard` waited for its shard to be produced.
        max_pending: The most shards in flight at once (queued, being produced, or ready and
            not yet handed out); None: ``prefetch + 1``. A consumer that keeps several shards
            it was handed (a shuffle window) lowers it, so that what it holds and what is in
            flight stay within its budget; at least 1, so production always overlaps.
        offsets: ``deal='balanced'``: the rows before each shard, as the producers learn
            them (``rows_before``: those before position ``skip``, on a resume); else None.
    """

    def __init__(self, stream: ShardMaker, epoch: int, skip: int = 0,
                 prepare: Prepare | None = None, skipped: Sequence[int] = (),
                 rows_before: int = 0) -> None:
        self.stream = stream
        self.epoch = epoch
        self.prepare = prepare
        # from ``skip`` on: a resume does not produce the shards before it again
        keys, self.finite, self.key_list = stream.dealer.epoch_keys(epoch, start=skip)
        self.keys = KeyCursor(keys, epoch, skip)
        self.pending: collections.deque = collections.deque()
        self.index = skip
        self.state = RunState.PRODUCING
        self.skipped = 0
        self.skipped_at: list[int] = []  # positions of the shards skipped, in order
        self.preskipped = frozenset(skipped)
        self.last_wait_s = 0.0
        self.waits = 0  # times a shard was asked for before it was produced
        self.max_pending: int | None = None
        self._handed = False  # a shard was handed out: the consumer holds one (see _window)
        #: generations ahead, and the pass's work waiting for a producer's place
        self.ahead = GenerationsAhead()
        self.offsets = RowOffsets(skip, rows_before) if stream.sizes.learns_rows(epoch) \
            else None
        # the consumer fills the window; producers finishing a shard start generations ahead
        self.lock = threading.RLock()

    def index_next(self) -> int:
        """The position of the shard :meth:`next_shard` hands out next."""
        with self.lock:
            return self.pending[0][1] if self.pending else self.index

    def push_back(self, shard: Shard) -> None:
        """Hand ``shard`` out again first (an epoch stopped inside it; the next goes on)."""
        done: cf.Future = cf.Future()
        done.set_result(shard)
        with self.lock:
            self.pending.appendleft((shard.key, shard.index, done))

    @property
    def cancelled(self) -> bool:
        """The pass was cancelled: it hands out nothing more."""
        return self.state is RunState.CANCELLED

    @property
    def exhausted(self) -> bool:
        """Every key is submitted (or the keys failed): nothing more will be produced."""
        return self.state >= RunState.EXHAUSTED

    def _advance(self, state: RunState) -> None:
        self.state = max(self.state, state)  # forward only: a cancelled pass stays cancelled

    def _generate_ahead(self, fut: Any = None) -> None:
        """Keep idle producers generating the shards after the window into the cache (called
        when the window is filled and whenever a producer finishes)."""
        self.ahead.go_on(self, fut)

    def next_epoch_run(self, doing: str) -> "KeyPass | None":
        """The stream's pass for the next epoch, begun early; None after the last epoch, in
        a pass of endless keys or a cancelled one, or if the next epoch's keys failed (they
        raise again when that epoch starts)."""
        last = self.stream.num_epochs is not None and self.epoch + 1 >= self.stream.num_epochs
        if last or not self.finite or self.cancelled:
            return None
        try:
            return self.stream.run_ahead(self.epoch + 1, self.prepare)
        except Exception as exc:
            logger.debug("not %s epoch %d early: %s: %s", doing, self.epoch + 1,
                         type(exc).__name__, exc)
            return None

    def _submit(self, key: Any, index: int, watch: bool = True) -> cf.Future:
        """Submit shard ``index``; with ``watch``, its producer starts generations ahead once
        it is done (see :meth:`_watch`)."""
        fut = self.stream.producer.submit_shard(key, self.epoch, index, self, self.prepare)
        if watch:
            self._watch(fut)
        return fut

    def _watch(self, fut: cf.Future) -> None:
        """Start generations ahead when ``fut``'s producer is done. A future already done runs
        it at once, in this thread: so the window's shards are submitted (and in ``pending``)
        first, or the generation ahead would take the window's next key for its own."""
        if self.stream.generate_ahead:
            fut.add_done_callback(self._generate_ahead)

    def _fill(self, depth: int, ahead: bool = True, capped: bool = True) -> None:
        """Submit shards until ``depth`` are pending (``capped``: at most ``max_pending``);
        ``ahead``: then the next epoch's first shards, and generations ahead."""
        if self.max_pending is not None and capped:
            depth = min(depth, max(1, self.max_pending))
        if len(self.pending) >= depth and not self.exhausted:  # full: nothing to submit
            if ahead and self.stream.generate_ahead:
                self._generate_ahead()
            return
        submitted: list[cf.Future] = []
        with self.lock:
            self._submit_window(depth, submitted)
        for fut in submitted:  # the window is filled: generations ahead come after it
            self._watch(fut)
        if ahead and self.exhausted and len(self.pending) < depth:
            # the window has room: start on the next epoch (the one set_epoch(e + 1) or the
            # next pass will ask for); a different epoch discards it
            nxt = self.next_epoch_run("starting")
            if nxt is None:
                return
            nxt._fill(depth - len(self.pending), ahead=False)
        if ahead:
            self._generate_ahead()

    def _submit_window(self, depth: int, submitted: list) -> None:
        while len(self.pending) < depth and not self.exhausted:
            nxt = self.keys.next()
            if nxt is END:
                self._advance(RunState.EXHAUSTED)
                break
            key, index = nxt
            self.index = index + 1  # first: a callback of the submit below draws the next key
            if index in self.preskipped:  # failed before the resume: skipped again
                logger.debug("shard %r (epoch %d) stays skipped, as before the resume", key,
                             self.epoch)
                self._skipped(index)
            else:
                submitted.append(self._submit(key, index, watch=False))
                self.pending.append((key, index, submitted[-1]))

    def start(self) -> None:
        """Submit the first window of shards now (otherwise the first ``next_shard`` does)."""
        self._fill(self.stream.prefetch + 1)

    def _window(self) -> int:
        """Shards to keep submitted: ``prefetch + 1`` before the first is handed out, then
        ``prefetch`` (at least the next one), before a shard is handed out as after: the
        shard in use is alive until the next is handed out, so filling ``prefetch + 1`` while
        the consumer held one kept a shard more than the memory bound counts."""
        prefetch = self.stream.prefetch
        return max(1, prefetch) if self._handed else prefetch + 1

    def ready(self) -> bool:
        """Whether :meth:`next_shard` would return without waiting for a producer."""
        if self.cancelled or self.stream.closed:
            return True
        self._fill(self._window())
        return not self.pending or self.pending[0][2].done()

    def has_shard(self) -> bool:
        """Whether the next shard is produced and good: :meth:`next_shard` hands it out at once."""
        if self.cancelled or self.stream.closed:
            return False
        self._fill(self.stream.prefetch + 1)
        if not self.pending:
            return False
        fut = self.pending[0][2]
        return fut.done() and not fut.cancelled() and fut.exception() is None

    def queued(self) -> int:
        """Shards of this pass submitted to the producers that have no producer's place yet:
        not started, or started in a thread that waits for a place (or for the shard's
        generation ahead, whose place it takes next)."""
        with self.lock:
            futures = [fut for _, _, fut in self.pending]
            ahead = self.ahead.queued()
        return ahead + sum(1 for fut in futures if not (fut.running() or fut.done()))

    def ready_ahead(self) -> int:
        """Shards ahead of the consumer that are already produced."""
        with self.lock:
            return sum(1 for _, _, fut in self.pending if fut.done())

    def next_shard(self) -> Shard | None:
        """The next shard in order, or None at the end of the epoch."""
        stream = self.stream
        self.last_wait_s = 0.0  # summed over retries; 0 at the end (nothing was waited for)
        while True:
            stream.check_open()
            if self.cancelled:
                raise LoaderClosed("this epoch pass was replaced by a newer one")
            self._fill(self._window())
            if not self.pending:
                error = self.keys.take_error()
                if error is not None:
                    raise error
                return None
            with self.lock:
                key, index, fut = self.pending.popleft()
            self._fill(stream.prefetch)
            shard = self._wait(key, index, fut)
            if shard is not None:
                self._handed = True
                return shard

    def _wait(self, key: Any, index: int, fut: cf.Future) -> Shard | None:
        """Shard ``index`` once produced and checked, the stream's error policy applied to a
        failure (:meth:`ErrorPolicy.verdict`): made again, or skipped (None), or raised."""
        stream = self.stream
        retried = 0
        while True:
            try:
                shard = self._result(fut, key)
                stream.producer.check_schema(shard)
            except Deferred:  # it waited for a shard before it that failed, and is made again
                fut = self._submit(key, index)
                continue
            except BaseException as exc:
                if stream.producer.failed(exc, key, self.epoch, index, retried) == "retry":
                    retried += 1
                    fut = self._submit(key, index)
                    continue
                self._skipped(index)
                return None
            stream.producer.handed(shard, index, self.last_wait_s, self.rows_before(index))
            if stream.tuner is not None:
                self._fill(stream.prefetch)  # a prefetch the tuner just raised fills the window
            return shard

    def _skipped(self, index: int) -> None:
        self.skipped += 1
        self.skipped_at.append(index)
        if self.offsets is not None:
            self.offsets.tell(index, 0)

    def _result(self, fut: cf.Future, key: Any = None) -> Shard:
        """``fut``'s shard, the wait added to :attr:`last_wait_s`. ``cf.wait``, not
        ``result(timeout=)``: since Python 3.11 ``cf.TimeoutError`` is the built-in
        ``TimeoutError``, so a shard that failed with ShardTimeout would look 'not ready yet'."""
        if fut.done():  # produced ahead: no wait to count
            return fut.result()
        start = self.stream.stats.clock()
        try:
            if not fut.done():
                self.waits += 1
                self.stream.waited(key, self.queued() + (not fut.running()))
            while not cf.wait([fut], timeout=WAIT_SLICE_S).done:
                self.check_alive()
            return fut.result()
        finally:
            self.last_wait_s += self.stream.stats.clock() - start

    def check_alive(self) -> None:
        """Raise :class:`~gluon_stream.LoaderClosed` if the stream is closed or the pass
        cancelled."""
        self.stream.check_open()
        if self.cancelled:
            raise LoaderClosed("this epoch pass was cancelled")

    def rows_before(self, index: int) -> int | None:
        """``deal='balanced'``: the rows of the epoch's shards before position ``index``,
        where known (None: not yet, or another deal)."""
        offsets = self.offsets
        return offsets.before_known(index) if offsets is not None else None

    def reaches(self, rows: int) -> bool:
        """``deal='balanced'``: whether the epoch's shards hold ``rows`` rows or more (see
        :func:`~gluon_stream._stages.offsets.reaches`)."""
        assert self.offsets is not None
        return reaches(self.offsets, rows, self)

    def frontier(self, index: int) -> tuple[bool, cf.Future | None]:
        """``(no shard is left at position index or after, its future if it is in the
        window)``, submitting the next shard when ``index`` is not submitted yet."""
        with self.lock:
            if self.exhausted and index >= self.index:
                return True, None
            futs = [fut for _, i, fut in self.pending if i == index]
            if index >= self.index:  # not submitted: the window holds only known ones
                self._fill(len(self.pending) + 1, ahead=False, capped=False)
        return False, futs[0] if futs else None

    def cancel(self) -> None:
        """Drop queued work; running producers finish (populating caches) and are ignored."""
        self._advance(RunState.CANCELLED)
        if self.offsets is not None:
            self.offsets.close()
        with self.lock:
            while self.pending:
                _, _, fut = self.pending.popleft()
                fut.cancel()
            self.ahead.cancel()


# -- the stream: the keys and production wired, its threads owned ----------------------------------
# ShardStream: shards in order, produced ahead of the consumer by a bounded thread pool.
#
# Producer threads generate, load, transform and (when shuffling) permute each shard
# while the consumer works on the current one; at most ``prefetch`` shards are ever
# ahead of it, so at most ``prefetch + 1`` shards are held at once. Threads, not
# processes: generation runs in external processes or in numpy code that releases the
# GIL, and nothing has to be forked or pickled.
#
# The contract with a consumer such as :class:`~gluon_stream.StreamLoader` is public:
# :meth:`ShardStream.start_epoch` begins a pass (optionally with a ``prepare`` step that runs in
# the producer threads, e.g. copying the shard into an NDArray) and returns an
# :class:`KeyPass`, whose :meth:`~KeyPass.next_shard` hands out the shards in order. The pass
# lives in this module too and drives the stream through the public methods
# of its :class:`~gluon_stream._stages.produce.ShardMaker` contract. The stream wires the keys
# stage (:mod:`.keys`) and the production stage (this module); the public
# :mod:`gluon_stream.stream` names it, ``Shard``, ``KeyPass``, ``RunState`` and ``Prepare``.
# the public name: its lines are filtered by it (docs/memory-budget.md)
logger = logging.getLogger("gluon_stream.stream")

DEAL_MODES = ("shards", "samples", "strides", "turns", "balanced")

class ShardStream(Closing):
    """Iterate shards in order while the next ones are produced in the background.

    Args:
        source: A :class:`~gluon_stream.CommandSource`, ``FunctionSource`` or ``FileSource``.
            The stream owns it: closing the stream closes the source.
        transform: ``transform(raw) -> arrays`` per shard, run in a producer thread; ``raw`` is
            the ``.npy`` array or the tuple of ``.npz`` arrays. Returns an array, a tuple or a
            dict of arrays with a common first (sample) dimension.
        prefetch: Shards produced ahead of the one being consumed (0: none). ``'auto'``
            (default): 2, or tuned within ``memory_budget``.
        producers: Shards produced at once. ``'auto'`` (default): one, and one more each time
            the consumer waits for a shard while every producer is busy and a core is free, up
            to ``min(prefetch, cores)``, counting the cores this process may use (its CPU
            affinity and cgroup quota: more have nothing ahead to make, or no core to run on);
            logged at INFO when it grows. An int fixes it; a ``concurrent.futures.Executor``
            (e.g. ``dask.distributed.Client.get_executor()``) generates shards elsewhere into a
            ``cache_dir`` both sides can see, loaded and transformed here, in order.
        shuffle: Shuffle the shard order (finite keys) and the samples within each shard,
            deterministically from ``(seed, epoch)``.
        seed: Seed for shuffling; None draws one (logged at INFO).
        on_error: Per shard: ``'raise'`` (default), ``'skip'`` (drop it with a WARNING and
            count it in stats), or ``('retry', n)``.
        schema: Expected ``[(dtype, trailing_shape), ...]`` per array; by default the first
            shard's schema is expected of all later ones.
        stats: A :class:`~gluon_stream.Stats` to record into (default: a new one).
        num_parts, part_index: Train on part ``part_index`` of ``num_parts`` (one per rank):
            each epoch's shards are dealt to the parts deterministically from ``(seed, epoch)``,
            differently each epoch. ``'auto'`` reads them from ``kvstore``, Horovod or the
            launcher's environment (see the multi-host guide).
        kvstore: An MXNet kvstore to read the rank from with ``'auto'``.
        shard_sizes: Samples per shard after ``transform``, for ``len()`` and ``even_batches``
            when headers cannot tell: ``{key: samples}``, ``fn(key) -> samples``, or one int for
            every shard.
        num_epochs: How many epochs will be run, if known: the shards of epoch ``num_epochs``
            are then not produced ahead while the last epoch ends (they would be thrown away).
        deal: How ``num_parts`` split an epoch: ``'shards'`` (default, each part its share of
            the shards), or every part reads every shard and takes its stride of each one's
            samples: ``'samples'`` (equal counts, fewer than ``num_parts`` samples dropped per
            shard), ``'strides'`` (nothing dropped), ``'turns'`` (the first row turns from shard
            to shard and pass to pass) or ``'balanced'`` (strides go on across shards: counts
            never differ by more than one). See the multi-host guide.
        generate_ahead: With a ``cache_dir``, producers that would otherwise sit idle generate
            up to this many shards beyond the ``prefetch`` window into the cache (disk, not
            memory), in key order: a shard that takes long to generate no longer holds up the
            ones after it, while batches keep their order and at most ``prefetch + 1`` shards
            are loaded. ``'auto'`` (default): ``2 * (prefetch + 1)`` with a cache, else 0, and
            with a ``cache_limit`` of N shards at most ``N - prefetch - 2`` (shards made ahead
            are not evicted before they are read).
        memory_budget: Bytes (or ``"4GiB"``, ``"512MB"``) the stream may hold for data:
            each shard's raw arrays, transform output and copy are admitted against it before
            they are allocated (:attr:`gate`), and ``prefetch`` and ``producers`` (unless
            given) are tuned live within it, each change logged at INFO and kept in
            :attr:`Stats.tuning`; too small a budget raises
            :class:`~gluon_stream.MemoryBudgetTooSmall` (see the memory-budget guide).
        context_rows, context_break: The last ``context_rows`` raw rows of the keys before a
            shard's, in key order, put before its own for ``transform`` (see
            :class:`~gluon_stream.StreamLoader` and the time-series guide).

    Example:
        >>> from gluon_stream import FunctionSource
        >>> with ShardStream(FunctionSource(range(3), lambda k: np.arange(4) + 10 * k)) as s:
        ...     [(shard.key, len(shard)) for shard in s]
        [(0, 4), (1, 4), (2, 4)]
    """

    def __init__(self, source: Source, *, transform: Callable[[Any], Any] | None = None,
                 prefetch: int | str = "auto", producers: int | str | cf.Executor = "auto",
                 shuffle: bool = False,
                 seed: int | None = None, on_error: OnError = "raise",
                 schema: Sequence[tuple[Any, Sequence[int]]] | None = None,
                 stats: Stats | None = None, num_parts: int | str = 1,
                 part_index: int | str = 0, kvstore: Any = None,
                 shard_sizes: Mapping[Any, int] | Callable[[Any], int] | int | None = None,
                 num_epochs: int | None = None, deal: str = "shards",
                 generate_ahead: int | str = "auto",
                 memory_budget: int | str | None = None, context_rows: int = 0,
                 context_break: ContextBreak | None = None) -> None:
        if not isinstance(source, Source):
            raise TypeError(f"source must be a CommandSource, FunctionSource or FileSource, got "
                            f"{type(source).__name__}")
        budget = (None if memory_budget is None
                  else _validate.byte_size("memory_budget", memory_budget))
        fixed_prefetch = not (isinstance(prefetch, str) and prefetch == "auto")
        self._remote = producers if isinstance(producers, cf.Executor) else None
        self.auto_producers = producers == "auto"
        caches = bool(getattr(source, "cached", False)) and self._remote is None
        prefetch, throttle = first_knobs(
            prefetch, producers, budget,
            caches and source.generates_apart and self.auto_producers)
        _validate.callable_or_none("transform", transform)
        self.source = source
        self.transform = transform
        # context_rows: nothing of it runs unless asked for
        context = context_rows_of(context_rows, context_break, source, transform) \
            if context_rows != 0 or context_break is not None else None
        self.prefetch = prefetch
        self.shuffle = bool(shuffle)
        self.num_parts, self.part_index = resolve_parts(num_parts, part_index, kvstore=kvstore)
        self.deal = _validate.choice("deal", deal, DEAL_MODES)
        self.seed_given = seed is not None
        #: the keys stage: which keys and rows this part reads
        self.dealer = KeyDealer(source, _seed(seed, self.shuffle, self.num_parts), self.shuffle,
                                self.num_parts, self.part_index, self.deal)
        self.error_policy = ErrorPolicy.parse(on_error)
        self.stats = stats if stats is not None else Stats()
        self.epoch = 0
        self._next_run: KeyPass | None = None
        #: what is known of the shards' sizes without producing them (len, even_batches)
        self.sizes = ShardSizes(source, transform, shard_sizes, self.deal, self.num_parts,
                                self.part_index, self.dealer.epoch_keys, self.dealer.remainder_of)
        self.dealer.sizes = self.sizes
        # context_rows over keys(epoch): a key's context, so its size, may change per epoch
        self.sizes.per_epoch = context is not None and not source.same_keys
        self._generate_auto = generate_ahead == "auto" and caches
        self.generate_ahead = (_auto_generate_ahead(source, prefetch) if self._generate_auto
                               else _fixed_generate_ahead(generate_ahead, caches))
        self.num_epochs = (None if num_epochs is None
                           else _validate.integer("num_epochs", num_epochs, minimum=1))
        self._pool = ProducerPool(source, throttle)
        self._production(budget, fixed_prefetch, schema, context)

    def _production(self, budget: int | None, fixed_prefetch: bool, schema: Any,
                    context: ContextRows | None) -> None:
        """The memory gate and the tuner (with a ``memory_budget``), the production stage, and
        what closes them."""
        self.memory_budget = budget
        #: memory admitted before it is allocated, within the budget (None: no budget)
        self.gate = None if budget is None else MemoryGate(budget)
        self.tuner: Tuner | None = None
        if self.gate is not None:
            limits = Limits(self.gate.budget, self._pool.throttle.bound,
                            fixed_prefetch=fixed_prefetch, fixed_producers=not self.auto_producers)
            self.tuner = Tuner(self, limits, lambda: self.stats.clock() - self.stats.origin,
                               self.stats.add_tuning)
            self.tuner.on_rows = self.gate.set_outside  # rows a loader holds, admitted too
        #: the production stage: shards made in the producer threads or the caller's
        self.producer = Producer(self.source, self.transform, self._pool, self.gate,
                                 self.dealer, self.sizes, self.stats, self.error_policy, schema,
                                 self._remote, self.check_open, self.tuner, context)
        self._finalizer = weakref.finalize(self, _close_all, self._pool, self.gate)
        track(self, self._finalizer)

    # -- configuration ------------------------------------------------------------------
    @property
    def producers(self) -> int:
        """Shards produced at once now (with ``'auto'``, it grows up to its bound)."""
        return self._pool.throttle.active

    def set_prefetch(self, prefetch: int) -> None:
        """Produce ``prefetch`` shards ahead from the next shard on (the ``memory_budget``
        tuner; shards already ahead beyond it are handed out as usual). ``generate_ahead='auto'``
        follows it."""
        self.prefetch = _validate.integer("prefetch", prefetch, minimum=0)
        if self._generate_auto:
            self.generate_ahead = _auto_generate_ahead(self.source, self.prefetch)

    def set_producers(self, producers: int) -> None:
        """Produce ``producers`` shards at once (the ``memory_budget`` tuner), within the
        producer threads the stream has."""
        self._pool.throttle.set_active(_validate.integer("producers", producers, minimum=1))

    def idle_producers(self) -> int:
        """Producers free to start a shard now: those that may work at once less those at work
        (below 0 while the ``memory_budget`` tuner's lower count lets shards at work finish)."""
        throttle = self._pool.throttle
        return throttle.active - throttle.running

    def waited(self, key: Any, queued: int = 0) -> None:
        """The consumer had to wait for shard ``key``: with ``'auto'``, add a producer if every
        producer is busy (running, or about to run one of the ``queued`` shards) and a core
        is free (the loop, waiting, uses none). With a ``memory_budget`` the tuner decides,
        from this and the budget."""
        throttle = self._pool.throttle
        if self.tuner is not None:
            self.tuner.waited(throttle.running + queued >= throttle.active)
            return
        if not self.auto_producers or throttle.running + queued < throttle.active:
            return
        if throttle.grow():
            logger.info("producers='auto': %d producers (the loop waited for shard %r while "
                        "every producer was busy)", throttle.active, key)

    @property
    def on_error(self) -> str:
        """``'raise'``, ``'skip'`` or ``'retry'`` (see :attr:`error_policy` for the count)."""
        return self.error_policy.mode

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch the next iteration produces (its keys, shuffle and cache entries)."""
        self.epoch = _validate.integer("epoch", epoch, minimum=0)

    @property
    def closed(self) -> bool:
        return self._pool.closed.is_set()

    def check_open(self) -> None:
        check_owner(self, "ShardStream")
        if self.closed:
            raise LoaderClosed("this ShardStream/StreamLoader is closed; create a new one")

    def adopt_seed(self, seed: int) -> None:
        """Take ``seed`` (a resumed state's) in place of the one drawn for ``seed=None``."""
        if self.seed_given:
            raise ValueError(f"this stream was given seed={self.seed}; it keeps it")
        self.dealer.seed = _validate.integer("seed", seed)
        self._drop_runs()

    @property
    def seed(self) -> int:
        """The seed of the shuffle and of per-sample randomness (the dealer's)."""
        return self.dealer.seed

    def set_remainder(self, remainder: Remainder | None) -> None:
        """Read ``remainder`` in place of its epoch's keys (an elastic resume; None: the keys)."""
        if remainder is not self.dealer.remainder:
            self.dealer.remainder = remainder
            self._drop_runs()

    def _drop_runs(self) -> None:
        self._next_run = None
        for run in list(self._pool.runs):  # shards made ahead in another order
            run.cancel()

    # -- iteration ----------------------------------------------------------------------
    def __iter__(self) -> Iterator[Shard]:
        run = self.start_epoch()
        try:
            while True:
                shard = run.next_shard()
                if shard is None:
                    break
                if shard.record is not None and shard.record.source is not None:
                    self.stats.add_delivered({shard.record.source: len(shard)})  # whole shards
                yield shard
                del shard
        finally:
            run.cancel()

    def start_epoch(self, skip: int = 0, prepare: Prepare | None = None,
                    skipped: Sequence[int] = (), reuse: "KeyPass | None" = None,
                    rows_before: int = 0) -> "KeyPass":
        """Begin producing the current epoch after ``skip`` shards; cancels any unfinished pass.

        ``skipped``: positions of shards that failed before (``on_error='skip'``, recorded in a
        resumed state): they count as skipped again without being produced, so a resume sees
        the epoch the interrupted pass saw. ``reuse``: a pass of this epoch that stopped at
        ``skip`` (an epoch of ``samples_per_epoch`` ended there): it goes on, with the shards it
        produced ahead, instead of a new one. ``rows_before``: ``deal='balanced'``, the rows of
        the epoch's shards before position ``skip`` (a resume's state holds them).

        ``prepare(arrays, order, what)``, if given, runs in the producer threads after the transform
        and returns the shard's arrays in ``order`` in the form the consumer wants; without it
        the rows are permuted with numpy. The same ``prepare`` is used for the next epoch's
        shards produced ahead.
        """
        self.check_open()
        epoch = self.epoch
        self.epoch += 1  # without set_epoch, the next pass is the next epoch
        if reuse is not None and reuse.epoch == epoch and reuse.index_next() == skip \
                and not reuse.cancelled and reuse.prepare is prepare and not skipped:
            for old in list(self._pool.runs):
                if old is not reuse and old is not self._next_run:
                    old.cancel()
            return reuse
        ahead, self._next_run = self._next_run, None
        for old in list(self._pool.runs):
            if old is not ahead:
                old.cancel()
        if (ahead is not None and ahead.epoch == epoch and not skip and not skipped
                and not ahead.cancelled and ahead.prepare is prepare):
            return ahead  # its first shards were produced while the last epoch ended
        if ahead is not None:
            ahead.cancel()
        return self._new_run(epoch, skip, prepare, skipped, rows_before)

    def _new_run(self, epoch: int, skip: int, prepare: Prepare | None,
                 skipped: Sequence[int] = (), rows_before: int = 0) -> "KeyPass":
        run = KeyPass(self, epoch, skip, prepare, skipped, rows_before)
        self._pool.runs.add(run)
        return run

    @property
    def next_run(self) -> KeyPass | None:
        """The pass of the next epoch, begun early while this one ends (None: none is)."""
        return self._next_run

    def run_ahead(self, epoch: int, prepare: Prepare | None) -> KeyPass:
        """The pass of the epoch after this one, started early to hide its first shards' cost."""
        ahead = self._next_run
        if ahead is None or ahead.epoch != epoch or ahead.prepare is not prepare:
            if ahead is not None:
                ahead.cancel()
            ahead = self._next_run = self._new_run(epoch, 0, prepare)
        return ahead

    # -- lifecycle ------------------------------------------------------------------------
    def close(self) -> None:
        """Stop producers, kill running generators and release everything; idempotent."""
        self._finalizer()


def _auto_generate_ahead(source: Source, prefetch: int) -> int:
    """``generate_ahead='auto'`` for ``prefetch``: two windows' worth, within the
    ``cache_limit``."""
    ahead = 2 * (prefetch + 1)
    room = source.cache_room
    if room is not None:  # shards made ahead must not be evicted before they are read
        ahead = max(0, min(ahead, room - prefetch - 2))
    return ahead


def _fixed_generate_ahead(generate_ahead: int | str, caches: bool) -> int:
    """``generate_ahead`` given as a number (``'auto'`` without a cache: 0)."""
    if generate_ahead == "auto":
        return 0
    ahead = _validate.integer("generate_ahead", generate_ahead, minimum=0, hint="or 'auto'")
    if ahead and not caches:
        raise ValueError(f"generate_ahead={generate_ahead} generates shards into a cache while "
                         "they wait to be loaded: it needs a source with a cache_dir, and local "
                         "producers")
    return ahead


def _seed(seed: int | None, shuffle: bool, parts: int) -> int:
    """The stream's seed: the one given, else drawn (one part) or 0 (several parts, which
    deal shards alike without shuffling)."""
    if seed is None and shuffle and parts > 1:
        raise ValueError("shuffle=True with num_parts > 1 needs an explicit seed, the same on "
                         "every rank, so that the ranks agree on who gets which shard")
    if seed is None and parts == 1:
        seed = int(np.random.SeedSequence().generate_state(1)[0]) % (2 ** 31)
        (logger.info if shuffle else logger.debug)(
            "no seed given: using seed=%d (shuffle order and per-sample randomness)", seed)
    return 0 if seed is None else _validate.integer("seed", seed)


def _close_all(res: ProducerPool, gate: MemoryGate | None) -> None:
    if gate is not None:  # producers waiting for memory wake and stop
        gate.close()
    res.close()
