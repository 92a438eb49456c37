"""Gluon DataLoaders ended now instead of in ``__del__`` (the bench's contenders use them).

MXNet 1.9.1's ``DataLoader`` ends its worker pool only in ``__del__`` (apache/mxnet#13521), and
``Pool.terminate()`` itself can hang (CPython gh-96995); ending a pool that cannot hang needs
MXNet's and multiprocessing's private attributes (reached through ``_mx/pools.py``, the MXNet
door). Only the bench ends Gluon DataLoaders, so this lives with it: gluon_stream's own loader
does not use these pools (see ``_mx/workers.py``).
"""
from __future__ import annotations

import logging
import time
from typing import Any

from ..._mx.pools import (
    free_queue_locks,
    is_process_pool,
    pool_processes,
    stop_maintenance,
    take_worker_pool,
    worker_pool,
)
from ..._mx.shm import remove_worker_shm

__all__ = ["release_dataloader", "worker_pool"]

logger = logging.getLogger(__name__)


def release_dataloader(loader: Any) -> None:
    """End a DataLoader's worker pool now instead of in ``__del__`` (apache/mxnet#13521).

    Thread pools are terminated and joined. Process pools are ended in a way that cannot hang:
    ``Pool.terminate()`` blocks forever on a queue lock held by a worker that died (CPython
    gh-96995, a SIGKILLed or OOM-killed worker), so the workers are first asked to exit, then
    killed, the queue locks freed, and only then is the pool terminated. Shared-memory files
    that a killed worker left in /dev/shm are removed.
    """
    pool = take_worker_pool(loader)
    if pool is None:
        return
    if is_process_pool(pool):
        _end_process_pool(pool)
    else:
        pool.terminate()
        pool.join()


POOL_EXIT_S = 1.0  # how long idle or finishing workers get to exit before they are killed
_JOIN_S = 10.0
_LOCK_GRACE_S = 0.2


def _end_process_pool(pool: Any) -> None:
    workers = pool_processes(pool)
    try:
        # Gentle part (may be cut short by a KeyboardInterrupt; the finally part still runs):
        # stop the maintenance thread so no replacement worker is forked behind our back; on
        # its way out it sends every worker a stop sentinel, so idle workers exit cleanly.
        stop_maintenance(pool, _JOIN_S)
        workers.update(pool_processes(pool))
        deadline = time.monotonic() + POOL_EXIT_S
        for proc in workers.values():
            proc.join(max(0.0, deadline - time.monotonic()))
    finally:
        _kill_pool(pool, workers)


def _kill_pool(pool: Any, workers: dict) -> None:
    """Kill what is left of a process pool and terminate it without the gh-96995 hang."""
    stop_maintenance(pool)
    workers.update(pool_processes(pool))
    for proc in workers.values():
        if proc.exitcode is None:
            logger.debug("killing DataLoader worker %d that did not exit", proc.pid)
            proc.kill()
    for proc in workers.values():
        proc.join(_JOIN_S)
    free_queue_locks(pool, _LOCK_GRACE_S)
    pool.terminate()
    pool.join()
    for pid, proc in workers.items():
        if proc.exitcode != 0:
            remove_worker_shm(pid)
