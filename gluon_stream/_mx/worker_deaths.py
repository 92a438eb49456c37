"""A worker's failures, told: deaths, batches stuck past ``timeout``, a close under a wait.

:class:`DeathBudget` counts the worker deaths each shard cost this epoch against
``on_error=('retry', n)``, and builds the :class:`~gluon_stream.WorkerDied` of a death past it;
:func:`death` says in words who died, how, and making what, and :func:`death_of` gathers
that with the shards a death costs (a :class:`Death`). The messages of a batch that took
too long (:func:`too_slow`) and of a loader closed while a batch was awaited
(:func:`closed_while`) are the same for worker threads and processes.
"""
from __future__ import annotations

import collections
import signal
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from ..errors import BatchTimeout, LoaderClosed, WorkerDied

__all__ = ["Death", "DeathBudget", "Held", "closed_while", "death", "death_of", "too_slow",
           "what_of"]


class Held(Protocol):
    """What a message needs of a batch a worker held."""

    what: str  # the batch in words ("batch 3 of 9 of shard 'a'"), or ""
    key: Any  # its shard's key, or None


def what_of(desc: str) -> str:
    """A batch's description, or "a batch" when it has none."""
    return desc or "a batch"


def closed_while(what: str) -> LoaderClosed:
    """The error of a wait for a batch that close() cut short."""
    return LoaderClosed(f"the loader was closed while waiting for {what_of(what)}")


def too_slow(what: str, timeout: float, where: str) -> BatchTimeout:
    """The error of a batch that took longer than ``timeout`` in a worker ``where`` (thread,
    process)."""
    return BatchTimeout(
        f"{what_of(what)} took longer than timeout={timeout:g} s in a worker {where}: "
        "sample_transform or batchify_fn is too slow (or stuck); speed it up or raise "
        "timeout=")


def death(pid: int, code: int | None, task: Held | None, last: Held | None) -> str:
    """What happened, in words: who died, how, and making what."""
    if code is not None and code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"exited with code {code}"
    if task is not None:
        doing = f"while making {_described(task)}"
    elif last is not None:
        doing = f"between batches (its last: {_described(last)})"
    else:
        doing = "before its first batch"
    return f"worker process {pid} {how} {doing}"


@dataclass(frozen=True)
class Death:
    """A worker's death: its pid and exit code, what happened in words, the shards it cost."""

    pid: int
    code: int | None
    how: str  # :func:`death`'s words
    keys: list  # the shards of the batches it held (or of its last one), [None] if none


def death_of(pid: int, code: int | None, lost: Sequence[Held], last: Held | None) -> Death:
    """The death of a worker that held the batches ``lost`` (still asked for), its last
    batch ``last``: the shards it costs are those of ``lost``, else that of ``last``."""
    held = list(lost) or ([last] if last is not None else [])
    keys = list(dict.fromkeys(t.key for t in held)) or [None]
    return Death(pid, code, death(pid, code, held[0] if lost else None, last), keys)


def _described(task: Held) -> str:
    if task.what:  # names its shard already ("batch 3 of 9 of shard 'a'")
        return task.what
    return f"a batch of shard {task.key!r}" if task.key is not None else "a batch"


class DeathBudget:
    """Worker deaths allowed per shard per epoch (``on_error=('retry', n)``).

    Example:
        >>> budget = DeathBudget(1)
        >>> budget.spend(["a"]), budget.spend(["a"])
        (1, None)
    """

    def __init__(self, retries: int) -> None:
        self.retries = retries
        self._deaths: collections.Counter = collections.Counter()  # per shard key, this epoch

    def new_epoch(self) -> None:
        """An epoch's batches begin: each shard may again lose ``retries`` workers."""
        self._deaths.clear()

    def spend(self, keys: Sequence[Any]) -> int | None:
        """Count one death against each shard in ``keys`` if every one is within the budget:
        the highest count after; None (nothing counted) past the budget."""
        if not all(self._deaths[k] < self.retries for k in keys):
            return None
        for k in keys:
            self._deaths[k] += 1
        return max(self._deaths[k] for k in keys)

    def error_of(self, dead: Death) -> WorkerDied:
        """The error of a death past the budget, named by its first shard."""
        return self.error(dead.pid, dead.code, dead.how, dead.keys[0])

    def error(self, pid: int, code: int | None, how: str, key: Any) -> WorkerDied:
        """The error of a death past the budget (``how``: :func:`death`'s words)."""
        if self.retries:
            why = (f"on_error=('retry', {self.retries}) allows {self.retries} worker "
                   "death(s) per shard per epoch. Likely out of memory (check `dmesg` for the "
                   "OOM killer) or a crash in sample_transform/batchify_fn: lower num_workers "
                   "or use thread_pool=True")
        else:
            why = ("Likely out of memory (check `dmesg` for the OOM killer) or a crash in "
                   "sample_transform/batchify_fn: lower num_workers, use thread_pool=True, or "
                   "pass on_error=('retry', n) to redo the lost batches in a new worker")
        return WorkerDied(f"{how}; this pass cannot go on (the next one starts with a new "
                          f"worker). {why}",
                          pid=pid, signal=-code if code is not None and code < 0 else None,
                          key=key)
