"""One pass over an epoch's keys (:class:`KeyPass`), and the contract it drives the stream by.

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
from ..errors import LoaderClosed
from .ahead import GenerationsAhead
from .deal import END, KeyCursor
from .offsets import Deferred, RowOffsets, reaches
from .shard import Prepare, Shard

if TYPE_CHECKING:
    from ..stats import Stats
    from .deal import KeyDealer
    from .produce import Producer
    from .sizes import ShardSizes
    from .tuning import Tuner

__all__ = ["KeyPass", "RunState", "ShardMaker"]

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
        :func:`~gluon_stream._pipeline.offsets.reaches`)."""
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
