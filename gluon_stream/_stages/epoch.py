"""The epochs stage: one loader epoch driven through the stages, where it stands, where the
next one starts, and how many batches it has.

An epoch (:class:`LoaderEpoch`) wires its stages: the stream's
:class:`~gluon_stream._stages.produce.KeyPass` (shards in order; several passes over the keys
with ``samples_per_epoch``), a feed (units: shards, or the mixed units of a shuffle window),
the :class:`~gluon_stream._stages.batching.BatchPlanner` (which samples form which batch), a
batch path (slices, or per-sample work on workers) and, with even_batches,
:class:`~gluon_stream._stages.even.EvenBatches`. Each stage owns its position;
:class:`PassState` composes them after the last batch yielded, so a
:class:`~gluon_stream._stages.state.LoaderState` taken between any two batches, the last one
included, resumes exactly. :class:`Rebuild` makes a resumed position's units again,
:class:`PassStarts` says where each pass starts (a loaded state, or where the last pass left
the stream), and :class:`BatchCounts` counts a pass's batches (``len(loader)``, the progress
bar, even_batches' limit) from sizes declared or known.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Generator, Iterator, Protocol, Sequence

import numpy as np

from .. import _mx as mx_arrays
from .._mx.padding import pad_rows
from .._utils.progress import ProgressBar
from .._utils.random import batch_seed
from ..errors import InvalidState, SizeUnknown, StreamError
from ..records import EpochRecord
from ..sources import Source
from .batching import Batch, BatchPlanner, LastBatch, Position, Segment, WindowMixer
from .contracts import BatchPath
from .even import EvenBatches, borrow_batch
from .feed import Carry, MixedData, UnitFeed, UnitSources, WindowFeed
from .keys import EMPTY_PASSES, Remainder, ShardSizes
from .produce import KeyPass, ShardStream
from .provenance import ProvenanceTracker
from .quotas import PartStream, endless_drawn
from .ranks import even_count
from .settings import PassSettings
from .state import LoaderState, check_segment_key

__all__ = ["BatchCounts", "LoaderEpoch", "PassSettings", "PassStarts", "PassState", "Rebuild"]

logger = logging.getLogger(__name__)

class _LoopClock:
    """When the loop waited and trained: the epoch record's stall, spans and rotation times."""

    def __init__(self, clock: Any, record: EpochRecord) -> None:
        self.now, self.record = clock, record
        self.start = self.waiting_since = clock()
        self.run: KeyPass | None = None
        self.feed: UnitFeed | None = None
        self._arrived = self.start
        self._last_unit: Any = None
        self._shard_wait, self._waits = 0.0, 0

    def new_run(self, run: KeyPass, feed: UnitFeed) -> None:
        self.run, self.feed = run, feed
        self._last_unit, self._shard_wait, self._waits = None, 0.0, 0

    def arrived(self, planned: Batch) -> None:
        """A batch is in the loop's hands: what it waited for it, and what switching cost."""
        record, run, feed = self.record, self.run, self.feed
        assert run is not None and feed is not None
        now = self._arrived = self.now()
        if record.first_batch_s is None:
            record.first_batch_s = now - self.start
        record.stall_s += now - self.waiting_since
        unit = planned.segments[-1].unit
        if self._last_unit is not None and unit != self._last_unit and run.waits == self._waits:
            # the first batch of a shard that was produced in time: what switching to it cost
            # (after a wait for production, refilling the workers is a stall)
            waited = feed.shard_wait_s - self._shard_wait
            record.rotation_s.append(max(0.0, now - self.waiting_since - waited))
        self._last_unit, self._shard_wait, self._waits = unit, feed.shard_wait_s, run.waits
        self.record_span("wait", self.waiting_since, now)

    def resumed(self) -> None:
        """The loop asks for the next batch: it trained since the last one arrived."""
        self.waiting_since = self.now()
        self.record_span("busy", self._arrived, self.waiting_since)

    def record_span(self, name: str, start: float, end: float) -> None:
        assert self.run is not None  # set by new_run before the first batch
        self.run.stream.stats.add_span("train", name, start, end)


