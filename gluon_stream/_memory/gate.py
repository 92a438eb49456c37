"""Bytes admitted against ``memory_budget`` before they are allocated, in the order the loop
needs them.

A :class:`MemoryGate` belongs to a :class:`~gluon_stream.ShardStream` with a budget. Each shard a
producer makes opens an :class:`Admission` ranked by need (its pass's epoch, then its position:
the shard the loop needs next ranks first) and reserves, part by part, what it is about to
allocate: its raw arrays (the largest seen so far, before the source makes them; then what they
hold, once made), the transform's output (before the transform runs), and the copy the loader
prepares (its exact bytes, before the copy). Raw and transformed arrays are given back once the
copy is made; the copy is held until the shard is freed (:meth:`Admission.release`, called by a
finalizer on the shard).

Deadlock-free by order: a reservation is granted only if, beside what is admitted, it leaves
room for what the shards ranked before it still expect to reserve (their parts still to come,
at the largest sizes seen; admissions open when shards are submitted, in the order the loop
needs them). So the shard the loop needs next finds room. A shard whose arrays turn out larger
than reserved (a ``FunctionSource``'s function allocates before anyone can know the size) is
counted at once; if it is not the one ranked first and leaves too little room for those
before it, it is freed and made again when the loop reaches it (:meth:`Admission.made` says
so). Only the shard ranked first can then exceed the budget, by its own growth: once no
memory was given back for :data:`PATIENCE_S` while it waited, it is admitted over the budget,
which is logged, rather than wait for memory only its own progress would free. A reservation that
could never fit (one shard's parts beyond the whole budget) raises
:class:`~gluon_stream.MemoryBudgetTooSmall` before the memory is used. A producer waits here without
its producer's place (see the stream), every wait re-checks the closed flag.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, ContextManager

from .._utils.closing import WAIT_SLICE_S
from .._utils.libc import trim_freed
from .._utils.validate import format_bytes
from ..errors import LoaderClosed, MemoryBudgetTooSmall

__all__ = ["Admission", "GiveWay", "MemoryGate", "PATIENCE_S"]

logger = logging.getLogger(__name__)

#: seconds the shard ranked first waits with nothing given back before it is admitted anyway
PATIENCE_S = 2.0
PARTS = ("raw", "transformed", "copy", "context")  # context: context_rows (context.py)


class GiveWay(Exception):
    """A shard waiting for room holds memory the shard ranked first waits for: it frees what
    it holds and is made again when the loop reaches it."""


class Admission:
    """One shard's reservations (see the module doc). Made by :meth:`MemoryGate.open`."""

    def __init__(self, gate: "MemoryGate", rank: tuple, what: str, transforms: bool) -> None:
        self.gate = gate
        self.rank = rank
        self.what = what
        self.transforms = transforms
        self.held = dict.fromkeys(PARTS, 0)
        self.expect = dict.fromkeys(PARTS, 0)  # what each reserved or made part holds
        self.touched: set[str] = set()  # parts reserved or made (the others are estimates)
        self.in_flight = True  # not yet handed to the loop
        self.released = False

    @property
    def total(self) -> int:
        return sum(self.held.values())

    def still_expected(self, largest: dict[str, int]) -> int:
        """Bytes this shard is still expected to reserve: the parts not reserved yet at the
        largest sizes seen (the copy at least as large as the raw arrays)."""
        if self.released:
            return 0
        copy = max(largest["copy"], largest["raw"])
        estimate = {"raw": largest["raw"], "copy": copy,
                    "transformed": largest["transformed"] if self.transforms else 0,
                    "context": largest["context"]}  # 0 unless context_rows is given
        return sum(estimate[p] for p in PARTS if p not in self.touched)

    def reserve(self, part: str, nbytes: int, closed: Callable[[], bool],
                outside: Callable[[], ContextManager[Any]] | None = None,
                exact: bool = False) -> None:
        """Hold ``nbytes`` for ``part``, waiting for room if it grows (``outside()``: a context
        manager the wait runs in, e.g. the producer's place given up; ``exact``: the part's
        size, not an estimate)."""
        self.gate.reserve(self, part, int(nbytes), closed, outside, exact)

    def made(self, part: str, nbytes: int) -> bool:
        """``part`` holds ``nbytes`` already (made before it could be known): counted at once.
        False when that leaves too little room for the shards ranked before this one (it grew
        beyond the size reserved for it): the caller frees it and makes it again later."""
        return self.gate.made(self, part, int(nbytes))

    def drop(self, *parts: str) -> None:
        """Give ``parts`` back (their arrays are freed), their pages too (:func:`trim_freed`)."""
        for part in parts:
            self.gate.set(self, part, 0)
        trim_freed()

    def handed(self) -> None:
        """The shard reached the loop: it no longer ranks among the shards being made."""
        self.gate.handed(self)

    def release(self) -> None:
        """Give everything back (the shard is freed, or failed); idempotent."""
        self.gate.release(self)


