"""Which samples form which batch: the loader's promise, written once, in pure Python.

An epoch is a sequence of *units* (the shards, in the order the stream delivers them), each
read front to back. :class:`BatchPlanner` cuts them into batches of ``batch_size``: the
samples left over at the end of a unit open the next unit's first batch, so every batch is full
except possibly the last of the epoch, which ``last_batch`` decides (``'keep'`` yields it,
``'discard'`` drops it, ``'rollover'`` carries it into the next epoch's first batch).

A planned :class:`Batch` is a tuple of :class:`Segment` s (unit, start, stop) and the
:class:`Position` the epoch stands at once it is delivered; a planner started at that position
plans exactly the batches that would have followed. Both of the loader's paths (slices of a
shard, and per-sample work in a DataLoader) consume these plans, so nothing here knows about
arrays or MXNet.

Example:
    >>> planner = BatchPlanner(4, "keep", Position(epoch=0))
    >>> [b.sizes for b in planner.add(0, 6).batches()]
    [(4,)]
    >>> [b.sizes for b in planner.add(1, 3).batches()]
    [(2, 2)]
    >>> planner.finish().sizes
    (1,)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

__all__ = ["LAST_BATCH_MODES", "Batch", "BatchPlanner", "Position", "Segment", "UnitPlan"]

LAST_BATCH_MODES = ("keep", "discard", "rollover")


@dataclass(frozen=True)
class Segment:
    """Samples ``start .. stop - 1`` of unit ``unit`` of epoch ``epoch`` (``key`` rides along)."""

    epoch: int
    unit: int
    start: int
    stop: int
    key: Any = field(default=None, compare=False)

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Position:
    """Where an epoch stands between batches.

    The next unread sample is row ``offset`` of unit ``unit`` of ``epoch``; ``carry`` holds
    samples already read from earlier units (or the previous epoch's rollover) that open the
    next batch.
    """

    epoch: int
    unit: int = 0
    offset: int = 0
    carry: tuple[Segment, ...] = ()

    @property
    def carried(self) -> int:
        return sum(s.size for s in self.carry)


@dataclass(frozen=True)
class Batch:
    """One planned batch: its segments in order, and the position once it is delivered."""

    segments: tuple[Segment, ...]
    after: Position

    @property
    def size(self) -> int:
        return sum(s.size for s in self.segments)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(s.size for s in self.segments)


@dataclass(frozen=True)
class UnitPlan:
    """The batches one unit completes, produced lazily (a shard may hold millions of samples).

    ``joined`` is the batch that tops up the carried samples with the unit's first rows (if the
    unit completes it); ``full`` the starts of the batches that lie wholly inside the unit;
    ``leftover`` what the unit passes on to the next one.
    """

    epoch: int
    unit: int
    length: int
    batch_size: int
    key: Any
    joined: Batch | None
    full: range
    leftover: tuple[Segment, ...]

    def batches(self) -> Iterator[Batch]:
        """The unit's batches in order."""
        if self.joined is not None:
            yield self.joined
        bs = self.batch_size
        for begin in self.full:
            end = begin + bs
            yield Batch((Segment(self.epoch, self.unit, begin, end, self.key),),
                        _after(self.epoch, self.unit, end, self.length))

    def __len__(self) -> int:
        return (self.joined is not None) + len(self.full)


def _after(epoch: int, unit: int, stop: int, length: int) -> Position:
    """The position once a batch ending at row ``stop`` of a unit of ``length`` is delivered."""
    if stop >= length:
        return Position(epoch, unit + 1, 0)
    return Position(epoch, unit, stop)


class BatchPlanner:
    """Plans an epoch's batches unit by unit, from a starting :class:`Position`.

    Args:
        batch_size: Samples per batch.
        last_batch: ``'keep'``, ``'discard'`` or ``'rollover'`` (the epoch's short tail).
        start: Where to begin: ``Position(epoch)`` for a fresh epoch; a delivered batch's
            ``after`` (or a rollover's carry) to continue exactly.
    """

    def __init__(self, batch_size: int, last_batch: str, start: Position) -> None:
        if last_batch not in LAST_BATCH_MODES:
            raise ValueError(f"last_batch must be one of {LAST_BATCH_MODES}, got {last_batch!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        if start.carried >= batch_size:
            raise ValueError(f"a position carries {start.carried} samples, more than a batch "
                             f"({batch_size}) can hold")
        self.batch_size = batch_size
        self.last_batch = last_batch
        self.start = start
        self.epoch = start.epoch
        self._carry: list[Segment] = list(start.carry)
        self._next_unit = start.unit

    @property
    def carry(self) -> tuple[Segment, ...]:
        """Samples read but not yet in a batch (they open the next one)."""
        return tuple(self._carry)

    @property
    def carried(self) -> int:
        return sum(s.size for s in self._carry)

    def add(self, unit: int, length: int, key: Any = None) -> UnitPlan:
        """Unit ``unit`` (the next in order; skipped units are simply never added) holds
        ``length`` samples: plan the batches it completes.

        Reading starts at the start position's offset when ``unit`` is its unit.
        """
        if unit < self._next_unit:
            raise ValueError(f"unit {unit} added after unit {self._next_unit - 1}: units must "
                             "come in increasing order, from the start position on")
        if length < 0:
            raise ValueError(f"unit {unit} has a negative length {length}")
        offset = self.start.offset if unit == self.start.unit else 0
        if offset > length:
            raise ValueError(f"the start position is row {offset} of unit {unit}, which holds "
                             f"only {length} samples: the data changed since it was saved")
        self._next_unit = unit + 1
        bs = self.batch_size
        pos, joined = offset, None
        if self._carry and pos < length:
            take = min(bs - self.carried, length - pos)
            self._carry.append(Segment(self.epoch, unit, pos, pos + take, key))
            pos += take
            if self.carried == bs:
                joined = Batch(tuple(self._carry), _after(self.epoch, unit, pos, length))
                self._carry = []
        if self._carry:  # the unit did not complete the carried batch: all of it waits
            full = range(0)
        else:
            stop = pos + (length - pos) // bs * bs
            full = range(pos, stop, bs)
            if stop < length:
                self._carry = [Segment(self.epoch, unit, stop, length, key)]
        leftover = tuple(s for s in self._carry if s.unit == unit and s.epoch == self.epoch)
        return UnitPlan(self.epoch, unit, length, bs, key, joined, full, leftover)

    def flush(self, unit: int) -> Batch | None:
        """Deliver the carried samples now, as a short batch, because unit ``unit`` failed
        (None with ``'discard'``, or when nothing is carried)."""
        carry, self._carry = self._carry, []
        if not carry or self.last_batch == "discard":
            return None
        return Batch(tuple(carry), Position(self.epoch, unit, 0))

    def finish(self) -> Batch | None:
        """End of the epoch: the short tail as a batch with ``'keep'``, else None.

        With ``'rollover'`` the tail stays in :attr:`carry` and :meth:`next_epoch` starts
        with it; with ``'discard'`` it is dropped.
        """
        if self.last_batch == "rollover":
            return None
        carry, self._carry = self._carry, []
        if not carry or self.last_batch == "discard":
            return None
        return Batch(tuple(carry), Position(self.epoch + 1))

    def next_epoch(self) -> Position:
        """Where the next epoch starts once this one is finished (the rollover, if any)."""
        return Position(self.epoch + 1, 0, 0, tuple(self._carry))
