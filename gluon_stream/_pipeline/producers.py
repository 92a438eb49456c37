"""The producer threads a :class:`~gluon_stream.ShardStream` owns, and the throttle that says
how many of them may work at once (``producers='auto'`` grows it)."""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import threading
import weakref
from typing import Any, Iterator

from .._utils.closing import CLOSE_WAIT_S, WAIT_SLICE_S, end_thread_pool
from ..errors import LoaderClosed
from ..sources import Source

__all__ = ["LANE_PREFIX", "ProducerPool", "Throttle"]

logger = logging.getLogger(__name__)


#: a producer's lane in the stats and the timeline: the prefix, then its place
LANE_PREFIX = "gluon_stream-producer_"


class Throttle:
    """How many producers may work at once: fixed, or growing (``producers='auto'``).

    Up to ``bound`` producers; a shard's production waits here until fewer than ``active``
    are running. :meth:`grow` admits one more; :meth:`set_active` (the ``memory_budget`` tuner)
    sets the count. Each producer at work holds a place (0, 1, ...), which names its lane
    (:meth:`lane`): the threads that run them may be more (one waits for a shard that another
    generates ahead), the producers never are.
    """

    def __init__(self, active: int, bound: int) -> None:
        self.active, self.bound = active, bound
        self.running = 0
        self._cond = threading.Condition()
        self._closed = False
        self._places: dict[int, int] = {}  # thread id -> place

    def __enter__(self) -> None:
        with self._cond:
            while self.running >= self.active and not self._closed:
                self._cond.wait(WAIT_SLICE_S)
            if self._closed:
                raise LoaderClosed("the stream was closed")
            self.running += 1
            taken = set(self._places.values())
            self._places[threading.get_ident()] = next(
                p for p in range(len(taken) + 1) if p not in taken)

    def __exit__(self, *exc: Any) -> None:
        with self._cond:
            self.running -= 1
            self._places.pop(threading.get_ident(), None)
            self._cond.notify()

    def lane(self) -> str:
        """The calling producer's lane: its place, or (outside the throttle: a shard made in
        the loop's thread) the thread's name."""
        place = self._places.get(threading.get_ident())
        return threading.current_thread().name if place is None else f"{LANE_PREFIX}{place}"

    @contextlib.contextmanager
    def released(self) -> Iterator[None]:
        """Give this producer's place to another while the block waits, then take one again."""
        self.__exit__()
        try:
            yield
        finally:
            self.__enter__()

    def grow(self) -> bool:
        """Admit one more producer if the bound allows; whether it did."""
        with self._cond:
            if self.active >= self.bound:
                return False
            self.active += 1
            self._cond.notify()
            return True

    def set_active(self, active: int) -> None:
        """Let ``active`` producers work at once (within the bound); those at work beyond it
        finish their shard."""
        with self._cond:
            self.active = max(1, min(active, self.bound))
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class ProducerPool:
    """What a ShardStream owns; closed by ``close()`` or by the garbage collector."""

    def __init__(self, source: Source, throttle: Throttle) -> None:
        self.source = source
        self.throttle = throttle
        # twice the producers: a thread may wait for a shard's generation ahead (or, with
        # balanced strides, for the shards before it) with its producer's place given up, and
        # the place must find a thread to work in meanwhile
        self.executor = cf.ThreadPoolExecutor(2 * throttle.bound,
                                              thread_name_prefix="gluon_stream-producer")
        self.closed = threading.Event()
        self.runs: weakref.WeakSet = weakref.WeakSet()

    def close(self) -> None:
        self.closed.set()
        self.throttle.close()
        for run in list(self.runs):
            run.cancel()
        self.source.close()  # kills running generator process groups
        for thread in end_thread_pool(self.executor, CLOSE_WAIT_S):
            logger.warning("producer thread %s is still running a transform or a "
                           "FunctionSource fn after close(); it ends when that call returns",
                           thread.name)
