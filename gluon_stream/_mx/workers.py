"""Per-sample work (``sample_transform``, ``batchify_fn``) done ahead of the training loop.

Three ways to run a :class:`~gluon_stream._mx.samples.BatchMaker`, one interface:

* :class:`InlineWorkers` (``num_workers=0``): in the loop's own thread, when a batch is asked for.
* :class:`ThreadWorkers` (``thread_pool=True``): a thread pool, for code that releases the GIL.
  Its first batch is made alone: Gluon's hybrid blocks are not thread-safe on their first call.
* :class:`ProcessWorkers` (``num_workers > 0``, the default): worker processes forked once, when
  the loader is built (before its producer threads exist, and before a training loop creates
  GPU contexts), and kept across shards and epochs. A shard reaches them as shared memory
  (its file descriptor over a Unix socket, see :mod:`.shm`); a batch comes back as MXNet
  ``cpu_shared`` NDArrays wrapped without a copy. A dead worker is noticed at once (its process
  sentinel wakes the wait); its batches are redone by a replacement when retries are allowed,
  so every batch is still delivered exactly once. Workers ignore SIGINT (Ctrl-C is the loop's)
  and die with the loader's process.

The interface: :meth:`attach` a source (a shard, or samples carried over) under an id,
:meth:`submit` batches as ``[(source id, rows), ...]``, take each :meth:`result` (in any order
the caller likes), :meth:`detach` sources no longer needed, :meth:`cancel_all` when a pass is
cut short, :meth:`close` at the end.
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import ctypes
import logging
import multiprocessing
import multiprocessing.connection as mp_connection
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from .._closing import end_thread_pool
from ..errors import BatchTimeout, LoaderClosed, WorkerDied, add_note
from .samples import BatchMaker, Refs
from .shm import SharedArrays, attach, dump_batch, load_batch, recv_fds, remove_worker_shm, send_fds

__all__ = ["InlineWorkers", "ProcessWorkers", "ThreadWorkers", "make_workers"]

logger = logging.getLogger(__name__)

PER_WORKER = 2  # batches in flight per worker (MXNet's DataLoader keeps 2 * num_workers)
WAIT_SLICE_S = 0.5  # how often a wait re-checks close()
EXIT_S = 1.0  # how long workers get to exit on close() before they are killed
CLOSE_WAIT_S = 2.0  # how long close() waits for a thread stuck in per-sample code


def make_workers(num_workers: int, thread_pool: bool, maker_args: dict, retries: int) -> Any:
    """The workers a loader's per-sample path runs on (see the module doc)."""
    if num_workers == 0:
        return InlineWorkers(BatchMaker(**maker_args))
    if thread_pool:
        return ThreadWorkers(num_workers, BatchMaker(**maker_args))
    return ProcessWorkers(num_workers, BatchMaker(**maker_args, shared_memory=True),
                          retries=retries)


def _what(desc: str) -> str:
    return desc or "a batch"


class InlineWorkers:
    """Makes each batch in the calling thread, when its result is asked for."""

    depth = 1
    uses_shared_memory = False

    def __init__(self, maker: BatchMaker) -> None:
        self.maker = maker
        self._sources: dict[int, Sequence[np.ndarray]] = {}
        self._tasks: dict[int, Refs] = {}

    def attach(self, sid: int, arrays: Sequence[np.ndarray]) -> None:
        self._sources[sid] = arrays

    def detach(self, sid: int) -> None:
        self._sources.pop(sid, None)

    def submit(self, tid: int, refs: Refs, what: str = "", key: Any = None,
               seed: int | None = None) -> None:
        self._tasks[tid] = refs

    def result(self, tid: int, timeout: float, what: str = "") -> Any:
        return self.maker(self._sources, self._tasks.pop(tid))

    def done(self, tid: int) -> bool:
        """Whether :meth:`result` would return without making or waiting for the batch."""
        return False

    def new_epoch(self) -> None:
        """An epoch's batches begin: per-epoch budgets (worker retries) start afresh."""

    def cancel_all(self) -> None:
        self._tasks.clear()
        self._sources.clear()

    def close(self) -> None:
        self.cancel_all()