class LoaderEpoch:
    """One loader epoch, ``start.epoch``, from ``start`` (see the module doc).

    Iterate it once. :attr:`state` is where the pass stands after the last batch it yielded
    (``start`` before the first); :attr:`finished` is true once it ran to its end.
    """

    def __init__(self, stream: ShardStream, path: BatchPath, settings: PassSettings,
                 start: LoaderState, limit: int | None, expected: int | None = None,
                 carry: Carry | None = None, handover: KeyPass | None = None) -> None:
        remainder = stream.dealer.remainder_of(start.position.epoch)
        #: samples_per_epoch after an elastic resume: the rest of the interrupted epoch is the
        #: remainder's pieces, read as one pass of the keys' kind (its end is the epoch's)
        self.closed_remainder = settings.epoch_samples is not None and remainder is not None \
            and remainder.fixed and start.epoch == remainder.epoch
        if self.closed_remainder:
            settings = dataclasses.replace(settings, epoch_samples=None)
        self.stream, self.path, self.settings = stream, path, settings
        self.start = start
        self.carry = carry  # the data of start's carry, when the last pass rolled it over
        # samples_per_epoch: the run the last epoch stopped in (the shard it stopped inside
        # handed out again first); once this pass ends by its budget, what it hands the next
        self.handover = handover
        self.even = (EvenBatches(settings.batch_size, limit, start, settings.even == "pad",
                                 counted=settings.epoch_samples is None)
                     if settings.even else None)
        #: where the pass stands: :attr:`state`, composed after every batch
        self.at = PassState(stream, settings, start, self.even)
        #: a resumed position's data, produced again
        self.rebuild = Rebuild(stream, path, settings.window, self.at.recorded_rows, None)
        self.expected = expected  # batches in the epoch, for the progress bar
        self.finished = False
        self.pad = 0  # padding rows of the batch yielded last
        self.names: tuple[str, ...] | None = None  # the arrays' names, once a batch is made

    @property
    def epoch(self) -> int:
        return self.start.epoch

    @property
    def state(self) -> LoaderState:
        """Where the pass stands after the last batch it yielded (``start`` before the first)."""
        return self.at.state

    @property
    def origins(self) -> ProvenanceTracker | None:
        """provenance=True: the loader's tracker, told of every batch (None: off)."""
        return self.rebuild.origins

    @origins.setter
    def origins(self, tracker: ProvenanceTracker | None) -> None:
        self.rebuild.origins = tracker

    def __iter__(self) -> Generator[Any, None, None]:
        if self.start.position.end:  # the rest of an ended epoch: nothing
            self.finished = True
            return _nothing()
        return self._batches()

    # -- the epoch's batches ----------------------------------------------------------------
    def _batches(self) -> Generator[Any, None, None]:
        stream, settings, start = self.stream, self.settings, self.start
        if self.even is not None and self.even.reached(start.delivered):  # a limit of 0
            if settings.epoch_samples is None:
                stream.set_epoch(start.epoch + 1)
            self.at.advance(start.position.ended(), start.delivered, ())
            self.finished = True
            return
        record = stream.stats.new_epoch(start.epoch)
        self._clock = _LoopClock(stream.stats.clock, record)
        bar = (ProgressBar(start.epoch, self.expected,
                           live=True if settings.progress == "live" else None)
               if settings.progress else None)
        worker_wait = self.path.wait_s
        runs: list[tuple[KeyPass, UnitFeed]] = []
        try:
            delivered = yield from self._passes(runs, record, bar)
            yield from self._end(*runs[-1], delivered, record)
        finally:
            self._account(runs, record, bar, worker_wait)

    def _passes(self, runs: list[tuple[KeyPass, UnitFeed]], record: EpochRecord,
                bar: ProgressBar | None) -> Generator[Any, None, int]:
        """The epoch's batches over its runs: one per pass over the keys (several with
        samples_per_epoch, which reads on in the next pass until the epoch read its samples);
        returns the batches delivered."""
        stream, settings, start = self.stream, self.settings, self.start
        position = start.position
        handover, self.handover = self.handover, None
        carry = self.carry if self.carry is not None else \
            self.rebuild.carry(position.carry, start.skipped)
        self.carry = carry  # what rolls over at the end, once the planner is done
        delivered = start.delivered
        empty = 0  # samples_per_epoch: passes in a row that read no sample
        while True:
            run, feed = self._start_run(position, carry, record, handover)
            handover = None
            runs.append((run, feed))
            # _deliver counts on from the batches delivered so far and yields the running
            # count with each batch: the loop carries it into the next run, or the tail
            for so_far, batch in self._deliver(run, feed, carry, delivered, record, bar):
                delivered = so_far
                yield batch
            if self.state.position.end or feed.final is not None or feed.failure is not None:
                return delivered
            assert feed.end is not None
            if settings.epoch_samples is None or feed.end.end:
                return delivered
            # samples_per_epoch: the keys ran out before the epoch read its samples
            if not run.finite:  # an endless key iterator that ended: the stream is over
                for so_far, batch in self._close(feed, carry, delivered, record, bar):
                    delivered = so_far
                    yield batch
                return delivered
            whole = not position.unit and not position.offset
            empty = empty + 1 if whole and _empty_pass(stream, feed, position) else 0
            if empty == EMPTY_PASSES:
                raise _no_sample_error(stream, settings.epoch_samples, run.epoch)
            position = Position(run.epoch + 1, 0, 0, feed.end.carry, taken=feed.end.taken)

    def _end(self, run: KeyPass, feed: UnitFeed, delivered: int,
             record: EpochRecord) -> Generator[Any, None, None]:
        """The epoch's end after its last run: even_batches' repeats, the state at the end
        (and, with samples_per_epoch, the run handed to the next epoch), a WARNING for an
        epoch that gave no sample."""
        stream, settings, start = self.stream, self.settings, self.start
        end = self.state.position if self.state.position.end else feed.end
        self.at.full_sizes.update(feed.full_sizes)
        even = self.even
        count = even.count(self.at.lead(run.index)) if even is not None else None
        if even is not None and count is not None and delivered < count:
            assert feed.end is not None
            stop = Position(run.epoch, feed.end.unit)  # the repeats come after the units
            yield from self._repeat(even, delivered, count, run, record, stop)
            end = stop.ended()
        assert end is not None  # the feed ended (a failure raised above)
        if settings.epoch_samples is not None and not end.end:
            end = Position(end.epoch, end.unit, end.offset, end.carry, True, end.taken)
        elif settings.epoch_samples is not None and settings.window == 1:
            # the epoch read its samples: the next goes on in this run, in this shard
            if end.offset and feed.current is not None:
                run.push_back(feed.current)
            self.handover = run
        self.at.advance(end, self.state.delivered, run.skipped_at)
        record.complete = True
        self.finished = True
        fresh = not start.delivered and start.position.unit == start.position.offset == 0
        if not record.samples and fresh and settings.epoch_samples is None \
                and stream.dealer.remainder_of(run.epoch) is None:  # a remainder may hold none
            logger.warning("epoch %d delivered no samples: %s", run.epoch,
                           _empty_reason(run, feed, settings.batch_size,
                                         "even_batches=True" if settings.even is True
                                         else f"last_batch={settings.last_batch!r}"))

    def _account(self, runs: list[tuple[KeyPass, UnitFeed]], record: EpochRecord,
                 bar: ProgressBar | None, worker_wait: float) -> None:
        """The pass is over (or abandoned): its runs cancelled (but the one handed over), the
        epoch's record completed, nothing of the pass kept."""
        for run, feed in runs:
            if run is not self.handover:
                run.cancel()
            feed.current = None
            record.skipped_shards += run.skipped
            record.shard_wait_s += feed.shard_wait_s
            record.mix_wait_s += feed.mix_wait_s
        record.worker_wait_s += self.path.wait_s - worker_wait
        record.wall_s = self._clock.now() - self._clock.start
        record.producers = self.stream.producers
        self._clock.run = self._clock.feed = self.at.run = None  # nothing outlives the pass
        if bar is not None:
            bar.close(record)

    def _start_run(self, position: Position, carry: Carry, record: EpochRecord,
                   handover: KeyPass | None = None) -> tuple[KeyPass, UnitFeed]:
        """Production of a pass over the keys from ``position`` (going on in the run the last
        epoch handed over, where it fits), and its feed of units."""
        stream, settings, start = self.stream, self.settings, self.start
        k = settings.window
        if settings.epoch_samples is not None or self.closed_remainder:
            stream.set_epoch(position.epoch)  # the pass over the keys, not the loader's epoch
        skip = WindowMixer.first_shard(position.unit, k)
        run = stream.start_epoch(skip=skip, prepare=self.path.prepare,
                                 skipped=[j for e, j in start.skipped if e == position.epoch],
                                 reuse=handover, rows_before=self.at.recorded_rows(skip))
        if settings.epoch_samples is not None:
            stream.dealer.forget_keys(position.epoch, skip)  # no later epoch starts before it
        planner = BatchPlanner(settings.batch_size, settings.last_batch, position,
                               settings.epoch_samples)
        closes = settings.epoch_samples is None
        if k > 1:
            mixer = WindowMixer(k, stream.seed, run.epoch, first_unit=position.unit)
            budget = max(stream.prefetch, k) + 1
            return run, WindowFeed(run, planner, carry, self.path, record, mixer, budget, closes,
                                   self.at.lengths)
        return run, UnitFeed(run, planner, carry, self.path, record, closes)

    def _deliver(self, run: KeyPass, feed: UnitFeed, carry: Carry, delivered: int,
                 record: EpochRecord, bar: ProgressBar | None) -> Iterator[tuple[int, Any]]:
        """One run's batches, as the loop gets them: ``(batches delivered, batch)``."""
        stream, path, settings = self.stream, self.path, self.settings
        seed, epoch = stream.seed, self.start.epoch
        batches = path.batches(feed, carry, first=delivered,
                               seed_of=lambda n: batch_seed(seed, epoch, n))
        if settings.ctx is not None:
            batches = _placed(batches, path, settings.ctx, record)
        even = self.even
        k = settings.window
        units = None if run.key_list is None or settings.epoch_samples is not None or (
            even is not None and even.pad) else (
            len(run.key_list) + k - 1 if k > 1 else len(run.key_list))
        clock = self._clock
        clock.new_run(run, feed)
        self.at.run = run
        run.start()  # producers start on the first shards before anything below can wait
        for planned, batch in batches:
            if even is not None and not even.admits(planned):
                continue  # even_batches: only full batches
            if even is not None and even.limit is None and run.offsets is not None and not \
                    run.reaches((delivered + 1) * settings.batch_size * stream.num_parts):
                # deal='balanced': every part holds rows // parts samples of the epoch or one
                # more; this batch needs this part's one more, so no other part fills it
                self.at.advance(self.state.position.ended(), delivered, run.skipped_at)
                break
            clock.arrived(planned)
            batch = self._delivered(planned, batch, delivered, carry, record)
            delivered += 1
            after = planned.after if even is None else \
                even.after(planned.after, delivered, settings.epoch_samples is None)
            self.at.full_sizes.update(feed.full_sizes)
            self.at.advance(after, delivered, run.skipped_at, units)
            if bar is not None:
                record.wall_s = clock.now() - clock.start
                bar.update(record, run.ready_ahead())
            self.names = feed.names
            yield delivered, batch
            clock.resumed()
            if after.end:
                break  # even_batches: every part stops after the same number of batches

    def _close(self, feed: UnitFeed, carry: Carry, delivered: int, record: EpochRecord,
               bar: ProgressBar | None) -> Iterator[tuple[int, Any]]:
        """samples_per_epoch, the stream over: the epoch's tail (per last_batch) as its last
        batch, the epoch ending where the stream did."""
        final, end = feed.planner.finish()
        feed.end = end
        if final is None or (self.even is not None and not self.even.admits(final)):
            return
        chunks = carry.take_all()
        batch = self.path.join(chunks, batch_seed(self.stream.seed, self.start.epoch,
                                                  delivered))
        if self.settings.ctx is not None:
            batch = mx_arrays.place(batch, self.settings.ctx)
        batch = self._delivered(final, batch, delivered, carry, record)
        self.at.advance(end, delivered + 1, ())
        yield delivered + 1, batch

    def _delivered(self, planned: Batch, batch: Any, number: int, carry: Carry,
                   record: EpochRecord) -> Any:
        """Batch ``number`` of the epoch goes to the loop: padded (``'pad'``), its origins
        noted (provenance, before its units may be let go of), counted, kept to repeat
        (even_batches)."""
        even = self.even
        self.pad = even.padding(planned) if even is not None else 0
        if self.pad:
            batch = pad_rows(batch, self.settings.batch_size)
        if self.origins is not None:
            self.origins.delivered(planned.segments, self.pad)
        record.batches += 1
        record.samples += planned.size
        self.stream.stats.add_delivered(carry.sources.count(planned.segments))
        carry.sources.forget_before(planned.after)
        if even is not None:
            even.delivered(planned, batch, number)
        return batch

    def _repeat(self, even: EvenBatches, delivered: int, count: int, run: KeyPass,
                record: EpochRecord, stop: Position) -> Iterator[Any]:
        """even_batches: this part is short of the ``count`` every part yields (skipped shards,
        shards smaller than declared; with ``'pad'``, a smaller part); repeat its last batch
        (as padding with ``'pad'``), so that synchronous training does not wait for it."""
        missing = count - delivered
        data = even.repeat_data
        if data is None and even.repeat:  # resumed while repeating: make that batch again
            data = self.rebuild.batch(even.repeat, even.repeat_number, run.epoch,
                                      self.start.skipped, self.carry, self.settings)
        if data is None:  # no batch of its own (dealt nothing): rows of another shard
            data = borrow_batch(self.stream, self.path, self.settings, run, count, self.origins)
        elif self.origins is not None:
            self.origins.repeated()  # the last batch again, all of it padding
        if not even.pad:
            _warn_short(self.stream, run, missing, count)
        for _ in range(missing):
            record.batches += 1
            delivered += 1
            self.at.advance(stop.ended() if delivered >= count else stop, delivered,
                            run.skipped_at)
            self.pad = self.settings.batch_size if even.pad else 0
            yield data


