"""A pass's keys as it draws them: in order, each with its position in the epoch, some drawn
early (a generation ahead looks past the prefetch window), a failing key iterator kept to be
raised after the shards drawn before it."""
from __future__ import annotations

import collections
from typing import Any, Iterator

from ..errors import add_note

__all__ = ["END", "KeyCursor"]

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
