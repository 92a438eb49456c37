"""A shuffle window's cuts: what is left of the shards an old rank read, mixed, in a unit.

With a shuffle window (``shuffle_window = k > 1``) an old rank that stands in mixed unit ``t``
has read part of up to ``k`` shards: of each shard ``j`` in ``t - k + 1 .. t``, the rows of
slice ``t - j`` the unit's first positions held (:class:`~gluon_stream._stages.batching.
WindowMixer`). Which rows those are depends on the lengths of all of the unit's shards, so the
rank's state records them (``unit_lengths``); a take of such a shard is then "the rows of
positions ``start .. stop`` of that unit which are this shard's"
(:class:`~gluon_stream._stages.keys.Mixed`), and its later slices a plain take from where
they start. Both expect the shard to hold the recorded number
of rows for the old rank, and refuse it (InvalidState naming the shard) if it does not. The
remainder's pieces are then read as any epoch's shards are, mixed by the window again.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

from ..errors import InvalidState
from .batching import Position, window_slice
from .keys import Mixed, Take, cached_mixed_order
from .state import unit_lengths

__all__ = ["WindowCuts"]


class WindowCuts:
    """What is left of the shards an old rank read with a shuffle window of ``window``: the
    rest of the mixed units its position and carry refer to, shard by shard, cut by the
    lengths its state records (``unit_lengths``), then its shards after them, whole."""

    def __init__(self, saved: Mapping[str, Any], rank: int, epoch: int, window: int,
                 seed: int, units: Callable[[int, int], list],
                 take: Callable[..., tuple[tuple, Take]]) -> None:
        self.saved, self.rank, self.epoch, self.window, self.seed = (saved, rank, epoch,
                                                                     window, seed)
        self.units, self.take = units, take
        self.lengths = unit_lengths(saved.get("unit_lengths", []), window, epoch)

    def takes(self) -> list[tuple[tuple, Take]]:
        """The rank's takes in order: its carry, the rest of its unit's shards, the shards
        after them."""
        saved, epoch = self.saved, self.epoch
        out = [t for e, u, a, b in saved["carry"] for t in self._positions(e, u, a, b)]
        if saved["end"]:
            return out
        unit, offset = saved["unit"], saved["offset"]
        count = len(self.units(epoch, self.rank))
        if unit > count + self.window - 1:
            raise InvalidState(f"the state of rank {self.rank} stands at mixed unit {unit} of "
                               f"epoch {epoch}, which has {count + self.window - 1}: the keys "
                               "changed since it was saved")
        read = Position(epoch, unit, offset).last_read
        if read >= 0:
            if offset:
                out += self._positions(epoch, read, offset, None)
            out += self._later(epoch, read)
        return out + [self.take(epoch, j, self.rank, 0, None)
                      for j in range(max(read + 1, 0), count)]

    def _shards(self, e: int, unit: int) -> tuple[tuple[int, ...], range]:
        """The recorded lengths of mixed unit ``unit`` of epoch ``e``, and the positions of its
        shards that exist."""
        rank, window = self.rank, self.window
        if (e, unit) not in self.lengths:
            raise InvalidState(
                f"field 'unit_lengths': the state of rank {rank} does not record the lengths of "
                f"the shards of mixed unit {unit} of epoch {e}, which it read part of (saved by "
                "an older gluon_stream?): save it again with this one, or resume on the same "
                "number of ranks")
        lengths = self.lengths[(e, unit)]
        count, first = len(self.units(e, rank)), unit - window + 1
        if unit >= count + window - 1 or any(lengths[j - first] for j in
                                             range(max(count, first), unit + 1)):
            raise InvalidState(
                f"field 'unit_lengths': the state of rank {rank} records samples of mixed unit "
                f"{unit} of epoch {e} in shards past the {count} of its keys now: the keys "
                "changed since it was saved")
        return lengths, range(max(0, first), min(unit + 1, count))

    def _positions(self, e: int, unit: int, start: int, stop: int | None) -> list:
        """Takes of positions ``start .. stop`` of mixed unit ``unit`` of epoch ``e``: the
        rows of each of its shards among them."""
        lengths, shards = self._shards(e, unit)
        first = unit - self.window + 1
        size = len(cached_mixed_order(self.window, self.seed, e, unit, lengths)[0])
        if start > size or (stop is not None and stop > size):
            raise InvalidState(
                f"the state of rank {self.rank} refers to samples {start}..{stop} of mixed unit "
                f"{unit} of epoch {e}, whose recorded shards hold {size} (field "
                "'unit_lengths'): the state does not match itself")
        out = []
        for j in shards:
            mixed = Mixed.of(self.window, self.seed, e, unit, lengths, j, start, stop)
            if mixed.held:
                out.append(self.take(e, j, self.rank, 0, None, lengths[j - first], mixed))
        return out

    def _later(self, e: int, unit: int) -> list:
        """Takes of the slices after mixed unit ``unit``'s of each of its shards (the units
        after it read them)."""
        lengths, shards = self._shards(e, unit)
        first = unit - self.window + 1
        out = []
        for j in shards:
            part, n = unit - j + 1, lengths[j - first]
            begin = window_slice(n, self.window, part)[0] if part < self.window else n
            if begin < n:
                out.append(self.take(e, j, self.rank, begin, None, n))
        return out
