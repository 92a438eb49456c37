"""The keys stage: which keys this part reads in each pass, in which order, and which rows of
each shard it takes.

A :class:`KeyDealer` holds what decides the deal (the source's keys, the seed, the shuffle,
the parts and the deal mode, an elastic resume's remainder, an endless iterator's kept keys),
and nothing of production: the producers ask it for a pass's keys and a shard's rows. A pass
draws its keys through a :class:`KeyCursor`: in order, each with its position, some early
(generations ahead look past the prefetch window), a failing key iterator kept to be raised
after the shards drawn before it.

In this module, in order: an epoch's keys dealt to the parts (:func:`part_keys`,
:func:`part_endless`, :class:`KeyTape`); the deal (:class:`KeyDealer`, :class:`KeyCursor`);
the rest of an interrupted epoch as pieces of shards, what the ranks of a resized job read
(:class:`Remainder`, cut by :func:`~gluon_stream._stages.resolve.resolve`); what the deal
knows of shard sizes without producing them (:class:`ShardSizes`, :func:`part_rows`, the
strides); and which part this process is (:func:`resolve_parts`: a kvstore, Horovod or the
launcher's environment). A source's own keys are :mod:`gluon_stream.sources.base`'s.
"""
from __future__ import annotations

import collections
import functools
import importlib
import itertools
import logging
import os
import threading
from dataclasses import dataclass
from typing import (
    Any,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Optional,
    Sequence,
    Union,
)

import numpy as np

from .._utils import validate as _validate
from .._utils.random import key_hash, seeded_rng
from ..errors import InvalidState, StreamError, add_note
from ..sources import Source
from .batching import mixed_order

__all__ = ["DeclaredSizes", "Drawn", "EMPTY_PASSES", "END", "KeyCursor", "KeyDealer", "KeyTape",
           "Mixed", "Piece", "Remainder", "SYNC_KVSTORES", "ShardSizes", "Take",
           "cached_mixed_order", "part_count", "part_endless", "part_keys", "part_rows",
           "remainder_deal", "resolve_parts", "stride_of", "stride_turn", "synchronous_job",
           "turn_of"]

#: samples_per_epoch: passes over the keys in a row that give a part no sample, at most (then
#: the stream is empty: an error, or where an elastic resume counts a part's samples, its end)
EMPTY_PASSES = 16


def part_keys(keys: list, seed: int, epoch: int, parts: int, part: int, shuffle: bool,
              deal: str) -> list:
    """Part ``part`` of ``parts``' shard order in ``epoch`` of a finite key list: its deal of
    the shards from ``(seed, epoch)`` (``deal='shards'``), or every shard (the parts take
    strides of their samples), shuffled from ``(seed, epoch)`` with ``shuffle``."""
    if parts > 1 and keys and deal == "shards":  # deal shards to parts
        dealt = seeded_rng(seed, epoch, 0xDEA1).permutation(len(keys))
        mine = dealt[part::parts]
        return [keys[i] for i in (mine if shuffle else np.sort(mine))]
    if shuffle and keys:
        order = seeded_rng(seed, epoch, 0x5EED).permutation(len(keys))
        return [keys[i] for i in order]
    return list(keys)


def part_endless(keys: Iterable[Any], parts: int, part: int, deal: str) -> Iterator[Any]:
    """Part ``part`` of ``parts``' keys of an endless iterator: every ``parts``-th key from
    its ``part``-th when shards are dealt whole; every key when the parts take strides of every
    shard's samples (``deal='samples'``/``'strides'``)."""
    if parts > 1 and deal == "shards":
        return itertools.islice(keys, part, None, parts)
    return iter(keys)


_GONE = object()  # the iterator has no more keys


