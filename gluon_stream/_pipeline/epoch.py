"""One pass over an epoch: the stages wired together, batches yielded, and where it stands.

A pass wires an epoch's stages: the stream's :class:`~gluon_stream.stream.EpochRun` (shards in
order), a feed (units: shards, or the mixed units of a shuffle window), the
:class:`~gluon_stream._pipeline.batching.BatchPlanner` (which samples form which batch), a batch
path (slices, or per-sample work on workers) and, with even_batches, :class:`EvenBatches`. Each
stage owns its position; :attr:`EpochPass.state` composes them after the last batch yielded, so a
:class:`~gluon_stream._pipeline.state.LoaderState` taken between any two batches, the last one
included, resumes exactly.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Generator, Iterator, Sequence

import numpy as np

from .._mx import arrays as mx_arrays
from .._mx.padding import pad_rows
from .._utils.progress import ProgressBar
from .._utils.random import batch_seed
from ..errors import InvalidState, StreamError
from ..records import EpochRecord
from ..stream import EpochRun, ShardStream
from .batching import Batch, BatchPlanner, MixedUnit, Position, Segment, WindowMixer
from .contracts import BatchPath
from .feed import Carry, MixedData, UnitFeed, UnitSources, WindowFeed
from .keys import EMPTY_PASSES
from .provenance import ProvenanceTracker
from .state import LoaderState, check_segment_key

__all__ = ["EpochPass", "EvenBatches", "PassSettings"]

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class PassSettings:
    """What a loader decides for every pass."""

    batch_size: int
    last_batch: str
    window: int  # shuffle_window
    even: bool | str  # even_batches: False, True or 'pad'
    progress: bool | str = False
    ctx: Any = None  # place batches here (None: where the path makes them)
    epoch_samples: int | None = None  # samples_per_epoch


class EvenBatches:
    """even_batches on one part, and its position (the last batch, to repeat).

    ``True``: only full batches and, with a ``limit`` (shards dealt to the parts, sizes known),
    exactly ``limit`` of them; a part that runs short (skipped shards, shards smaller than
    declared) repeats its last full batch. ``'pad'``: every batch, the short last one padded to
    ``batch_size``, then the last batch repeated as padding up to ``limit`` (None: the largest
    part's count, known once the epoch's shards are seen: ``lead`` counts its samples).
    """

    def __init__(self, batch_size: int, limit: int | None, start: LoaderState,
                 pad: bool = False, counted: bool = True) -> None:
        self.batch_size = batch_size
        self.limit = limit
        self.pad = pad
        self.counted = counted  # False with samples_per_epoch: every part reads as many
        kept = limit is not None or pad
        self.repeat: tuple[Segment, ...] = start.repeat if kept else ()
        self.repeat_number = start.repeat_number
        self.repeat_data: Any = None  # the repeated batch's data, once known
        self.lead = start.lead  # samples of the largest part in the shards before the run's

    def admits(self, batch: Batch) -> bool:
        """Whether a planned batch is delivered: a short one only with padding."""
        return self.pad or batch.size == self.batch_size

    def padding(self, batch: Batch) -> int:
        """Rows of padding a planned batch gets."""
        return self.batch_size - batch.size if self.pad else 0

    def reached(self, delivered: int) -> bool:
        return self.limit is not None and delivered >= self.limit

    def count(self, lead: int) -> int | None:
        """The batches every part yields, given the largest part's samples (``'pad'``)."""
        if self.limit is not None or not self.pad or not self.counted:
            return self.limit
        return -(-lead // self.batch_size)

    def delivered(self, batch: Batch, data: Any, number: int) -> None:
        if self.limit is not None or self.pad:  # kept only to repeat it; it pins its shard
            self.repeat, self.repeat_number, self.repeat_data = batch.segments, number, data


class _LoopClock:
    """When the loop waited and trained: the epoch record's stall, spans and rotation times."""

    def __init__(self, clock: Any, record: EpochRecord) -> None:
        self.now, self.record = clock, record
        self.start = self.waiting_since = clock()
        self.run: EpochRun | None = None
        self.feed: UnitFeed | None = None
        self._arrived = self.start
        self._last_unit: Any = None
        self._shard_wait, self._waits = 0.0, 0

    def new_run(self, run: EpochRun, feed: UnitFeed) -> None:
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


class EpochPass:
    """One pass over epoch ``start.epoch`` from ``start`` (see the module doc).

    Iterate it once. :attr:`state` is where the pass stands after the last batch it yielded
    (``start`` before the first); :attr:`finished` is true once it ran to its end.
    """

    def __init__(self, stream: ShardStream, path: BatchPath, settings: PassSettings,
                 start: LoaderState, limit: int | None, expected: int | None = None,
                 carry: Carry | None = None, handover: EpochRun | None = None) -> None:
        remainder = stream.dealer.remainder_of(start.position.epoch)
        #: samples_per_epoch after an elastic resume: the rest of the interrupted epoch is the
        #: remainder's pieces, read as one pass of the keys' kind (its end is the epoch's)
        self.closed_remainder = settings.epoch_samples is not None and remainder is not None \
            and remainder.fixed and start.epoch == remainder.epoch
        if self.closed_remainder:
            settings = dataclasses.replace(settings, epoch_samples=None)
        self.stream, self.path, self.settings = stream, path, settings
        self.start = self.state = start
        self._recorded = dict(start.rows_before)  # deal='balanced': shard -> rows before it
        # shuffle_window > 1: (epoch, unit) -> its shards' lengths, of the units handed out
        # (and those the start state records) a state may refer to
        self._lengths = {(e, u): n for e, u, n in start.unit_lengths}
        self.carry = carry  # the data of start's carry, when the last pass rolled it over
        # samples_per_epoch: the run the last epoch stopped in (the shard it stopped inside
        # handed out again first); once this pass ends by its budget, what it hands the next
        self.handover = handover
        self.even = (EvenBatches(settings.batch_size, limit, start, settings.even == "pad",
                                 counted=settings.epoch_samples is None)
                     if settings.even else None)
        self.expected = expected  # batches in the epoch, for the progress bar
        self.finished = False
        self.pad = 0  # padding rows of the batch yielded last
        self._full_sizes: dict[int, int] = {}  # shard position -> samples, for the lead
        self.names: tuple[str, ...] | None = None  # the arrays' names, once a batch is made
        self.origins: ProvenanceTracker | None = None  # provenance=True: set by the loader

    @property
    def epoch(self) -> int:
        return self.start.epoch

    def __iter__(self) -> Generator[Any, None, None]:
        if self.start.position.end:  # the rest of an ended epoch: nothing
            return self._ended()
        return self._batches()

    def _ended(self) -> Generator[Any, None, None]:
        self.finished = True
        return
        yield

    # -- the epoch's batches ----------------------------------------------------------------
    def _batches(self) -> Generator[Any, None, None]:
        stream, path, settings, start = self.stream, self.path, self.settings, self.start
        position = start.position
        if self.even is not None and self.even.reached(start.delivered):  # a limit of 0
            if settings.epoch_samples is None:
                stream.set_epoch(start.epoch + 1)
            self._advance(position.ended(), start.delivered, ())
            self.finished = True
            return
        stats = stream.stats
        clock = stats.clock
        record = stats.new_epoch(start.epoch)
        self._clock = _LoopClock(clock, record)
        bar = (ProgressBar(start.epoch, self.expected,
                           live=True if settings.progress == "live" else None)
               if settings.progress else None)
        worker_wait = path.wait_s
        runs: list[tuple[EpochRun, UnitFeed]] = []
        handover, self.handover = self.handover, None
        try:
            carry = self.carry if self.carry is not None else \
                self._rebuild_carry(position.carry, start.skipped)
            self.carry = carry  # what rolls over at the end, once the planner is done
            delivered = start.delivered
            empty = 0  # samples_per_epoch: passes in a row that read no sample
            while True:  # one run per pass over the keys (several with samples_per_epoch)
                run, feed = self._start_run(position, carry, record, handover)
                handover = None
                runs.append((run, feed))
                # _deliver counts on from the batches delivered so far and yields the running
                # count with each batch: the loop carries it into the next run, or the tail
                for so_far, batch in self._deliver(run, feed, carry, delivered, record, bar):
                    delivered = so_far
                    yield batch
                if self.state.position.end or feed.final is not None or feed.failure is not None:
                    break
                assert feed.end is not None
                if settings.epoch_samples is None or feed.end.end:
                    break
                # samples_per_epoch: the keys ran out before the epoch read its samples
                if not run.finite:  # an endless key iterator that ended: the stream is over
                    for so_far, batch in self._close(feed, carry, delivered, record, bar):
                        delivered = so_far
                        yield batch
                    break
                whole = not position.unit and not position.offset
                empty = empty + 1 if whole and _empty_pass(stream, feed, position) else 0
                if empty == EMPTY_PASSES:
                    whose = (f"gave part {stream.part_index} of {stream.num_parts} no sample"
                             if stream.deal == "shards" else "held no sample in any shard "
                             "(every rank stops here alike)")
                    raise StreamError(
                        f"samples_per_epoch={settings.epoch_samples}: {EMPTY_PASSES} passes "
                        f"over the keys in a row (up to pass {run.epoch}) {whose}; are the "
                        "shards empty (a transform returning 0 rows), or skipped?")
                position = Position(run.epoch + 1, 0, 0, feed.end.carry, taken=feed.end.taken)
            run, feed = runs[-1]
            end = self.state.position if self.state.position.end else feed.end
            self._full_sizes.update(feed.full_sizes)
            even = self.even
            count = even.count(self._lead(run.index)) if even is not None else None
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
            self._advance(end, self.state.delivered, run.skipped_at)
            record.complete = True
            self.finished = True
            fresh = not start.delivered and position.unit == position.offset == 0
            if not record.samples and fresh and settings.epoch_samples is None \
                    and stream.dealer.remainder_of(run.epoch) is None:  # a remainder may hold none
                logger.warning("epoch %d delivered no samples: %s", run.epoch,
                               _empty_reason(run, feed, settings.batch_size,
                                             "even_batches=True" if settings.even is True
                                             else f"last_batch={settings.last_batch!r}"))
        finally:
            for run, feed in runs:
                if run is not self.handover:
                    run.cancel()
                feed.current = None
                record.skipped_shards += run.skipped
                record.shard_wait_s += feed.shard_wait_s
                record.mix_wait_s += feed.mix_wait_s
            record.worker_wait_s += path.wait_s - worker_wait
            record.wall_s = clock() - self._clock.start
            record.producers = stream.producers
            self._clock.run = self._clock.feed = None  # nothing of the pass outlives it
            if bar is not None:
                bar.close(record)

    def _start_run(self, position: Position, carry: Carry, record: EpochRecord,
                   handover: EpochRun | None = None) -> tuple[EpochRun, UnitFeed]:
        """Production of a pass over the keys from ``position`` (going on in the run the last
        epoch handed over, where it fits), and its feed of units."""
        stream, settings, start = self.stream, self.settings, self.start
        k = settings.window
        if settings.epoch_samples is not None or self.closed_remainder:
            stream.set_epoch(position.epoch)  # the pass over the keys, not the loader's epoch
        skip = WindowMixer.first_shard(position.unit, k)
        run = stream.start_epoch(skip=skip, prepare=self.path.prepare,
                                 skipped=[j for e, j in start.skipped if e == position.epoch],
                                 reuse=handover, rows_before=self._recorded_rows(skip))
        if settings.epoch_samples is not None:
            stream.dealer.forget_keys(position.epoch, skip)  # no later epoch starts before it
        planner = BatchPlanner(settings.batch_size, settings.last_batch, position,
                               settings.epoch_samples)
        closes = settings.epoch_samples is None
        if k > 1:
            mixer = WindowMixer(k, stream.seed, run.epoch, first_unit=position.unit)
            budget = max(stream.prefetch, k) + 1
            return run, WindowFeed(run, planner, carry, self.path, record, mixer, budget, closes,
                                   self._lengths)
        return run, UnitFeed(run, planner, carry, self.path, record, closes)

    def _deliver(self, run: EpochRun, feed: UnitFeed, carry: Carry, delivered: int,
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
        run.start()  # producers start on the first shards before anything below can wait
        for planned, batch in batches:
            if even is not None and not even.admits(planned):
                continue  # even_batches: only full batches
            if even is not None and even.limit is None and run.offsets is not None and not \
                    run.reaches((delivered + 1) * settings.batch_size * stream.num_parts):
                # deal='balanced': every part holds rows // parts samples of the epoch or one
                # more; this batch needs this part's one more, so no other part fills it
                self._advance(self.state.position.ended(), delivered, run.skipped_at)
                break
            pad = even.padding(planned) if even is not None else 0
            if pad:
                batch = pad_rows(batch, settings.batch_size)
            clock.arrived(planned)
            if self.origins is not None:  # provenance: before its units may be let go of
                self.origins.delivered(planned.segments, pad)
            record.batches += 1
            record.samples += planned.size
            stream.stats.add_delivered(carry.sources.count(planned.segments))
            carry.sources.forget_before(planned.after)
            delivered += 1
            after = planned.after
            if even is not None:
                even.delivered(planned, batch, delivered - 1)
                if even.reached(delivered):
                    after = after.ended()
                elif after.end and settings.epoch_samples is None:  # 'pad': more may follow
                    after = Position(after.epoch, after.unit)
            self._full_sizes.update(feed.full_sizes)
            self._advance(after, delivered, run.skipped_at, units)
            if bar is not None:
                record.wall_s = clock.now() - clock.start
                bar.update(record, run.ready_ahead())
            self.names = feed.names
            self.pad = pad
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
        pad = self.even.padding(final) if self.even is not None else 0
        if pad:
            batch = pad_rows(batch, self.settings.batch_size)
        if self.origins is not None:
            self.origins.delivered(final.segments, pad)
        record.batches += 1
        record.samples += final.size
        self.stream.stats.add_delivered(carry.sources.count(final.segments))
        delivered += 1
        if self.even is not None:
            self.even.delivered(final, batch, delivered - 1)
        self._advance(end, delivered, ())
        self.pad = pad
        yield delivered, batch

    def _advance(self, position: Position, delivered: int, skipped_at: Sequence[int],
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
            self._lead(WindowMixer.first_shard(position.unit, window))
        rows = self._rows_of(first[epoch], max(u for e, u in needed if e == epoch)) \
            if epoch in first else ()
        self.state = LoaderState(position, delivered, tuple(sorted(skipped)), repeat, number,
                                 lead, self.start.stream_epoch, rows, self._unit_lengths(position))

    def _unit_lengths(self, position: Position) -> tuple:
        """``shuffle_window > 1``: the lengths of the mixed units ``position`` has read part of
        (see :attr:`LoaderState.unit_lengths`); those of units before them are let go of."""
        if self.settings.window == 1:
            return ()
        units = position.units_read()
        floor = min(units, default=(position.epoch, position.unit))
        for old in [u for u in self._lengths if u < floor]:
            del self._lengths[old]
        return tuple((e, u, self._lengths[(e, u)]) for e, u in sorted(units)
                     if (e, u) in self._lengths)

    def _rows_of(self, first: int, last: int) -> tuple[tuple[int, int], ...]:
        """``deal='balanced'``: ``(position, rows before it)`` of the epoch's shards a resume
        reads again or starts from (``first .. last``; see :attr:`LoaderState.rows_before`),
        and of the shards before them that another rank, at the same step, may not have
        finished: those whose rows before them are within ``num_parts * (2 * batch_size +
        2)`` of the last one's (every rank at a step has read as many samples, give or take a
        batch, and holds ``rows // num_parts`` of the rows read or one more), so that a merge
        of every rank's state (:func:`gluon_stream.merge_states`) knows each shard's strides.
        () for other deals."""
        clock = getattr(self, "_clock", None)
        run = clock.run if clock is not None else None
        if run is None or run.offsets is None:
            return ()

        def rows(unit: int) -> int | None:  # None: past the shards read (a window's units)
            found = run.rows_before(unit)
            return found if found is not None else self._recorded.get(unit)

        known = [(unit, n) for unit in range(first, last + 1) if (n := rows(unit)) is not None]
        if not known:
            return ()
        floor = known[-1][1] - self.stream.num_parts * (2 * self.settings.batch_size + 2)
        while first > 0 and (n := rows(first - 1)) is not None and n >= floor:
            first -= 1
            known.insert(0, (first, n))
        return tuple(known)

    def _recorded_rows(self, unit: int) -> int:
        """``deal='balanced'``: the rows before position ``unit`` of the epoch, as the state
        this pass started from records them (0 at the epoch's start)."""
        recorded = self._recorded
        if unit in recorded or not unit or not self.stream.sizes.learns_rows(self.epoch):
            return recorded.get(unit, 0)
        raise InvalidState(
            f"the state resumes epoch {self.epoch} at shard {unit}, but does not record the rows "
            "of the shards before it, which decide the strides every rank takes "
            "(even_batches=True, sizes unknown): save it again with this gluon_stream")

    def _lead(self, before: int) -> int:
        """even_batches='pad': the largest part's samples in the shards before position
        ``before`` (those a resume does not produce again)."""
        lead = self.even.lead if self.even is not None else 0
        share, epoch = self.stream.sizes.largest_share, self.start.position.epoch
        return lead + sum(share(epoch, j, n) for j, n in self._full_sizes.items() if j < before)

    def _repeat(self, even: EvenBatches, delivered: int, count: int, run: EpochRun,
                record: EpochRecord, stop: Position) -> Iterator[Any]:
        """even_batches: this part is short of the ``count`` every part yields (skipped shards,
        shards smaller than declared; with ``'pad'``, a smaller part); repeat its last batch
        (as padding with ``'pad'``), so that synchronous training does not wait for it."""
        missing = count - delivered
        data = even.repeat_data
        if data is None and even.repeat:  # resumed while repeating: make that batch again
            chunks = self._rebuild(even.repeat, self.start.skipped,
                                   self.carry.sources if self.carry is not None else None)
            if self.origins is not None:
                self.origins.delivered(even.repeat, self.settings.batch_size
                                       - sum(s.size for s in even.repeat))
            data = self.path.join(chunks, batch_seed(self.stream.seed, run.epoch,
                                                     even.repeat_number))
            if self.settings.ctx is not None:
                data = mx_arrays.place(data, self.settings.ctx)
            data = pad_rows(data, self.settings.batch_size)
        if data is None:  # no batch of its own (dealt nothing): rows of another shard
            data = self._borrow(run, count)
        elif self.origins is not None:
            self.origins.repeated()  # the last batch again, all of it padding
        if not even.pad:
            logger.warning("epoch %d: part %d of %d is %d batch(es) short of the %d every part "
                           "yields (even_batches=True; %d shard(s) skipped); repeating its last "
                           "batch %d time(s)", run.epoch, self.stream.part_index,
                           self.stream.num_parts, missing, count, run.skipped, missing)
        for _ in range(missing):
            record.batches += 1
            delivered += 1
            self._advance(stop.ended() if delivered >= count else stop, delivered,
                          run.skipped_at)
            self.pad = self.settings.batch_size if even.pad else 0
            yield data

    def _borrow(self, run: EpochRun, count: int) -> Any:
        """A batch for a part that has none of its own to repeat (it was dealt no sample, or
        its shards failed) while the others yield ``count``: the first ``batch_size`` rows
        (cycled) of the first shard of the epoch's key list that holds any, read whole. With
        ``'pad'`` all its rows are padding; with ``True`` it keeps the step count, as a
        repeat does. The same on every resume (a state records no borrowed segment)."""
        stream, bs = self.stream, self.settings.batch_size
        keys, finite = stream.source.keys_for_epoch(run.epoch)
        tried = []
        for key in (keys if finite else ()):
            if stream.sizes.full_size(key, run.epoch) == 0:
                continue
            try:
                shard = stream.producer.produce_now(key, run.epoch, self.path.prepare, whole=True)
            except Exception as exc:  # a failing shard (on_error='skip'): the next one
                if stream.error_policy.verdict(exc, stream.error_policy.retries) != "skip":
                    raise
                tried.append(f"{key!r}: {type(exc).__name__}")
                continue
            if len(shard):
                rows = min(bs, len(shard))
                unit: Any = shard  # or the mixed unit a mixing path gathers from it
                if self.settings.window > 1:  # the path gathers a mixed unit from its shards
                    mixed = MixedUnit(0, np.zeros(rows, np.int64), np.arange(rows), ())
                    unit = self.path.mix(MixedData(mixed, {0: shard}, key))
                seg = Segment(run.epoch, 0, 0, rows, key)
                data = self.path.join([self.path.cut(unit, seg)],
                                      batch_seed(stream.seed, run.epoch, count))
                if self.settings.ctx is not None:
                    data = mx_arrays.place(data, self.settings.ctx)
                if self.origins is not None:
                    self.origins.borrowed(shard, rows, bs)
                logger.info("epoch %d: part %d of %d has no batch of its own; it yields %d "
                            "batch(es) of rows of shard %r (even_batches=%r) to keep the "
                            "ranks' step counts equal", run.epoch, stream.part_index,
                            stream.num_parts, count, key, self.settings.even)
                return pad_rows(data, bs)
        raise StreamError(
            f"part {stream.part_index} of {stream.num_parts} has no batch to give in epoch "
            f"{run.epoch} while the others yield {count}, and no shard of the epoch holds a "
            f"sample to pad with ({run.skipped} shard(s) skipped here"
            f"{'; failed: ' + ', '.join(tried) if tried else ''}): the declared sizes "
            "(shard_sizes=) say there are samples the shards do not hold; see the warnings above")

    # -- a resumed position's data ----------------------------------------------------------
    def _rebuild_carry(self, segments: Sequence[Segment],
                       skipped: Sequence[tuple[int, int]]) -> Carry:
        carry = Carry()
        carry.sources.origins = self.origins  # provenance: the carried units' origins too
        for seg, chunk in zip(segments, self._rebuild(segments, skipped, carry.sources)):
            carry.add(seg, chunk)
        return carry

    def _rebuild(self, segments: Sequence[Segment], skipped: Sequence[tuple[int, int]],
                 sources: UnitSources | None = None) -> list[tuple]:
        """The rows of ``segments``, cut from their units produced again (a resume); their
        samples' sources noted in ``sources``."""
        chunks = []
        for seg in segments:
            unit = self._unit_again(seg, skipped, sources)
            if seg.stop > len(unit):
                raise InvalidState(
                    f"the state holds rows {seg.start}..{seg.stop - 1} of {_unit_name(seg)} of "
                    f"epoch {seg.epoch}, which now holds only {len(unit)} samples: the data "
                    "changed since the state was saved; start the epoch afresh")
            chunks.append(self.path.cut(unit, seg))
        return chunks

    def _unit_again(self, seg: Segment, skipped: Sequence[tuple[int, int]],
                    sources: UnitSources | None = None) -> Any:
        """Unit ``seg.unit`` of epoch ``seg.epoch``, produced again (its samples' sources
        noted in ``sources``)."""
        stream, window = self.stream, self.settings.window
        keys = stream.dealer.epoch_keys(seg.epoch)[2]
        prepare = self.path.prepare
        if window == 1:
            key = keys[seg.unit] if keys is not None and seg.unit < len(keys) else seg.key
            shard = stream.producer.produce_now(key, seg.epoch, prepare, seg.unit,
                                       before=self._recorded_rows(seg.unit))
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
                                           before=self._recorded_rows(j))
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


def _empty_pass(stream: Any, feed: UnitFeed, start: Position) -> bool:
    """samples_per_epoch: whether a whole pass over the keys gave nothing. Where every part
    reads every shard (strides), only a pass whose shards all held no sample counts, which
    every part sees alike: a part that turning strides left without a row this pass has its
    turn in a later one. Dealt whole, this part's shards gave it no sample."""
    assert feed.end is not None
    if stream.deal != "shards" and stream.num_parts > 1:
        return not any(feed.full_sizes.values())
    return feed.end.taken == start.taken


def _empty_reason(run: EpochRun, feed: UnitFeed, batch_size: int, rule: str) -> str:
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

