"""Gluon DataLoaders ended now instead of in ``__del__`` (the bench's contenders use them).

MXNet 1.9.1's ``DataLoader`` ends its worker pool only in ``__del__`` (apache/mxnet#13521), and
``Pool.terminate()`` itself can hang (CPython gh-96995); ending a pool that cannot hang needs
MXNet's and multiprocessing's private attributes, which is why this lives behind the MXNet door.
gluon_stream's own loader does not use these pools (see :mod:`.workers`).
"""
from __future__ import annotations

import logging
import multiprocessing.pool as _mp_pool
import time
from typing import Any

from .shm import remove_worker_shm

__all__ = ["release_dataloader", "worker_pool"]

logger = logging.getLogger(__name__)


def worker_pool(loader: Any) -> Any:
    """The DataLoader's worker pool (private in MXNet 1.9.1), or None."""
    return getattr(loader, "_worker_pool", None)


def is_process_pool(pool: Any) -> bool:
    return pool is not None and not isinstance(pool, _mp_pool.ThreadPool)


def release_dataloader(loader: Any) -> None:
    """End a DataLoader's worker pool now instead of in ``__del__`` (apache/mxnet#13521).

    Thread pools are terminated and joined. Process pools are ended in a way that cannot hang:
    ``Pool.terminate()`` blocks forever on a queue lock held by a worker that died (CPython
    gh-96995, a SIGKILLed or OOM-killed worker), so the workers are first asked to exit, then
    killed, the queue locks freed, and only then is the pool terminated. Shared-memory files
    that a killed worker left in /dev/shm are removed.
    """
    pool = worker_pool(loader)
    if pool is None:
        return
    loader._worker_pool = None
    if is_process_pool(pool):
        _end_process_pool(pool)
    else:
        pool.terminate()
        pool.join()


POOL_EXIT_S = 1.0  # how long idle or finishing workers get to exit before they are killed
_JOIN_S = 10.0
_LOCK_GRACE_S = 0.2


def _end_process_pool(pool: Any) -> None:
    workers = {proc.pid: proc for proc in list(pool._pool)}
    try:
        # Gentle part (may be cut short by a KeyboardInterrupt; the finally part still runs):
        # stop the maintenance thread so no replacement worker is forked behind our back; on
        # its way out it sends every worker a stop sentinel, so idle workers exit cleanly.
        handler = pool._worker_handler
        handler._state = _mp_pool.TERMINATE
        pool._change_notifier.put(None)
        handler.join(_JOIN_S)
        workers.update((proc.pid, proc) for proc in list(pool._pool))
        deadline = time.monotonic() + POOL_EXIT_S
        for proc in workers.values():
            proc.join(max(0.0, deadline - time.monotonic()))
    finally:
        _kill_pool(pool, workers)


def _kill_pool(pool: Any, workers: dict) -> None:
    """Kill what is left of a process pool and terminate it without the gh-96995 hang."""
    pool._worker_handler._state = _mp_pool.TERMINATE
    workers.update((proc.pid, proc) for proc in list(pool._pool))
    for proc in workers.values():
        if proc.exitcode is None:
            logger.debug("killing DataLoader worker %d that did not exit", proc.pid)
            proc.kill()
    for proc in workers.values():
        proc.join(_JOIN_S)
    # a worker that died inside queue.get()/put() holds these locks forever: free them
    # (a short wait first: the parent's own task-handler thread may hold one for a moment)
    for lock in (pool._inqueue._rlock, pool._outqueue._wlock):
        lock.acquire(timeout=_LOCK_GRACE_S)
        lock.release()
    pool.terminate()
    pool.join()
    for pid, proc in workers.items():
        if proc.exitcode != 0:
            remove_worker_shm(pid)