class KeyTape:
    """The keys an endless iterator gave, kept from position ``base`` on, so that a pass can
    start again at any kept position (``samples_per_epoch`` starts each epoch where the last
    one stopped) without drawing them again: an iterator gives each key once.

    A pass may start beyond the keys drawn so far: a resumed state, in a new process whose
    iterator starts from its beginning again. The keys before it are drawn then, in order, so
    position ``i`` is always the iterator's ``i``-th key (:meth:`key_at` tells which).
    """

    def __init__(self, keys: Iterable[Any]) -> None:
        self._source = iter(keys)
        self._keys: list[Any] = []
        self.base = 0
        self._lock = threading.Lock()

    def read(self, start: int) -> Iterator[Any]:
        """The keys from position ``start`` on (the kept ones, then new ones, kept too)."""
        index = start
        while True:
            with self._lock:
                key = self._at(index)
            if key is _GONE:
                return
            yield key
            index += 1

    def key_at(self, index: int) -> tuple[Any, str | None]:
        """(the key at ``index``, None), drawing up to it; or (None, why there is none)."""
        with self._lock:
            if index < self.base:
                return None, (f"its keys before position {self.base} were let go (an iterator "
                              "gives each key once)")
            key = self._at(index)
            if key is _GONE:
                return None, f"it ended after {self.base + len(self._keys)} key(s)"
            return key, None

    def kept(self, index: int) -> tuple[int, Any] | None:
        """(position, key) of the last key kept at or before ``index``, without drawing."""
        with self._lock:
            last = min(index, self.base + len(self._keys) - 1)
            return (last, self._keys[last - self.base]) if last >= self.base else None

    def _at(self, index: int) -> Any:
        """The key at ``index`` (the lock held): kept, or drawn with every key before it."""
        if index < self.base:
            raise StreamError(f"the keys before position {self.base} of the iterator "
                              f"were let go; a pass cannot start at {index}")
        while index - self.base >= len(self._keys):
            key = next(self._source, _GONE)
            if key is _GONE:
                return _GONE
            self._keys.append(key)
        return self._keys[index - self.base]

    def forget(self, before: int) -> None:
        with self._lock:
            drop = max(0, min(before - self.base, len(self._keys)))
            del self._keys[:drop]
            self.base += drop


