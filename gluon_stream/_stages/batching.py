"""Which samples form which batch: the loader's promise, written once, in pure Python.

An epoch is a sequence of *units*, each read front to back: the shards in the order the stream
delivers them or, with a shuffle window, units that each mix the samples of up to k
consecutive shards (:class:`WindowMixer`). :class:`BatchPlanner` cuts them into batches of
``batch_size``: the samples left over at the end of a unit open the next unit's first batch, so
every batch is full except possibly the last of the epoch, which ``last_batch`` decides
(``'keep'`` yields it, ``'discard'`` drops it, ``'rollover'`` carries it into the next epoch's
first batch).

A planned :class:`Batch` is a tuple of :class:`Segment` s (unit, start, stop) and the
:class:`Position` the epoch stands at once it is delivered; a planner started at that position
plans exactly the batches that would have followed. Both of the loader's paths (slices of a
unit, and per-sample work on workers) consume these plans, so nothing here knows about arrays
or MXNet.

Example:
    >>> planner = BatchPlanner(4, "keep", Position(epoch=0))
    >>> [b.sizes for b in planner.add(0, 6).batches()]
    [(4,)]
    >>> [b.sizes for b in planner.add(1, 3).batches()]
    [(2, 2)]
    >>> final, end = planner.finish()
    >>> final.sizes, end.end
    ((1,), True)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Literal

import numpy as np

from .._utils import validate as _validate
from .._utils.random import seeded_rng

__all__ = ["LAST_BATCH_MODES", "Batch", "LastBatch", "BatchPlanner", "MixedUnit", "Position",
           "Segment", "UnitPlan", "WindowMixer", "mixed_order", "window_slice"]

LAST_BATCH_MODES = ("keep", "discard", "rollover")
LastBatch = Literal["keep", "discard", "rollover"]  # what to do with an epoch's short tail


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
    next batch. ``end``: every batch of the epoch is delivered (``carry`` is then what rolls
    over into the next epoch); a pass resumed there yields nothing, and the next is ``epoch + 1``.
    """

    epoch: int
    unit: int = 0
    offset: int = 0
    carry: tuple[Segment, ...] = ()
    end: bool = False
    taken: int = 0  # samples_per_epoch: samples the epoch read before this position

    @property
    def carried(self) -> int:
        return sum(s.size for s in self.carry)

    @property
    def last_read(self) -> int:
        """The last unit the position has read rows of: its own where it stands inside it,
        else the one before (-1: none)."""
        return self.unit if self.offset else self.unit - 1

    def units_read(self) -> set[tuple[int, int]]:
        """``(epoch, unit)`` of the units the position has read part of: each carried
        segment's, and :attr:`last_read` (the end of an epoch holds only its carry)."""
        units = {(s.epoch, s.unit) for s in self.carry}
        if not self.end and self.last_read >= 0:
            units.add((self.epoch, self.last_read))
        return units

    def ended(self) -> "Position":
        """This position, marked as the end of its epoch (nothing rolls over)."""
        return Position(self.epoch, self.unit, 0, (), True, self.taken)

    def next_epoch(self) -> "Position":
        """Where the next epoch starts once this one has ended: with what rolls over."""
        return Position(self.epoch + 1, 0, 0, self.carry)


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
    taken: int | None = None  # samples_per_epoch: the epoch's samples read before ``offset``
    offset: int = 0  # the unit's first row read

    def batches(self) -> Iterator[Batch]:
        """The unit's batches in order."""
        if self.joined is not None:
            yield self.joined
        bs = self.batch_size
        for begin in self.full:
            end = begin + bs
            yield Batch((Segment(self.epoch, self.unit, begin, end, self.key),),
                        _after(self.epoch, self.unit, end, self.length,
                               0 if self.taken is None else self.taken + end - self.offset))

    def __len__(self) -> int:
        return (self.joined is not None) + len(self.full)


def _after(epoch: int, unit: int, stop: int, length: int, taken: int = 0) -> Position:
    """The position once a batch ending at row ``stop`` of a unit of ``length`` is delivered
    (``taken``: the epoch's samples read up to it)."""
    if stop >= length:
        return Position(epoch, unit + 1, 0, taken=taken)
    return Position(epoch, unit, stop, taken=taken)


