"""The worker processes of :class:`~gluon_stream._mx.workers.ProcessWorkers`, as processes.

:class:`WorkerPool` forks a worker (:func:`~gluon_stream._mx.worker_process.worker_main`),
sends it messages, watches every worker's socket and process sentinel with one kept poll set,
reaps a dead or stuck one, and stops them all on close. It knows processes and sockets, not
batches: what a message carries, and what a death costs, are the caller's. Kept apart so the
pool's bookkeeping (the poll set, each worker's slots, reaping) lives in one place.
"""
from __future__ import annotations

import logging
import math
import multiprocessing
import multiprocessing.connection as mp_connection
import select
import socket
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

from .parent_pipe import ParentPipe
from .samples import BatchMaker
from .shm import SlotTable, remove_worker_shm, send_fds
from .worker_deaths import Held
from .worker_process import worker_main

__all__ = ["EXIT_S", "Worker", "WorkerPool"]

logger = logging.getLogger(__name__)

EXIT_S = 1.0  # how long workers get to exit on close() before they are killed


@dataclass(eq=False)
class Worker:
    """One worker process: its socket, and the batches it holds."""

    process: Any
    conn: mp_connection.Connection
    pid: int
    serial: int  # unique in this pool (pids are reused): names its slots
    busy: set[int] = field(default_factory=set)
    last: Held | None = None  # the last batch it was given (named if it dies holding none)

    def has_data(self) -> bool:
        """Whether a dead worker's socket still holds data (a message it sent before dying)."""
        try:
            return self.conn.poll(0)
        except (OSError, ValueError) as exc:  # closed meanwhile (by close())
            logger.debug("socket of a dead worker unreadable: %s", exc)
            return False


class WorkerPool:
    """Worker processes forked from this process, each with its slots in ``slots``.

    Args:
        maker: What each worker runs per batch (inherited at fork, never pickled).
        slots: The loader's side of the workers' slots (a worker is added on fork, removed
            when reaped); the caller owns and closes it.
    """

    def __init__(self, maker: BatchMaker, slots: SlotTable) -> None:
        self.maker = maker
        self.slots = slots
        self.workers: list[Worker] = []
        self.forks = 0
        self._context = multiprocessing.get_context("fork")
        self._poller = select.poll()  # every worker's socket and process sentinel, kept
        self._watched: dict[int, tuple[Worker, bool]] = {}  # fd -> (worker, is sentinel)
        self._parent = ParentPipe()

    def fork(self, shared_fds: Sequence[int]) -> Worker:
        """Fork one worker; ``shared_fds`` (the loader's shard files) are closed in it."""
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        inherited = [w.conn.fileno() for w in self.workers] + [parent_sock.fileno()] + \
            list(shared_fds)
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
        worker = Worker(process, mp_connection.Connection(parent_sock.detach()), process.pid,
                        self.forks)
        self.forks += 1
        self.workers.append(worker)
        self.slots.add_worker(worker.serial)
        for fd, sentinel in ((worker.conn.fileno(), False), (process.sentinel, True)):
            self._poller.register(fd, select.POLLIN)
            self._watched[fd] = (worker, sentinel)
        return worker

    @staticmethod
    def send(worker: Worker, message: tuple, fds: Sequence[int] = ()) -> bool:
        """Send to a worker; False if it cannot be reached (it is dead: the caller's to
        handle)."""
        try:
            worker.conn.send(message)
            send_fds(worker.conn, fds)
        except OSError as exc:  # BrokenPipeError, ConnectionResetError: its end is closed
            logger.debug("worker %d cannot be sent %r: %s", worker.pid, message[0], exc)
            return False
        return True

    def events(self, timeout: float) -> list[tuple[Worker, bool]]:
        """``(worker, is its sentinel)`` for each socket with data and each process that
        ended, waiting up to ``timeout`` seconds for one (one poll on the kept set)."""
        ready = self._poller.poll(max(1, math.ceil(timeout * 1000)) if timeout > 0 else 0)
        return [self._watched[fd] for fd, _ in ready if fd in self._watched]

    def _unwatch(self, worker: Worker) -> None:
        for fd in [fd for fd, (w, _) in self._watched.items() if w is worker]:
            del self._watched[fd]
            self._poller.unregister(fd)

    def retire(self, worker: Worker, kill: bool) -> int | None:
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
        self.workers.remove(worker)
        self._unwatch(worker)
        self.slots.remove_worker(worker.serial)
        worker.conn.close()
        worker.process.close()
        remove_worker_shm(worker.pid)
        return code

    def stop(self) -> None:
        """Stop every worker (killed if it does not exit within a second)."""
        workers, self.workers = list(self.workers), []
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
