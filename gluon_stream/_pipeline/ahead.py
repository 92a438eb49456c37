"""A pass's generations ahead (shards made into the cache beyond the prefetch window), and
the count of its work waiting for a producer's place: what tells an idle producer from a
busy one, so that generations ahead never hold up the window's shards."""
from __future__ import annotations

import concurrent.futures as cf
import functools
import threading
from typing import Any, Callable, Collection, Protocol

from .deal import KeyCursor

__all__ = ["AheadOf", "GenerationsAhead"]


class _Generating(Protocol):
    """What generations ahead use of their pass's stream."""

    @property
    def generate_ahead(self) -> int: ...

    @property
    def closed(self) -> bool: ...

    @property
    def next_run(self) -> Any: ...

    @property
    def dealer(self) -> Any: ...  # made_epoch(epoch, index): the epoch a shard is made for

    @property
    def producer(self) -> Any: ...  # submit_generation(key, epoch, index, run) -> Future

    def idle_producers(self) -> int: ...


class AheadOf(Protocol):
    """What :class:`GenerationsAhead` reads of its pass (an
    :class:`~gluon_stream._pipeline.run.KeyPass`)."""

    @property
    def stream(self) -> _Generating: ...

    @property
    def epoch(self) -> int: ...

    @property
    def cancelled(self) -> bool: ...

    @property
    def keys(self) -> KeyCursor: ...  # the pass's keys: generations ahead look past its window

    @property
    def preskipped(self) -> Collection[int]: ...  # positions never made (failed before)

    @property
    def lock(self) -> Any: ...  # held while a generation is started

    @property
    def ahead(self) -> GenerationsAhead: ...

    def queued(self) -> int: ...

    def next_epoch_run(self, doing: str) -> Any: ...


class GenerationsAhead:
    """The generations ahead of one pass, by shard position, and its work waiting for a
    place (``unplaced``). Its own lock: the pass fills its window holding the pass's lock, and
    a producer's callback counts here without it."""

    def __init__(self) -> None:
        self._futures: dict[int, cf.Future] = {}  # index -> generation into the cache
        self._unplaced = 0  # work started in a thread, waiting for a producer's place
        self._lock = threading.Lock()
        self._awaited: set[cf.Future] = set()  # generations a window's shard waits for

    def __contains__(self, index: int) -> bool:
        return index in self._futures

    def start_one(self, keys: KeyCursor, depth: int, skip: Collection[int],
                  submit: Callable[[Any, int], cf.Future],
                  on_done: Callable[[cf.Future], None]) -> bool:
        """Submit (``submit(key, index)``) the generation of the first of the next ``depth``
        keys that has none yet (``skip``: positions never made), ``on_done`` called when it
        ends; True when there is none and the keys have ended."""
        ended = not keys.draw_ahead(depth)
        for key, index in keys.lookahead:
            if index not in self._futures and index not in skip:
                fut = self._futures[index] = submit(key, index)
                fut.add_done_callback(on_done)  # after it is known: a done one runs it now
                return False
        return ended

    def queued(self) -> int:
        """Generations not started, and work waiting for a place."""
        futures = list(self._futures.values())
        return self._unplaced + sum(1 for fut in futures if not (fut.running() or fut.done()))

    def unplaced(self, change: int) -> None:
        """Work started (``+1``) or stopped (``-1``) waiting for a producer's place."""
        with self._lock:
            self._unplaced += change

    def wait_for(self, index: int) -> float:
        """Wait for shard ``index``'s generation ahead, if one runs: its seconds (0: none
        ran; a generation not yet started is dropped and the shard made as usual). Its
        failure is raised here, where the shard's error policy applies.

        The caller is then counted as waiting for a place (it says :meth:`unplaced` ``-1``
        once it has one): from the end of the generation it waited for, not before (that
        generation's place is the one it takes next, so it keeps no other producer from work
        meanwhile). The generation's done-callback counts it first when it runs first
        (:meth:`done`), so that the producer finishing the generation sees it."""
        fut = self._futures.pop(index, None)  # one pop: atomic, no lock to wait for
        if fut is None or fut.cancel():
            self.unplaced(1)
            return 0.0
        with self._lock:
            self._awaited.add(fut)
        try:
            return fut.result()
        finally:
            self.done(fut)

    def done(self, fut: cf.Future) -> None:
        """Generation ``fut`` ended: the window's shard that waited for it, if any, now waits
        for a place (counted once, by whichever of it and this callback comes first)."""
        with self._lock:
            if fut in self._awaited:
                self._awaited.discard(fut)
                self._unplaced += 1

    def cancel(self) -> None:
        """Drop the generations not started (those running finish into the cache)."""
        for fut in self._futures.values():
            fut.cancel()
        self._futures.clear()

    def go_on(self, run: AheadOf, fut: Any = None) -> None:
        """Keep idle producers generating ``run``'s shards after its window into the cache:
        called when the window is filled and whenever a producer finishes (``fut``: the
        generation that did, if it was one)."""
        if isinstance(fut, cf.Future):
            self.done(fut)  # a window's shard waited for it: it comes first
        stream = run.stream
        if not stream.generate_ahead or run.cancelled or stream.closed:
            return
        with run.lock:
            self.start(run)

    def start(self, run: AheadOf, busy: int = 0) -> None:
        """Submit one generation ahead for ``run`` if a producer is idle (``busy``: shards an
        earlier pass has queued, which come first). Once every key of the pass is made or
        under way, the next epoch's first shards are generated into the cache (disk, not
        memory: a shuffle window's tail keeps its shards, and the next epoch starts on shards
        already made)."""
        stream = run.stream
        if run.queued() + busy >= stream.idle_producers():
            return  # no producer is idle: the window's shards come first

        def generation(key: Any, index: int) -> cf.Future:
            made = stream.dealer.made_epoch(run.epoch, index)
            return stream.producer.submit_generation(key, made, index, run)

        if not self.start_one(run.keys, stream.generate_ahead, run.preskipped, generation,
                              functools.partial(self.go_on, run)):
            return  # one at a time: the next call sees whether a producer is still idle
        nxt = None if stream.next_run is run else run.next_epoch_run("generating")
        if nxt is not None:  # (a pass made ahead stops at its own end)
            with nxt.lock:
                nxt.ahead.start(nxt, busy=run.queued())
