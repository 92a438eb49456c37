"""An epoch's keys dealt to the parts: a key list's (:func:`part_keys`) and an endless
iterator's (:func:`part_endless`), and the kept keys of an endless iterator that a pass may
start again from (:class:`KeyTape`). A source's own keys are :mod:`gluon_stream.sources._keys`'s;
:class:`~gluon_stream._pipeline.deal.KeyDealer` holds one part's deal."""
from __future__ import annotations

import itertools
import threading
from typing import Any, Iterable, Iterator

import numpy as np

from .._utils.random import seeded_rng
from ..errors import StreamError

__all__ = ["EMPTY_PASSES", "KeyTape", "part_endless", "part_keys"]

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
