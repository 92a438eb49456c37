"""``samples_per_epoch``: what is left of an old rank's epoch, walked in its stream of samples.

An old rank that read its own stream (not an earlier remainder) leaves its carried samples,
then its stream from its position for the rest of its epoch's ``samples_per_epoch``: a
:class:`PartStream` of the old job's deal, walked with the shards' sizes (:class:`Quotas`). The
same walk says where a fresh job's epoch starts in a new rank's stream
(:mod:`~gluon_stream._stages.epoch`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

from ..errors import InvalidState
from .batching import Position, window_slice
from .keys import EMPTY_PASSES, Drawn, Mixed, Take, part_count, stride_of, stride_turn
from .state import check_rank_keys

__all__ = ["PartStream", "Quotas", "Stretch", "endless_drawn", "unit_size"]

#: ``keys_of(epoch, parts, part, deal)``: a part's shard order in an epoch (the loader's deal).
KeysOf = Callable[[int, int, int, str], Sequence[Any]]
#: ``size_of(key, epoch)``: a shard's samples after the transform, before the parts take theirs
#: (known ahead, or counted by producing it: ``ShardStream.counted_size``).
SizeOf = Callable[[Any, int], int]

_GONE = object()  # past a pass's keys


@dataclass(frozen=True)
class Stretch:
    """Rows ``start .. stop`` of a part's rows of the shard ``key`` at position ``unit`` of
    pass ``epoch`` over the keys (``full``: the shard's samples); with a shuffle window,
    positions ``start .. stop`` of mixed unit ``unit`` (``lengths``: the part's samples of
    each shard of its window; ``key``: its newest shard's, None past the keys)."""

    epoch: int
    unit: int
    key: Any
    start: int
    stop: int
    full: int = 0
    lengths: tuple[int, ...] = ()


def unit_size(window: int, unit: int, lengths: Sequence[int]) -> int:
    """Samples of mixed unit ``unit`` of a window of ``window`` shards holding ``lengths``:
    slice ``unit - j`` of each shard ``j`` of the window (:func:`mixed_order`)."""
    first = unit - window + 1
    return sum(b - a for j in range(max(0, first), unit + 1)
               for a, b in [window_slice(lengths[j - first], window, unit - j)])


class PartStream:
    """``samples_per_epoch``: part ``part`` of ``parts``' stream of samples as a job of
    ``parts`` ranks deals it (``deal``): its shards of pass 0 over the keys, then of pass 1, ...
    (``keys_of``), or of the one pass of an endless iterator (``drawn``), each shard's rows
    for the part counted from its size (``size_of``). An elastic resume walks it: what is left
    of an old rank's epoch, and where a fresh job's epoch starts in a new rank's stream."""

    def __init__(self, parts: int, part: int, deal: str, keys_of: KeysOf, size_of: SizeOf,
                 drawn: Drawn | None = None, window: int = 1) -> None:
        self.parts, self.part, self.deal = parts, part, deal
        self._keys_of, self._size_of, self._drawn = keys_of, size_of, drawn
        self.window = window  # shuffle_window: the stream is each pass's mixed units
        self._lists: dict[int, list] = {}

    def keys(self, epoch: int) -> list | None:
        """The part's key list of pass ``epoch`` (None: an endless iterator's)."""
        if self._drawn is not None:
            return None
        if epoch not in self._lists:
            self._lists[epoch] = list(self._keys_of(epoch, self.parts, self.part, self.deal))
        return self._lists[epoch]

    def key(self, epoch: int, unit: int) -> Any:
        """The key at position ``unit`` of pass ``epoch`` (``_GONE`` past the pass's keys)."""
        keys = self.keys(epoch)
        if keys is not None:
            return keys[unit] if unit < len(keys) else _GONE
        assert self._drawn is not None
        if epoch:  # an endless iterator is one pass
            return _GONE
        dealt = self.deal == "shards" and self.parts > 1  # every parts-th key (part_endless)
        index = unit * self.parts + self.part if dealt else unit
        drawn = self._drawn.upto(index + 1)
        return drawn[index] if index < len(drawn) else _GONE

    def rows(self, epoch: int, unit: int, key: Any) -> tuple[int, int]:
        """(the shard's samples, the part's rows of them) at position ``unit`` of ``epoch``."""
        full = self._size_of(key, epoch)
        turn = stride_turn(self.deal, epoch, unit, None)
        return full, part_count(full, self.parts, self.part, self.deal, turn)

    def lengths(self, epoch: int, unit: int) -> tuple[int, ...] | None:
        """A shuffle window's mixed unit ``unit`` of pass ``epoch``: the part's samples of each
        shard of its window (0 before the first, past the last); None past the pass's units."""
        first = unit - self.window + 1
        if first >= 0 and self.key(epoch, first) is _GONE:
            return None
        keys = [self.key(epoch, j) if j >= 0 else _GONE for j in range(first, unit + 1)]
        return tuple(0 if key is _GONE else self.rows(epoch, first + i, key)[1]
                     for i, key in enumerate(keys))

    def take(self, epoch: int, unit: int, start: int, stop: int | None,
             expect: int | None = None, mixed: Mixed | None = None) -> Take:
        """Rows ``start .. stop`` of the part's rows of the shard at ``unit`` of ``epoch``
        (``expect``, ``mixed``: see :class:`Take`)."""
        turn = stride_turn(self.deal, epoch, unit, None)
        if turn is None:
            return Take(None, self.parts, self.part, self.deal, start, stop, expect, mixed)
        return Take(None, self.parts, stride_of(self.part, self.parts, self.deal, turn),
                    "strides", start, stop, expect, mixed)  # its stride, as its position says

    def at(self, epoch: int, unit: int) -> Stretch | None:
        """The whole of what the part reads at ``unit`` of ``epoch`` (a shard, or a window's
        mixed unit), as a stretch; None past the pass."""
        if self.window == 1:
            key = self.key(epoch, unit)
            if key is _GONE:
                return None
            full, rows = self.rows(epoch, unit, key)
            return Stretch(epoch, unit, key, 0, rows, full)
        lengths = self.lengths(epoch, unit)
        if lengths is None:
            return None
        key = self.key(epoch, unit)
        return Stretch(epoch, unit, None if key is _GONE else key, 0,
                       unit_size(self.window, unit, lengths), lengths=lengths)

    def walk(self, epoch: int, unit: int, offset: int, count: int
             ) -> tuple[list[Stretch], Position]:
        """The next ``count`` samples from row ``offset`` of the shard at ``unit`` of pass
        ``epoch``: the stretches of shards that hold them, and the position after them. Fewer
        where the stream ends: an endless iterator that ends, or :data:`EMPTY_PASSES` passes
        in a row without a sample (an epoch reading it would stop there too)."""
        out: list[Stretch] = []
        empty, read, whole = 0, 0, not unit and not offset
        while count > 0:
            at = self.at(epoch, unit)
            if at is None:  # the pass is over: the next one (a key list's)
                empty = empty + 1 if whole and not read else 0
                if self._drawn is not None or empty >= EMPTY_PASSES:
                    break
                epoch, unit, offset, read, whole = epoch + 1, 0, 0, 0, True
                continue
            n = max(0, min(at.stop - offset, count))
            if n:
                out.append(dataclasses.replace(at, start=offset, stop=offset + n))
                count, read = count - n, read + n
            if offset + n >= at.stop:
                unit, offset = unit + 1, 0
            else:
                offset += n
        return out, Position(epoch, unit, offset)


class Quotas:
    """``samples_per_epoch``: what is left of the epoch of each old rank that read its own
    stream (not an earlier remainder): the samples it carried, then its stream from its
    position for the rest of its epoch's ``samples_per_epoch`` (a :class:`PartStream` of the
    old job's deal, walked with the shards' sizes; ``full_of`` gets them)."""

    def __init__(self, spec: Mapping[str, Any], keys_of: KeysOf,
                 endless_of: Callable[[int], Iterator[Any]] | None, size_of: SizeOf | None,
                 full_of: dict[tuple, int]) -> None:
        if size_of is None:
            raise InvalidState("field 'samples_per_epoch': the remainder of an epoch of "
                               "samples_per_epoch is cut by the shards' sizes; none were given")
        self.spec, self.full_of = spec, full_of
        sizes: dict[tuple, int] = {}

        def sized(key: Any, epoch: int) -> int:  # each shard counted once, for every rank
            if (epoch, key) not in sizes:
                sizes[(epoch, key)] = size_of(key, epoch)
            return sizes[(epoch, key)]

        drawn = endless_drawn(endless_of) if spec.get("endless") else None
        self.window, self.seed = int(spec.get("window", 1)), spec.get("seed", 0)
        self.streams = [PartStream(spec["parts"], rank, spec["deal"], keys_of, sized, drawn,
                                   self.window) for rank in range(spec["parts"])]

    def takes(self, saved: Mapping[str, Any], rank: int) -> list[tuple[tuple, Take]]:
        """The rank's takes in order: its carry, then the rest of its quota."""
        stream, out = self.streams[rank], []
        for e, u, a, b in saved["carry"]:
            out += self._unit_takes(stream, rank, e, u, a, b) if self.window > 1 \
                else [self._take(stream, rank, e, u, a, b)]
        if saved["end"]:
            return out
        epoch, unit, offset = saved["pass"], saved["unit"], saved["offset"]
        keys = stream.keys(epoch)
        if keys is not None:
            check_rank_keys(saved, keys, epoch, rank)
        at = stream.at(epoch, unit)
        if at is not None and offset > at.stop:
            raise InvalidState(f"the state of rank {rank} stands at row {offset} of "
                               f"{'mixed unit' if self.window > 1 else 'shard'} {unit} of "
                               f"pass {epoch}, which holds {at.stop} for it now: the data "
                               "changed since it was saved")
        left = self.spec["samples_per_epoch"] - saved["taken"]
        for s in stream.walk(epoch, unit, offset, left)[0]:
            if self.window > 1:
                out += self._unit_takes(stream, rank, s.epoch, s.unit, s.start, s.stop,
                                        s.lengths)
                continue
            self.full_of[(s.epoch, s.key)] = s.full
            out.append(((s.epoch, s.key), stream.take(s.epoch, s.unit, s.start, s.stop)))
        return _joined(out) if self.window > 1 else out

    def _unit_takes(self, stream: PartStream, rank: int, epoch: int, unit: int, start: int,
                    stop: int, lengths: tuple[int, ...] | None = None
                    ) -> list[tuple[tuple, Take]]:
        """A shuffle window's positions ``start .. stop`` of mixed unit ``unit``: each of its
        shards' rows among them (a whole unit: the shard's slice of it), expecting the
        lengths counted now of each shard, which a shard read later must still give."""
        lengths = lengths if lengths is not None else stream.lengths(epoch, unit)
        size = -1 if lengths is None else unit_size(self.window, unit, lengths)
        if lengths is None or stop > size:
            raise InvalidState(f"the state of rank {rank} refers to samples {start}..{stop} of "
                               f"mixed unit {unit} of pass {epoch}, which its shards do not "
                               "hold now: the keys or the data changed since it was saved")
        whole = not start and stop == size
        first, out = unit - self.window + 1, []
        for j in range(max(0, first), unit + 1):
            n = lengths[j - first]
            if not n:
                continue
            key = stream.key(epoch, j)
            self.full_of[(epoch, key)] = stream.rows(epoch, j, key)[0]
            if whole:
                a, b = window_slice(n, self.window, unit - j)
                if b > a:
                    out.append(((epoch, key), stream.take(epoch, j, a, b, n)))
                continue
            mixed = Mixed.of(self.window, self.seed, epoch, unit, lengths, j, start, stop)
            if mixed.held:
                out.append(((epoch, key), stream.take(epoch, j, 0, None, n, mixed)))
        return out

    def _take(self, stream: PartStream, rank: int, epoch: int, unit: int, start: int,
              stop: int) -> tuple[tuple, Take]:
        """A carried segment's take: rows ``start .. stop`` of the shard at ``unit``."""
        key = stream.key(epoch, unit)
        if key is _GONE:
            raise InvalidState(f"the state of rank {rank} carries samples of shard {unit} of "
                               f"pass {epoch}, which has no such shard now: the keys changed "
                               "since it was saved")
        self.full_of[(epoch, key)] = stream.rows(epoch, unit, key)[0]
        return (epoch, key), stream.take(epoch, unit, start, stop)


def _joined(takes: list[tuple[tuple, Take]]) -> list[tuple[tuple, Take]]:
    """The takes, a shard's slices of consecutive whole units joined into one take (the
    slices of one shard follow each other): fewer takes to cut at every read."""
    out: list[tuple[tuple, Take]] = []
    last: dict[tuple, int] = {}  # a shard -> the index of its last plain take in ``out``
    for ident, take in takes:
        at = last.get(ident)
        if take.mixed is None and at is not None:
            before = out[at][1]
            if before.mixed is None and before.stop == take.start and \
                    (before.parts, before.part, before.deal, before.expect) == \
                    (take.parts, take.part, take.deal, take.expect):
                out[at] = (ident, dataclasses.replace(before, stop=take.stop))
                continue
        last[ident] = len(out)
        out.append((ident, take))
    return out


def endless_drawn(endless_of: Callable[[int], Iterator[Any]] | None) -> Drawn:
    """``samples_per_epoch`` with endless keys: the iterator (one pass), drawn anew from its
    beginning. An iterator given itself (not ``keys(epoch)`` building a new one each call)
    gives its keys once, and a resume on another world size must draw them again."""
    if endless_of is None:
        raise InvalidState("the state was saved reading endless keys: this loader's keys "
                           "are a list (field 'keys'); build it with the same keys")
    keys = endless_of(0)
    if endless_of(0) is keys:
        raise InvalidState(
            "field 'keys': with samples_per_epoch, a resume on another world size draws the "
            "key iterator again from its beginning (what each old rank has left, where a "
            "fresh job's epoch starts); an iterator given itself gives its keys once: give "
            "keys=fn(pass) that builds the iterator anew, or resume on the same world size")
    return Drawn(0, keys)
