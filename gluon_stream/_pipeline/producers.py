"""The producer threads a :class:`~gluon_stream.ShardStream` owns, and the throttle that says
how many of them may work at once (``producers='auto'`` grows it)."""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import heapq
import itertools
import logging
import threading
import weakref
from typing import Any, Iterator

from .._utils import validate as _validate
from .._utils.closing import CLOSE_WAIT_S, WAIT_SLICE_S, end_thread_pool
from .._utils.cores import usable_cores
from .._utils.lifecycle import ThreadPool
from ..errors import LoaderClosed
from ..sources import Source
from .tuning import DEFAULT_PREFETCH, start_knobs

__all__ = ["LANE_PREFIX", "ProducerPool", "Throttle", "first_knobs"]

logger = logging.getLogger(__name__)


#: a producer's lane in the stats and the timeline: the prefix, then its place
LANE_PREFIX = "gluon_stream-producer_"


class Throttle:
    """How many producers may work at once: fixed, or growing (``producers='auto'``), and which
    work gets a free place first.

    Up to ``bound`` producers; work waits in :meth:`take` until fewer than ``active`` are
    running and no waiting work comes before it. Work comes in the order the loop needs it:
    by ``rank`` (a pass's epoch, then the shard's position in it), so a shard of the window
    the loop waits for takes a place before a generation ahead of a later shard, or of the
    next epoch, however the threads are woken (the thread that just gave a place up would
    otherwise take it again for its next task). :meth:`grow` admits one more; :meth:`set_active`
    (the ``memory_budget`` tuner) sets the count. Each producer at work holds a place
    (0, 1, ...), which names its lane (:meth:`lane`): the threads that run them may be more
    (one waits for a shard that another generates ahead), the producers never are.
    """

    def __init__(self, active: int, bound: int) -> None:
        self.active, self.bound = active, bound
        self.running = 0
        self._cond = threading.Condition()
        self._closed = False
        self._places: dict[int, int] = {}  # thread id -> place
        self._ranks: dict[int, tuple] = {}  # thread id -> the rank of the work it holds for
        self._waiting: list[tuple] = []  # heap of (rank, ticket) waiting for a place
        self._tickets = itertools.count()

    def take(self, rank: tuple = ()) -> None:
        """Wait for a place, after any waiting work of a lower ``rank`` (equal ranks: first
        come, first served), and hold it for this thread."""
        with self._cond:
            if self._waiting or self.running >= self.active:  # else: a free place, now
                self._wait_turn(rank)
            if self._closed:
                self._cond.notify_all()
                raise LoaderClosed("the stream was closed")
            self.running += 1
            taken = set(self._places.values())
            ident = threading.get_ident()
            self._places[ident] = next(p for p in range(len(taken) + 1) if p not in taken)
            self._ranks[ident] = rank
            self._cond.notify_all()  # the next in line may find a place too

    def _wait_turn(self, rank: tuple) -> None:
        entry = (rank, next(self._tickets))
        heapq.heappush(self._waiting, entry)
        try:
            while (self.running >= self.active or self._waiting[0] != entry) \
                    and not self._closed:
                self._cond.wait(WAIT_SLICE_S)
        finally:
            self._waiting.remove(entry)
            heapq.heapify(self._waiting)

    def give(self) -> None:
        """Give this thread's place up."""
        with self._cond:
            self.running -= 1
            ident = threading.get_ident()
            self._places.pop(ident, None)
            self._ranks.pop(ident, None)
            self._cond.notify_all()

    @property
    def waiting(self) -> int:
        """Work waiting for a place now."""
        with self._cond:
            return len(self._waiting)

    def lane(self) -> str:
        """The calling producer's lane: its place, or (outside the throttle: a shard made in
        the loop's thread) the thread's name."""
        place = self._places.get(threading.get_ident())
        return threading.current_thread().name if place is None else f"{LANE_PREFIX}{place}"

    @contextlib.contextmanager
    def released(self) -> Iterator[None]:
        """Give this producer's place to another while the block waits, then take one again
        (in the same rank)."""
        rank = self._ranks.get(threading.get_ident(), ())
        self.give()
        try:
            yield
        finally:
            self.take(rank)

    def grow(self) -> bool:
        """Admit one more producer if the bound allows; whether it did."""
        with self._cond:
            if self.active >= self.bound:
                return False
            self.active += 1
            self._cond.notify_all()
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
        # the place must find a thread to work in meanwhile; ThreadPool: a Ctrl-C in submit
        # cannot leave a thread running that the pool does not count or join
        self.executor = ThreadPool(2 * throttle.bound, thread_name_prefix="gluon_stream-producer")
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


def first_knobs(prefetch: int | str, producers: Any, budget: int | None,
                apart: bool) -> tuple[int, Throttle]:
    """A stream's first ``prefetch`` and its producers' :class:`Throttle`, from its arguments
    (``'auto'``, an int, or for ``producers`` an executor that generates shards elsewhere);
    with a ``memory_budget`` they start low and the tuner raises them. ``apart``: shards are
    generated apart from loading (a program into a cache), so the tuner's start differs."""
    start = None if budget is None else start_knobs(apart, usable_cores())
    fixed = not (isinstance(prefetch, str) and prefetch == "auto")
    prefetch = _validate.integer("prefetch", prefetch if fixed else (
        DEFAULT_PREFETCH if start is None else start.prefetch), minimum=0)
    if isinstance(producers, cf.Executor):  # local threads only wait for, load and transform
        return prefetch, Throttle(prefetch + 1, prefetch + 1)
    if producers == "auto" and start is not None:  # the tuner sets the count
        return prefetch, Throttle(start.producers, usable_cores())
    if producers == "auto":
        return prefetch, Throttle(1, max(1, min(prefetch, usable_cores())))
    producers = _validate.integer("producers", producers, minimum=1,
                                  hint="'auto', or a concurrent.futures.Executor")
    return prefetch, Throttle(producers, producers)
