"""An epoch's units, each with its batch plan: what both of the loader's batch paths read.

A unit is the thing the :class:`~gluon_stream._stages.batching.BatchPlanner` cuts into batches: a
shard (``shuffle_window=1``), or a :class:`MixedUnit` that mixes the samples of up to k consecutive
shards (see :class:`~gluon_stream._stages.batching.WindowMixer`). :class:`UnitFeed` and
:class:`WindowFeed` pull the shards from an :class:`~gluon_stream.stream.KeyPass` and hand out
``(unit, plan)`` in order; :attr:`UnitFeed.final` is then the epoch's short tail (or the samples
carried before a failing shard), :attr:`UnitFeed.failure` the error to raise after it.
"""
from __future__ import annotations

import collections
import enum
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from .._utils.validate import every_nth
from ..errors import LoaderClosed, StreamError
from ..records import EpochRecord
from .batching import Batch, BatchPlanner, MixedUnit, Position, Segment, UnitPlan, WindowMixer
from .produce import KeyPass, Shard
from .provenance import ProvenanceTracker

__all__ = ["Carry", "EMPTY_SHARDS", "FeedState", "MixedData", "UnitFeed", "UnitSources",
           "WindowFeed"]

#: An endless key iterator: shards in a row that hold no sample for this part before it is an
#: error. Its pass never ends, so without a bound a part whose dealt keys are all empty (every
#: 7th date on 7 ranks: a weekday with no data) would wait for a sample forever.
EMPTY_SHARDS = 64


class Carry:
    """The data of the samples the planner carries, in the planner's segment order.

    Chunks are tuples of arrays (copies of the carried rows: NDArrays on the vectorised path,
    numpy arrays on the per-sample path), so a small leftover never keeps its shard alive.
    :attr:`sources` goes along with it from pass to pass: which source the units' samples,
    carried ones included, came from.
    """

    def __init__(self) -> None:
        self.chunks: list[tuple] = []
        self.segments: list[Segment] = []
        self.sources = UnitSources()

    def add(self, segment: Segment, chunk: tuple) -> None:
        self.segments.append(segment)
        self.chunks.append(chunk)

    def take_all(self) -> list[tuple]:
        chunks, self.chunks, self.segments = self.chunks, [], []
        return chunks

    def __len__(self) -> int:
        return sum(s.size for s in self.segments)


class UnitSources:
    """Which source of a :class:`~gluon_stream.MixSource` each sample of a unit came from, per
    ``(epoch, unit)``, from when the unit is handed out until no batch reads it any more: what
    ``stats.per_source()`` counts of the batches the loop receives. Empty for a source used
    alone (its shards name no source)."""

    def __init__(self) -> None:
        # a unit's source name, or (the shard position of each row, {position: source name})
        self._units: dict[tuple[int, int], Any] = {}
        self.origins: ProvenanceTracker | None = None  # provenance=True: told the same units

    def shard(self, epoch: int, unit: int, shard: Shard) -> None:
        if self.origins is not None:
            self.origins.shard(epoch, unit, shard)
        name = _source(shard)
        if name is not None:
            self._units[(epoch, unit)] = name

    def mixed(self, epoch: int, data: "MixedData") -> None:
        if self.origins is not None:
            self.origins.mixed(epoch, data.unit, data.shards)
        names = {j: _source(shard) for j, shard in data.shards.items()}
        if any(name is not None for name in names.values()):
            self._units[(epoch, data.index)] = (data.unit.shards, names)

    def count(self, segments: Iterator[Segment] | tuple[Segment, ...]) -> dict[str, int]:
        """Samples per source in ``segments`` (of units handed out and not forgotten)."""
        out: dict[str, int] = {}
        for seg in segments:
            entry = self._units.get((seg.epoch, seg.unit))
            if isinstance(entry, str):
                out[entry] = out.get(entry, 0) + seg.size
            elif entry is not None:
                positions, counts = np.unique(entry[0][seg.start:seg.stop], return_counts=True)
                for j, n in zip(positions.tolist(), counts.tolist()):
                    name = entry[1].get(j)
                    if name is not None:
                        out[name] = out.get(name, 0) + n
        return out

    def forget_before(self, position: Position) -> None:
        """No batch reads units before ``position``'s unit or its carried segments any more."""
        if self.origins is not None:
            self.origins.forget_before(position)
        first = min([(position.epoch, position.unit)]
                    + [(s.epoch, s.unit) for s in position.carry])
        for unit in [u for u in self._units if u < first]:
            del self._units[unit]


def _source(shard: Shard) -> str | None:
    return shard.record.source if shard.record is not None else None


class _EpochEnd:
    """What the look-ahead met instead of a shard: the run has no more."""