class BatchPlanner:
    """Plans an epoch's batches unit by unit, from a starting :class:`Position`.

    Args:
        batch_size: Samples per batch.
        last_batch: ``'keep'``, ``'discard'`` or ``'rollover'`` (the epoch's short tail).
        start: Where to begin: ``Position(epoch)`` for a fresh epoch; a delivered batch's
            ``after`` (or a rollover's carry) to continue exactly.
        epoch_samples: Samples an epoch reads (``samples_per_epoch``): reading stops once
            the epoch has read them (``start.taken`` before the start), inside a unit if need
            be, and :meth:`finish` ends the epoch at that row. None: every unit whole.
    """

    def __init__(self, batch_size: int, last_batch: str, start: Position,
                 epoch_samples: int | None = None) -> None:
        _validate.choice("last_batch", last_batch, LAST_BATCH_MODES)
        _validate.integer("batch_size", batch_size, minimum=1)
        if start.carried >= batch_size:
            raise ValueError(f"a position carries {start.carried} samples, more than a batch "
                             f"({batch_size}) can hold")
        self.batch_size = batch_size
        self.last_batch = last_batch
        self.start = start
        self.epoch = start.epoch
        self._carry: list[Segment] = list(start.carry)
        self._carried = start.carried  # samples in _carry, kept with it (read once per unit)
        self._next_unit = start.unit
        self.epoch_samples = epoch_samples
        self.taken = start.taken  # samples of the epoch read so far
        self._resume = (start.unit, start.offset)  # where reading goes on: (unit, row)

    @property
    def carry(self) -> tuple[Segment, ...]:
        """Samples read but not yet in a batch (they open the next one)."""
        return tuple(self._carry)

    @property
    def carried(self) -> int:
        return self._carried

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
        read = length if self.epoch_samples is None else \
            min(length, offset + max(0, self.epoch_samples - self.taken))
        taken = self.taken
        if self.epoch_samples is not None:  # positions say how much of the epoch is read
            self.taken += read - offset
        self._resume = (unit + 1, 0) if read >= length else (unit, read)
        bs = self.batch_size
        pos, joined = offset, None
        carried_before = len(self._carry)  # segments of earlier adds: not this unit's leftover
        if self._carry and pos < read:
            take = min(bs - self._carried, read - pos)
            self._carry.append(Segment(self.epoch, unit, pos, pos + take, key))
            self._carried += take
            pos += take
            if self._carried == bs:
                joined = Batch(tuple(self._carry), _after(
                    self.epoch, unit, pos, length,
                    0 if self.epoch_samples is None else taken + pos - offset))
                self._carry, self._carried, carried_before = [], 0, 0
        if self._carry:  # the unit did not complete the carried batch: all of it waits
            full = range(0)
        else:
            stop = pos + (read - pos) // bs * bs
            full = range(pos, stop, bs)
            if stop < read:
                self._carry = [Segment(self.epoch, unit, stop, read, key)]
                self._carried = read - stop
        leftover = tuple(self._carry[carried_before:])
        return UnitPlan(self.epoch, unit, length, bs, key, joined, full, leftover,
                        None if self.epoch_samples is None else taken, offset)

    @property
    def position(self) -> Position:
        """Where the planner stands: where reading goes on, and what it carries."""
        return Position(self.epoch, *self._resume, tuple(self._carry), taken=self.taken)

    @property
    def exhausted(self) -> bool:
        """Whether the epoch read its ``epoch_samples``: it reads no more units."""
        return self.epoch_samples is not None and self.taken >= self.epoch_samples

    def flush(self, unit: int) -> Batch | None:
        """Deliver the carried samples now, as a short batch, because unit ``unit`` failed
        (None with ``'discard'``, or when nothing is carried)."""
        carry, self._carry, self._carried = self._carry, [], 0
        if not carry or self.last_batch == "discard":
            return None
        return Batch(tuple(carry), Position(self.epoch, unit, 0, taken=self.taken))

    def finish(self) -> tuple[Batch | None, Position]:
        """End of the epoch: the short tail as a batch with ``'keep'`` (else None), and the end
        position, which holds the tail with ``'rollover'`` (it opens the next epoch's first
        batch; see :meth:`Position.next_epoch`)."""
        carry, self._carry, self._carried = tuple(self._carry), [], 0
        end = Position(self.epoch, *self._resume, carry if self.last_batch == "rollover" else (),
                       True, self.taken)
        if not carry or self.last_batch != "keep":
            return None, end
        return Batch(carry, end), end


# -- mixing shards: the samples of k consecutive shards in one shuffled unit -----------------------
@dataclass(frozen=True)
class MixedUnit:
    """One unit of a shuffle window: which shard and row each of its samples comes from.

    ``shards[i]`` and ``rows[i]`` are the shard (its position in the epoch) and the row (in
    that shard's own shuffled order) of the unit's ``i``-th sample; ``done`` lists the shards
    no later unit reads; ``lengths`` the samples of shards ``index - window + 1 .. index``
    the unit was built from (0: none, skipped or past the epoch's last), which decide it
    (:func:`mixed_order`): what a state records for an elastic resume.
    """

    index: int
    shards: np.ndarray
    rows: np.ndarray
    done: tuple[int, ...]
    lengths: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.shards)