# -- the deal: one part's keys of each pass, a shard's rows ----------------------------------------
class KeyDealer:
    """The deal of one part (``part_index`` of ``num_parts``): keys per pass, rows per shard.

    ``sizes`` is set by the stream once its :class:`~gluon_stream._stages.keys.ShardSizes`
    exists (the sizes ask the dealer for keys; the dealer asks the sizes for rows before a
    shard).
    """

    def __init__(self, source: Source, seed: int, shuffle: bool, num_parts: int,
                 part_index: int, deal: str) -> None:
        self.source = source
        self.seed = seed
        self.shuffle = shuffle
        self.num_parts, self.part_index, self.deal = num_parts, part_index, deal
        self.keep_keys = False  # keep an endless iterator's keys (samples_per_epoch restarts)
        self._tapes: dict[tuple[int, int], KeyTape] = {}
        #: an elastic resume: the rest of the interrupted epoch, read in place of its keys
        self.remainder: Remainder | None = None
        self.sizes: ShardSizes | None = None

    def dealt_keys(self, epoch: int, parts: int, part: int, deal: str,
                   seed: int | None = None) -> list:
        """Part ``part`` of ``parts``' shard order in ``epoch`` as a job of ``parts`` ranks dealt
        it (with this stream's keys and shuffle; ``seed``: another seed than the stream's)."""
        keys, finite = self.source.keys_for_epoch(epoch)
        if not finite:
            raise InvalidState("field 'keys': the state was saved reading a key list, this "
                               "loader's keys are an endless iterator (the two deal their "
                               "shards differently); build it with the same keys")
        return part_keys(list(keys), self.seed if seed is None else seed, epoch, parts, part,
                         self.shuffle, deal)

    def endless_keys(self, epoch: int) -> Iterator[Any]:
        """An endless iterator's keys of ``epoch``, every part's (an elastic resume deals
        them again); InvalidState for a key list."""
        keys, finite = self.source.keys_for_epoch(epoch)
        if finite:
            raise InvalidState("field 'keys': the state was saved reading an endless key "
                               "iterator, this loader's keys are a list; build it with the "
                               "same keys")
        return iter(keys)

    def epoch_keys(self, epoch: int, part_index: int | None = None, seed: int | None = None,
                   start: int = 0) -> tuple[Iterator[Any], bool, list | None]:
        """(keys iterator from position ``start``, finite, key list or None) of one part in this
        epoch's shard order (``seed``: with another seed than the stream's)."""
        part = self.part_index if part_index is None else part_index
        seed = self.seed if seed is None else seed
        remainder = self.remainder_of(epoch)
        if remainder is not None:  # every part reads every piece (its stride of their rows)
            pieces = remainder.keys
            if remainder.tail is None:
                return iter(pieces[start:]), True, pieces
            # endless keys: then the iterator's keys after the pieces, as this job deals them
            tail = remainder.tail_keys(self.num_parts, part, self.deal)
            tail = itertools.islice(tail, max(0, start - len(pieces)), None)
            return itertools.chain(pieces[start:], tail), False, None
        if self.keep_keys and (epoch, part) in self._tapes:
            return self._tapes[(epoch, part)].read(start), False, None
        keys, finite = self.source.keys_for_epoch(epoch)
        if not finite:
            keys = part_endless(keys, self.num_parts, part, self.deal)
            if self.keep_keys:  # a pass may start again at a later epoch's boundary
                tape = self._tapes[(epoch, part)] = KeyTape(keys)
                return tape.read(start), False, None
            return itertools.islice(keys, start, None), False, None
        keys = part_keys(list(keys), seed, epoch, self.num_parts, part, self.shuffle, self.deal)
        return iter(keys[start:]), True, keys

    def keys_between(self, epoch: int, start: int, stop: int) -> list:
        """This part's keys at positions ``start .. stop - 1`` of pass ``epoch`` (fewer where
        its keys end): a key list's, or an endless iterator's drawn again up to them, as a
        resumed pass draws them (a resumed state's mixed units name their shards so)."""
        remainder = self.remainder_of(epoch)
        if remainder is None or remainder.tail is None or stop <= len(remainder.pieces):
            return list(itertools.islice(self.epoch_keys(epoch, start=start)[0], stop - start))
        # an elastic resume's tail (the keys after its pieces): from the iterator built anew,
        # leaving the one the remainder's pass reads where it stands
        fresh = self.endless_keys(epoch)
        if fresh is remainder.tail.rest:
            raise InvalidState(
                f"field 'keys': the state holds samples of shard {stop - 1} of epoch {epoch}, a "
                "key of the endless iterator after an elastic resume's pieces, drawn again from "
                "its beginning to name it; an iterator given itself gives its keys once: give "
                "keys=fn(pass) that builds the iterator anew")
        pieces = len(remainder.pieces)
        tail = part_endless(itertools.islice(fresh, remainder.tail_start, None),
                            self.num_parts, self.part_index, self.deal)
        return remainder.keys[start:stop] + list(
            itertools.islice(tail, max(0, start - pieces), stop - pieces))

    def key_at(self, epoch: int, index: int) -> tuple[Any, str | None] | None:
        """An endless iterator's keys kept for passes that start again (``keep_keys``): this
        part's key ``index`` of pass ``epoch``, drawn up to it as a resumed pass draws them:
        ``(key, None)``, or ``(None, why there is none)``; None for a key list, or keys not kept."""
        if not self.keep_keys or self.epoch_keys(epoch)[1]:
            return None
        return self._tapes[(epoch, self.part_index)].key_at(index)

    def kept_key(self, epoch: int, index: int) -> tuple[int, Any] | None:
        """(position, key) of the last key kept at or before ``index`` for this part's pass
        ``epoch`` of an endless iterator, without drawing any; None: none kept."""
        tape = self._tapes.get((epoch, self.part_index)) if self.keep_keys else None
        return tape.kept(index) if tape is not None else None

    def forget_keys(self, epoch: int, before: int) -> None:
        """The keys of an endless iterator kept for ``epoch`` before position ``before`` are
        needed no more (no pass starts again before it)."""
        tape = self._tapes.get((epoch, self.part_index))
        if tape is not None:
            tape.forget(before)

    def remainder_of(self, epoch: int) -> Remainder | None:
        """The remainder read in place of ``epoch``'s keys (an elastic resume), if any."""
        remainder = self.remainder
        return remainder if remainder is not None and remainder.epoch == epoch else None

    def made_epoch(self, epoch: int, index: int) -> int:
        """The epoch whose shard is at position ``index`` of ``epoch`` (a remainder's pieces
        may be of the epoch before: samples it rolled over)."""
        remainder = self.remainder_of(epoch)
        return remainder.pieces[index].epoch if remainder is not None \
            and remainder.is_piece(index) else epoch

    def row_order(self, key: Any, epoch: int, length: int, index: int = -1,
                  before: int | None = None) -> np.ndarray | None:
        """The rows of a shard this part reads, in order (None: all of them, as they are);
        ``index``: its position in the epoch (a remainder's piece says which rows are left);
        ``before``: ``deal='balanced'``, the rows of the epoch's shards before it."""
        remainder, sizes = self.remainder_of(epoch), self.sizes
        assert sizes is not None  # set by the stream
        if remainder is not None and remainder.is_piece(index):  # else: an endless tail's key
            made = remainder.pieces[index].epoch
            own = self.shard_order(key, made, length)
            agreed = sizes.rows_before(epoch, index)  # else: learned, as a fresh epoch's
            learned = before if sizes.learns_rows(epoch) else None
            return remainder.rows(index, np.arange(length) if own is None else own,
                                  self.num_parts, self.part_index, self.deal,
                                  agreed if agreed is not None else learned)
        order = self.shard_order(key, epoch, length)
        if self.deal != "shards" and self.num_parts > 1:
            rows = np.arange(length) if order is None else order
            # an endless remainder's tail (keys after its pieces): as its pieces (equal
            # strides where it was merged by an older gluon_stream)
            deal = "samples" if remainder is not None and self.deal == "balanced" \
                and not sizes.learns_rows(epoch) else self.deal
            order = part_rows(rows, self.num_parts, self.part_index, deal,
                              stride_turn(deal, epoch, index, before))
        return order

    def shard_order(self, key: Any, epoch: int, length: int) -> np.ndarray | None:
        """A shard's own row order in ``epoch``, before parts take theirs (None: as it is)."""
        if self.shuffle and length > 1:
            return seeded_rng(self.seed, epoch, key_hash(key)).permutation(length)
        return None