class MemoryGate:
    """Bytes admitted within ``budget`` (see the module doc)."""

    def __init__(self, budget: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.budget = budget
        self.clock = clock
        self.used = 0
        self.peak = 0  # the most bytes admitted at once
        self.over = 0  # admissions made over the budget (shards grew past every size seen)
        #: bytes held outside the shards: the batches in flight (the tuner sets them)
        self.outside = 0
        self.largest = dict.fromkeys(PARTS, 0)  # the largest of each part seen, in bytes
        self._open: list[Admission] = []  # in flight, not yet handed out
        self._holding: dict[int, Admission] = {}  # id -> admissions holding bytes
        self._waiting: set[Admission] = set()  # waiting for room now
        self._cond = threading.Condition()
        self._given_at = clock()  # when memory was last given back
        self._closed = False

    @property
    def in_flight(self) -> int:
        """Admissions open for shards being made (not yet handed out, freed or failed)."""
        with self._cond:
            return len(self._open)

    def open(self, rank: tuple, what: str, transformed: bool) -> Admission:
        """An admission for one shard, expected at the largest sizes seen."""
        adm = Admission(self, rank, what, transformed)
        with self._cond:
            self._open.append(adm)
        return adm

    def _before(self, adm: Admission) -> int:
        """Bytes the shards ranked before ``adm`` still expect to reserve."""
        return sum(a.still_expected(self.largest) for a in self._open if a.rank < adm.rank)

    def _first(self, adm: Admission) -> bool:
        return adm.in_flight and all(a.rank >= adm.rank for a in self._open)

    def reserve(self, adm: Admission, part: str, nbytes: int, closed: Callable[[], bool],
                outside: Callable[[], ContextManager[Any]] | None, exact: bool) -> None:
        with self._cond:
            more = nbytes - adm.held[part]
            if more > 0 and adm.total + more > self.budget:
                raise MemoryBudgetTooSmall(
                    f"{adm.what} needs {format_bytes(adm.total + more)} at once (its "
                    f"{_parts(adm, part, nbytes)}), more than the whole memory_budget of "
                    f"{format_bytes(self.budget)}: raise memory_budget, or make smaller shards")
            if more <= 0 or self._grantable(adm, more):
                self._set(adm, part, nbytes, exact)
                return
        if outside is None:
            self._wait(adm, part, nbytes, closed, exact)
            return
        with outside():
            self._wait(adm, part, nbytes, closed, exact)

    def _grantable(self, adm: Admission, more: int) -> bool:
        return self.used + more + self._before(adm) + self.outside <= self.budget

    def set_outside(self, nbytes: int) -> None:
        """Bytes the loader holds besides shards (batches in flight), kept free of shards."""
        with self._cond:
            self.outside = max(0, int(nbytes))
            self._cond.notify_all()

    def _wait(self, adm: Admission, part: str, nbytes: int, closed: Callable[[], bool],
              exact: bool) -> None:
        with self._cond:
            self._waiting.add(adm)
            self._cond.notify_all()  # a waiter holding memory may have to give way to it
            try:
                self._wait_locked(adm, part, nbytes, closed)
            finally:
                self._waiting.discard(adm)
            self._set(adm, part, nbytes, exact)

    def _wait_locked(self, adm: Admission, part: str, nbytes: int,
                     closed: Callable[[], bool]) -> None:
        start = self.clock()
        while True:
            if self._closed or closed():
                raise LoaderClosed("the stream was closed")
            more = nbytes - adm.held[part]
            if more <= 0 or self._grantable(adm, more):
                return
            first = self._first(adm)
            if not first and adm.total and any(self._first(a) for a in self._waiting):
                raise GiveWay(f"{adm.what} gives way to the shard the loop needs first")
            if first and self.clock() - max(start, self._given_at) >= PATIENCE_S:
                self.over += 1
                logger.warning(
                    "memory_budget=%s: %s is admitted over the budget (%s admitted, %s "
                    "more for its %s): shards grew beyond every size seen before, while "
                    "shards after it were made (held: %s)", format_bytes(self.budget),
                    adm.what, format_bytes(self.used), format_bytes(more), part,
                    "; ".join(f"{a.what}{'' if a.in_flight else ' (handed out)'}: "
                              f"{_parts(a, 'copy', a.held['copy'])}"
                              for a in self._holding.values()))
                return
            self._cond.wait(WAIT_SLICE_S / 5)

    def made(self, adm: Admission, part: str, nbytes: int) -> bool:
        with self._cond:
            grew = nbytes > adm.held[part]
            self._set(adm, part, nbytes, exact=True)
            return not grew or self._first(adm) or \
                self.used + self._before(adm) + self.outside <= self.budget

    def set(self, adm: Admission, part: str, nbytes: int) -> None:
        with self._cond:
            self._set(adm, part, nbytes)

    def _set(self, adm: Admission, part: str, nbytes: int, exact: bool = False) -> None:
        if adm.released:
            return
        if exact and nbytes > self.largest[part]:
            self.largest[part] = nbytes
        adm.expect[part] = nbytes  # reserved or made: no longer an estimate
        adm.touched.add(part)
        change = nbytes - adm.held[part]
        adm.held[part] = nbytes
        if adm.total:
            self._holding[id(adm)] = adm
        else:
            self._holding.pop(id(adm), None)
        self.used += change
        self.peak = max(self.peak, self.used)
        if change < 0:
            self._given_at = self.clock()
        self._cond.notify_all()

    def handed(self, adm: Admission) -> None:
        with self._cond:
            if adm.in_flight:
                adm.in_flight = False
                self._open.remove(adm)
                self._cond.notify_all()

    def release(self, adm: Admission) -> None:
        """Give back everything ``adm`` holds; then the allocator gives the OS the pages freed
        since (the shard's copy, and its raw arrays long before: :func:`trim_freed`), outside
        the lock, so that the process's memory is what the gate counts."""
        with self._cond:
            if adm.released:
                return
            for part in PARTS:
                self._set(adm, part, 0)
            adm.released = True
            if adm.in_flight:
                adm.in_flight = False
                self._open.remove(adm)
            self._cond.notify_all()
        trim_freed()

    def close(self) -> None:
        """Wake every waiter: they raise LoaderClosed."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


def _parts(adm: Admission, part: str, nbytes: int) -> str:
    held = dict(adm.held, **{part: nbytes})
    words = {"raw": "raw arrays", "transformed": "transform's output", "copy": "copy",
             "context": "context rows and a previous key's shard"}
    return ", ".join(f"{words[p]} {format_bytes(held[p])}" for p in PARTS if held[p])
