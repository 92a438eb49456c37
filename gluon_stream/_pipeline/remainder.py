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

The pieces are cut from a merged state by :func:`~gluon_stream._pipeline.resolve.resolve`,
with :mod:`~gluon_stream._pipeline.quotas` (``samples_per_epoch``) and
:mod:`~gluon_stream._pipeline.window_cuts` (a shuffle window).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional, Sequence

import numpy as np

from ..errors import InvalidState
from .batching import mixed_order
from .keys import part_endless
from .sizes import part_count, part_rows

__all__ = ["Drawn", "Mixed", "Piece", "Remainder", "Take", "cached_mixed_order",
           "remainder_deal"]


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


def remainder_deal(deal: str, before: int | None = None) -> str:
    """How the ranks split a piece of a remainder with ``before`` rows left in the pieces
    before it (None: not known alike on every rank): their strides, going on from piece to
    piece where ``before`` is known (see :func:`~gluon_stream._pipeline.sizes.stride_of`), so
    that with ``'balanced'`` (even_batches=True) the ranks' counts differ by one at most and
    the rest of the epoch leaves out at most a batch a rank; cut to equal counts where the
    loader's deal is and ``before`` is not known (``'samples'``, and ``'balanced'`` with sizes
    unknown)."""
    if deal == "samples" or (deal == "balanced" and before is None):
        return "samples"
    return "strides"


@functools.lru_cache(maxsize=8)
def cached_mixed_order(window: int, seed: int, epoch: int, unit: int,
                       lengths: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
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
        shards, _ = cached_mixed_order(window, seed, epoch, unit, lengths)
        held = int(np.count_nonzero(shards[start:stop] == shard))
        return cls(window, seed, epoch, unit, lengths, shard, start, stop, held)

    def rows(self) -> np.ndarray:
        """The shard's rows (in its own order, as the old rank read it) among the positions,
        in the unit's order."""
        shards, rows = cached_mixed_order(self.window, self.seed, self.epoch, self.unit,
                                          self.lengths)
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
        return part_rows(self.pieces[index].rows(order), parts, part,
                         remainder_deal(deal, before), before)

    def share(self, index: int, full: int, parts: int, part: int, deal: str,
              before: int | None = None) -> int:
        """How many rows part ``part`` of ``parts`` reads of piece ``index`` of a shard of
        ``full`` rows."""
        return part_count(self.pieces[index].count(full), parts, part,
                          remainder_deal(deal, before), before)

    def counts(self, fulls: Sequence[int | None]) -> list[int | None]:
        """The rows left in the pieces before each piece, given the shards' sizes (None from
        the first unknown size on)."""
        out: list[int | None] = []
        total: int | None = 0
        for piece, full in zip(self.pieces, fulls):
            out.append(total)
            total = None if total is None or full is None else total + piece.count(full)
        return out