@dataclass
class MixedData:
    """A mixed unit's plan and the shards it reads (by their position in the epoch)."""

    unit: MixedUnit
    shards: dict[int, Shard]
    key: Any
    arrays: tuple = ()  # the unit's own arrays, when a path builds them

    @property
    def index(self) -> int:
        return self.unit.index

    def __len__(self) -> int:
        return len(self.unit)

    def sources(self, start: int, stop: int) -> Iterator[tuple[int, list[int]]]:
        """``(shard position, rows)`` runs of samples ``start .. stop - 1``, in order."""
        shards, rows = self.unit.shards[start:stop], self.unit.rows[start:stop]
        out: list[tuple[int, list[int]]] = []
        for shard, row in zip(shards.tolist(), rows.tolist()):
            if out and out[-1][0] == shard:
                out[-1][1].append(row)
            else:
                out.append((shard, [row]))
        return iter(out)


class FeedState(enum.IntEnum):
    """Where a feed is: handing out units (``READING``); its run has no more shards, the units
    they complete are still to hand out (``DRAINED``, a shuffle window's last units); done,
    the epoch's tail and end known (``ENDED``). It only moves forward."""

    READING = 0
    DRAINED = 1
    ENDED = 2


class UnitFeed:
    """Shards in order as units (``shuffle_window=1``), each with its batch plan.

    :meth:`done` cuts a finished unit's leftover rows into the carry (through the path's
    ``cut``).
    """

    def __init__(self, run: KeyPass, planner: BatchPlanner, carry: Carry, path: Any,
                 record: EpochRecord, closes: bool = True) -> None:
        self.run, self.planner, self.carry, self.path, self.record = (run, planner, carry,
                                                                      path, record)
        self.closes = closes  # the run's end is the epoch's (not so with samples_per_epoch)
        self.final: Batch | None = None
        self.end: Position | None = None  # where the epoch ends, once the units run out
        self.failure: BaseException | None = None
        self.shard_wait_s = 0.0  # time spent waiting for shards to be produced, in total
        self.mix_wait_s = 0.0  # time spent waiting for a window's unit to be gathered
        self.samples = 0  # samples of the shards handed out
        self.full_sizes: dict[int, int] = {}  # their samples before ranks took their parts
        self.current: Shard | None = None  # the shard handed out last, if it may be pushed back
        self.names: tuple[str, ...] | None = None  # the arrays' names, where they have some
        self.state = FeedState.READING
        self._empty: list[Any] = []  # an endless pass: the keys of the empty shards in a row

    def ready(self) -> bool:
        """Whether :meth:`next` would return without waiting for a shard to be produced."""
        return self.state is FeedState.ENDED or self.run.ready()

    def _next_shard(self) -> Shard | None:
        """The run's next shard; on a failure, the carried samples become :attr:`final`."""
        try:
            shard = self._take()
        except LoaderClosed:
            raise
        except Exception as exc:  # deliver what earlier shards left over first, then raise
            self.state, self.failure = FeedState.ENDED, exc
            self.final = self.planner.flush(self.run.index)
            return None
        if shard is not None:
            self._accept(shard)
        return shard

    def _take(self) -> Shard | None:
        try:
            return self.run.next_shard()
        finally:
            self.shard_wait_s += self.run.last_wait_s

    def _accept(self, shard: Shard) -> None:
        # kept only where the run goes on past the epoch (samples_per_epoch pushes it back):
        # otherwise it would keep the shard alive while the loop waits for the next one
        self.current = None if self.closes else shard
        self.record.peak_prefetch = max(self.record.peak_prefetch, self.run.ready_ahead() + 1)
        self.samples += len(shard)
        self.full_sizes[shard.index] = shard.full_size
        self.names = shard.names
        if not self.run.finite:
            self._check_empty(shard)

    def _check_empty(self, shard: Shard) -> None:
        """An endless pass: :data:`EMPTY_SHARDS` shards in a row with no sample for this part
        raise StreamError, naming the keys, instead of waiting for a sample forever."""
        if len(shard):
            self._empty.clear()
            return
        self._empty.append(shard.key)
        if len(self._empty) < EMPTY_SHARDS:
            return
        stream = self.run.stream
        dealt = (f"; the iterator's keys are dealt to {stream.num_parts} ranks, "
                 f"{every_nth(stream.num_parts, 'key')} to this one: are the keys dealt here "
                 "always empty "
                 "(dates of one weekday)? Leave them out of the iterator"
                 if stream.num_parts > 1 else "")
        raise StreamError(
            f"part {stream.part_index} of {stream.num_parts}: {EMPTY_SHARDS} shards in a row "
            f"(keys {self._empty[0]!r} .. {self._empty[-1]!r} of an endless key iterator, "
            f"epoch {self.run.epoch}) held no sample for it, so its epoch can never fill"
            f"{dealt}")

    def next(self) -> tuple[Any, UnitPlan] | None:
        if self.state is FeedState.ENDED:
            return None
        if self.planner.exhausted:  # samples_per_epoch: the epoch read its samples
            self._end(True)
            return None
        shard = self._next_shard()
        if shard is None:
            if self.state is not FeedState.ENDED:
                self._end()
            return None
        self.carry.sources.shard(self.run.epoch, shard.index, shard)
        return shard, self.planner.add(shard.index, len(shard), key=shard.key)

    def _end(self, closes: bool | None = None) -> None:
        """No unit follows: end the epoch (its tail, :attr:`final`, per last_batch), or, where
        the stream goes on past this run (``samples_per_epoch``), leave what the planner holds
        to the next run."""
        self.state = FeedState.ENDED
        if self.closes if closes is None else closes:
            self.final, self.end = self.planner.finish()
        else:
            self.end = self.planner.position

    def done(self, unit: Any, plan: UnitPlan) -> None:
        for seg in plan.leftover:
            self.carry.add(seg, self.path.cut(unit, seg))


