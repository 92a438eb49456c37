"""One loader epoch: the stages wired together, batches yielded, and where it stands.

An epoch wires its stages: the stream's :class:`~gluon_stream._pipeline.run.KeyPass` (shards in
order; several passes over the keys with ``samples_per_epoch``), a feed (units: shards, or the
mixed units of a shuffle window), the :class:`~gluon_stream._pipeline.batching.BatchPlanner`
(which samples form which batch), a batch path (slices, or per-sample work on workers) and,
with even_batches, :class:`~gluon_stream._pipeline.even.EvenBatches`. Each stage owns its
position; :class:`~gluon_stream._pipeline.pass_state.PassState` composes them after the last
batch yielded, so a :class:`~gluon_stream._pipeline.state.LoaderState` taken between any two
batches, the last one included, resumes exactly.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Generator, Iterator

from .._mx import arrays as mx_arrays
from .._mx.padding import pad_rows
from .._utils.progress import ProgressBar
from .._utils.random import batch_seed
from ..errors import StreamError
from ..records import EpochRecord
from .batching import Batch, BatchPlanner, Position, WindowMixer
from .contracts import BatchPath
from .even import EvenBatches, borrow_batch
from .feed import Carry, UnitFeed, WindowFeed
from .keys import EMPTY_PASSES
from .pass_state import PassState
from .provenance import ProvenanceTracker
from .rebuild import Rebuild
from .run import KeyPass
from .settings import PassSettings
from .state import LoaderState
from .stream import ShardStream

__all__ = ["LoaderEpoch", "PassSettings"]

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

