"""The keys stage: which keys this rank reads in each pass, in which order, and which rows of
each shard it takes.

A :class:`KeyDealer` holds what decides the deal (the source's keys, the seed, the shuffle,
the parts and the deal mode, an elastic resume's remainder, an endless iterator's kept keys),
and nothing of production: the producers ask it for a pass's keys and a shard's rows.

A pass draws its keys through a :class:`KeyCursor`: in order, each with its position, some
early (generations ahead look past the prefetch window), a failing key iterator kept to be
raised after the shards drawn before it.
"""
from __future__ import annotations

import collections
import itertools
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

from .._utils.random import key_hash, seeded_rng
from ..errors import InvalidState, add_note
from .keys import KeyTape, part_endless, part_keys
from .remainder import Remainder
from .sizes import part_rows, stride_turn

if TYPE_CHECKING:
    from ..sources import Source
    from .sizes import ShardSizes

__all__ = ["END", "KeyCursor", "KeyDealer"]

class KeyDealer:
    """The deal of one part (``part_index`` of ``num_parts``): keys per pass, rows per shard.

    ``sizes`` is set by the stream once its :class:`~gluon_stream._pipeline.sizes.ShardSizes`
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


# -- cursor ------------------------------------------------------------------------------------
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