def _placed(batches: Iterator[tuple], path: Any, ctx: Any, record: EpochRecord
            ) -> Iterator[tuple]:
    """Batches copied to ``ctx``, the next one's copy started before the current one is handed
    out whenever the next one is ready (never waiting for it)."""
    def place(item: tuple | None) -> tuple | None:
        if item is None:
            return None
        start = time.perf_counter()
        placed = mx_arrays.place(item[1], ctx)
        record.place_s += time.perf_counter() - start
        return item[0], placed

    item = next(batches, None)
    current = place(item)
    while current is not None:
        ahead = path.ready()
        if not ahead:
            yield current
        try:
            item = next(batches, None)
        except BaseException:
            if ahead:  # what the loop would have had before the error
                yield current
            raise
        following = place(item)
        if ahead:
            yield current
        current = following


def _nothing() -> Generator[Any, None, None]:
    yield from ()


def _warn_short(stream: Any, run: KeyPass, missing: int, count: int) -> None:
    logger.warning("epoch %d: part %d of %d is %d batch(es) short of the %d every part yields "
                   "(even_batches=True; %d shard(s) skipped); repeating its last batch %d "
                   "time(s)", run.epoch, stream.part_index, stream.num_parts, missing, count,
                   run.skipped, missing)


def _no_sample_error(stream: Any, epoch_samples: int | None, key_pass: int) -> StreamError:
    """samples_per_epoch: :data:`EMPTY_PASSES` passes in a row gave this part no sample."""
    whose = (f"gave part {stream.part_index} of {stream.num_parts} no sample"
             if stream.deal == "shards" else "held no sample in any shard "
             "(every rank stops here alike)")
    return StreamError(
        f"samples_per_epoch={epoch_samples}: {EMPTY_PASSES} passes over the keys in a row (up "
        f"to pass {key_pass}) {whose}; are the shards empty (a transform returning 0 rows), "
        "or skipped?")