class WindowMixer:
    """Mixes the samples of ``window`` consecutive shards, deterministically from (seed, epoch).

    A sliding window: shard ``j``'s samples (in its own shuffled order) are dealt into
    ``window`` slices, and unit ``t`` holds slice ``t - j`` of each shard ``j`` in
    ``t - window + 1 .. t``, shuffled together. So every unit (and every batch) mixes up to
    ``window`` shards, a shard is spread over ``window`` consecutive units, and unit ``t`` can
    be built as soon as shard ``t`` is in: no waiting for a whole window. The epoch has
    ``shards + window - 1`` units; the first and last ``window - 1`` mix fewer shards.

    Shards are added in increasing position; a position that is skipped (a shard that failed)
    counts as an empty shard. Resuming at unit ``t`` starts the mixer there: it needs shards
    from ``t - window + 1`` on (:meth:`first_shard`).

    Example:
        >>> mixer = WindowMixer(2, seed=0, epoch=0)
        >>> [len(u) for u in mixer.add(0, 4)], [len(u) for u in mixer.add(1, 4)]
        ([2], [4])
        >>> [len(u) for u in mixer.finish()]
        [2]
    """

    SALT = 0x317D

    def __init__(self, window: int, seed: int, epoch: int, first_unit: int = 0) -> None:
        _validate.integer("shuffle_window", window, minimum=1)
        self.window, self.seed, self.epoch = window, seed, epoch
        self.first_unit = first_unit
        self._next = self.first_shard(first_unit, window)
        self._lengths: dict[int, int] = {}

    @staticmethod
    def first_shard(unit: int, window: int) -> int:
        """The first shard a mixer resumed at ``unit`` needs."""
        return max(0, unit - window + 1)

    def add(self, shard: int, length: int) -> list[MixedUnit]:
        """Shard ``shard`` holds ``length`` samples: the units it completes (positions skipped
        since the last shard count as empty shards)."""
        if shard < self._next:
            raise ValueError(f"shard {shard} added after shard {self._next - 1}: shards must "
                             "come in increasing order")
        units = []
        while self._next <= shard:
            j = self._next
            self._lengths[j] = length if j == shard else 0
            self._next += 1
            if j >= self.first_unit:
                units.append(self._unit(j))
        return units

    def finish(self) -> list[MixedUnit]:
        """The units after the epoch's last shard (they hold the rest of its last shards)."""
        end = self._next + self.window - 1
        units = [self._unit(t) for t in range(max(self._next, self.first_unit), end)]
        self._next = end
        return units

    def _unit(self, t: int) -> MixedUnit:
        k = self.window
        lengths = tuple(self._lengths.get(j, 0) for j in range(t - k + 1, t + 1))
        shard_of, row_of = mixed_order(k, self.seed, self.epoch, t, lengths)
        done = t - k + 1
        if done >= 0:
            self._lengths.pop(done, None)
        return MixedUnit(t, shard_of, row_of, (done,) if done >= 0 else (), lengths)


def window_slice(length: int, window: int, part: int) -> tuple[int, int]:
    """Rows ``start, stop`` of slice ``part`` of a shard of ``length`` samples dealt into
    ``window`` slices (the first ``length % window`` one row longer)."""
    q, r = divmod(length, window)
    start = part * q + min(part, r)
    return start, start + q + (1 if part < r else 0)


def mixed_order(window: int, seed: int, epoch: int, unit: int, lengths: tuple[int, ...]
                ) -> tuple[np.ndarray, np.ndarray]:
    """Unit ``unit`` of a shuffle window: the shard (position in the epoch) and row of each of
    its samples in order, given ``lengths``, the samples of shards ``unit - window + 1 ..
    unit`` (see :class:`WindowMixer`). Only these decide it, so an elastic resume rebuilds a
    unit a rank read from the lengths its state records."""
    shards, rows = [], []
    for j in range(max(0, unit - window + 1), unit + 1):
        start, stop = window_slice(lengths[j - unit + window - 1], window, unit - j)
        shards.append(np.full(stop - start, j, dtype=np.int64))
        rows.append(np.arange(start, stop, dtype=np.int64))
    shard_of = np.concatenate(shards) if shards else np.zeros(0, np.int64)
    row_of = np.concatenate(rows) if rows else np.zeros(0, np.int64)
    if len(shard_of) > 1:
        order = seeded_rng(seed, epoch, unit, WindowMixer.SALT).permutation(len(shard_of))
        shard_of, row_of = shard_of[order], row_of[order]
    return shard_of, row_of
