"""The batches asked of :class:`~gluon_stream._mx.workers.ProcessWorkers`, submit to result.

:class:`TaskBook` holds each batch's :class:`Task` until its result is taken, the order the
batches go out to workers in, what came back (a batch, or a :class:`Failure` to raise), and a
worker death past its budget that the next ``result()`` raises. Kept apart from the processes
(:mod:`.worker_pool`) so that redoing a dead worker's batches is a matter of this book alone.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..errors import WorkerDied
from .samples import Refs
from .worker_pool import Worker

__all__ = ["Failure", "Task", "TaskBook"]


@dataclass
class Task:
    """One batch asked for: its rows, its words and shard (for messages), its seed."""

    refs: Refs
    what: str
    key: Any
    seed: int | None
    numpy: bool = False  # the loop's thread had Gluon's numpy semantics on
    worker: Worker | None = None


@dataclass
class Failure:
    """A batch that failed in a worker: the exception to raise when it is asked for."""

    error: BaseException


class TaskBook:
    """Tasks by id, the queue of ids not yet sent, results by id, and a pending death."""

    def __init__(self) -> None:
        self.tasks: dict[int, Task] = {}
        self.queue: collections.deque[int] = collections.deque()
        self.results: dict[int, Any] = {}
        self.failure: WorkerDied | None = None  # a death past its budget: the next result()

    def add(self, tid: int, task: Task) -> None:
        """Batch ``tid`` is asked for: it goes out after those asked before."""
        self.tasks[tid] = task
        self.queue.append(tid)

    def raise_failure(self) -> None:
        """Raise the pending death past its budget, once."""
        if self.failure is not None:
            error, self.failure = self.failure, None
            raise error

    def take(self, tid: int) -> Any:
        """Batch ``tid``'s result, which has arrived (raising what the batch raised)."""
        self.tasks.pop(tid, None)
        result = self.results.pop(tid)
        if isinstance(result, Failure):
            raise result.error
        return result

    def held_by(self, worker: Worker) -> list[int]:
        """The batches a worker holds that are still asked for, in order."""
        return sorted(t for t in worker.busy if t in self.tasks)

    def put_back(self, tids: Sequence[int]) -> None:
        """Send these batches out again first, in this order."""
        self.queue.extendleft(reversed(tids))

    def fail(self, tids: Sequence[int], error: Callable[[], WorkerDied]) -> None:
        """These batches raise ``error()`` (each its own), and so does the next result()."""
        for tid in tids:
            self.results[tid] = Failure(error())
        self.failure = error()

    def clear(self) -> None:
        """Forget every batch asked for and every result not taken."""
        self.queue.clear()
        self.tasks.clear()
        self.results.clear()