class ThreadWorkers(InlineWorkers):
    """Makes batches in a pool of ``num_workers`` threads."""

    def __init__(self, num_workers: int, maker: BatchMaker) -> None:
        super().__init__(maker)
        self.depth = PER_WORKER * num_workers
        self._pool = cf.ThreadPoolExecutor(num_workers, thread_name_prefix="gluon_stream-worker")
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
        self._futures[tid] = self._pool.submit(self.maker, sources, refs)

    def result(self, tid: int, timeout: float, what: str = "") -> Any:
        future = self._futures.pop(tid)
        deadline = time.monotonic() + timeout
        while not cf.wait([future], timeout=min(WAIT_SLICE_S, max(0.0, deadline -
                                                                 time.monotonic()))).done:
            if self._closed.is_set():
                raise LoaderClosed(f"the loader was closed while waiting for {_what(what)}")
            if time.monotonic() >= deadline:
                raise BatchTimeout(
                    f"{_what(what)} took longer than timeout={timeout:g} s in a worker thread: "
                    "sample_transform or batchify_fn is too slow (or stuck); speed it up or "
                    "raise timeout=")
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


@dataclass
class _Worker:
    process: Any
    conn: mp_connection.Connection
    pid: int
    busy: set = field(default_factory=set)


@dataclass
class _Task:
    refs: Refs
    what: str
    key: Any
    worker: "_Worker | None" = None


@dataclass
class _Failure:
    """A batch that failed in a worker: the exception to raise when it is asked for."""

    error: BaseException