# -- a pass's keys as it draws them ----------------------------------------------------------------
#: no key is left (or the keys' iterator failed: see :attr:`KeyCursor.error`)
END = object()


class KeyCursor:
    """Keys of pass ``epoch`` from position ``start``: :meth:`next` hands them out in order,
    :meth:`draw` draws one more early into :attr:`lookahead` (which :meth:`next` hands out
    first)."""

    def __init__(self, keys: Iterator[Any], epoch: int, start: int) -> None:
        self._keys = keys
        self._epoch = epoch
        self._drawn = start  # the position of the next key drawn from the iterator
        self.lookahead: collections.deque = collections.deque()  # (key, index) drawn early
        #: the keys' own iterator failed: raised once the shards drawn before it are handed out
        self.error: BaseException | None = None

    def next(self) -> Any:
        """The next ``(key, index)`` in order, or :data:`END`."""
        if self.lookahead:
            return self.lookahead.popleft()
        return self._draw()

    def draw_ahead(self, depth: int) -> bool:
        """Draw keys early until ``depth`` are looked ahead at; False once the keys ended."""
        while len(self.lookahead) < depth:
            nxt = self._draw()
            if nxt is END:
                return False
            self.lookahead.append(nxt)
        return True

    def take_error(self) -> BaseException | None:
        """The key iterator's failure, once (None: none)."""
        error, self.error = self.error, None
        return error

    def _draw(self) -> Any:
        if self.error is not None:
            return END
        try:
            key = next(self._keys, END)
        except Exception as exc:  # the keys' own iterator failed: the shards drawn come first
            add_note(exc, f"gluon_stream: raised by the keys of epoch {self._epoch} after "
                          f"{self._drawn} key(s); the shards of those were delivered first")
            self.error = exc
            return END
        if key is END:
            return END
        self._drawn += 1
        return key, self._drawn - 1


# -- an interrupted epoch's rest, as pieces of shards (elastic resume) -----------------------------
# The rest of an interrupted epoch, as pieces of shards: what the ranks of a resized job read.
#
# An elastic resume (:func:`gluon_stream.merge_states`) joins the positions the old ranks reached
# in an epoch. What none of them trained yet is, per old rank: the samples it carried, the rest
# of the shard it was in, and the shards after it in its deal. Each becomes a :class:`Take` of a
# shard: rows ``start .. stop`` of the old rank's rows of it, dealt as the old job dealt them
# (:func:`~gluon_stream._stages.keys.part_rows`). The takes of one shard form a
# :class:`Piece`; the pieces, in a canonical order, form the :class:`Remainder`, which every new
# rank reads whole, each taking its stride of every piece's rows (the even rules of
# ``deal='strides'``/``'samples'``), so no size needs to be known and no rank needs another's.
#
# Nothing here needs a shard's rows until it is produced: a take knows how to cut a shard's row
# order of any length. A remainder can itself be interrupted and merged again: a take's source is
# then an earlier remainder's piece (``parent``), resolved the same way.
#
# The pieces are cut from a merged state by :func:`~gluon_stream._stages.resolve.resolve`,
# with :mod:`~gluon_stream._stages.quotas` (``samples_per_epoch``) and
# :mod:`~gluon_stream._stages.window_cuts` (a shuffle window).
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
    piece where ``before`` is known (see :func:`~gluon_stream._stages.keys.stride_of`), so
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
    """:func:`~gluon_stream._stages.batching.mixed_order`, kept a while for the takes of one
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
        rank knows them alike; see :func:`~gluon_stream._stages.keys.stride_of`)."""
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


