"""Gluon DataLoaders driven from outside: built over our own batch lists, supervised, ended.

MXNet 1.9.1's ``DataLoader`` waits forever for a batch whose process-pool worker died, ends
its pool only in ``__del__`` (apache/mxnet#13521), and ``Pool.terminate()`` itself can hang
(CPython gh-96995). Everything here works around that through MXNet's private attributes,
which is why it lives behind the MXNet door.
"""
from __future__ import annotations

import collections
import glob
import logging
import multiprocessing
import multiprocessing.pool as _mp_pool
import os
import pickle
import signal
import threading
import time
from typing import Any, Iterator, Sequence

from ..errors import BatchTimeout, LoaderClosed, WorkerDied
from . import require_mxnet

__all__ = ["make_dataloader", "pool_batches", "release_dataloader", "remove_worker_shm",
           "thread_batches", "worker_pool"]

logger = logging.getLogger(__name__)


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
    gluon = require_mxnet().gluon
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
    dataloader = require_mxnet().gluon.data.dataloader
    return loader._worker_pool.apply_async(dataloader._worker_fn,
                                           (list(samples), loader._batchify_fn, None))


def receive_batch(loader: Any, result: Any) -> Any:
    """Unpickle a finished batch (NDArrays arrive through shared memory), pinned if asked."""
    batch = pickle.loads(result.get(0))
    if getattr(loader, "_pin_memory", False):
        mx = require_mxnet()
        batch = mx.gluon.data.dataloader._as_in_context(batch,
                                                        mx.cpu_pinned(loader._pin_device_id))
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



POOL_POLL_S = 0.1  # how often a wait for a process-pool batch checks for dead workers
WORKER_DEATH_S = 5.0  # how long a failed fetch from a worker waits for its death to show


def _describe_key(key: Any) -> str:
    return f"shard {key!r}" if key is not None else "the current shard"


def pool_batches(dataloader: Any, batches: list, timeout: float, key: Any, *, first: int,
                 total: int) -> Iterator[Any]:
    """Yield a process-pool DataLoader's batches in order, as MXNet's iterator would, but
    sleeping in short slices that check whether a worker died and whether ``timeout`` passed."""
    known: dict = {}
    dead_workers(dataloader, known)  # remember the workers forked for this shard
    pending: collections.deque = collections.deque()
    todo = iter(enumerate(batches, start=first))

    def push() -> None:
        item = next(todo, None)
        if item is not None:
            pending.append((item[0], submit_batch(dataloader, item[1])))

    for _ in range(prefetch_depth(dataloader)):
        push()
    while pending:
        index, result = pending.popleft()
        push()
        deadline = time.monotonic() + timeout
        while not result.ready():
            result.wait(POOL_POLL_S)
            if result.ready():
                break
            if worker_pool(dataloader) is None:  # released: close() from another thread
                raise LoaderClosed(f"the loader was closed while waiting for batch {index + 1} "
                                   f"of {total} of {_describe_key(key)}")
            dead = dead_workers(dataloader, known)
            if dead:
                raise _worker_died(dead, key, index, total)
            if time.monotonic() >= deadline:
                raise BatchTimeout(
                    f"batch {index + 1} of {total} of {_describe_key(key)} took longer than "
                    f"timeout={timeout:g} s in a DataLoader worker process: sample_transform or "
                    "batchify_fn is too slow (or stuck); speed it up or raise timeout=")
        try:
            batch = receive_batch(dataloader, result)
        except Exception as exc:
            # the shared-memory fd of a finished batch is fetched from the worker that made it:
            # if that worker was just killed, this fails before its death is visible here
            patience = WORKER_DEATH_S if isinstance(exc, (OSError, EOFError)) else 0.0
            dead = dead_workers(dataloader, known)
            deadline = time.monotonic() + patience
            while not dead and time.monotonic() < deadline:
                time.sleep(POOL_POLL_S)
                dead = dead_workers(dataloader, known)
            if dead:
                raise _worker_died(dead, key, index, total) from exc
            exc.add_note(f"gluon_stream: raised in a DataLoader worker process while loading "
                         f"batch {index + 1} of {total} of {_describe_key(key)}")
            raise
        del result
        yield batch
        del batch  # a kept exception's frames must not pin shared-memory batches


def _worker_died(dead: list, key: Any, index: int, total: int) -> Exception:
    pid, code = dead[0]
    if code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"exited with code {code}"
    return WorkerDied(
        f"DataLoader worker process {pid} {how} while {_describe_key(key)} was loading; batch "
        f"{index + 1} of {total} and the others it held are lost. Likely out of memory (check "
        "`dmesg` for the OOM killer) or a crash in sample_transform/batchify_fn: lower "
        "num_workers, use thread_pool=True, or pass on_error=('retry', n) to redo the lost "
        "batches in a new pool", pid=pid, signal=-code if code < 0 else None, key=key)


def thread_batches(dataloader: Any, timeout: float, key: Any, total: int) -> Iterator[Any]:
    """A thread-pool or in-process DataLoader's batches, its timeout raised as BatchTimeout."""
    batches = iter(dataloader)
    try:
        index = 0
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            except multiprocessing.TimeoutError as exc:
                raise BatchTimeout(
                    f"batch {index + 1} of {total} of {_describe_key(key)} took longer than "
                    f"timeout={timeout:g} s in a DataLoader worker thread: sample_transform or "
                    "batchify_fn is too slow (or stuck); speed it up or raise timeout=") from exc
            index += 1
            yield batch
    finally:
        batches.close()