class ProcessWorkers:
    """Persistent worker processes (see the module doc).

    Args:
        num_workers: Processes to fork now.
        maker: What each worker runs per batch (inherited at fork, never pickled).
        retries: Replacement workers per shard when a worker dies (``on_error=('retry', n)``);
            0 raises :class:`~gluon_stream.WorkerDied` instead.
    """

    uses_shared_memory = True

    def __init__(self, num_workers: int, maker: BatchMaker, retries: int = 0) -> None:
        self.num_workers = num_workers
        self.depth = PER_WORKER * num_workers
        self.maker = maker
        self.retries = retries
        self.forks = 0
        self._context = multiprocessing.get_context("fork")
        self._workers: list[_Worker] = []
        self._sources: dict[int, SharedArrays] = {}
        self._tasks: dict[int, _Task] = {}
        self._queue: collections.deque[int] = collections.deque()
        self._results: dict[int, Any] = {}
        self._deaths: collections.Counter = collections.Counter()
        self._closed = threading.Event()
        self._lock = threading.Lock()  # close() may come from another thread
        for _ in range(num_workers):
            self._spawn()

    # -- workers ---------------------------------------------------------------------------
    def _spawn(self) -> None:
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        inherited = [w.conn.fileno() for w in self._workers] + [parent_sock.fileno()] + \
            [s.fd for s in self._sources.values()]
        process = self._context.Process(target=_worker_main, daemon=True,
                                        name=f"gluon_stream-worker-{self.forks}",
                                        args=(child_sock, self.maker, inherited, os.getpid()))
        with warnings.catch_warnings():  # MXNet's engine threads are made fork-safe by MXNet
            warnings.filterwarnings("ignore", message=".*fork.*", category=DeprecationWarning)
            process.start()
        child_sock.close()
        worker = _Worker(process, mp_connection.Connection(parent_sock.detach()), process.pid)
        self.forks += 1
        self._workers.append(worker)
        for sid, shared in self._sources.items():
            self._send_attach(worker, sid, shared)

    def _send_attach(self, worker: _Worker, sid: int, shared: SharedArrays) -> None:
        worker.conn.send(("attach", sid, shared.layout))
        send_fds(worker.conn, [shared.fd])

    @property
    def pids(self) -> list[int]:
        """Process ids of the workers alive now."""
        return [w.pid for w in self._workers]

    # -- the interface ---------------------------------------------------------------------
    def attach(self, sid: int, arrays: Sequence[np.ndarray]) -> None:
        shared = arrays if isinstance(arrays, SharedArrays) else SharedArrays.copy_of(arrays)
        self._sources[sid] = shared
        for worker in list(self._workers):
            self._send_attach(worker, sid, shared)

    def detach(self, sid: int) -> None:
        if self._sources.pop(sid, None) is None:
            return
        for worker in list(self._workers):
            worker.conn.send(("detach", sid))

    def submit(self, tid: int, refs: Refs, what: str = "", key: Any = None,
               seed: int | None = None) -> None:
        self._tasks[tid] = _Task(refs, what, key)
        self._queue.append(tid)
        self._dispatch()

    def result(self, tid: int, timeout: float, what: str = "") -> Any:
        deadline = time.monotonic() + timeout
        while tid not in self._results:
            if self._closed.is_set():
                raise LoaderClosed(f"the loader was closed while waiting for {_what(what)}")
            self._dispatch()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._stuck(tid, timeout, what)
            objects = [w.conn for w in self._workers] + [w.process.sentinel
                                                         for w in self._workers]
            try:
                ready = mp_connection.wait(objects, timeout=min(WAIT_SLICE_S, remaining))
            except (OSError, ValueError):
                if self._closed.is_set():
                    raise LoaderClosed(f"the loader was closed while waiting for "
                                       f"{_what(what)}") from None
                raise
            for obj in ready:
                worker = next((w for w in self._workers
                               if obj is w.conn or obj == w.process.sentinel), None)
                if worker is None:
                    continue
                if obj is worker.conn:
                    self._receive(worker)
                else:
                    self._died(worker)
        self._tasks.pop(tid, None)
        result = self._results.pop(tid)
        if isinstance(result, _Failure):
            raise result.error
        return result

    def done(self, tid: int) -> bool:
        """Whether the batch is back (takes in what arrived, without waiting)."""
        if tid not in self._results and not self._closed.is_set():
            for worker in mp_connection.wait([w.conn for w in self._workers], timeout=0):
                owner = next((w for w in self._workers if w.conn is worker), None)
                if owner is not None:
                    self._receive(owner)
        return tid in self._results

    def new_epoch(self) -> None:
        """An epoch's batches begin: per-epoch budgets (worker retries) start afresh."""

    def cancel_all(self) -> None:
        """Forget every batch not yet taken; results still in flight are dropped on arrival."""
        self._queue.clear()
        self._tasks.clear()
        self._results.clear()
        for sid in list(self._sources):
            self.detach(sid)

    # -- internals -------------------------------------------------------------------------
    def _dispatch(self) -> None:
        if len(self._workers) < self.num_workers and not self._closed.is_set():
            for _ in range(self.num_workers - len(self._workers)):
                self._spawn()  # after a death or a stuck batch: the pool is whole again
        while self._queue:
            worker = min(self._workers, key=lambda w: len(w.busy))
            if len(worker.busy) >= PER_WORKER:
                return
            tid = self._queue.popleft()
            task = self._tasks.get(tid)
            if task is None:
                continue
            task.worker = worker
            worker.busy.add(tid)
            worker.conn.send(("task", tid, list(task.refs)))

    def _receive(self, worker: _Worker) -> None:
        try:
            message = worker.conn.recv()
        except (EOFError, OSError):
            self._died(worker)
            return
        kind, tid = message[0], message[1]
        worker.busy.discard(tid)
        if kind == "done":
            fds = recv_fds(worker.conn, message[3])
            batch = load_batch(message[2], fds)
            if tid in self._tasks:
                self._results[tid] = batch
            return
        error = _unpickle_error(message[2])
        task = self._tasks.get(tid)
        if task is not None:
            add_note(error, f"gluon_stream: raised in worker process {worker.pid} while making "
                            f"{_what(task.what)}")
            self._results[tid] = _Failure(error)

    def _died(self, worker: _Worker) -> None:
        """A worker's sentinel fired: redo its batches in a replacement, or fail them."""
        if worker not in self._workers:
            return
        code = self._retire(worker, kill=False)
        lost = sorted(t for t in worker.busy if t in self._tasks)
        if self._closed.is_set() or not lost:
            return
        key = self._tasks[lost[0]].key
        if self._deaths[key] < self.retries:
            self._deaths[key] += 1
            logger.warning("%s; redoing its %d batch(es) in a new worker process (retry %d/%d)",
                           _death(worker.pid, code, key, self._tasks[lost[0]].what),
                           len(lost), self._deaths[key], self.retries)
            self._queue.extendleft(reversed(lost))
            return
        for tid in lost:
            message = _death(worker.pid, code, self._tasks[tid].key, self._tasks[tid].what)
            self._results[tid] = _Failure(WorkerDied(
                f"{message}; it and the batches it held are lost. Likely out of memory (check "
                "`dmesg` for the OOM killer) or a crash in sample_transform/batchify_fn: lower "
                "num_workers, use thread_pool=True, or pass on_error=('retry', n) to redo the "
                "lost batches in a new worker", pid=worker.pid,
                signal=-code if code is not None and code < 0 else None,
                key=self._tasks[tid].key))

    def _stuck(self, tid: int, timeout: float, what: str) -> None:
        """A batch ran past ``timeout``: kill its worker (stuck in user code) and raise."""
        task = self._tasks.get(tid)
        if task is not None and task.worker is not None and task.worker in self._workers:
            self._retire(task.worker, kill=True)
        raise BatchTimeout(
            f"{_what(what)} took longer than timeout={timeout:g} s in a worker process: "
            "sample_transform or batchify_fn is too slow (or stuck); speed it up or raise "
            "timeout=")

    def _retire(self, worker: _Worker, kill: bool) -> int | None:
        """Take a dead (or, with ``kill``, a stuck) worker out of the pool; its exit code."""
        if kill:
            worker.process.kill()
        worker.process.join(EXIT_S)
        code = worker.process.exitcode
        self._workers.remove(worker)
        worker.conn.close()
        worker.process.close()
        remove_worker_shm(worker.pid)
        return code

    def close(self) -> None:
        """Stop every worker (killed if it does not exit within a second); idempotent."""
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
        workers, self._workers = list(self._workers), []
        for worker in workers:
            try:
                worker.conn.send(("stop",))
            except OSError as exc:
                logger.debug("worker %d is gone already: %s", worker.pid, exc)
        deadline = time.monotonic() + EXIT_S
        for worker in workers:
            worker.process.join(max(0.0, deadline - time.monotonic()))
        for worker in workers:
            if worker.process.exitcode is None:
                logger.debug("killing worker %d that did not exit", worker.pid)
                worker.process.kill()
                worker.process.join(EXIT_S)
            if worker.process.exitcode != 0:
                remove_worker_shm(worker.pid)
            worker.conn.close()
            worker.process.close()
        self._queue.clear()
        self._tasks.clear()
        self._results.clear()
        self._sources.clear()


