"""The rest of an interrupted epoch, as pieces of shards: what the ranks of a resized job read.

An elastic resume (:func:`gluon_stream.merge_states`) joins the positions the old ranks reached
in an epoch. What none of them trained yet is, per old rank: the samples it carried, the rest
of the shard it was in, and the shards after it in its deal. Each becomes a :class:`Take` of a
shard: rows ``start .. stop`` of the old rank's rows of it, dealt as the old job dealt them
(:func:`~gluon_stream._pipeline.sizes.part_rows`). The takes of one shard form a
:class:`Piece`; the pieces, in a canonical order, form the :class:`Remainder`, which every new
rank reads whole, each taking its stride of every piece's rows (the even rules of
``deal='strides'``/``'samples'``), so no size needs to be known and no rank needs another's.

Nothing here needs a shard's rows until it is produced: a take knows how to cut a shard's row
order of any length. A remainder can itself be interrupted and merged again: a take's source is
then an earlier remainder's piece (``parent``), resolved the same way.

With a shuffle window (``shuffle_window = k > 1``) an old rank that stands in mixed unit ``t``
has read part of up to ``k`` shards: of each shard ``j`` in ``t - k + 1 .. t``, the rows of
slice ``t - j`` the unit's first positions held (:class:`~gluon_stream._pipeline.batching.
WindowMixer`). Which rows those are depends on the lengths of all of the unit's shards, so the
rank's state records them (``unit_lengths``); a take of such a shard is then "the rows of
positions ``start .. stop`` of that unit which are this shard's" (:class:`Mixed`), and its later
slices a plain take from where they start. Both expect the shard to hold the recorded number
of rows for the old rank, and refuse it (InvalidState naming the shard) if it does not. The
remainder's pieces are then read as any epoch's shards are, mixed by the window again.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import numpy as np

from .batching import Position, mixed_order, window_slice
from .keys import EMPTY_PASSES, part_endless
from .sizes import part_count, part_rows, stride_of, stride_turn
from .state import check_rank_keys, unit_lengths
from ..errors import InvalidState

__all__ = ["Drawn", "Mixed", "PartStream", "Piece", "Quotas", "Remainder", "Stretch", "Take",
           "WindowCuts", "remainder_deal", "unit_size"]

#: ``keys_of(epoch, parts, part, deal)``: a part's shard order in an epoch (the loader's deal).
KeysOf = Callable[[int, int, int, str], Sequence[Any]]
#: ``size_of(key, epoch)``: a shard's samples after the transform, before the parts take theirs
#: (known ahead, or counted by producing it: ``ShardStream.counted_size``).
SizeOf = Callable[[Any, int], int]


class Drawn:
    """An endless iterator's keys of one epoch, drawn in order as far as a merge needs them
    (every rank of the old job drew the same iterator and took its part); the keys after them
    are the remainder's tail, read from the same iterator."""

    def __init__(self, epoch: int, keys: Iterator[Any]) -> None:
        self.epoch = epoch
        self.keys: list = []
        self.rest = keys

    def upto_end(self) -> int:
        """Draw every key (the iterator ended in the saved job); how many there are."""
        self.keys.extend(self.rest)
        return len(self.keys)

    def upto(self, count: int) -> list:
        """The first ``count`` keys (fewer: the iterator ended)."""
        while len(self.keys) < count:
            key = next(self.rest, _GONE)
            if key is _GONE:
                break
            self.keys.append(key)
        return self.keys[:count]


_GONE = object()


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


def remainder_deal(deal: str) -> str:
    """How the ranks split every piece of a remainder: their strides, cut to equal counts
    where the loader's deal is (``'samples'``, and ``'balanced'``: even_batches=True without
    sizes)."""
    return "samples" if deal in ("samples", "balanced") else "strides"


@functools.lru_cache(maxsize=8)
def _mixed(window: int, seed: int, epoch: int, unit: int, lengths: tuple[int, ...]
           ) -> tuple[np.ndarray, np.ndarray]:
    """:func:`~gluon_stream._pipeline.batching.mixed_order`, kept a while for the takes of one
    unit (one per shard of it, made in a row); a few units only: each is as long as a shard."""
    shards, rows = mixed_order(window, seed, epoch, unit, lengths)
    shards.setflags(write=False)
    rows.setflags(write=False)
    return shards, rows


@dataclass(frozen=True)
class Mixed:
    """Shard ``shard``'s samples among positions ``start .. stop`` of mixed unit ``unit`` of
    epoch ``epoch`` (a shuffle window of ``window`` shards, ``seed``), built from ``lengths``,
    the samples of the unit's shards as the old rank read them; ``held``: how many there
    are (counted once: sizes and batch counts ask often)."""

    window: int
    seed: int
    epoch: int
    unit: int
    lengths: tuple[int, ...]
    shard: int
    start: int
    stop: int | None
    held: int

    @classmethod
    def of(cls, window: int, seed: int, epoch: int, unit: int, lengths: tuple[int, ...],
           shard: int, start: int, stop: int | None) -> "Mixed":
        shards, _ = _mixed(window, seed, epoch, unit, lengths)
        held = int(np.count_nonzero(shards[start:stop] == shard))
        return cls(window, seed, epoch, unit, lengths, shard, start, stop, held)

    def rows(self) -> np.ndarray:
        """The shard's rows (in its own order, as the old rank read it) among the positions,
        in the unit's order."""
        shards, rows = _mixed(self.window, self.seed, self.epoch, self.unit, self.lengths)
        return rows[self.start:self.stop][shards[self.start:self.stop] == self.shard]


