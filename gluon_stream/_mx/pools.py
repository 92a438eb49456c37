"""The private attributes of a Gluon DataLoader's worker pool, reached only here (MXNet 1.9.1
keeps the pool in ``_worker_pool``; multiprocessing's ``Pool`` has no public way to stop its
maintenance thread or free a queue lock a killed worker held). The bench ends its DataLoader
contenders with these (``tools/bench/dataloader.py``); the loader itself never uses them."""
from __future__ import annotations

import multiprocessing.pool as _mp_pool
from typing import Any

__all__ = ["free_queue_locks", "is_process_pool", "pool_processes", "stop_maintenance",
           "take_worker_pool", "worker_pool"]


def worker_pool(loader: Any) -> Any:
    """The DataLoader's worker pool, or None."""
    return getattr(loader, "_worker_pool", None)


def take_worker_pool(loader: Any) -> Any:
    """The DataLoader's worker pool (None if it has none), which the loader no longer holds."""
    pool = worker_pool(loader)
    if pool is not None:
        loader._worker_pool = None
    return pool


def is_process_pool(pool: Any) -> bool:
    return pool is not None and not isinstance(pool, _mp_pool.ThreadPool)


def pool_processes(pool: Any) -> dict[int, Any]:
    """The pool's worker processes by pid."""
    return {proc.pid: proc for proc in list(pool._pool)}


def stop_maintenance(pool: Any, join_s: float | None = None) -> None:
    """Stop the thread that forks replacement workers (with ``join_s``: wait for it to end,
    which sends every worker a stop sentinel on its way out)."""
    handler = pool._worker_handler
    handler._state = _mp_pool.TERMINATE
    if join_s is not None:
        pool._change_notifier.put(None)
        handler.join(join_s)


def free_queue_locks(pool: Any, grace_s: float) -> None:
    """Free the queue locks a worker that died inside ``get()``/``put()`` holds forever (after
    ``grace_s``: the parent's own task-handler thread may hold one for a moment)."""
    for lock in (pool._inqueue._rlock, pool._outqueue._wlock):
        lock.acquire(timeout=grace_s)
        lock.release()