def _empty_pass(stream: Any, feed: UnitFeed, start: Position) -> bool:
    """samples_per_epoch: whether a whole pass over the keys gave nothing. Where every part
    reads every shard (strides), only a pass whose shards all held no sample counts, which
    every part sees alike: a part that turning strides left without a row this pass has its
    turn in a later one. Dealt whole, this part's shards gave it no sample."""
    assert feed.end is not None
    if stream.deal != "shards" and stream.num_parts > 1:
        return not any(feed.full_sizes.values())
    return feed.end.taken == start.taken


def _empty_reason(run: KeyPass, feed: UnitFeed, batch_size: int, rule: str) -> str:
    """Why an epoch gave no batch, in words (for its one WARNING; ``rule``: the setting that
    keeps a short batch out)."""
    shards = run.index
    if not shards:
        return "it has no keys"
    if run.skipped == shards:
        return f"all {shards} shards were skipped (on_error='skip'; see the warnings above)"
    if feed.samples:
        return (f"its {feed.samples} samples are fewer than batch_size={batch_size} and "
                f"{rule} keeps them out of this epoch")
    return (f"its {shards} shard(s) hold no samples (does a transform return 0 rows, e.g. "
            "windows longer than the shard?)")


# -- where a pass stands: the stages' positions composed after each batch --------------------------
# Where a pass stands after each batch: its stages' positions composed into a
# :class:`~gluon_stream._stages.state.LoaderState` (the planner's position, the batches
# delivered, the shards skipped around it, even_batches' repeat and lead, ``deal='balanced'``'s
# rows before the shards a resume reads, a shuffle window's unit lengths), so a state taken
# between any two batches, the last one included, resumes exactly.
class PassState:
    """The state of a pass from ``start`` (:attr:`state`), composed by :meth:`advance`.

    It keeps what a state records beyond the stages' positions: the rows before the shards
    (``recorded``, ``deal='balanced'``), a window's unit lengths (``lengths``, shared with the
    window's feed), the shards' full sizes seen (``full_sizes``, even_batches='pad''s lead),
    and the run whose rows it reads (``run``, while one is on).
    """

    def __init__(self, stream: ShardStream, settings: PassSettings, start: LoaderState,
                 even: EvenBatches | None) -> None:
        self.stream, self.settings, self.start, self.even = stream, settings, start, even
        self.state = start
        self.recorded = dict(start.rows_before)  # deal='balanced': shard -> rows before it
        # shuffle_window > 1: (epoch, unit) -> its shards' lengths, of the units handed out
        # (and those the start state records) a state may refer to
        self.lengths = {(e, u): n for e, u, n in start.unit_lengths}
        self.full_sizes: dict[int, int] = {}  # shard position -> samples, for the lead
        self.run: KeyPass | None = None

    def advance(self, position: Position, delivered: int, skipped_at: Sequence[int],
                 units: int | None = None) -> None:
        """The pass stands at ``position`` after ``delivered`` batches: compose the state.

        ``units``: the epoch's count of units, where known: a position past all of them, with
        nothing left to deliver, is the end of the epoch (said so at once, not on the next
        pass).
        """
        settings = self.settings
        even = self.even
        tail_due = position.carry and settings.last_batch == "keep" and settings.even is not True
        # even_batches=True: a part short of the limit repeats its last batch after the units
        repeats_due = even is not None and even.limit is not None and delivered < even.limit
        if units is not None and not position.end and position.unit >= units \
                and not position.offset and not tail_due and not repeats_due:
            position = Position(position.epoch, position.unit, 0,
                                position.carry if settings.last_batch == "rollover" else (),
                                True)
        repeat = even.repeat if even is not None else ()
        number = even.repeat_number if even is not None else 0
        epoch, window = position.epoch, self.settings.window
        needed = [(s.epoch, s.unit) for s in position.carry + repeat]
        if not position.end:
            needed.append((epoch, position.unit))
        first: dict[int, int] = {}  # epoch -> the first shard a resume reads
        for e, unit in needed:
            first[e] = min(first.get(e, unit), WindowMixer.first_shard(unit, window))
        skipped = {(e, j) for e, j in self.start.skipped if j >= first.get(e, j + 1)}
        skipped |= {(epoch, j) for j in skipped_at if j >= first.get(epoch, j + 1)}
        # where a resume's run starts
        lead = 0 if position.end or even is None or not even.pad else \
            self.lead(WindowMixer.first_shard(position.unit, window))
        rows = self.rows_of(first[epoch], max(u for e, u in needed if e == epoch)) \
            if epoch in first else ()
        self.state = LoaderState(position, delivered, tuple(sorted(skipped)), repeat, number,
                                 lead, self.start.loader_epoch, rows, self.unit_lengths(position))

    def unit_lengths(self, position: Position) -> tuple:
        """``shuffle_window > 1``: the lengths of the mixed units ``position`` has read part of
        (see :attr:`LoaderState.unit_lengths`); those of units before them are let go of."""
        if self.settings.window == 1:
            return ()
        units = position.units_read()
        floor = min(units, default=(position.epoch, position.unit))
        for old in [u for u in self.lengths if u < floor]:
            del self.lengths[old]
        return tuple((e, u, self.lengths[(e, u)]) for e, u in sorted(units)
                     if (e, u) in self.lengths)

    def rows_of(self, first: int, last: int) -> tuple[tuple[int, int], ...]:
        """``deal='balanced'``: ``(position, rows before it)`` of the epoch's shards a resume
        reads again or starts from (``first .. last``; see :attr:`LoaderState.rows_before`),
        and of the shards before them that another rank, at the same step, may not have
        finished: those whose rows before them are within ``num_parts * (2 * batch_size +
        2)`` of the last one's (every rank at a step has read as many samples, give or take a
        batch, and holds ``rows // num_parts`` of the rows read or one more), so that a merge
        of every rank's state (:func:`gluon_stream.merge_states`) knows each shard's strides.
        () for other deals."""
        run = self.run
        if run is None or run.offsets is None:
            return ()

        def rows(unit: int) -> int | None:  # None: past the shards read (a window's units)
            found = run.rows_before(unit)
            return found if found is not None else self.recorded.get(unit)

        known = [(unit, n) for unit in range(first, last + 1) if (n := rows(unit)) is not None]
        if not known:
            return ()
        floor = known[-1][1] - self.stream.num_parts * (2 * self.settings.batch_size + 2)
        while first > 0 and (n := rows(first - 1)) is not None and n >= floor:
            first -= 1
            known.insert(0, (first, n))
        return tuple(known)

    def recorded_rows(self, unit: int) -> int:
        """``deal='balanced'``: the rows before position ``unit`` of the epoch, as the state
        this pass started from records them (0 at the epoch's start)."""
        recorded = self.recorded
        if unit in recorded or not unit or not self.stream.sizes.learns_rows(self.start.epoch):
            return recorded.get(unit, 0)
        raise InvalidState(
            f"the state resumes epoch {self.start.epoch} at shard {unit}, but does not record "
            "the rows of the shards before it, which decide the strides every rank takes "
            "(even_batches=True, sizes unknown): save it again with this gluon_stream")

    def lead(self, before: int) -> int:
        """even_batches='pad': the largest part's samples in the shards before position
        ``before`` (those a resume does not produce again)."""
        lead = self.even.lead if self.even is not None else 0
        share, epoch = self.stream.sizes.largest_share, self.start.position.epoch
        return lead + sum(share(epoch, j, n) for j, n in self.full_sizes.items() if j < before)


