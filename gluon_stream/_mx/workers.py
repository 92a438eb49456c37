"""Per-sample work (``sample_transform``, ``batchify_fn``) done ahead of the training loop.

Three ways to run a :class:`~gluon_stream._mx.samples.BatchMaker`, one interface:

* :class:`InlineWorkers` (``num_workers=0``): in the loop's own thread, when a batch is asked for.
* :class:`ThreadWorkers` (``thread_pool=True``): a thread pool, for code that releases the GIL.
  Its first batch is made alone: Gluon's hybrid blocks are not thread-safe on their first call.
* :class:`ProcessWorkers` (``num_workers > 0``, the default): worker processes forked once, when
  the loader is built (before its producer threads exist, and before a training loop creates
  GPU contexts), and kept across shards and epochs. A shard reaches them as shared memory
  (its file descriptor over a Unix socket, see :mod:`.shm`); a batch comes back in one of the
  worker's slots (shared memory the loader mapped once, reused once the loop dropped the batch
  it held), as NDArrays wrapped without a copy: per batch the loop's process sends one short
  message and receives one. A dead worker is noticed at once (its process
  sentinel wakes a wait; a message it cannot be sent is a death too) and replaced; its batches
  are redone by the replacement within ``retries`` deaths per shard per epoch, so every batch
  is still delivered exactly once, and past that the next :meth:`~ProcessWorkers.result`
  raises :class:`~gluon_stream.WorkerDied`. Workers ignore SIGINT (Ctrl-C is the loop's) and
  exit when the loader's process dies, whichever of its threads built them (see
  :class:`~gluon_stream._mx.parent_pipe.ParentPipe`).

Random augmentation (the ``seed`` of :meth:`submit`, apache/mxnet#9335): worker processes
forked from one process inherit one numpy, one ``random`` and one MXNet RNG state, so without
care they repeat each other's draws. A batch is made with the global RNGs seeded from its seed
(:func:`~gluon_stream._mx.samples.seeded_globals`), so draws differ between batches and epochs,
and a batch draws the same numbers on any number of worker processes, after a worker's death
and after a resume. Per kind of worker:

* processes: numpy's, ``random``'s and MXNet's CPU RNG are seeded. Reseeding MXNet's costs
  about 1.7 ms of a worker's CPU (MXNet reseeds every one of its parallel generators), so it is
  done just before a batch's first MXNet operator, and not at all for a batch that runs none
  (numpy-only augmentation): see :func:`~gluon_stream._mx.samples.seed_mxnet_lazily`.
* ``num_workers=0``: numpy's and ``random``'s, which draw what the processes draw, and are put
  back after each batch, so the loop's own draws are as if the loader were not there. MXNet's
  RNG is not seeded (its state cannot be saved and restored). Another thread drawing from the
  global RNGs meanwhile (a ``FunctionSource`` function in a producer thread) shares the
  batch's seeded state: such code should draw from its own ``np.random.default_rng``.
* threads: **not seeded**. The global RNGs are shared by every thread, so a seed set for one
  batch would be consumed by whichever batches run at the same time; augmentation draws from
  the process's RNGs as they stand: random, never repeated, but not reproducible.

The interface: :meth:`attach` a source (a shard, or samples carried over) under an id,
:meth:`submit` batches as ``[(source id, rows), ...]``, take each :meth:`result` (in any order
the caller likes), :meth:`detach` sources no longer needed, :meth:`new_epoch` when an epoch's
batches begin, :meth:`cancel_all` when a pass is cut short, :meth:`close` at the end.
"""
from __future__ import annotations

import collections
import logging
import math
import multiprocessing
import multiprocessing.connection as mp_connection
import select
import socket
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from .._utils.closing import WAIT_SLICE_S
from ..errors import WorkerDied, add_note
from .in_process import PER_WORKER, InlineWorkers, ThreadWorkers
from .numpy_mode import numpy_mode
from .parent_pipe import ParentPipe
from .samples import BatchMaker, Refs
from .shm import SharedArrays, SlotTable, recv_fds, remove_worker_shm, send_fds
from .worker_deaths import DeathBudget, closed_while, death, too_slow, what_of
from .worker_process import unpickle_error, worker_main

__all__ = ["InlineWorkers", "PER_WORKER", "ProcessWorkers", "ThreadWorkers", "make_workers"]

logger = logging.getLogger(__name__)

EXIT_S = 1.0  # how long workers get to exit on close() before they are killed


