"""One pass over an epoch's keys (:class:`EpochRun`), and the contract it drives the stream by.

A pass keeps a window of shards submitted to the producers and hands them out in order, with
the stream's error policy applied where each is waited for. It drives the stream's producer
side through :class:`ShardMaker` (public methods only), which
:class:`~gluon_stream.ShardStream` implements; the stream owns the producer threads, the
pass only what it submitted.
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import enum
import logging
import threading
from typing import TYPE_CHECKING, Any, Protocol, Sequence

from .._utils.closing import WAIT_SLICE_S
from .._utils.retry import ErrorPolicy
from ..errors import LoaderClosed, add_note
from ..records import ShardRecord
from .offsets import Deferred, RowOffsets
from .shard import Prepare, Shard

if TYPE_CHECKING:
    from ..stats import Stats
    from .deal import KeyDealer
    from .produce import Producer
    from .sizes import ShardSizes
    from .tuning import Tuner

__all__ = ["EpochRun", "RunState", "ShardMaker"]

# the stream's logger: its per-shard lines are filtered by this name (docs/memory-budget.md)
logger = logging.getLogger("gluon_stream.stream")

_END = object()


class ShardMaker(Protocol):
    """The producer side of a :class:`~gluon_stream.ShardStream`, as an :class:`EpochRun`
    drives it: what it reads of the stream's configuration, and how it submits work.

    It lives beside :class:`EpochRun`, not in :mod:`.contracts`: the contracts name the
    feed's types, and the feed names :class:`EpochRun` (an import cycle).

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
    def next_run(self) -> EpochRun | None:
        """The pass of the next epoch, begun early, if any."""

    def check_open(self) -> None:
        """Raise :class:`~gluon_stream.errors.LoaderClosed` if the stream is closed."""

    def idle_producers(self) -> int:
        """Producers free to start a shard now (below 0: more at work than may be)."""

    def waited(self, key: Any, queued: int = 0) -> None:
        """The consumer had to wait for shard ``key`` (``queued``: shards not started)."""

    def run_ahead(self, epoch: int, prepare: Prepare | None) -> EpochRun:
        """The pass of the epoch after this one, begun early."""


class RunState(enum.IntEnum):
    """Where an :class:`EpochRun` is in its life: it submits shards while keys are left
    (``PRODUCING``), then hands out what it submitted (``EXHAUSTED``: no key left, or the key
    iterator failed), until its consumer is done or a newer pass replaces it (``CANCELLED``:
    queued work dropped, running producers finish and are ignored). It only moves forward."""

    PRODUCING = 0
    EXHAUSTED = 1
    CANCELLED = 2


