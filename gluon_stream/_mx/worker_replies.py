"""What a worker process sends back, taken in by the loader's process.

A reply is ``("done", tid, payload, slot, size if the slot is new, slots it retired)``, a new
slot's file descriptor following it, or ``("error", tid, the exception as bytes)`` (see
:func:`~gluon_stream._mx.worker_process.worker_main`). :func:`take_reply` reads one, keeps
the worker's slots up to date, and files the batch (read from its slot) or its error under
its task in the :class:`~gluon_stream._mx.worker_tasks.TaskBook`. Kept apart: it is the one
place that knows the reply's layout on the loader's side.
"""
from __future__ import annotations

import logging
from typing import Any

from ..errors import add_note
from .shm import SlotTable, recv_fds
from .worker_deaths import what_of
from .worker_pool import Worker
from .worker_process import unpickle_error
from .worker_tasks import Failure, Task, TaskBook

__all__ = ["take_reply"]

logger = logging.getLogger(__name__)


def take_reply(worker: Worker, slots: SlotTable, book: TaskBook) -> bool:
    """Take in one message from a worker; False if there is none whole (it is gone)."""
    try:
        message = worker.conn.recv()
        kind, tid = message[0], message[1]
        if kind == "done":  # (payload, slot, size if the slot is new, slots it retired)
            slot, size = message[3], message[4]
            fd = recv_fds(worker.conn, 1)[0] if size else None
            slots.update(worker.serial, slot, size, fd, message[5])
    except (EOFError, OSError) as exc:  # closed, or died mid-message: the batch is lost
        logger.debug("worker %d: nothing more to receive (%s)", worker.pid, exc)
        return False
    worker.busy.discard(tid)
    task = book.tasks.get(tid)
    if task is None:  # cancelled meanwhile
        if kind == "done" and slot >= 0:
            slots.give_back(worker.serial, slot)
        return True
    book.results[tid] = _outcome(message, worker, task, slots)
    return True


def _outcome(message: tuple, worker: Worker, task: Task, slots: SlotTable) -> Any:
    """The batch a reply carries (read from its slot), or a :class:`Failure` with its error."""
    if message[0] == "done":
        try:
            return slots.load(worker.serial, message[3], message[2])
        except Exception as exc:  # e.g. a class the loader's process cannot import
            add_note(exc, f"gluon_stream: the batch worker process {worker.pid} made "
                          f"({what_of(task.what)}) could not be read here")
            return Failure(exc)
    error = unpickle_error(message[2])
    add_note(error, f"gluon_stream: raised in worker process {worker.pid} while making "
                    f"{what_of(task.what)}")
    return Failure(error)