# -- a resumed position's units, made again --------------------------------------------------------
# A resumed position's data: the units a state's segments name (a carry, a batch to
# repeat), produced again in the calling thread exactly as the producers made them.
class Rebuild:
    """Produces again the units of a state's segments.

    Args:
        stream: Whose keys and producer make them.
        path: The batch path (its ``prepare``, ``cut`` and ``mix``).
        window: ``shuffle_window``.
        rows_before: ``deal='balanced'``: the rows before a shard position, as the state
            records them.
        origins: provenance=True: told of the units made again.
    """

    def __init__(self, stream: ShardStream, path: BatchPath, window: int,
                 rows_before: Callable[[int], int], origins: ProvenanceTracker | None) -> None:
        self.stream, self.path, self.window = stream, path, window
        self.rows_before, self.origins = rows_before, origins

    def carry(self, segments: Sequence[Segment],
                       skipped: Sequence[tuple[int, int]]) -> Carry:
        carry = Carry()
        carry.sources.origins = self.origins  # provenance: the carried units' origins too
        for seg, chunk in zip(segments, self.chunks(segments, skipped, carry.sources)):
            carry.add(seg, chunk)
        return carry

    def batch(self, segments: Sequence[Segment], number: int, epoch: int,
              skipped: Sequence[tuple[int, int]], carry: Carry | None,
              settings: PassSettings) -> Any:
        """Batch ``number`` of ``epoch`` (``segments``), made again: the batch even_batches
        repeats, after a resume while repeating it; padded to a batch, placed on ``ctx``."""
        chunks = self.chunks(segments, skipped, carry.sources if carry is not None else None)
        if self.origins is not None:
            self.origins.delivered(segments, settings.batch_size - sum(s.size for s in segments))
        data = self.path.join(chunks, batch_seed(self.stream.seed, epoch, number))
        if settings.ctx is not None:
            data = mx_arrays.place(data, settings.ctx)
        return pad_rows(data, settings.batch_size)

    def chunks(self, segments: Sequence[Segment], skipped: Sequence[tuple[int, int]],
                 sources: UnitSources | None = None) -> list[tuple]:
        """The rows of ``segments``, cut from their units produced again (a resume); their
        samples' sources noted in ``sources``."""
        chunks = []
        for seg in segments:
            unit = self.unit(seg, skipped, sources)
            if seg.stop > len(unit):
                raise InvalidState(
                    f"the state holds rows {seg.start}..{seg.stop - 1} of {_unit_name(seg)} of "
                    f"epoch {seg.epoch}, which now holds only {len(unit)} samples: the data "
                    "changed since the state was saved; start the epoch afresh")
            chunks.append(self.path.cut(unit, seg))
        return chunks

    def unit(self, seg: Segment, skipped: Sequence[tuple[int, int]],
                    sources: UnitSources | None = None) -> Any:
        """Unit ``seg.unit`` of epoch ``seg.epoch``, produced again (its samples' sources
        noted in ``sources``)."""
        stream, window = self.stream, self.window
        keys = stream.dealer.epoch_keys(seg.epoch)[2]
        prepare = self.path.prepare
        if window == 1:
            key = keys[seg.unit] if keys is not None and seg.unit < len(keys) else seg.key
            shard = stream.producer.produce_now(key, seg.epoch, prepare, seg.unit,
                                       before=self.rows_before(seg.unit))
            if sources is not None:
                sources.shard(seg.epoch, seg.unit, shard)
            return shard
        first = WindowMixer.first_shard(seg.unit, window)
        if keys is None:  # an endless iterator: the unit's shards drawn again up to it
            named = stream.dealer.keys_between(seg.epoch, first, seg.unit + 1)
            check_segment_key(seg, named, first)
        else:
            named = keys[first:seg.unit + 1]
        mixer = WindowMixer(window, stream.seed, seg.epoch, first_unit=seg.unit)
        shards, units = {}, []
        for j, key in enumerate(named, first):
            if (seg.epoch, j) in skipped:  # failed before: an empty shard in the mix, as it was
                continue
            shards[j] = stream.producer.produce_now(key, seg.epoch, prepare, j,
                                           before=self.rows_before(j))
            units.extend(mixer.add(j, len(shards[j])))
        units.extend(mixer.finish())
        unit = next((u for u in units if u.index == seg.unit), None)
        if unit is None:
            raise InvalidState(f"the state holds samples of mixed unit {seg.unit} of epoch "
                               f"{seg.epoch}, which does not exist: the keys changed")
        used = {j: shards[j] for j in np.unique(unit.shards).tolist()}  # as the feed holds them
        newest = shards.get(seg.unit)
        mixed = MixedData(unit, used, newest.key if newest else None)
        if sources is not None:
            sources.mixed(seg.epoch, mixed)
        return self.path.mix(mixed)


