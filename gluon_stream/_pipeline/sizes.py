"""What a stream knows of its shards' sizes without producing them: for ``len()``, the
progress bar and ``even_batches``' equal counts across ranks."""
from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping, Union

import numpy as np

from .._utils import validate as _validate
from ..sources import Source

__all__ = ["DeclaredSizes", "ShardSizes"]

#: ``shard_sizes=``: ``{key: samples}``, ``fn(key) -> samples``, or one int for every shard.
DeclaredSizes = Union[Mapping[Any, int], Callable[[Any], int], int, None]
KeysOf = Callable[..., "tuple[Iterator[Any], bool, list | None]"]


class ShardSizes:
    """Shard sizes after the transform: declared, known to the source, or seen in a pass.

    Args:
        source: Whose headers or cache may know sizes ahead.
        transform: A stream's transform (a transform may change counts: files then tell nothing).
        declared: ``shard_sizes=``.
        deal, num_parts, part_index: How the ranks split each shard or epoch.
        keys_of: ``keys_of(epoch, part_index) -> (keys, finite, key list)``.
    """

    def __init__(self, source: Source, transform: Any, declared: DeclaredSizes, deal: str,
                 num_parts: int, part_index: int, keys_of: KeysOf) -> None:
        if isinstance(declared, int) and not isinstance(declared, bool):
            declared = _validate.integer("shard_sizes", declared, minimum=0)
        elif declared is not None and not (callable(declared) or isinstance(declared, Mapping)):
            raise TypeError(f"shard_sizes must be a dict {{key: samples}}, a callable "
                            f"fn(key) -> samples or one int for every shard, got "
                            f"{type(declared).__name__}")
        self.source, self.transform, self._declared = source, transform, declared
        self.deal, self.num_parts, self.part_index = deal, num_parts, part_index
        self._keys_of = keys_of
        self._seen: dict[tuple, int] = {}  # (key, epoch or None) -> samples seen

    def remember(self, key: Any, epoch: int, full_size: int) -> None:
        """A shard turned out to hold ``full_size`` samples (for later passes' counts)."""
        self._seen[(key, epoch)] = full_size
        if not self.source.per_epoch:
            self._seen[(key, None)] = full_size

    def part_share(self, full: int, part: int | None = None) -> int:
        """Samples a part takes of a shard of ``full`` samples."""
        parts = self.num_parts
        if self.deal == "samples" and parts > 1:
            return full // parts
        if self.deal == "strides" and parts > 1:
            return len(range(self.part_index if part is None else part, full, parts))
        return full

    def shard_size(self, key: Any, epoch: int, part: int | None = None) -> int | None:
        """A part's samples of a shard after transform (this part's by default), if known
        without producing it (see :meth:`full_size`)."""
        full = self.full_size(key, epoch)
        return None if full is None else self.part_share(full, part)

    def full_size(self, key: Any, epoch: int) -> int | None:
        """A shard's samples after transform, before ranks take their parts, if known without
        producing it.

        Sizes every rank knows alike come first: declared ones (``shard_sizes=``), then those
        the source knows ahead (headers, a cache filled by ``gluon-stream generate``); they are
        never replaced by what a shard turned out to hold, so batch counts agree across ranks.
        Then sizes seen in an earlier pass (when the data cannot change), then cached headers.
        """
        n = self.declared(key)
        if n is None and self.transform is None:
            n = self.source.known_size(key, epoch)  # the same on every rank
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
        _, finite, keys = self._keys_of(epoch, part_index)
        if not finite or keys is None:
            return None
        total = 0
        for key in keys:
            n = self.shard_size(key, epoch, part_index)
            if n is None:
                return None
            total += n
        return total

    def part_sizes(self, epoch: int) -> list[int] | None:
        """Total samples of every part in an epoch (for equal batch counts), or None if unknown."""
        sizes = [self.epoch_size(epoch, part) for part in range(self.num_parts)]
        known = [n for n in sizes if n is not None]
        return known if len(known) == len(sizes) else None