def _death(pid: int, code: int | None, key: Any, what: str) -> str:
    if code is not None and code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"exited with code {code}"
    shard = f" of shard {key!r}" if key is not None else ""
    return f"worker process {pid} {how} while making {_what(what)}{shard}"


def _pickle_error(exc: BaseException) -> bytes:
    """The exception as bytes, keeping its type where it pickles; its traceback as a note."""
    add_note(exc, "gluon_stream: traceback in the worker process:\n"
                  + "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    try:
        return pickle.dumps(exc)
    except Exception as why:  # an exception type pickle cannot rebuild
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return pickle.dumps(RuntimeError(f"{type(exc).__name__}: {exc} (not picklable: {why})"
                                         f"\n{text}"))


def _unpickle_error(data: bytes) -> BaseException:
    try:
        return pickle.loads(data)
    except Exception as exc:  # e.g. a class the loader's process cannot import
        return RuntimeError(f"a worker raised an exception that cannot be rebuilt here: {exc}")


# -- the worker process ------------------------------------------------------------------------
def _die_with_parent(parent: int) -> None:
    """Ask Linux to SIGKILL this worker when the loader's process dies (best effort)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError) as exc:
            logger.debug("prctl(PR_SET_PDEATHSIG) unavailable: %s", exc)
    if os.getppid() != parent:
        os._exit(0)


def _worker_main(sock: socket.socket, maker: BatchMaker, inherited: list[int],
                 parent: int) -> None:
    """A worker's life: attach sources, make batches, send them back, until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the training loop
    _die_with_parent(parent)
    for fd in inherited:  # the other workers' sockets and the loader's shard files
        try:
            os.close(fd)
        except OSError as exc:
            logger.debug("fd %d not inherited: %s", fd, exc)
    conn = mp_connection.Connection(sock.detach())
    sources: dict[int, tuple] = {}
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        kind = message[0]
        if kind == "attach":
            sources[message[1]] = attach(recv_fds(conn, 1)[0], message[2])
        elif kind == "detach":
            sources.pop(message[1], None)
        elif kind == "task":
            tid, refs = message[1], message[2]
            try:
                payload, fds, keep = dump_batch(maker(sources, refs))
            except Exception as exc:
                conn.send(("error", tid, _pickle_error(exc)))
                continue
            conn.send(("done", tid, payload, len(fds)))
            send_fds(conn, fds)
            del keep
        elif kind == "stop":
            return