def make_workers(num_workers: int, thread_pool: bool, maker_args: dict, retries: int,
                 active: int | None = None) -> "InlineWorkers | ThreadWorkers | ProcessWorkers":
    """The workers a loader's per-sample path runs on (see the module doc); ``active``: of
    the processes, how many are given batches at first (the ``memory_budget`` tuner)."""
    if num_workers == 0:
        return InlineWorkers(BatchMaker(**maker_args))
    if thread_pool:
        return ThreadWorkers(num_workers, BatchMaker(**maker_args))
    return ProcessWorkers(num_workers, BatchMaker(**maker_args, in_worker=True),
                          retries=retries, active=active)


# -- worker processes ------------------------------------------------------------------------------
@dataclass
class _Task:
    refs: Refs
    what: str
    key: Any
    seed: int | None
    numpy: bool = False  # the loop's thread had Gluon's numpy semantics on
    worker: "_Worker | None" = None


@dataclass(eq=False)
class _Worker:
    process: Any
    conn: mp_connection.Connection
    pid: int
    serial: int  # unique in this pool (pids are reused): names its slots
    busy: set[int] = field(default_factory=set)
    last: _Task | None = None  # the last batch it was given (named if it dies holding none)


@dataclass
class _Failure:
    """A batch that failed in a worker: the exception to raise when it is asked for."""

    error: BaseException


