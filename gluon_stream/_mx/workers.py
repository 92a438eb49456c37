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

import logging
import threading
import time
from typing import Any, Sequence

import numpy as np

from .._utils.closing import WAIT_SLICE_S
from . import numpy_mode
from .in_process import PER_WORKER, InlineWorkers, ThreadWorkers
from .samples import BatchMaker, Refs
from .shm import SharedArrays, SlotTable
from .worker_deaths import DeathBudget, closed_while, death_of, too_slow
from .worker_pool import Worker, WorkerPool
from .worker_replies import take_reply
from .worker_tasks import Task, TaskBook

__all__ = ["InlineWorkers", "PER_WORKER", "ProcessWorkers", "ThreadWorkers", "make_workers"]

logger = logging.getLogger(__name__)


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


class ProcessWorkers:
    """Persistent worker processes (see the module doc).

    The processes themselves are a :class:`~gluon_stream._mx.worker_pool.WorkerPool`, the
    batches asked of them a :class:`~gluon_stream._mx.worker_tasks.TaskBook`, their replies
    are read by :func:`~gluon_stream._mx.worker_replies.take_reply`; this class ties them
    together: which worker gets which batch, and what a death costs.

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
        self._sources: dict[int, SharedArrays] = {}
        self._book = TaskBook()
        self._budget = DeathBudget(retries)  # worker deaths per shard, this epoch
        self._closed = threading.Event()
        self._lock = threading.Lock()  # close() may come from another thread
        self._slots = SlotTable()
        self._pool = WorkerPool(maker, self._slots)
        try:
            for _ in range(num_workers):
                self._spawn()
        except BaseException:
            self.close()
            raise

    # -- workers ---------------------------------------------------------------------------
    def _spawn(self) -> None:
        """Fork one worker and attach every source to it."""
        worker = self._pool.fork([s.fd for s in self._sources.values()])
        for sid, shared in self._sources.items():
            if not self._send(worker, ("attach", sid, shared.layout), [shared.fd]):
                return

    def _send(self, worker: Worker, message: tuple, fds: Sequence[int] = ()) -> bool:
        """Send to a worker; one that cannot be reached is dead (handled here: False)."""
        if self._pool.send(worker, message, fds):
            return True
        self._died(worker)
        return False

    @property
    def forks(self) -> int:
        """Worker processes forked so far (replacements included)."""
        return self._pool.forks

    @property
    def pids(self) -> list[int]:
        """Process ids of the workers in the pool now."""
        return [w.pid for w in self._pool.workers]

    # -- the interface ---------------------------------------------------------------------
    def attach(self, sid: int, arrays: Sequence[np.ndarray]) -> None:
        shared = arrays if isinstance(arrays, SharedArrays) else SharedArrays.copy_of(arrays)
        self._sources[sid] = shared
        for worker in list(self._pool.workers):
            self._send(worker, ("attach", sid, shared.layout), [shared.fd])

    def detach(self, sid: int) -> None:
        if self._sources.pop(sid, None) is None:
            return
        for worker in list(self._pool.workers):
            self._send(worker, ("detach", sid))

    def submit(self, tid: int, refs: Refs, what: str = "", key: Any = None,
               seed: int | None = None) -> None:
        self._book.add(tid, Task(refs, what, key, seed, numpy_mode()))
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
            self._book.raise_failure()
            self._dispatch()  # workers that finished a batch get the next one now
            if tid in self._book.results:
                return self._book.take(tid)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._stuck(tid, timeout, what)
            wait = min(WAIT_SLICE_S, remaining)

    def done(self, tid: int) -> bool:
        """Whether :meth:`result` would return (or raise) at once (takes in what arrived)."""
        if tid not in self._book.results and not self._closed.is_set():
            self._poll(0)
        return tid in self._book.results or self._book.failure is not None

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
        return sum(len(w.busy) for w in self._pool.workers)

    def cancel_all(self) -> None:
        """Forget every batch not yet taken; results still in flight are dropped on arrival."""
        self._book.clear()
        for sid in list(self._sources):
            self.detach(sid)

    # -- internals -------------------------------------------------------------------------
    def _dispatch(self) -> None:
        """Fork replacements for dead workers (the pool is whole again), then send queued
        batches to the least busy workers, PER_WORKER at most each."""
        book = self._book
        while not self._closed.is_set() and book.failure is None:
            if len(self._pool.workers) < self.num_workers:
                self._spawn()
                continue
            if not book.queue:
                return
            worker = min(self._pool.workers[:self.active], key=lambda w: len(w.busy))
            if len(worker.busy) >= PER_WORKER:
                return
            tid = book.queue.popleft()
            task = book.tasks.get(tid)
            if task is None:
                continue
            message = ("task", tid, list(task.refs), task.seed, self._slots.freed(worker.serial),
                       task.numpy)
            if self._send(worker, message):
                task.worker, worker.last = worker, task
                worker.busy.add(tid)
            else:  # it was dead already: the batch goes to another (or a new) worker
                book.queue.appendleft(tid)

    def _poll(self, timeout: float) -> None:
        """Take in the batches that came back and handle the workers that died, waiting up
        to ``timeout`` seconds for either."""
        events = self._pool.events(timeout)
        for worker, sentinel in events:
            if not sentinel and worker in self._pool.workers and not self._receive(worker):
                self._died(worker)
        for worker, sentinel in events:
            if sentinel and worker in self._pool.workers:
                self._died(worker)

    def _receive(self, worker: Worker) -> bool:
        """Take in one message from a worker; False if there is none whole (it is gone)."""
        return take_reply(worker, self._slots, self._book)

    def _died(self, worker: Worker) -> None:
        """A worker is gone: keep the batches it sent whole, then redo the ones it held in a
        replacement (within this epoch's budget of their shards) or fail with WorkerDied."""
        if worker not in self._pool.workers:
            return
        while worker.has_data() and self._receive(worker):
            continue
        code = self._pool.retire(worker, kill=False)
        if self._closed.is_set():
            return
        lost = self._book.held_by(worker)
        dead = death_of(worker.pid, code, [self._book.tasks[t] for t in lost], worker.last)
        count = self._budget.spend(dead.keys)
        if count is None:
            self._book.fail(lost, lambda: self._budget.error_of(dead))
            return
        logger.warning("%s; %s in a new worker process (retry %d/%d of shard %s this epoch)",
                       dead.how, f"redoing its {len(lost)} batch(es)" if lost else "replacing it",
                       count, self.retries, ", ".join(repr(k) for k in dead.keys))
        self._book.put_back(lost)

    def _stuck(self, tid: int, timeout: float, what: str) -> None:
        """A batch ran past ``timeout``: kill its worker (stuck in user code) and raise."""
        task = self._book.tasks.get(tid)
        if task is not None and task.worker is not None and task.worker in self._pool.workers:
            self._pool.retire(task.worker, kill=True)
        raise too_slow(what, timeout, "process")

    def close(self) -> None:
        """Stop every worker (killed if it does not exit within a second); idempotent."""
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
        self._pool.stop()
        self._slots.close()
        self._book.clear()
        self._sources.clear()