def _unit_name(seg: Segment) -> str:
    return f"shard {seg.key!r}" if seg.key is not None else f"unit {seg.unit}"


# -- where each pass starts ------------------------------------------------------------------------
# Where each pass of a loader starts: a loaded state, or where the last pass left the stream.
#
# Without ``samples_per_epoch`` a pass is the stream's epoch, from its start (with what the last
# pass rolled over). With it, the loader's epochs are cut from the stream: epoch ``e`` starts
# where epoch ``e - 1`` stopped, so its start is known only once that epoch was read (or a state
# saved in it loaded). After an elastic resume the epoch after the remainder starts where a fresh
# job of the new world size starts it: after ``e * samples_per_epoch`` samples of this part's
# stream, counted from the shards' sizes (:meth:`PassStarts.fresh_start`).
logger = logging.getLogger(__name__)


class PassStarts:
    """A loader's epochs and the position each pass starts from."""

    def __init__(self, stream: ShardStream, samples_per_epoch: int | None,
                 batch_size: int = 1, last_batch: str = "keep", window: int = 1) -> None:
        self.stream = stream
        self.samples_per_epoch = samples_per_epoch
        self.batch_size, self.last_batch, self.window = batch_size, last_batch, window
        self._fresh: tuple[int, LoaderState] | None = None  # the last fresh_start counted
        self._epoch = 0  # samples_per_epoch: the loader's epoch (the stream's is its key pass)
        self.loaded: LoaderState | None = None  # a state loaded for the next pass
        self.last: LoaderEpoch | None = None  # the pass in progress, or the last one

    @property
    def epoch(self) -> int:
        """The epoch the next pass produces."""
        return self.stream.epoch if self.samples_per_epoch is None else self._epoch

    def set_epoch(self, epoch: int) -> None:
        if self.samples_per_epoch is None:
            self.stream.set_epoch(epoch)
        else:
            self._epoch = epoch

    def load(self, state: LoaderState) -> None:
        """The next pass starts at ``state`` (checked already)."""
        self.loaded, self.last = state, None
        self.set_epoch(state.epoch)

    def begin(self) -> tuple[LoaderState, Carry | None, KeyPass | None]:
        """(start, carry, handover) of a new pass: the carry and the run the last pass left,
        where the new one goes on from them."""
        start = self.next()
        self.loaded = None
        remainder = self.stream.dealer.remainder
        if remainder is not None and remainder.fixed and start.epoch != remainder.epoch:
            self.stream.set_remainder(None)  # its epoch is over: the next ones read the stream
        if start.position.end and self.samples_per_epoch is None:
            self.stream.set_epoch(start.epoch + 1)  # the rest of an ended epoch: nothing
        self._epoch = start.epoch + 1  # samples_per_epoch: without set_epoch, the next one
        last = self.last if self.last is not None and self.last.finished else None
        carry = last.carry if last is not None and start.position.carry and \
            last.state.position.carry == start.position.carry else None
        handover = last.handover if last is not None and start.loader_epoch is not None \
            else None
        return start, carry, handover

    def current(self) -> LoaderState:
        """Where the stream stands between batches (what a state saves)."""
        last = self.last
        if self.loaded is not None or last is None or last.finished:
            return self.next()
        return last.state

    def next(self, warn: bool = True) -> LoaderState:
        """Where the next pass starts: a loaded state, or the stream's epoch with what the last
        pass rolled over."""
        if self.samples_per_epoch is not None:
            return self._in_stream()
        epoch, loaded, last = self.stream.epoch, self.loaded, self.last
        if loaded is not None:
            if loaded.epoch == epoch:
                return loaded
            if loaded.position.end and loaded.epoch + 1 == epoch:  # the next epoch, as it said
                return LoaderState(loaded.position.next_epoch(), skipped=loaded.skipped,
                                   unit_lengths=loaded.unit_lengths)
            if warn:
                logger.warning("state loaded for epoch %d, but epoch %d starts: iterating it "
                               "from its beginning", loaded.epoch, epoch)
            return LoaderState(Position(epoch))
        if last is not None and last.finished:
            return LoaderState(Position(epoch, carry=last.state.position.carry),
                               skipped=last.state.skipped,
                               unit_lengths=last.state.unit_lengths)
        return LoaderState(Position(epoch))

    def _in_stream(self) -> LoaderState:
        """samples_per_epoch: where the loader's epoch starts in the stream: where the one
        before it stopped (as it ended, or as far as the loop took it)."""
        epoch, loaded, last = self._epoch, self.loaded, self.last
        before = loaded if loaded is not None else last.state if last is not None else None
        if before is not None and before.epoch == epoch and loaded is not None:
            return self.fresh_start(epoch) if loaded.fresh and not loaded.position.end \
                else loaded
        remainder = self.stream.dealer.remainder
        if before is not None and before.epoch + 1 == epoch and (before.fresh or (
                remainder is not None and remainder.fixed and before.epoch == remainder.epoch)):
            return self.fresh_start(epoch)  # after an elastic resume's remainder
        if before is not None and before.epoch + 1 == epoch:
            p = before.position
            return LoaderState(Position(p.epoch, p.unit, p.offset, p.carry),
                               skipped=before.skipped, loader_epoch=epoch,
                               unit_lengths=before.unit_lengths)
        if before is None and epoch == 0:
            return LoaderState(Position(0), loader_epoch=0)
        raise InvalidState(
            f"samples_per_epoch={self.samples_per_epoch}: epoch {epoch} starts where epoch "
            f"{epoch - 1} stopped in the stream, which this loader has not reached: iterate the "
            "epochs in order, or load the state saved in the epoch before")

    def fresh_start(self, epoch: int) -> LoaderState:
        """samples_per_epoch: where a fresh job of this world size starts ``epoch`` in this
        part's stream: after ``epoch * samples_per_epoch`` of its samples, with the samples
        its epoch before rolled over (``last_batch='rollover'``). The same on every run from
        the same state: the walk counts the part's shards up to there by their sizes, known
        ahead (``shard_sizes=``, the source's, a cache filled ahead) or seen, else counted by
        producing each shard once (a cache hit with a ``cache_dir``)."""
        if self._fresh is not None and self._fresh[0] == epoch:
            return self._fresh[1]
        assert self.samples_per_epoch is not None
        stream = self.stream
        endless = not stream.source.keys_for_epoch(0)[1]
        dealer = stream.dealer
        part = PartStream(stream.num_parts, stream.part_index, stream.deal, dealer.dealt_keys,
                          stream.producer.counted_size,
                          endless_drawn(dealer.endless_keys) if endless else None, self.window)
        stretches, at = part.walk(0, 0, 0, epoch * self.samples_per_epoch)
        carried = epoch * self.samples_per_epoch % self.batch_size \
            if self.last_batch == "rollover" else 0
        carry: list[Segment] = []
        for s in reversed(stretches):  # the last samples before it, in order
            if not carried:
                break
            n = min(carried, s.stop - s.start)
            carry.insert(0, Segment(s.epoch, s.unit, s.stop - n, s.stop, s.key))
            carried -= n
        logger.debug("epoch %d starts at shard %d of pass %d, row %d (a fresh job's start on "
                      "part %d of %d, after %d shard(s) counted)", epoch, at.unit, at.epoch,
                      at.offset, stream.part_index, stream.num_parts, len(stretches))
        position = Position(at.epoch, at.unit, at.offset, tuple(carry))
        lengths = [] if self.window == 1 else [  # the mixed units a state there names
            (e, u, shards) for e, u in sorted(position.units_read())
            if (shards := part.lengths(e, u)) is not None]
        start = LoaderState(position, loader_epoch=epoch, unit_lengths=tuple(lengths))
        self._fresh = (epoch, start)
        return start