# -- shard sizes known without producing them; the rows and strides of each part -------------------
# What a stream knows of its shards' sizes without producing them: for ``len()``, the
# progress bar and ``even_batches``' equal counts across ranks.
logger = logging.getLogger("gluon_stream.stream")


#: ``shard_sizes=``: ``{key: samples}``, ``fn(key) -> samples``, or one int for every shard.
DeclaredSizes = Union[Mapping[Any, int], Callable[[Any], int], int, None]
KeysOf = Callable[..., "tuple[Iterator[Any], bool, list | None]"]


def part_rows(rows: np.ndarray, parts: int, part: int, deal: str,
              before: int | None = None) -> np.ndarray:
    """The rows of a shard (``rows``, in the shard's order) that part ``part`` of ``parts``
    reads: all of them when shards are dealt whole; its stride with ``'strides'``, ``'turns'``
    and ``'balanced'``; the same stride cut to ``len(rows) // parts`` with ``'samples'``
    (equal counts on every part). ``before``: see :func:`stride_of`."""
    if deal == "shards" or parts == 1:
        return rows
    out = rows[stride_of(part, parts, deal, before)::parts]
    return out[:len(rows) // parts] if deal == "samples" else out


def part_count(full: int, parts: int, part: int, deal: str, before: int | None = None) -> int:
    """``len(part_rows(rows, parts, part, deal, before))`` for ``full`` rows, without the rows."""
    if deal == "shards" or parts == 1:
        return full
    if deal == "samples":
        return full // parts
    return len(range(stride_of(part, parts, deal, before), full, parts))


def turn_of(key_pass: int, index: int) -> int:
    """``deal='turns'``: the part a shard's first row goes to (mod the part count), for the
    shard at position ``index`` of pass ``key_pass`` over the keys. Every part reaches every
    row position of every shard within ``parts`` passes, so a shard smaller than the part count
    starves no part for good; known to every part alike, without any size."""
    return key_pass + index


def stride_turn(deal: str, key_pass: int, index: int, before: int | None) -> int | None:
    """What turns the strides of the shard at position ``index`` of pass ``key_pass`` (the
    ``before`` of :func:`stride_of`): its turn with ``'turns'`` (:func:`turn_of`), the rows
    before it with ``'balanced'`` (``before``, None where unknown), nothing otherwise."""
    if deal == "turns":
        return turn_of(key_pass, index)
    return before if deal == "balanced" else None


def stride_of(part: int, parts: int, deal: str, before: int | None) -> int:
    """Which stride of a shard part ``part`` of ``parts`` takes (the first row it reads).

    ``before``: the rows dealt to the parts ahead of this shard, where every part knows them
    alike (None: not known). With ``'strides'`` the strides then go on from where the last
    shard's stopped (the first row goes to part ``before % parts``), so over any run of shards
    dealt this way the parts' counts differ by one at most; unknown, each shard's strides start
    at part 0. With ``'turns'``, ``before`` is the shard's turn (:func:`turn_of`), so the first
    row goes to the next part from shard to shard and pass to pass. ``'balanced'`` always
    turns by the rows before (every part knows them: it reads every shard of the epoch).
    ``'samples'`` cuts every stride to the same count: it never turns."""
    if before is None or deal == "samples":
        return part
    return (part - before) % parts


class ShardSizes:
    """Shard sizes after the transform: declared, known to the source, or seen in a pass.

    Args:
        source: Whose headers or cache may know sizes ahead.
        transform: A stream's transform (a transform may change counts: files then tell nothing).
        declared: ``shard_sizes=``.
        deal, num_parts, part_index: How the ranks split each shard or epoch.
        keys_of: ``keys_of(epoch, part_index) -> (keys, finite, key list)``.
        remainder_of: ``remainder_of(epoch)``: the remainder read in place of an epoch's keys
            after an elastic resume (None: the keys are read).
    """

    def __init__(self, source: Source, transform: Any, declared: DeclaredSizes, deal: str,
                 num_parts: int, part_index: int, keys_of: KeysOf,
                 remainder_of: Callable[[int], Any] = lambda epoch: None,
                 seen: dict[tuple, int] | None = None) -> None:
        if isinstance(declared, int) and not isinstance(declared, bool):
            declared = _validate.integer("shard_sizes", declared, minimum=0)
        elif declared is not None and not (callable(declared) or isinstance(declared, Mapping)):
            raise TypeError(f"shard_sizes must be a dict {{key: samples}}, a callable "
                            f"fn(key) -> samples or one int for every shard, got "
                            f"{type(declared).__name__}")
        self.source, self.transform, self._declared = source, transform, declared
        self.deal, self.num_parts, self.part_index = deal, num_parts, part_index
        self._keys_of = keys_of
        self._remainder_of = remainder_of
        self._before: tuple[Any, list] = (None, [])  # a remainder, and its rows_before
        # (key, epoch or None) -> samples seen; ``seen``: another ShardSizes' (shared)
        self._seen: dict[tuple, int] = {} if seen is None else seen
        #: a shard's size may differ between epochs though its source's data does not
        #: (``context_rows`` over ``keys(epoch)`` lists: a key's context changes with them)
        self.per_epoch = False

    def without_remainder(self, keys_of: KeysOf) -> "ShardSizes":
        """These sizes as a fresh job of this size counts an epoch: its keys (``keys_of``), an
        elastic resume's remainder aside; sizes seen in a pass are shared."""
        sizes = ShardSizes(self.source, self.transform, self._declared, self.deal,
                           self.num_parts, self.part_index, keys_of, seen=self._seen)
        sizes.per_epoch = self.per_epoch
        return sizes

    def check_declared(self, key: Any, epoch: int, index: int, before: int | None,
                       samples: int) -> None:
        """Warn when a shard gives this part other than the ``samples`` ``shard_sizes``
        declares: batch counts follow the declared sizes on every rank."""
        if self.declared(key) is None:
            return
        expected = self.shard_size(key, epoch, index=index, before=before)
        if expected is not None and expected != samples:
            logger.warning(
                "shard %r (epoch %d) gives this part %d samples after transform, but "
                "shard_sizes declares %d: batch counts (len(), even_batches) follow the "
                "declared sizes on every rank, and a part left short repeats its last batch. "
                "Fix shard_sizes", key, epoch, samples, expected)

    def remember(self, key: Any, epoch: int, full_size: int) -> None:
        """A shard turned out to hold ``full_size`` samples (for later passes' counts)."""
        self._seen[(key, epoch)] = full_size
        if not (self.source.per_epoch or self.per_epoch):
            self._seen[(key, None)] = full_size

    def part_share(self, full: int, part: int | None = None, turn: int | None = None) -> int:
        """Samples a part takes of a shard of ``full`` samples (``turn``: what turns its
        strides, see :func:`stride_turn`)."""
        return part_count(full, self.num_parts, self.part_index if part is None else part,
                          self.deal, turn)

    def unit_share(self, epoch: int, index: int, full: int, part: int | None = None) -> int:
        """Samples a part takes of the shard at position ``index`` of ``epoch`` holding ``full``
        (a remainder's piece: its share of the rows left)."""
        remainder = self._remainder_of(epoch)
        if remainder is not None and not remainder.is_piece(index) and self.deal == "balanced":
            return part_count(full, self.num_parts,  # an endless tail's key: as its pieces
                              self.part_index if part is None else part, "samples")
        if remainder is None or not remainder.is_piece(index):
            return self.part_share(full, part, stride_turn(self.deal, epoch, index, None))
        return remainder.share(index, full, self.num_parts,
                               self.part_index if part is None else part, self.deal,
                               self.rows_before(epoch, index))

    def largest_share(self, epoch: int, index: int, full: int) -> int:
        """The most samples any part takes of the shard at position ``index`` of ``epoch``
        holding ``full`` (part 0's, but for a remainder's pieces and ``deal='turns'``, whose
        strides turn)."""
        remainder = self._remainder_of(epoch)
        if (remainder is None or not remainder.is_piece(index)) and self.deal != "turns":
            return self.part_share(full, 0)
        return max(self.unit_share(epoch, index, full, p) for p in range(self.num_parts))

    def learns_rows(self, epoch: int) -> bool:
        """``deal='balanced'``: whether a pass of ``epoch`` learns the rows before each shard
        from its producers (:class:`~gluon_stream._stages.offsets.RowOffsets`) to turn its
        strides: a fresh epoch; an elastic resume's remainder whose rest not every rank counts
        alike ahead (a piece's size unknown, or an endless tail), its pieces told by the rows
        left in them (a remainder merged by an older gluon_stream: its pieces were cut to
        equal strides, and are read so again)."""
        if self.deal != "balanced" or self.num_parts == 1:
            return False
        remainder = self._remainder_of(epoch)
        if remainder is None:
            return True
        return bool(remainder.spec.get("learned")) and not remainder.fixed \
            and self.rows_before(epoch, 0) is None

    def rows_dealt(self, epoch: int, index: int, full: int) -> int:
        """The rows the parts split of the shard at position ``index`` of ``epoch`` holding
        ``full`` (a remainder's piece: the rows left in it)."""
        remainder = self._remainder_of(epoch)
        if remainder is None or not remainder.is_piece(index):
            return full
        return remainder.pieces[index].count(full)

    def rows_before(self, epoch: int, index: int) -> int | None:
        """An elastic resume's remainder: the rows left in its pieces before piece ``index``,
        where every rank knows them alike (declared sizes, or the source's, without a
        transform; with ``samples_per_epoch``, those the merge counted); None otherwise (with
        ``deal='balanced'``: for every piece, unless every piece's size is known and no endless
        tail follows, since its batch count is then counted from the pieces' equal strides)."""
        remainder = self._remainder_of(epoch)
        if remainder is None or not remainder.is_piece(index):
            return None
        if self._before[0] is not remainder:
            fulls = remainder.sizes or [self.agreed_size(p.key, p.epoch)
                                        for p in remainder.pieces]
            counts = remainder.counts(fulls)
            if self.deal == "balanced" and (None in fulls or remainder.tail is not None):
                counts = [None] * len(counts)  # turn only where every rank counts the rest
            self._before = (remainder, counts)
        return self._before[1][index]

    def agreed_size(self, key: Any, epoch: int) -> int | None:
        """A shard's size as every rank knows it ahead (declared, or known to the source
        without a transform), or None."""
        n = self.declared(key)
        if n is None and self.transform is None:
            n = self.source.known_size(key, epoch)
        return n

    def shard_size(self, key: Any, epoch: int, part: int | None = None, index: int = 0,
                   before: int | None = None) -> int | None:
        """A part's samples of a shard after transform (this part's by default; ``index``: its
        position in the pass, for ``deal='turns'``; ``before``: the rows before it, for
        ``'balanced'``), if known without producing it (see :meth:`full_size`)."""
        full = self.full_size(key, epoch)
        if full is None:
            return None
        return self.part_share(full, part, stride_turn(self.deal, epoch, index, before))

    def full_size(self, key: Any, epoch: int) -> int | None:
        """A shard's samples after transform, before ranks take their parts, if known without
        producing it.

        Sizes every rank knows alike come first: declared ones (``shard_sizes=``), then those
        the source knows ahead (headers, a cache filled by ``gluon-stream generate``); they are
        never replaced by what a shard turned out to hold, so batch counts agree across ranks.
        Then sizes seen in an earlier pass (when the data cannot change), then cached headers.
        """
        n = self.agreed_size(key, epoch)  # the same on every rank
        if n is None:
            n = self._seen.get((key, epoch), self._seen.get((key, None)))
        if n is None and self.transform is None:
            n = self.source.num_samples(key, epoch)
        return n

    def declared(self, key: Any) -> int | None:
        """The size ``shard_sizes=`` declares for a shard (None: not declared)."""
        sizes = self._declared
        if sizes is None:
            return None
        if isinstance(sizes, int):
            return sizes
        n = sizes(key) if callable(sizes) else sizes.get(key)
        if n is not None and (isinstance(n, bool) or not isinstance(n, (int, np.integer))
                              or n < 0):
            raise ValueError(f"shard_sizes gives {n!r} for shard {key!r}: a number of samples "
                             "(an int >= 0) is expected")
        return None if n is None else int(n)

    def epoch_size(self, epoch: int, part_index: int | None = None) -> int | None:
        """Total samples of one part's epoch if every shard size is known, else None."""
        remainder = self._remainder_of(epoch)
        if remainder is not None:
            fulls = remainder.sizes or [self.full_size(p.key, p.epoch)
                                        for p in remainder.pieces]
            if remainder.tail is not None or any(n is None for n in fulls):
                return None
            if self.learns_rows(epoch):  # strides turned by the rows left before each piece
                part = self.part_index if part_index is None else part_index
                return sum(remainder.share(i, n, self.num_parts, part, self.deal, before)
                           for i, (n, before) in enumerate(zip(fulls, remainder.counts(fulls)))
                           if n is not None)
            return sum(self.unit_share(epoch, i, n, part_index) for i, n in enumerate(fulls)
                       if n is not None)
        _, finite, keys = self._keys_of(epoch, part_index)
        if not finite or keys is None:
            return None
        total = before = 0
        for index, key in enumerate(keys):
            full = self.full_size(key, epoch)
            if full is None:
                return None
            total += self.part_share(full, part_index,
                                     stride_turn(self.deal, epoch, index, before))
            before += full
        return total

    def part_sizes(self, epoch: int) -> list[int] | None:
        """Total samples of every part in an epoch (for equal batch counts), or None if unknown."""
        sizes = [self.epoch_size(epoch, part) for part in range(self.num_parts)]
        known = [n for n in sizes if n is not None]
        return known if len(known) == len(sizes) else None


# -- which part this process is: num_parts / part_index, or 'auto' ---------------------------------
# Which part of the data this process trains on: ``num_parts`` / ``part_index`` (MXNet's names).
#
# ``'auto'`` reads the rank and the world size from, in order: a ``kvstore`` passed in
# (``kv.rank``, ``kv.num_workers``), Horovod (``horovod.mxnet`` when importable and
# initialised), then the environment that ``horovodrun``/``mpirun``/``torchrun``-style
# launchers set. Sources that disagree are an error, not a guess.
logger = logging.getLogger(__name__)

ENV_PAIRS = (  # (rank variable, size variable)
    ("HOROVOD_RANK", "HOROVOD_SIZE"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("PMI_RANK", "PMI_SIZE"),
    ("RANK", "WORLD_SIZE"),
)


#: kvstore types whose workers step together (a push waits for every worker's), as Horovod's do
SYNC_KVSTORES = ("dist_sync", "dist_sync_device", "dist_device_sync", "horovod")


def synchronous_job(kvstore: Any = None) -> str | None:
    """What makes this process's rank step together with the others, where it can be told:
    a synchronous kvstore's type (``'dist_sync'``, ...) or ``'horovod'`` (initialised, more
    than one rank); None otherwise (independent ranks, or a launcher that does not say)."""
    kind = getattr(kvstore, "type", None)
    if isinstance(kind, str) and kind in SYNC_KVSTORES:
        return kind
    hvd = _from_horovod()
    return "horovod" if hvd is not None and hvd[0] > 1 else None


def _from_horovod() -> tuple[int, int] | None:
    try:
        hvd = importlib.import_module("horovod.mxnet")
    except ImportError:
        return None
    try:
        return int(hvd.size()), int(hvd.rank())
    except ValueError:  # horovod raises ValueError before hvd.init()
        logger.debug("horovod.mxnet is importable but not initialised")
        return None


def _from_env(environ: Mapping[str, str]) -> dict[str, tuple[int, int]]:
    found = {}
    for rank_var, size_var in ENV_PAIRS:
        if rank_var in environ and size_var in environ:
            try:
                found[f"{rank_var}/{size_var}"] = (int(environ[size_var]), int(environ[rank_var]))
            except ValueError as exc:
                raise ValueError(f"{rank_var}={environ[rank_var]!r} / {size_var}="
                                 f"{environ[size_var]!r} are not integers") from exc
    return found


def resolve_parts(num_parts: int | str = 1, part_index: int | str = 0, *, kvstore: Any = None,
                  environ: Mapping[str, str] | None = None) -> tuple[int, int]:
    """Return ``(num_parts, part_index)``, resolving ``'auto'`` from kvstore, Horovod or env.

    Raises:
        ValueError: out of range, only one of the two is 'auto', or the sources disagree.
    """
    if (num_parts == "auto") != (part_index == "auto"):
        raise ValueError("num_parts and part_index must both be 'auto' or both integers, got "
                         f"num_parts={num_parts!r}, part_index={part_index!r}")
    if num_parts == "auto":
        found: dict[str, tuple[int, int]] = {}
        if kvstore is not None:
            found["kvstore"] = (int(kvstore.num_workers), int(kvstore.rank))
        hvd = _from_horovod()
        if hvd is not None:
            found["horovod"] = hvd
        found.update(_from_env(os.environ if environ is None else environ))
        if not found:
            raise ValueError(
                "num_parts='auto' found no rank: pass kvstore=mx.kv.create('dist_sync'), call "
                "hvd.init() first, or launch with horovodrun/mpirun (or set RANK and WORLD_SIZE)")
        if len(set(found.values())) > 1:
            raise ValueError(f"num_parts='auto': rank sources disagree (as (size, rank)): {found}")
        num_parts, part_index = next(iter(found.values()))
        logger.info("num_parts=%d, part_index=%d (from %s)", num_parts, part_index,
                    ", ".join(found))
    num_parts = _validate.integer("num_parts", num_parts, minimum=1, hint="or 'auto'")
    part_index = _validate.integer("part_index", part_index, minimum=0, hint="or 'auto'")
    if part_index >= num_parts:
        raise ValueError(f"part_index must be in [0, {num_parts}), got {part_index!r}")
    return num_parts, part_index
