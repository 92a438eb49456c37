"""What a stream knows of its shards' sizes without producing them: for ``len()``, the
progress bar and ``even_batches``' equal counts across ranks."""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterator, Mapping, Union

import numpy as np

from .._utils import validate as _validate
from ..sources import Source

logger = logging.getLogger("gluon_stream.stream")

__all__ = ["DeclaredSizes", "ShardSizes", "part_count", "part_rows", "stride_of", "stride_turn",
           "turn_of"]

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
        from its producers (:class:`~gluon_stream._pipeline.offsets.RowOffsets`) to turn its
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