# -- how many batches a pass yields ----------------------------------------------------------------
# How many batches a pass yields: ``len(loader)``, the progress bar's total and even_batches'
# limit, from the declared or known shard sizes (never by producing shards).
class Dealt(Protocol):
    """What :class:`BatchCounts` reads of a stream's keys stage."""

    remainder: Remainder | None

    def epoch_keys(self, epoch: int, part_index: int | None = None
                   ) -> tuple[Iterator[Any], bool, list | None]: ...


class Counted(Protocol):
    """What :class:`BatchCounts` reads of a stream."""

    sizes: ShardSizes
    num_parts: int
    deal: str
    source: Source
    transform: Any

    @property
    def dealer(self) -> Dealt: ...


class BatchCounts:
    """Batch counts of one loader's epochs (its stream, batch size and batch rules)."""

    def __init__(self, stream: Counted, batch_size: int, last_batch: LastBatch,
                 even_batches: bool | str, samples_per_epoch: int | None) -> None:
        self.stream = stream
        self.batch_size = batch_size
        self.last_batch = last_batch
        self.even_batches = even_batches
        self.samples_per_epoch = samples_per_epoch

    def fresh_len(self, epoch: int, start: Position) -> int:
        """``len(loader)``: batches of ``epoch`` from its start as a fresh job of this size
        yields them (``start``: where the next pass starts; its carry counts at the epoch's
        start); :class:`~gluon_stream.SizeUnknown` where the sizes are not known."""
        fresh = start.epoch == epoch and start.unit == start.offset == 0
        count = self.batches(epoch, start.carried if fresh else 0, fresh=True)
        if count is None:
            raise SizeUnknown(f"len(StreamLoader) is unknown for epoch {epoch}: "
                              f"{self.unknown_reason(epoch)}")
        return count

    def batches(self, epoch: int, carried: int = 0, fresh: bool = False) -> int | None:
        """Batches epoch ``epoch`` yields from its start (``carried``: samples rolled over);
        None where the sizes are not known. ``fresh``: as a fresh job of this size counts the
        epoch (``len()``), not the rest an elastic resume reads in its place."""
        if fresh and self._resumed(epoch):
            return self._fresh().batches(epoch, carried)
        bs = self.batch_size
        if self._fixed(epoch):  # rolled over: what the epochs before left
            n = self.samples_per_epoch
            assert n is not None
            full, rest = divmod(n + (epoch * n % bs if self.last_batch == "rollover" else 0), bs)
            keeps = self.even_batches == "pad" or (self.last_batch == "keep"
                                                   and not self.even_batches)
            return full + (1 if rest and keeps else 0)
        if self.even_batches:
            limit = self.even_limit(epoch)
            if limit is not None or self.even_batches == "pad":
                return limit
        total = self.stream.sizes.epoch_size(epoch)
        if total is None:
            return None
        full, rest = divmod(total + carried, bs)
        return full + (1 if rest and self.last_batch == "keep" and not self.even_batches else 0)

    def even_limit(self, epoch: int) -> int | None:
        """With even_batches, the batch count every part yields in ``epoch``: the smallest
        part's full batches, by the declared or known sizes. None where the parts hold equal
        counts by construction (``deal='samples'``, or one part): every full batch.

        With ``'pad'``: the largest part's batches, the last one short; None where that is
        only known once the epoch's shards are seen (``deal='strides'``, or one part).
        ``deal='balanced'`` without the sizes: None, the pass stops where every part can no
        longer fill a batch (see :meth:`~gluon_stream._stages.produce.KeyPass.reaches`)."""
        stream = self.stream
        if self._fixed(epoch):  # every part reads as many samples
            return None
        if self.even_batches == "pad":
            sizes = stream.sizes.part_sizes(epoch)
            return None if sizes is None else even_count("pad", sizes, self.batch_size)
        if not self.even_batches or stream.deal == "samples" or stream.num_parts == 1:
            return None
        sizes = stream.sizes.part_sizes(epoch)
        if sizes is None and stream.deal == "balanced":
            return None
        if sizes is None:
            raise SizeUnknown(
                f"even_batches=True needs every shard's size for epoch {epoch} on every rank: "
                f"{self.unknown_reason(epoch)}")
        return even_count(True, sizes, self.batch_size)

    def _resumed(self, epoch: int) -> bool:
        """Whether ``epoch`` reads an elastic resume's remainder in place of its keys."""
        remainder = self.stream.dealer.remainder
        return remainder is not None and remainder.epoch == epoch

    def _fresh(self) -> "BatchCounts":
        """These counts as a fresh job of this size has them: its keys, no remainder."""
        assert isinstance(self.stream, ShardStream)  # a remainder is only ever a stream's
        return BatchCounts(_FreshStream(self.stream), self.batch_size, self.last_batch,
                           self.even_batches, self.samples_per_epoch)

    def _fixed(self, epoch: int) -> bool:
        """Whether ``epoch`` reads ``samples_per_epoch`` samples: not the rest of an epoch an
        elastic resume reads (its pieces, counted as an epoch of keys is)."""
        remainder = self.stream.dealer.remainder
        return self.samples_per_epoch is not None and not (
            remainder is not None and remainder.fixed and remainder.epoch == epoch)

    def unknown_reason(self, epoch: int) -> str:
        """Why an epoch's samples cannot be counted without producing it, and the fix."""
        stream = self.stream
        _, finite, keys = stream.dealer.epoch_keys(epoch)
        if not finite or keys is None:
            return ("the keys are an endless iterator, so the epoch has no known end (iterate "
                    "with a fixed number of steps instead)")
        unknown = [k for k in keys if stream.sizes.shard_size(k, epoch) is None]
        why = [stream.source.unknown_size_reason()]
        if stream.transform is not None:
            why.insert(0, "a transform may change the sample counts of the files")
        return (f"the sizes of {len(unknown)} of {len(keys)} shards (e.g. {unknown[0]!r}) are not "
                f"known without producing them ({'; '.join(why)}). "
                "Pass shard_sizes= (a dict, fn(key), or one int for every shard), fill the cache "
                "ahead with gluon-stream generate, or read existing files with FileSource; sizes "
                "of shards seen in an earlier pass are reused when the data cannot change")


class _FreshStream:
    """What :class:`BatchCounts` reads of a stream, as a fresh job of its size has it: the
    epoch's own keys and sizes, an elastic resume's remainder aside (sizes seen are shared)."""

    remainder: Remainder | None = None

    def __init__(self, stream: ShardStream) -> None:
        self._stream = stream
        self.num_parts, self.deal = stream.num_parts, stream.deal
        self.source, self.transform = stream.source, stream.transform
        self.sizes = stream.sizes.without_remainder(self.epoch_keys)
        self.dealer: Dealt = self  # its own keys, without the remainder

    def epoch_keys(self, epoch: int, part_index: int | None = None
                   ) -> tuple[Iterator[Any], bool, list | None]:
        stream = self._stream
        _, finite = stream.source.keys_for_epoch(epoch)
        if not finite:
            return iter(()), False, None
        part = stream.part_index if part_index is None else part_index
        keys = stream.dealer.dealt_keys(epoch, stream.num_parts, part, stream.deal)
        return iter(keys), True, keys
