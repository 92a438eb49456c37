"""Per-sample work in the loader's own process: in the loop's thread, or in a thread pool.

:class:`InlineWorkers` (``num_workers=0``) makes a batch when its result is asked for;
:class:`ThreadWorkers` (``thread_pool=True``) in a pool of threads, for code that releases the
GIL. Both offer the interface of :class:`~gluon_stream._mx.workers.ProcessWorkers` (see
:mod:`gluon_stream._mx.workers` for it and for how each kind seeds random augmentation).
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from typing import Any, Sequence

import numpy as np

from .._utils.closing import CLOSE_WAIT_S, WAIT_SLICE_S, end_thread_pool
from .._utils.lifecycle import ThreadPool
from . import numpy_mode
from .samples import BatchMaker, Refs
from .worker_deaths import closed_while, too_slow

__all__ = ["InlineWorkers", "PER_WORKER", "ThreadWorkers"]

logger = logging.getLogger(__name__)

PER_WORKER = 2  # batches in flight per worker (MXNet's DataLoader keeps 2 * num_workers)


class InlineWorkers:
    """Makes each batch in the calling thread, when its result is asked for (seeded: numpy's
    and ``random``'s states are restored after it, MXNet's RNG is not touched)."""

    depth = 1
    uses_shared_memory = False

    def __init__(self, maker: BatchMaker) -> None:
        self.maker = maker
        self._sources: dict[int, Sequence[np.ndarray]] = {}
        self._tasks: dict[int, tuple[Refs, int | None]] = {}

    def attach(self, sid: int, arrays: Sequence[np.ndarray]) -> None:
        self._sources[sid] = arrays

    def detach(self, sid: int) -> None:
        self._sources.pop(sid, None)

    def submit(self, tid: int, refs: Refs, what: str = "", key: Any = None,
               seed: int | None = None) -> None:
        self._tasks[tid] = (refs, seed)

    def result(self, tid: int, timeout: float, what: str = "") -> Any:
        refs, seed = self._tasks.pop(tid)
        return self.maker(self._sources, refs, seed)

    def done(self, tid: int) -> bool:
        """Whether :meth:`result` would return without making or waiting for the batch."""
        return False

    def new_epoch(self) -> None:
        """An epoch's batches begin (nothing is counted per epoch here)."""

    def cancel_all(self) -> None:
        self._tasks.clear()
        self._sources.clear()

    def close(self) -> None:
        self.cancel_all()


class ThreadWorkers(InlineWorkers):
    """Makes batches in a pool of ``num_workers`` threads; ``seed`` is ignored (threads share
    the global RNGs, see the module doc)."""

    def __init__(self, num_workers: int, maker: BatchMaker) -> None:
        super().__init__(maker)
        self.depth = PER_WORKER * num_workers
        self._pool = ThreadPool(num_workers, thread_name_prefix="gluon_stream-worker")
        self._futures: dict[int, cf.Future] = {}
        self._warm = False
        self._closed = threading.Event()

    def submit(self, tid: int, refs: Refs, what: str = "", key: Any = None,
               seed: int | None = None) -> None:
        sources = {sid: self._sources[sid] for sid, _ in refs}
        if not self._warm:  # hybrid blocks build their cache on the first call: not in parallel
            self._warm = True
            future: cf.Future = cf.Future()
            try:
                future.set_result(self.maker(sources, refs))
            except Exception as exc:
                future.set_exception(exc)
            self._futures[tid] = future
            return
        # made in the mode of the loop's thread (Gluon's numpy semantics are thread-local)
        self._futures[tid] = self._pool.submit(self.maker, sources, refs, None, numpy_mode())

    def result(self, tid: int, timeout: float, what: str = "") -> Any:
        future = self._futures.pop(tid)
        deadline = time.monotonic() + timeout
        while not cf.wait([future], timeout=min(WAIT_SLICE_S, max(0.0, deadline -
                                                                 time.monotonic()))).done:
            if self._closed.is_set():
                raise closed_while(what)
            if time.monotonic() >= deadline:
                raise too_slow(what, timeout, "thread")
        return future.result()

    def done(self, tid: int) -> bool:
        future = self._futures.get(tid)
        return future is not None and future.done()

    def cancel_all(self) -> None:
        for future in self._futures.values():
            future.cancel()
        self._futures.clear()
        super().cancel_all()

    def close(self) -> None:
        self._closed.set()
        self.cancel_all()
        for thread in end_thread_pool(self._pool, CLOSE_WAIT_S):
            logger.warning("worker thread %s is still running sample_transform/batchify_fn "
                           "after close(); it ends when that call returns", thread.name)