class WindowFeed(UnitFeed):
    """Units that mix the samples of ``window`` consecutive shards (``shuffle_window > 1``).

    Unit ``t`` is handed out as soon as shard ``t`` is in (see
    :class:`~gluon_stream._stages.batching.WindowMixer`); a shard is let go of once no later unit
    reads it. The shards held here and those in flight stay within ``budget``
    (``max(prefetch, window) + 1``), at least one always being produced ahead. The path's
    ``mix_later`` gives a unit its data in the background: when a unit is handed out and the
    next shard is already produced, that shard is taken at once, so the next unit's data is
    gathered while the loop trains on this one. A failure met that way is kept and raised
    where the loop reaches it, as without the look-ahead.
    """

    def __init__(self, run: KeyPass, planner: BatchPlanner, carry: Carry, path: Any,
                 record: EpochRecord, mixer: WindowMixer, budget: int,
                 closes: bool = True, lengths: dict | None = None) -> None:
        super().__init__(run, planner, carry, path, record, closes)
        self.mixer = mixer
        #: (epoch, unit) -> :attr:`MixedUnit.lengths` of each unit handed out (what a state
        #: records of the units its position refers to)
        self.lengths: dict[tuple[int, int], tuple[int, ...]] = {} if lengths is None \
            else lengths
        self.budget = budget  # shards held here plus shards in flight
        self._shards: dict[int, Shard] = {}
        self._units: collections.deque[tuple[MixedUnit, Future]] = collections.deque()
        # what the look-ahead met instead of a shard: the end of the epoch, or an error
        self._deferred: _EpochEnd | Exception | None = None

    def ready(self) -> bool:
        return (bool(self._units) or self.state is not FeedState.READING
                or self._deferred is not None or self.run.ready())

    def next(self) -> tuple[Any, UnitPlan] | None:
        # samples_per_epoch: the epoch is read
        if self.state is not FeedState.ENDED and self.planner.exhausted:
            self._end(True)
            return None
        while not self._units:
            if self.state is FeedState.ENDED:
                return None
            if self.state is FeedState.DRAINED:
                self._end()
                return None
            self._limit_in_flight()
            shard = self._next_shard()
            if shard is None:
                if self.state is FeedState.ENDED:  # failed
                    return None
                self.state = FeedState.DRAINED
                self._add_units(self.mixer.finish())
                continue
            self._add_shard(shard)
        unit, pending = self._units.popleft()
        self.lengths[(self.run.epoch, unit.index)] = unit.lengths
        start = time.perf_counter()
        mixed = pending.result()
        self.mix_wait_s += time.perf_counter() - start
        for j in unit.done:  # only now: until gathered, the unit's shards count in the budget
            self._shards.pop(j, None)
        self.run.max_pending = self.budget - len(self._shards)
        self._look_ahead()
        return mixed, self.planner.add(unit.index, len(unit), key=mixed.key)

    def _take(self) -> Shard | None:
        deferred, self._deferred = self._deferred, None
        if deferred is None:
            return super()._take()
        if isinstance(deferred, _EpochEnd):
            return None
        raise deferred

    def _look_ahead(self) -> None:
        """Take the next shard if it is produced already, and start gathering its units."""
        if self._units or self.state is not FeedState.READING or self._deferred is not None:
            return
        self._limit_in_flight()
        if not self.run.has_shard():
            return
        try:
            shard = super()._take()
        except LoaderClosed:
            raise
        except Exception as exc:  # e.g. a schema mismatch: raised where the loop reaches it
            self._deferred = exc
            return
        if shard is None:
            self._deferred = _EpochEnd()
            return
        self._accept(shard)
        self._add_shard(shard)

    def _limit_in_flight(self) -> None:
        """Before taking a shard: the run refills as it hands one out, and that shard joins
        those held, so one fewer may be in flight (the run keeps at least one)."""
        self.run.max_pending = self.budget - len(self._shards) - 1

    def _add_shard(self, shard: Shard) -> None:
        self._shards[shard.index] = shard
        self._add_units(self.mixer.add(shard.index, len(shard)))

    def _add_units(self, units: list[MixedUnit]) -> None:
        for unit in units:
            shards = {j: self._shards[j] for j in np.unique(unit.shards).tolist()}
            newest = self._shards.get(unit.index)
            mixed = MixedData(unit, shards, newest.key if newest else None)
            self.carry.sources.mixed(self.run.epoch, mixed)  # before mixing lets go of them
            self._units.append((unit, self.path.mix_later(mixed)))