class ProcessWorkers:
    """Persistent worker processes (see the module doc).

    Args:
        num_workers: Processes to fork now.
        maker: What each worker runs per batch (inherited at fork, never pickled).
        retries: Worker deaths allowed per shard per epoch (``on_error=('retry', n)``), each
            redoing the batches the dead worker held; 0: a death raises
            :class:`~gluon_stream.WorkerDied` from the next :meth:`result`.
        active: Of the ``num_workers`` forked, how many are given batches (None: all);
            :meth:`set_active` changes it (the ``memory_budget`` tuner: processes are forked
            once, here, before the loader's threads exist, and never later).
    """

    uses_shared_memory = True

    def __init__(self, num_workers: int, maker: BatchMaker, retries: int = 0,
                 active: int | None = None) -> None:
        self.num_workers = num_workers
        self.active = num_workers if active is None else max(1, min(active, num_workers))
        self.depth = PER_WORKER * self.active
        self.maker = maker
        self.forks = 0
        self._context = multiprocessing.get_context("fork")
        self._workers: list[_Worker] = []
        self._sources: dict[int, SharedArrays] = {}
        self._tasks: dict[int, _Task] = {}
        self._queue: collections.deque[int] = collections.deque()
        self._results: dict[int, Any] = {}
        self._budget = DeathBudget(retries)  # worker deaths per shard, this epoch
        self._failure: WorkerDied | None = None  # a death past its budget: the next result()
        self._closed = threading.Event()
        self._lock = threading.Lock()  # close() may come from another thread
        self._slots = SlotTable()
        self._poller = select.poll()  # every worker's socket and process sentinel, kept
        self._watched: dict[int, tuple[_Worker, bool]] = {}  # fd -> (worker, is sentinel)
        self._parent = ParentPipe()
        try:
            for _ in range(num_workers):
                self._spawn()
        except BaseException:
            self.close()
            raise

    # -- workers ---------------------------------------------------------------------------
    def _spawn(self) -> None:
        """Fork one worker and attach every source to it."""
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        inherited = [w.conn.fileno() for w in self._workers] + [parent_sock.fileno()] + \
            [s.fd for s in self._sources.values()]
        process = self._context.Process(target=worker_main, daemon=True,
                                        name=f"gluon_stream-worker-{self.forks}",
                                        args=(child_sock, self.maker, inherited,
                                              self._parent.read_fd))
        try:
            with warnings.catch_warnings():  # MXNet's engine threads are made fork-safe by MXNet
                warnings.filterwarnings("ignore", message=".*fork.*", category=DeprecationWarning)
                process.start()
        except BaseException:
            parent_sock.close()
            raise
        finally:
            child_sock.close()
        assert process.pid is not None  # started
        worker = _Worker(process, mp_connection.Connection(parent_sock.detach()), process.pid,
                         self.forks)
        self.forks += 1
        self._workers.append(worker)
        self._slots.add_worker(worker.serial)
        for fd, sentinel in ((worker.conn.fileno(), False), (process.sentinel, True)):
            self._poller.register(fd, select.POLLIN)
            self._watched[fd] = (worker, sentinel)
        for sid, shared in self._sources.items():
            if not self._send(worker, ("attach", sid, shared.layout), [shared.fd]):
                return

    def _send(self, worker: _Worker, message: tuple, fds: Sequence[int] = ()) -> bool:
        """Send to a worker; one that cannot be reached is dead (handled here: False)."""
        try:
            worker.conn.send(message)
            send_fds(worker.conn, fds)
        except OSError as exc:  # BrokenPipeError, ConnectionResetError: its end is closed
            logger.debug("worker %d cannot be sent %r: %s", worker.pid, message[0], exc)
            self._died(worker)
            return False
        return True

    @property
    def pids(self) -> list[int]:
        """Process ids of the workers in the pool now."""
        return [w.pid for w in self._workers]

    # -- the interface ---------------------------------------------------------------------
    def attach(self, sid: int, arrays: Sequence[np.ndarray]) -> None:
        shared = arrays if isinstance(arrays, SharedArrays) else SharedArrays.copy_of(arrays)
        self._sources[sid] = shared
        for worker in list(self._workers):
            self._send(worker, ("attach", sid, shared.layout), [shared.fd])

    def detach(self, sid: int) -> None:
        if self._sources.pop(sid, None) is None:
            return
        for worker in list(self._workers):
            self._send(worker, ("detach", sid))

    def submit(self, tid: int, refs: Refs, what: str = "", key: Any = None,
               seed: int | None = None) -> None:
        self._tasks[tid] = _Task(refs, what, key, seed, numpy_mode())
        self._queue.append(tid)
        self._dispatch()

    def result(self, tid: int, timeout: float, what: str = "") -> Any:
        """The batch ``tid`` (raising what it raised), waiting at most ``timeout`` seconds.

        Raises:
            WorkerDied: a worker died past the retry budget since the last call (whichever
                batch it held).
            BatchTimeout: the batch took too long (its worker is killed and replaced).
            LoaderClosed: :meth:`close` was called meanwhile.
        """
        deadline = time.monotonic() + timeout
        wait = 0.0  # first take in what arrived and notice deaths, without waiting
        while True:
            if self._closed.is_set():
                raise closed_while(what)
            try:
                self._poll(wait)
            except (OSError, ValueError):
                if self._closed.is_set():
                    raise closed_while(what) from None
                raise
            if self._failure is not None:
                error, self._failure = self._failure, None
                raise error
            self._dispatch()  # workers that finished a batch get the next one now
            if tid in self._results:
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._stuck(tid, timeout, what)
            wait = min(WAIT_SLICE_S, remaining)
        self._tasks.pop(tid, None)
        result = self._results.pop(tid)
        if isinstance(result, _Failure):
            raise result.error
        return result

    def done(self, tid: int) -> bool:
        """Whether :meth:`result` would return (or raise) at once (takes in what arrived)."""
        if tid not in self._results and not self._closed.is_set():
            self._poll(0)
        return tid in self._results or self._failure is not None

    @property
    def retries(self) -> int:
        """Worker deaths allowed per shard per epoch."""
        return self._budget.retries

    def new_epoch(self) -> None:
        """An epoch's batches begin: each shard may again lose ``retries`` workers."""
        self._budget.new_epoch()

    def set_active(self, active: int) -> None:
        """Give batches to ``active`` of the workers from now on (1 .. ``num_workers``); a
        worker left out finishes what it holds."""
        self.active = max(1, min(active, self.num_workers))
        self.depth = PER_WORKER * self.active

    def in_flight(self) -> int:
        """Batches the workers hold now: sent, not back yet (takes in what arrived, does not
        wait)."""
        if not self._closed.is_set():
            self._poll(0)
        return sum(len(w.busy) for w in self._workers)

    def cancel_all(self) -> None:
        """Forget every batch not yet taken; results still in flight are dropped on arrival."""
        self._queue.clear()
        self._tasks.clear()
        self._results.clear()
        for sid in list(self._sources):
            self.detach(sid)

    # -- internals -------------------------------------------------------------------------
    def _dispatch(self) -> None:
        """Fork replacements for dead workers (the pool is whole again), then send queued
        batches to the least busy workers, PER_WORKER at most each."""
        while not self._closed.is_set() and self._failure is None:
            if len(self._workers) < self.num_workers:
                self._spawn()
                continue
            if not self._queue:
                return
            worker = min(self._workers[:self.active], key=lambda w: len(w.busy))
            if len(worker.busy) >= PER_WORKER:
                return
            tid = self._queue.popleft()
            task = self._tasks.get(tid)
            if task is None:
                continue
            message = ("task", tid, list(task.refs), task.seed, self._slots.freed(worker.serial),
                       task.numpy)
            if self._send(worker, message):
                task.worker, worker.last = worker, task
                worker.busy.add(tid)
            else:  # it was dead already: the batch goes to another (or a new) worker
                self._queue.appendleft(tid)

    def _poll(self, timeout: float) -> None:
        """Take in the batches that came back and handle the workers that died, waiting up
        to ``timeout`` seconds for either (one poll on the kept set of descriptors)."""
        ready = self._poller.poll(max(1, math.ceil(timeout * 1000)) if timeout > 0 else 0)
        events = [self._watched[fd] for fd, _ in ready if fd in self._watched]
        for worker, sentinel in events:
            if not sentinel and worker in self._workers and not self._receive(worker):
                self._died(worker)
        for worker, sentinel in events:
            if sentinel and worker in self._workers:
                self._died(worker)

    def _unwatch(self, worker: _Worker) -> None:
        for fd in [fd for fd, (w, _) in self._watched.items() if w is worker]:
            del self._watched[fd]
            self._poller.unregister(fd)

    def _receive(self, worker: _Worker) -> bool:
        """Take in one message from a worker; False if there is none whole (it is gone)."""
        try:
            message = worker.conn.recv()
            kind, tid = message[0], message[1]
            if kind == "done":  # (payload, slot, size if the slot is new, slots it retired)
                slot, size = message[3], message[4]
                fd = recv_fds(worker.conn, 1)[0] if size else None
                self._slots.update(worker.serial, slot, size, fd, message[5])
        except (EOFError, OSError) as exc:  # closed, or died mid-message: the batch is lost
            logger.debug("worker %d: nothing more to receive (%s)", worker.pid, exc)
            return False
        worker.busy.discard(tid)
        task = self._tasks.get(tid)
        if task is None:  # cancelled meanwhile
            if kind == "done" and slot >= 0:
                self._slots.give_back(worker.serial, slot)
            return True
        if kind == "done":
            try:
                self._results[tid] = self._slots.load(worker.serial, slot, message[2])
            except Exception as exc:  # e.g. a class the loader's process cannot import
                add_note(exc, f"gluon_stream: the batch worker process {worker.pid} made "
                              f"({what_of(task.what)}) could not be read here")
                self._results[tid] = _Failure(exc)
            return True
        error = unpickle_error(message[2])
        add_note(error, f"gluon_stream: raised in worker process {worker.pid} while making "
                        f"{what_of(task.what)}")
        self._results[tid] = _Failure(error)
        return True

    def _died(self, worker: _Worker) -> None:
        """A worker is gone: keep the batches it sent whole, then redo the ones it held in a
        replacement (within this epoch's budget of their shards) or fail with WorkerDied."""
        if worker not in self._workers:
            return
        while _readable(worker.conn) and self._receive(worker):
            continue
        code = self._retire(worker, kill=False)
        if self._closed.is_set():
            return
        lost = sorted(t for t in worker.busy if t in self._tasks)
        tasks = [self._tasks[t] for t in lost] or \
            ([worker.last] if worker.last is not None else [])
        keys = list(dict.fromkeys(t.key for t in tasks)) or [None]
        how = death(worker.pid, code, tasks[0] if lost else None, worker.last)
        count = self._budget.spend(keys)
        if count is not None:
            logger.warning("%s; %s in a new worker process (retry %d/%d of shard %s this epoch)",
                           how, f"redoing its {len(lost)} batch(es)" if lost else "replacing it",
                           count, self.retries, ", ".join(repr(k) for k in keys))
            self._queue.extendleft(reversed(lost))
            return
        for tid in lost:
            self._results[tid] = _Failure(self._budget.error(worker.pid, code, how, keys[0]))
        self._failure = self._budget.error(worker.pid, code, how, keys[0])

    def _stuck(self, tid: int, timeout: float, what: str) -> None:
        """A batch ran past ``timeout``: kill its worker (stuck in user code) and raise."""
        task = self._tasks.get(tid)
        if task is not None and task.worker is not None and task.worker in self._workers:
            self._retire(task.worker, kill=True)
        raise too_slow(what, timeout, "process")

    def _retire(self, worker: _Worker, kill: bool) -> int | None:
        """Take a dead (or, with ``kill``, a stuck) worker out of the pool; its exit code.
        One still running a second later (its socket failed while it lived) is killed. It
        leaves the pool only once reaped: interrupted before, close() still ends it."""
        if kill:
            worker.process.kill()
        worker.process.join(EXIT_S)
        if worker.process.exitcode is None:
            logger.warning("worker %d could not be reached but still runs: killing it",
                           worker.pid)
            worker.process.kill()
            worker.process.join(EXIT_S)
        code = worker.process.exitcode
        self._workers.remove(worker)
        self._unwatch(worker)
        self._slots.remove_worker(worker.serial)
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
            self._unwatch(worker)
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
        self._parent.close()
        self._slots.close()
        self._queue.clear()
        self._tasks.clear()
        self._results.clear()
        self._sources.clear()


def _readable(conn: mp_connection.Connection) -> bool:
    """Whether a dead worker's socket still holds data (a message it sent before dying)."""
    try:
        return conn.poll(0)
    except (OSError, ValueError) as exc:  # closed meanwhile (by close())
        logger.debug("socket of a dead worker unreadable: %s", exc)
        return False
