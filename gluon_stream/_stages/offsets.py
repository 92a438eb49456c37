"""The rows of an epoch's shards before each one, learned as the producers make them.

With ``deal='balanced'`` (``even_batches=True``, sizes unknown) every rank reads every shard
and takes its stride of it, the strides going on from where the last shard's stopped: row
``i`` of a shard with ``before`` rows ahead of it in the epoch goes to rank
``(before + i) % parts``. Over any prefix of the epoch the ranks then hold ``rows // parts``
samples or one more, so no rank drops more than a batch. A producer needs ``before`` to cut
its rank's rows, and the shards before it may still be in other producers' hands:
:class:`RowOffsets` is where each producer tells its shard's size and waits for those before
it. The consumer reads how many rows are known in order (``known``) to tell whether every
rank can fill a batch yet.

Producers take shards in order (the executor's queue is first in, first out), so a shard's
predecessors are made or being made when it waits. A predecessor that failed is made again
only when the consumer reaches it: a shard waiting for it gives up at once (:class:`Deferred`)
and is made again, after it, by the consumer.
"""
from __future__ import annotations

import concurrent.futures as cf
import threading
from typing import Callable, Protocol

from .._utils.closing import WAIT_SLICE_S
from ..errors import LoaderClosed, StreamError

__all__ = ["Deferred", "Frontier", "RowOffsets", "reaches"]


class Deferred(StreamError):
    """A shard's producer gave up waiting for the size of a shard before it, which failed:
    the consumer makes it again once that one is made (never raised to the user)."""


class RowOffsets:
    """Rows before each shard of one pass, from position ``first`` (``before`` rows ahead of
    it: 0 at an epoch's start, the saved count on a resume).

    Example:
        >>> rows = RowOffsets(0, 0)
        >>> rows.tell(0, 7); rows.before(1, 5, lambda: False), rows.known
        (7, 12)
    """

    def __init__(self, first: int, before: int) -> None:
        self._cond = threading.Condition()
        self._sizes: dict[int, int] = {}  # position -> rows, told out of order
        self._failed: set[int] = set()
        self._prefix = {first: before}  # position -> rows before it, contiguous from first
        self._next = first  # the first position whose size is not known yet
        self._closed = False

    @property
    def known(self) -> int:
        """Rows of the shards known in order from the start of the epoch."""
        with self._cond:
            return self._prefix[self._next]

    @property
    def frontier(self) -> int:
        """The first position whose size is not known yet."""
        return self._next

    def before_known(self, index: int) -> int | None:
        """The rows before position ``index``, if the sizes up to it are known."""
        with self._cond:
            return self._prefix.get(index)

    def tell(self, index: int, rows: int) -> None:
        """Shard ``index`` holds ``rows`` (made, or skipped: 0)."""
        with self._cond:
            self._sizes[index] = rows
            self._failed.discard(index)
            while self._next in self._sizes:
                self._prefix[self._next + 1] = self._prefix[self._next] + self._sizes.pop(
                    self._next)
                self._next += 1
            self._cond.notify_all()

    def failed(self, index: int) -> None:
        """Shard ``index`` failed: those after it stop waiting (see :class:`Deferred`)."""
        with self._cond:
            if index >= self._next:
                self._failed.add(index)
            self._cond.notify_all()

    def before(self, index: int, rows: int, closed: Callable[[], bool]) -> int:
        """Tell shard ``index``'s ``rows``, then wait until the rows before it are known and
        return them (``closed()``: the pass or stream is over: LoaderClosed)."""
        self.tell(index, rows)
        with self._cond:
            while index > self._next:
                if any(self._next <= j < index for j in self._failed):
                    raise Deferred(f"shard at position {index} waits for the size of a shard "
                                   "before it, which failed")
                if self._closed or closed():
                    raise LoaderClosed("the pass was cancelled")
                self._cond.wait(WAIT_SLICE_S)
            return self._prefix[index]

    def wait_change(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for another size to be told."""
        with self._cond:
            self._cond.wait(timeout)

    def close(self) -> None:
        """Wake every waiting producer: the pass is over."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class Frontier(Protocol):
    """What :func:`reaches` asks of a pass."""

    def frontier(self, index: int) -> tuple[bool, cf.Future | None]: ...

    def check_alive(self) -> None: ...


def reaches(offsets: RowOffsets, rows: int, run: Frontier) -> bool:
    """``deal='balanced'``: whether the epoch's shards hold ``rows`` rows or more, counted in
    order as far as their sizes are known. Waits for the sizes after those known (the pass
    submits the next shards if none is in flight); False once every shard is known and they
    hold fewer. A shard that failed where the count stands ends the wait (True): the consumer
    meets it and applies the error policy, so the count never waits on it."""
    while offsets.known < rows:
        ended, fut = run.frontier(offsets.frontier)
        if ended:
            return False
        if fut is not None and fut.done() and not fut.cancelled() \
                and fut.exception() is not None:
            return True
        run.check_alive()
        offsets.wait_change(WAIT_SLICE_S)
    return True