class EpochRun:
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
        self.keys, self.finite, self.key_list = stream.dealer.epoch_keys(epoch, start=skip)
        self.pending: collections.deque = collections.deque()
        self.index = skip
        self.state = RunState.PRODUCING
        self.skipped = 0
        self.skipped_at: list[int] = []  # positions of the shards skipped, in order
        self._preskipped = frozenset(skipped)
        self.key_error: BaseException | None = None
        self.last_wait_s = 0.0
        self.waits = 0  # times a shard was asked for before it was produced
        self.max_pending: int | None = None
        self._handed = False  # a shard was handed out: the consumer holds one (see _window)
        self._lookahead: collections.deque = collections.deque()  # (key, index) drawn early
        self._ahead: dict[int, cf.Future] = {}  # index -> generation into the cache
        self._unplaced = 0  # work started in a thread, waiting for a producer's place
        self._unplaced_lock = threading.Lock()  # not _lock: the window is filled holding it
        self._awaited: set[cf.Future] = set()  # generations ahead a window's shard waits for
        self.offsets = RowOffsets(skip, rows_before) if stream.sizes.learns_rows(epoch) \
            else None
        # the consumer fills the window; producers finishing a shard start generations ahead
        self._lock = threading.RLock()

    def index_next(self) -> int:
        """The position of the shard :meth:`next_shard` hands out next."""
        with self._lock:
            return self.pending[0][1] if self.pending else self.index

    def push_back(self, shard: Shard) -> None:
        """Hand ``shard`` out again first (an epoch stopped inside it; the next goes on)."""
        done: cf.Future = cf.Future()
        done.set_result(shard)
        with self._lock:
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

    def _next_key(self) -> Any:
        """The next (key, index) in order, or _END; a failing key iterator ends the keys."""
        if self._lookahead:
            return self._lookahead.popleft()
        return self._draw_key()

    def _draw_key(self) -> Any:
        """The key after those drawn already (and looked ahead at), with its index, or _END."""
        if self.key_error is not None:
            return _END
        try:
            key = next(self.keys, _END)
        except Exception as exc:  # the keys' own iterator failed: the shards drawn come first
            add_note(exc, f"gluon_stream: raised by the keys of epoch {self.epoch} after "
                          f"{self.index + len(self._lookahead)} key(s); the shards of those "
                          "were delivered first")
            self.key_error = exc
            return _END
        if key is _END:
            return _END
        return key, self.index + len(self._lookahead)

    def generated(self, index: int) -> float:
        """Wait for shard ``index``'s generation ahead, if one runs: its seconds (0: none
        ran; a generation not yet started is dropped and the shard made as usual). Its
        failure is raised here, where the shard's error policy applies.

        The caller is then counted as waiting for a producer's place (:meth:`_queued`; it
        says :meth:`unplaced` ``-1`` once it has one): from the end of the generation it
        waited for, not before (that generation's place is the one it takes next, so it keeps
        no other producer from work meanwhile). The generation's done-callback counts it
        first when it runs first, so that the producer finishing the generation sees it."""
        fut = self._ahead.pop(index, None)  # one pop: atomic, no lock to wait for
        if fut is None or fut.cancel():
            self.unplaced(1)
            return 0.0
        with self._unplaced_lock:
            self._awaited.add(fut)
        try:
            return fut.result()
        finally:
            self._count_waiter(fut)

    def _count_waiter(self, fut: cf.Future) -> None:
        """Count the window's shard that waited for generation ``fut`` as waiting for a
        place, once (by whichever of it and ``fut``'s done-callback comes first)."""
        with self._unplaced_lock:
            if fut in self._awaited:
                self._awaited.discard(fut)
                self._unplaced += 1

    def _generate_ahead(self, fut: Any = None) -> None:
        """Keep idle producers generating the shards after the window into the cache (called
        when the window is filled and whenever a producer finishes)."""
        if isinstance(fut, cf.Future):
            self._count_waiter(fut)  # a window's shard waited for it: it comes first
        stream = self.stream
        if not stream.generate_ahead or self.cancelled or stream.closed:
            return
        with self._lock:
            self._start_generation()

    def _start_generation(self, busy: int = 0) -> None:
        """Submit one generation ahead if a producer is idle (``busy``: shards an earlier
        pass has queued, which come first)."""
        stream = self.stream
        depth = stream.generate_ahead
        idle = stream.idle_producers()  # before the queue: a shard starting leaves it for these
        if self._queued() + busy >= idle:
            return  # no producer is idle: the window's shards come first
        ended = False
        while len(self._lookahead) < depth:
            nxt = self._draw_key()
            if nxt is _END:
                ended = True
                break
            self._lookahead.append(nxt)
        for key, index in self._lookahead:
            if index not in self._ahead and index not in self._preskipped:
                made = stream.dealer.made_epoch(self.epoch, index)
                fut = stream.producer.submit_generation(key, made, index, self)
                self._ahead[index] = fut
                fut.add_done_callback(self._generate_ahead)
                return  # one at a time: the next call sees whether a producer is still idle
        if ended and self.finite and not self.cancelled and not self._last_epoch() \
                and self.stream.next_run is not self:  # a pass made ahead stops at its own
            self._generate_next_epoch()

    def _last_epoch(self) -> bool:
        return self.stream.num_epochs is not None and self.epoch + 1 >= self.stream.num_epochs

    def _generate_next_epoch(self) -> None:
        """Every key of this pass is made or under way, and a producer is idle: it generates
        the next epoch's first shards into the cache (disk, not memory: a shuffle window's
        tail keeps its shards, and the next epoch starts on shards already made)."""
        nxt = self._next_epoch_run("generating")
        if nxt is None:
            return
        with nxt._lock:
            nxt._start_generation(busy=self._queued())

    def _next_epoch_run(self, doing: str) -> "EpochRun | None":
        """The stream's pass for the next epoch, begun early; None if its keys failed (they
        raise again when that epoch starts)."""
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

    def _fill(self, depth: int, ahead: bool = True) -> None:
        with self._lock:
            self._fill_locked(depth, ahead)

    def _fill_locked(self, depth: int, ahead: bool, capped: bool = True) -> None:
        if self.max_pending is not None and capped:
            depth = min(depth, max(1, self.max_pending))
        submitted = []
        while len(self.pending) < depth and not self.exhausted:
            nxt = self._next_key()
            if nxt is _END:
                self._advance(RunState.EXHAUSTED)
                break
            key, index = nxt
            self.index = index + 1  # first: a callback of the submit below draws the next key
            if index in self._preskipped:  # failed before the resume: skipped again
                logger.debug("shard %r (epoch %d) stays skipped, as before the resume", key,
                             self.epoch)
                self._skipped(index)
            else:
                submitted.append(self._submit(key, index, watch=False))
                self.pending.append((key, index, submitted[-1]))
        for fut in submitted:  # the window is filled: generations ahead come after it
            self._watch(fut)
        if ahead and self.exhausted and self.finite and len(self.pending) < depth \
                and not self.cancelled and not self._last_epoch():
            # the window has room: start on the next epoch (the one set_epoch(e + 1) or the
            # next pass will ask for); a different epoch discards it
            nxt = self._next_epoch_run("starting")
            if nxt is None:
                return
            nxt._fill(depth - len(self.pending), ahead=False)
        if ahead:
            self._generate_ahead()

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

    def _queued(self) -> int:
        """Shards of this pass submitted to the producers that have no producer's place yet:
        not started, or started in a thread that waits for a place (or for the shard's
        generation ahead, whose place it takes next)."""
        with self._lock:
            futures = [fut for _, _, fut in self.pending] + list(self._ahead.values())
        return self._unplaced + sum(1 for fut in futures if not (fut.running() or fut.done()))

    def unplaced(self, change: int) -> None:
        """Work of this pass started (``+1``) or stopped (``-1``) waiting for a producer's
        place in a producer thread (see :meth:`_queued`)."""
        with self._unplaced_lock:
            self._unplaced += change

    def ready_ahead(self) -> int:
        """Shards ahead of the consumer that are already produced."""
        with self._lock:
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
                if self.key_error is not None:
                    error, self.key_error = self.key_error, None
                    raise error
                return None
            with self._lock:
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
                verdict = stream.error_policy.verdict(exc, retried)
                if verdict == "raise":
                    raise
                summary = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                logger.debug("shard %r failure in full: %s", key, exc)
                if verdict == "retry":
                    retried += 1
                    logger.warning("shard %r failed (%s); retry %d/%d", key, summary, retried,
                                   stream.error_policy.retries)
                    stream.producer.forget_failure(key, stream.dealer.made_epoch(self.epoch,
                                                                                 index))
                    fut = self._submit(key, index)
                    continue
                logger.warning("skipping shard %r (epoch %d): %s", key, self.epoch, summary)
                self._skipped(index)
                stream.stats.add_shard(ShardRecord(key, self.epoch,
                                                   error=f"{type(exc).__name__}: {exc}"))
                return None
            self._accept(shard, key, index)
            return shard

    def _skipped(self, index: int) -> None:
        self.skipped += 1
        self.skipped_at.append(index)
        if self.offsets is not None:
            self.offsets.tell(index, 0)

    def _accept(self, shard: Shard, key: Any, index: int) -> None:
        """A good shard handed out: recorded, told to the tuner, its size remembered and
        checked against a declared one."""
        stream = self.stream
        record = shard.record
        assert record is not None  # _make records every shard it makes
        stream.stats.add_shard(record)
        if shard.admission is not None:  # the loop has it: shards after it rank first
            shard.admission.handed()
        if stream.tuner is not None:  # may refuse the shard: before any batch of it
            stream.tuner.shard_ready(key, record.nbytes, record.samples, self.last_wait_s,
                                     record.generate_s + record.load_s + record.transform_s,
                                     self.epoch, shard.source_nbytes)
            self._fill(stream.prefetch)  # a prefetch just raised fills the window now
        stream.sizes.remember(key, stream.dealer.made_epoch(self.epoch, index), shard.full_size)
        if stream.dealer.remainder_of(self.epoch) is None:
            stream.sizes.check_declared(key, self.epoch, index, self.rows_before(index),
                                        len(shard))
        logger.info("shard %r ready: %d samples (generate %.2f s, load %.2f s, "
                    "transform %.2f s%s)", key, len(shard), record.generate_s,
                    record.load_s, record.transform_s, ", cached" if record.cache_hit else "")

    def _result(self, fut: cf.Future, key: Any = None) -> Shard:
        clock = self.stream.stats.clock
        start = clock()
        try:
            return self._poll(fut, key)
        finally:
            self.last_wait_s += clock() - start

    def _poll(self, fut: cf.Future, key: Any = None) -> Shard:
        # cf.wait, not result(timeout=): since Python 3.11 cf.TimeoutError is the built-in
        # TimeoutError, so a shard that failed with ShardTimeout would look 'not ready yet'
        if not fut.done():
            self.waits += 1
            self.stream.waited(key, self._queued() + (not fut.running()))
        while not cf.wait([fut], timeout=WAIT_SLICE_S).done:
            self.stream.check_open()
            if self.cancelled:
                raise LoaderClosed("this epoch pass was cancelled")
        return fut.result()

    def rows_before(self, index: int) -> int | None:
        """``deal='balanced'``: the rows of the epoch's shards before position ``index``,
        where known (None: not yet, or another deal)."""
        offsets = self.offsets
        return offsets.before_known(index) if offsets is not None else None

    def reaches(self, rows: int) -> bool:
        """``deal='balanced'``: whether the epoch's shards hold ``rows`` rows or more, counted
        in order as far as their sizes are known. Waits for the sizes after those known
        (submitting the next shards if none is in flight); False once every shard is known
        and they hold fewer. A shard that failed where the count stands ends the wait (True):
        the consumer meets it and applies the error policy, so the count never waits on it."""
        offsets = self.offsets
        assert offsets is not None
        while offsets.known < rows:
            with self._lock:
                frontier = offsets.frontier
                if self.exhausted and frontier >= self.index:
                    return False
                futs = [fut for _, index, fut in self.pending if index == frontier]
                if frontier >= self.index:  # not submitted: the window holds only known ones
                    self._fill_locked(len(self.pending) + 1, ahead=False, capped=False)
            if futs and futs[0].done() and not futs[0].cancelled() \
                    and futs[0].exception() is not None:
                return True
            self.stream.check_open()
            if self.cancelled:
                raise LoaderClosed("this epoch pass was cancelled")
            offsets.wait_change(WAIT_SLICE_S)
        return True

    def cancel(self) -> None:
        """Drop queued work; running producers finish (populating caches) and are ignored."""
        self._advance(RunState.CANCELLED)
        if self.offsets is not None:
            self.offsets.close()
        with self._lock:
            while self.pending:
                _, _, fut = self.pending.popleft()
                fut.cancel()
            for fut in self._ahead.values():
                fut.cancel()
            self._ahead.clear()
