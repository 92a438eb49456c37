"""The only module that imports MXNet or touches its private attributes.

MXNet 1.9.1 needs ``numpy<1.24`` (it uses ``np.bool``); with a newer numpy its import
raises AttributeError. Either way gluon_stream still imports, and whatever needs
MXNet calls :func:`require_mxnet`, which says which extra to install.
"""
from __future__ import annotations

import glob
import logging
import multiprocessing.pool as _mp_pool
import os
import pickle
import threading
import time
from typing import Any, Sequence

import numpy as np

logger = logging.getLogger(__name__)

try:
    import mxnet as mx
    from mxnet import gluon, nd
    from mxnet.gluon.data import dataloader as _dataloader

    DataIterBase = mx.io.DataIter
    _IMPORT_ERROR: BaseException | None = None
except (ImportError, AttributeError, OSError) as exc:  # AttributeError: numpy>=1.24
    mx = gluon = nd = _dataloader = None
    _IMPORT_ERROR = exc

    class DataIterBase:  # type: ignore[no-redef]
        """Placeholder for ``mx.io.DataIter`` when MXNet is unavailable."""

INSTALL_HINT = ("gluon_stream needs MXNet 1.9.1 with numpy<1.24: pip install 'gluon_stream[cpu]' "
                "(or 'gluon_stream[cu112]' for CUDA 11.2; never both)")


def require_mxnet() -> Any:
    """Return the ``mxnet`` module or raise an ImportError that names the extra to install."""
    if mx is None:
        raise ImportError(f"{INSTALL_HINT} (import failed: {_IMPORT_ERROR})") from _IMPORT_ERROR
    return mx


def context(pin_memory: bool, pin_device_id: int) -> Any:
    """The context batches are allocated in: pinned host memory speeds up copies to a GPU."""
    require_mxnet()
    return mx.cpu_pinned(pin_device_id) if pin_memory else mx.cpu()


GATHER_CHUNK_BYTES = 4 << 20


def to_ndarray(array: np.ndarray, ctx: Any, order: np.ndarray | None = None) -> Any:
    """Copy a numpy array (its rows in ``order``, if given) into a new NDArray of its dtype.

    ``nd.empty`` + ``_sync_copyfrom`` is 4-5x faster than ``nd.array`` and, unlike
    ``nd.array`` without ``dtype``, keeps int64 as int64. With ``order`` the rows are gathered
    a few MB at a time straight into the NDArray, so no permuted copy of the whole shard exists.
    """
    out = nd.empty(array.shape, ctx=ctx, dtype=array.dtype)
    if order is None:
        out._sync_copyfrom(np.ascontiguousarray(array))
        return out
    row_bytes = max(1, array.itemsize * int(np.prod(array.shape[1:], dtype=np.int64)))
    step = max(1, GATHER_CHUNK_BYTES // row_bytes)
    for begin in range(0, len(order), step):
        end = min(len(order), begin + step)
        out[begin:end]._sync_copyfrom(np.take(array, order[begin:end], axis=0))
    return out


def concat(parts: Sequence[Any]) -> Any:
    """Join NDArrays along the sample axis, in the first part's context.

    ``nd.concat`` of ``cpu_pinned`` inputs returns a ``cpu`` array: pinned batches stay pinned.
    """
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    rows = sum(int(p.shape[0]) for p in parts)
    out = nd.empty((rows,) + tuple(first.shape[1:]), ctx=first.context, dtype=first.dtype)
    return nd.concat(*parts, dim=0, out=out)


def default_batchify_fn() -> Any:
    return _dataloader.default_batchify_fn


def make_dataloader(dataset: Any, batch_sampler: Any, *, batchify_fn: Any, num_workers: int,
                    thread_pool: bool, pin_memory: bool, pin_device_id: int,
                    timeout: float) -> Any:
    """Build a ``gluon.data.DataLoader`` over our own batch sampler.

    With MXNet's default ``auto_reload=False`` nothing is submitted to the workers until the
    DataLoader is iterated, so a caller may drive the pool itself (:func:`submit_batch`).
    """
    if num_workers > 0 and not thread_pool \
            and threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            "num_workers > 0 with thread_pool=False forks a worker process pool, which MXNet can "
            "only do from the main thread (it installs a signal handler); iterate the loader in "
            "the main thread, or use thread_pool=True")
    return gluon.data.DataLoader(dataset, batch_sampler=batch_sampler, batchify_fn=batchify_fn,
                                 num_workers=num_workers, thread_pool=thread_pool,
                                 pin_memory=pin_memory, pin_device_id=pin_device_id,
                                 timeout=max(1, int(timeout)))


def worker_pool(loader: Any) -> Any:
    """The DataLoader's worker pool (private in MXNet 1.9.1), or None."""
    return getattr(loader, "_worker_pool", None)


def is_process_pool(pool: Any) -> bool:
    return pool is not None and not isinstance(pool, _mp_pool.ThreadPool)


def prefetch_depth(loader: Any) -> int:
    """Batches MXNet keeps in flight for this DataLoader (``2 * num_workers`` by default)."""
    return max(1, int(getattr(loader, "_prefetch", 0) or 0))


def submit_batch(loader: Any, samples: Sequence[int]) -> Any:
    """Send one batch of sample indices to a process-pool worker, as MXNet's iterator does."""
    return loader._worker_pool.apply_async(_dataloader._worker_fn,
                                           (list(samples), loader._batchify_fn, None))


def receive_batch(loader: Any, result: Any) -> Any:
    """Unpickle a finished batch (NDArrays arrive through shared memory), pinned if asked."""
    batch = pickle.loads(result.get(0))
    if getattr(loader, "_pin_memory", False):
        batch = _dataloader._as_in_context(batch, mx.cpu_pinned(loader._pin_device_id))
    return batch


def dead_workers(loader: Any, known: dict) -> list[tuple[int, int]]:
    """(pid, exitcode) of the pool's worker processes that have died.

    ``known`` (pid -> Process) remembers every worker ever seen, because ``multiprocessing.Pool``
    silently replaces a dead worker and drops it from its list (the dead worker's batch is lost
    and MXNet would wait for it forever).
    """
    pool = worker_pool(loader)
    if is_process_pool(pool):
        for proc in list(pool._pool):
            known.setdefault(proc.pid, proc)
    return [(pid, proc.exitcode) for pid, proc in known.items() if proc.exitcode is not None]


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


def remove_worker_shm(pid: int) -> list[str]:
    """Remove /dev/shm files a dead worker created but never unlinked.

    MXNet names them ``/dev/shm/mx_<pid in hex>_<id>`` and unlinks each right after creating
    it (the fd travels to the parent), so only a worker killed inside that window leaves one.
    """
    removed = []
    for path in glob.glob(f"/dev/shm/mx_{pid:x}_*"):
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            logger.debug("%s already removed", path)
    if removed:
        logger.info("removed %d shared-memory file(s) left by dead DataLoader worker %d",
                    len(removed), pid)
    return removed