@dataclass(frozen=True)
class Take:
    """Rows ``start .. stop`` (None: to the end) of what part ``part`` of ``parts`` read of a
    source dealt by ``deal``: the shard's own row order, or an earlier remainder's piece.

    ``mixed``: the take is the rows of a mixed unit's positions that are its shard's (in place
    of ``start .. stop``). ``expect``: the rows the part read of the source, as its state
    recorded them (a shuffle window's); a source that gives another count now is refused.
    """

    parent: Optional["Piece"]
    parts: int
    part: int
    deal: str
    start: int
    stop: int | None
    expect: int | None = None
    mixed: Mixed | None = None

    def rows(self, order: np.ndarray, name: str = "the shard") -> np.ndarray:
        source = order if self.parent is None else self.parent.rows(order, name)
        read = part_rows(source, self.parts, self.part, self.deal)
        if self.expect is not None and len(read) != self.expect:
            raise InvalidState(
                f"field 'unit_lengths': part {self.part} of {self.parts} read {self.expect} "
                f"row(s) of {name} (its state records them for a shuffle window's unit), which "
                f"gives it {len(read)} now: the shard changed since the state was saved; "
                "resuming would repeat or skip samples. Resume with the data it was saved with")
        if self.mixed is not None:
            return read[self.mixed.rows()]
        return read[self.start:self.stop]

    def count(self, full: int) -> int:
        """How many rows the take holds of a shard of ``full`` rows (a recorded count, where
        the state holds one: the rows, once read, are checked against it)."""
        if self.mixed is not None:
            return self.mixed.held
        if self.expect is not None:
            return len(range(self.expect)[self.start:self.stop])
        n = full if self.parent is None else self.parent.count(full)
        return len(range(n)[:part_count(n, self.parts, self.part, self.deal)]
                   [self.start:self.stop])


@dataclass(frozen=True)
class Piece:
    """What is left of one shard (of ``epoch``, ``key``): its takes' rows, in order."""

    epoch: int
    key: Any
    takes: tuple[Take, ...]

    def rows(self, order: np.ndarray, name: str | None = None) -> np.ndarray:
        """The rows left, given the shard's own row order (all its rows)."""
        name = name or f"shard {self.key!r} of epoch {self.epoch}"
        return np.concatenate([t.rows(order, name) for t in self.takes])

    def count(self, full: int) -> int:
        """How many rows are left of a shard of ``full`` rows."""
        return sum(t.count(full) for t in self.takes)


@dataclass(frozen=True)
class Remainder:
    """The rest of epoch ``epoch``: its pieces in order, read by every rank (``spec``: what
    the merged state holds, saved again in the states taken while it is read)."""

    epoch: int
    pieces: tuple[Piece, ...]
    spec: Mapping[str, Any]
    #: endless keys: the iterator's keys after those the pieces came from (from position
    #: ``tail_start``), read after the pieces as a fresh job of the new size deals them
    tail: Optional[Drawn] = None
    tail_start: int = 0
    #: samples_per_epoch: each piece's shard's samples, counted at the merge (every rank
    #: alike): the pieces are the epoch, read as one pass, and the next epoch starts where a
    #: fresh job of the new size starts it (None: the keys' epochs, sizes as the stream knows)
    sizes: Optional[tuple[int, ...]] = None

    @property
    def fixed(self) -> bool:
        """Whether it is the rest of an epoch of ``samples_per_epoch`` samples."""
        return self.sizes is not None

    @property
    def keys(self) -> list:
        return [p.key for p in self.pieces]

    def is_piece(self, index: int) -> bool:
        """Whether position ``index`` of the remainder's pass is a piece (not a tail key)."""
        return 0 <= index < len(self.pieces)

    def tail_keys(self, parts: int, part: int, deal: str) -> Iterator[Any]:
        """Part ``part`` of ``parts``' keys of the tail (none without one)."""
        return part_endless(self.tail.rest, parts, part, deal) if self.tail else iter(())

    def rows(self, index: int, order: np.ndarray, parts: int, part: int, deal: str,
             before: int | None = None) -> np.ndarray:
        """The rows part ``part`` of ``parts`` reads of piece ``index`` (``order``: the
        shard's own row order; ``before``: the rows left in the pieces before it, where every
        rank knows them alike; see :func:`~gluon_stream._pipeline.sizes.stride_of`)."""
        return part_rows(self.pieces[index].rows(order), parts, part, remainder_deal(deal),
                         before)

    def share(self, index: int, full: int, parts: int, part: int, deal: str,
              before: int | None = None) -> int:
        """How many rows part ``part`` of ``parts`` reads of piece ``index`` of a shard of
        ``full`` rows."""
        return part_count(self.pieces[index].count(full), parts, part, remainder_deal(deal),
                          before)

    def counts(self, fulls: Sequence[int | None]) -> list[int | None]:
        """The rows left in the pieces before each piece, given the shards' sizes (None from
        the first unknown size on)."""
        out: list[int | None] = []
        total: int | None = 0
        for piece, full in zip(self.pieces, fulls):
            out.append(total)
            total = None if total is None or full is None else total + piece.count(full)
        return out


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
        size = len(_mixed(self.window, self.seed, e, unit, lengths)[0])
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
