"""Tuning within a memory budget: how many shards to produce ahead and at once, decided live.

``memory_budget=`` bounds what a stream holds for data: as a hard limit where memory is made
(:mod:`.admission`: every shard's parts admitted before they are allocated), and here, softly,
in the settings chosen within it. :func:`footprint` says what a setting costs, :func:`decide` (pure:
measurements and the budget in, a setting and its reason out, no clock, no MXNet) what to run with
next, and :class:`Tuner` owns the measurements of one stream, applies each decision to a
:class:`Tunable` and records it.

What is counted, per shard of ``S`` bytes (the largest seen, after ``transform``):

* the shard the loop trains on, the one before it (the loop's last batch of it, a view, still
  holds it while the next begins), and the ``prefetch`` shards produced or loading ahead
  (``max(prefetch, shuffle_window)`` with a window, plus the window's gathered unit);
* the source of each shard a producer is making (at most ``prefetch + 1`` work): while a
  shard is made, its raw arrays, the transform's output (the largest of both seen together,
  ``source_bytes``) and the copy the loader prepares of them (an NDArray, shared memory for
  the workers) are all alive;
* batches in flight: the loop's, and on the per-sample path the workers' slots
  (``rows_in_flight`` rows of the shard's bytes per sample).

The least a loader can run with is ``prefetch=0`` and one producer: the shard trained on, and
the next one's copy with its source beside it (three shards without a transform). A budget below
that, or a shard larger than the budget, raises :class:`~gluon_stream.MemoryBudgetTooSmall`.

The rule, at each shard handed out (from rule 4 on, once at least :data:`MIN_SHARDS` shards
were handed out since the last change; the per-sample path's workers are tuned only when
``num_workers`` was not given: the loader forks one process per usable core once, and the
tuner gives batches to more of them):

1. a setting that no longer fits (shards grew) shrinks: ``prefetch`` first, then producers;
2. as ``producers='auto'`` does: the loop waited for a shard while every producer was busy,
   so one more producer (and ``prefetch`` at least as many, and at least its default), if a
   core and the budget allow; decided at once (before rule 6 has :data:`MIN_SHARDS` shards
   to go by), the start-up wait for the very first shard included;
3. ``prefetch`` rises to its default (2) as soon as the first shard shows it fits;
4. the loop waited for per-sample batches at least :data:`WAIT_SHARE` of the time, and more
   than for shards: workers rise to ``ceil(workers x wall / the loop's own seconds)`` (at
   least one more), bounded by the cores and by the budget (their slots); decided after one
   shard when the loop waited :data:`CLEAR_WAIT_SHARE` of it or more, and within a shard,
   every :data:`EARLY_BATCHES` batches, when the loop waited that share of the time it held
   a shard (so a large first shard is not made at one worker's pace);
5. the loop waited less than :data:`WAIT_SHARE` of the time for shards: nothing changes
   (training, or per-sample work, is the bottleneck);
6. it waited: producers rise to ``ceil(production seconds per shard / the loop's seconds per
   shard)`` (at least one more when every producer was busy at a wait), bounded by the cores
   and by the budget, with ``prefetch`` as large (more producers than shards ahead have
   nothing to make); when the producers keep up on average and the loop still waits (slow
   shards now and then), ``prefetch`` grows by one to absorb them, if the budget allows (up
   to :data:`MAX_PREFETCH`). Production slower than the loop with no producer to add (no core
   left, or producers fixed) changes nothing: more shards ahead would only hold memory.

A setting given explicitly is never changed. Batches do not depend on the settings: they only
decide when shards and batches are made, never which ones or in what order.
"""
from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass, replace
from typing import Callable, Protocol

from .._utils.validate import format_bytes
from ..errors import MemoryBudgetTooSmall
from ..records import TuningRecord

__all__ = ["CLEAR_WAIT_SHARE", "DEFAULT_PREFETCH", "EARLY_BATCHES", "Knobs", "LEAST_PREFETCH",
           "Limits", "MIN_SHARDS", "Measured", "START_PREFETCH", "Tunable", "TunableWorkers",
           "Tuner", "WAIT_SHARE", "decide", "footprint", "start_knobs"]

logger = logging.getLogger(__name__)

DEFAULT_PREFETCH = 2
MIN_SHARDS = 2  # shards handed out since the last change before the next decision
WAIT_SHARE = 0.05  # the loop waiting less than this share of the time for shards: no change
# the loop waiting this share of a shard's time or more for per-sample batches: more workers at
# once, without the MIN_SHARDS a subtler wait needs (as a busy wait adds a producer at once)
CLEAR_WAIT_SHARE = 0.5
# per-sample batches between looks at the workers within a shard (rule 4's clear wait)
EARLY_BATCHES = 4
LEAST_PREFETCH = 0  # no shard ahead: the next one is made when the loop asks for it
# before the first shard is measured: with one producer, the first shard and the second one
# being made hold three shards at most, as the least does (the tuner then decides)
START_PREFETCH = 1
MAX_PREFETCH = 16  # more shards ahead than this absorb no burst worth their memory


@dataclass(frozen=True)
class Knobs:
    """The settings the tuner moves (``workers``: per-sample worker processes given batches;
    0 where the tuner does not move them)."""

    prefetch: int
    producers: int
    workers: int = 0


@dataclass(frozen=True)
class Measured:
    """What was measured since the last change.

    Attributes:
        shard_bytes: The largest shard seen, in bytes (0: none yet).
        sample_bytes: Bytes per sample of that shard.
        shards: Shards handed out since the last change.
        wall_s: Seconds since the last change.
        wait_s: Of them, seconds the loop waited for shards.
        busy_waits: Waits that found every producer busy.
        produce_s: Mean seconds to make a shard (generate, load, transform).
        epoch: The epoch of the last shard.
        worker_wait_s: Of ``wall_s``, seconds the loop waited for per-sample workers.
        source_bytes: The largest raw and transformed arrays of a shard seen together, alive
            beside its copy while a producer makes it (0: as ``shard_bytes``).
    """

    shard_bytes: int = 0
    sample_bytes: float = 0.0
    shards: int = 0
    wall_s: float = 0.0
    wait_s: float = 0.0
    busy_waits: int = 0
    produce_s: float = 0.0
    epoch: int = 0
    worker_wait_s: float = 0.0
    source_bytes: int = 0


@dataclass(frozen=True)
class Limits:
    """What bounds the settings: the budget, the cores, what is held besides shards, and
    the settings given explicitly (never changed). ``rows_in_flight``: rows of batches held
    whatever the tuner picks; ``rows_per_worker``: more of them per worker it adds, up to
    ``max_workers`` (0: workers are not tuned)."""

    budget: int
    cores: int
    window: int = 1
    rows_in_flight: int = 0
    fixed_prefetch: bool = False
    fixed_producers: bool = False
    rows_per_worker: int = 0
    max_workers: int = 0


@dataclass(frozen=True)
class Decision:
    """New settings, why, and whether the budget is what stopped them from going further."""

    knobs: Knobs
    reason: str
    limited: bool = False


def start_knobs(generates_apart: bool, cores: int) -> Knobs:
    """The settings before the first shard is measured, which must hold whatever its size:
    as few shards as the least settings hold (three). One producer making the first shard
    and then the second, ``prefetch`` :data:`START_PREFETCH`; or, where another program
    generates shards into a cache (``generates_apart``: this process holds none of a shard
    until it loads it), two producers and ``prefetch`` 0: the first shard loads while the
    second producer generates the next ones ahead, on disk, so the start waits for one
    generation, not two in a row."""
    if generates_apart and cores > 1:
        return Knobs(LEAST_PREFETCH, 2)
    return Knobs(START_PREFETCH, 1)


def footprint(knobs: Knobs, m: Measured, limits: Limits) -> float:
    """Bytes a setting holds at most (see the module doc for what is counted)."""
    rows = limits.rows_in_flight + limits.rows_per_worker * knobs.workers
    source = max(m.source_bytes, m.shard_bytes)
    return (shards_kept(knobs, limits) * m.shard_bytes + at_work(knobs) * source
            + rows * m.sample_bytes)


def shards_kept(knobs: Knobs, limits: Limits) -> int:
    """Shards a setting keeps made at most: the last one trained on (the loop's last batch of
    it still holds it while the next begins), the one trained on, and those ahead
    (``max(prefetch, shuffle_window)`` with a window, and its gathered unit)."""
    window = limits.window
    ahead = max(knobs.prefetch, window) + 1 if window > 1 else knobs.prefetch  # and a unit
    return ahead + 2


def at_work(knobs: Knobs) -> int:
    """Producers at work at once (at most ``prefetch + 1`` have a shard to make): each holds a
    shard's raw (and transformed) arrays beside the copy it makes."""
    return min(knobs.producers, knobs.prefetch + 1)


def shards_held(knobs: Knobs, limits: Limits) -> int:
    """Shards' worth a setting holds at most, sources as large as their copies."""
    return shards_kept(knobs, limits) + at_work(knobs)


def minimum(knobs: Knobs, limits: Limits) -> Knobs:
    """The least settings the loader runs with (a fixed setting stays as given)."""
    return Knobs(knobs.prefetch if limits.fixed_prefetch else LEAST_PREFETCH,
                 knobs.producers if limits.fixed_producers else 1,
                 min(knobs.workers, 1) if limits.max_workers else knobs.workers)


def check_room(key: object, m: Measured, knobs: Knobs, limits: Limits) -> None:
    """Raise :class:`MemoryBudgetTooSmall` if the budget cannot hold a shard of this size at
    the least settings (or, for ``key``'s shard alone, at all)."""
    budget = format_bytes(limits.budget)
    size = format_bytes(m.shard_bytes)
    if m.shard_bytes > limits.budget:
        raise MemoryBudgetTooSmall(
            f"shard {key!r} holds {size}, more than the whole memory_budget of {budget}: "
            "raise memory_budget, or make smaller shards")
    least = minimum(knobs, limits)
    need = footprint(least, m, limits)
    if need > limits.budget:
        fix = ", or a smaller shuffle_window" if limits.window > 1 else ""
        raise MemoryBudgetTooSmall(
            f"memory_budget={budget} cannot hold what the least settings (prefetch="
            f"{least.prefetch}, {least.producers} producer{'s' if least.producers > 1 else ''}) "
            f"keep at once with shards of "
            f"{size}, as shard {key!r} is: {_least_parts(least, m, limits)}; "
            f"{format_bytes(need)} with the batches in flight. Raise memory_budget to at "
            f"least {format_bytes(need)}, or make smaller shards{fix}")


def _least_parts(knobs: Knobs, m: Measured, limits: Limits) -> str:
    """What a setting holds, in words: :func:`shards_kept`'s shards, then the sources of the
    shards being made (see :func:`footprint`)."""
    parts = ["the one trained on", "the next one"]
    if limits.window > 1:
        parts.append(f"{max(knobs.prefetch, limits.window)} more for the shuffle window and "
                     "1 for the unit gathered from them")
    elif knobs.prefetch:
        parts.append(f"{knobs.prefetch} more made ahead")
    work = at_work(knobs)
    made = "raw and transformed arrays" if m.source_bytes > m.shard_bytes else "raw arrays"
    being = "the one being made" if work == 1 else f"each of the {work} being made"
    source = format_bytes(max(m.source_bytes, m.shard_bytes))
    return (f"{shards_kept(knobs, limits)} shards of {format_bytes(m.shard_bytes)} "
            f"({', '.join(parts)}) and the {made} of {being} beside its copy ({source})")


def _largest(knobs: Knobs, m: Measured, limits: Limits) -> Knobs:
    """``knobs`` shrunk until they fit: ``prefetch`` first, then producers, then workers."""
    least = minimum(knobs, limits)
    while footprint(knobs, m, limits) > limits.budget and knobs != least:
        if knobs.prefetch > least.prefetch:
            knobs = replace(knobs, prefetch=knobs.prefetch - 1)
        elif knobs.producers > least.producers:
            knobs = replace(knobs, producers=knobs.producers - 1)
        else:
            knobs = replace(knobs, workers=knobs.workers - 1)
    return knobs


def _fits(knobs: Knobs, m: Measured, limits: Limits) -> bool:
    return footprint(knobs, m, limits) <= limits.budget


def decide(knobs: Knobs, m: Measured, limits: Limits) -> Decision | None:
    """The next settings and their reason, or None to keep ``knobs`` (see the module doc)."""
    if not m.shard_bytes:
        return None
    room = _room(m, limits)
    if not _fits(knobs, m, limits):  # rule 1
        return Decision(_largest(knobs, m, limits),
                        f"shards grew to {format_bytes(m.shard_bytes)}: fewer held to stay "
                        f"within the budget of {format_bytes(limits.budget)}", True)
    decision = _busy_producers(knobs, m, limits, room)  # rule 2
    if decision is None:
        decision = _default_prefetch(knobs, m, limits, room)  # rule 3
    if decision is not None or m.wall_s <= 0:
        return decision
    share = m.wait_s / m.wall_s
    workers_share = m.worker_wait_s / m.wall_s
    if limits.max_workers and workers_share >= max(WAIT_SHARE, share) and (
            m.shards >= MIN_SHARDS or workers_share >= CLEAR_WAIT_SHARE):
        return _more_workers(knobs, m, limits, room)  # rule 4
    if m.shards < MIN_SHARDS or share < WAIT_SHARE:  # rule 5: production keeps up
        return None
    return _more_production(knobs, m, limits, room, share)  # rule 6


def _busy_producers(knobs: Knobs, m: Measured, limits: Limits, room: str) -> Decision | None:
    """Rule 2, as ``producers='auto'``: the loop waited while every producer was busy, one
    more at once (rule 6 decides from more shards, and may add several)."""
    if not (m.busy_waits and m.shards < MIN_SHARDS and not limits.fixed_producers
            and knobs.producers < limits.cores):
        return None
    wanted = Knobs(max(knobs.prefetch, DEFAULT_PREFETCH, knobs.producers + 1)
                   if not limits.fixed_prefetch else knobs.prefetch,
                   knobs.producers + 1, knobs.workers)
    got = _grown(knobs, wanted, m, limits)
    if got == knobs:
        return None
    return Decision(got, f"the loop waited for a shard while every producer was busy "
                         f"(epoch {m.epoch}); {_held(got, limits)} {room}"
                         + (" (it holds no more)" if got != wanted else ""), got != wanted)


def _default_prefetch(knobs: Knobs, m: Measured, limits: Limits, room: str) -> Decision | None:
    """Rule 3: ``prefetch`` rises to its default, or as near it as the budget allows."""
    if limits.fixed_prefetch or knobs.prefetch >= DEFAULT_PREFETCH:
        return None
    for prefetch in range(DEFAULT_PREFETCH, knobs.prefetch, -1):
        wanted = replace(knobs, prefetch=prefetch)
        if _fits(wanted, m, limits):
            why = "the default prefetch" if prefetch == DEFAULT_PREFETCH else \
                "as near the default prefetch as the budget allows"
            return Decision(wanted, f"{why}: {_held(wanted, limits)} {room}",
                            prefetch < DEFAULT_PREFETCH)
    return None


def _more_production(knobs: Knobs, m: Measured, limits: Limits, room: str,
                     share: float) -> Decision | None:
    """Rule 6: the loop waited ``share`` of the time for shards: producers rise to keep up
    with it (with ``prefetch`` as large); when they keep up on average, one more shard ahead
    absorbs the slow ones."""
    waited = (f"the loop waited {100 * share:.0f} % of its last {m.shards} shards "
              f"(epoch {m.epoch}) for them")
    loop_per_shard = max(m.wall_s - m.wait_s, 1e-9) / m.shards
    needed = max(1, math.ceil(round(m.produce_s / loop_per_shard, 6)))  # no float noise
    if m.busy_waits and needed <= knobs.producers:
        needed = knobs.producers + 1 if knobs.producers < limits.cores else needed
    if not limits.fixed_producers and needed > knobs.producers < limits.cores:
        target = min(needed, limits.cores)
        wanted = Knobs(knobs.prefetch if limits.fixed_prefetch else max(knobs.prefetch, target),
                       target)
        got = _grown(knobs, wanted, m, limits)
        if got != knobs:
            return Decision(got, f"{waited}; {_held(got, limits)} {room}"
                                 + (" (it holds no more)" if got != wanted else ""),
                            got != wanted)
    if limits.fixed_prefetch or needed > knobs.producers or knobs.prefetch >= MAX_PREFETCH:
        return None  # production is slower than the loop on average: more ahead cannot help
    wanted = replace(knobs, prefetch=knobs.prefetch + 1)
    why = f"{knobs.producers} producer(s) keep up on average"
    if _fits(wanted, m, limits):
        return Decision(wanted, f"{waited}, and {why}: one more shard ahead absorbs slow "
                                f"ones; {_held(wanted, limits)} {room}")
    return None


def _more_workers(knobs: Knobs, m: Measured, limits: Limits, room: str,
                  over: str = "") -> Decision | None:
    """The loop waits for per-sample batches more than for shards: more worker processes,
    ``ceil(workers x wall / the loop's own seconds)`` (the workers were busy all along), at
    least one more, up to ``max_workers`` (the cores) and the budget."""
    if knobs.workers >= limits.max_workers:
        return None
    own = max(m.wall_s - m.worker_wait_s, 1e-9)
    needed = max(knobs.workers + 1, math.ceil(round(knobs.workers * m.wall_s / own, 6)))
    wanted = replace(knobs, workers=min(needed, limits.max_workers))
    got = knobs
    while got.workers < wanted.workers and _fits(replace(got, workers=got.workers + 1), m,
                                                 limits):
        got = replace(got, workers=got.workers + 1)
    if got == knobs:
        return None
    over = over or f"{m.shards} shards"
    waited = (f"the loop waited {100 * m.worker_wait_s / m.wall_s:.0f} % of its last "
              f"{over} (epoch {m.epoch}) for per-sample batches")
    return Decision(got, f"{waited}; {got.workers} workers' batches and "
                         f"{_held(got, limits)} {room}"
                         + (" (it holds no more)" if got != wanted else ""), got != wanted)


def _grown(knobs: Knobs, wanted: Knobs, m: Measured, limits: Limits) -> Knobs:
    """``wanted``, or as far towards it as the budget allows (producers and prefetch one step
    at a time, together)."""
    got = knobs
    while got != wanted:
        step = Knobs(min(wanted.prefetch, max(got.prefetch, got.producers + 1)),
                     min(wanted.producers, got.producers + 1), got.workers)
        if step == got or not _fits(step, m, limits):
            break
        got = step
    return got


def _room(m: Measured, limits: Limits) -> str:
    return f"{format_bytes(m.shard_bytes)} fit in the budget of {format_bytes(limits.budget)}"


def _held(knobs: Knobs, limits: Limits) -> str:
    shards = shards_held(knobs, limits)
    plural = "s" if knobs.producers > 1 else ""
    return f"{shards} shards (prefetch {knobs.prefetch}, {knobs.producers} producer{plural}) of"


class TunableWorkers(Protocol):
    """What the tuner moves on the per-sample path: worker processes given batches."""

    @property
    def active(self) -> int:
        """Workers given batches now."""

    def set_active(self, active: int) -> None:
        """Give batches to this many workers from now on."""


class Tunable(Protocol):
    """What the tuner reads and moves: a :class:`~gluon_stream.ShardStream` (its
    ``generate_ahead``, with ``'auto'``, follows ``prefetch``: the tuner records that too)."""

    prefetch: int
    generate_ahead: int

    @property
    def producers(self) -> int:
        """Shards produced at once now."""

    def set_prefetch(self, prefetch: int) -> None:
        """Produce this many shards ahead from now on."""

    def set_producers(self, producers: int) -> None:
        """Produce this many shards at once from now on."""


class Tuner:
    """The measurements of one stream since the last change, and the changes made.

    The stream calls :meth:`shard_ready` in the loop's thread for every shard it hands out
    (which also checks the budget holds it) and :meth:`waited` when the loop waits for one.
    Each change is applied to the :class:`Tunable`, logged once at INFO with its reason and
    given to ``record`` (the stream's :class:`~gluon_stream.Stats`).
    """

    def __init__(self, target: Tunable, limits: Limits, clock: Callable[[], float],
                 record: Callable[[TuningRecord], None]) -> None:
        self.target = target
        self.limits = limits
        self.clock = clock
        self.record = record
        self.limited = False  # the budget stopped the last change short
        self.workers: TunableWorkers | None = None
        #: told the bytes of batches in flight after each shard (the memory gate keeps them free)
        self.on_rows: Callable[[int], None] | None = None
        self._worker_wait: Callable[[], float] = lambda: 0.0
        self._lock = threading.Lock()
        self._shard_bytes, self._sample_bytes, self._source_bytes = 0, 0.0, 0
        self._epoch = 0  # of the last shard handed out
        self._reset(clock())

    def _reset(self, now: float) -> None:
        self._since, self._shards, self._wait_s, self._busy, self._produce_s = now, 0, 0.0, 0, 0.0
        self._worker_wait_at = self._worker_wait()
        self._batches = 0  # per-sample batches taken since the last change

    def reserve_rows(self, rows: int) -> None:
        """Rows of batches the consumer keeps in flight (counted at the shards' bytes per
        sample)."""
        self.limits = replace(self.limits, rows_in_flight=rows)

    def watch_workers(self, workers: TunableWorkers, wait_s: Callable[[], float],
                      rows_per_worker: int, max_workers: int) -> None:
        """Tune the per-sample path's worker processes too: ``wait_s()`` is the seconds the
        loop waited for their batches so far; each worker holds ``rows_per_worker`` rows."""
        self.workers, self._worker_wait = workers, wait_s
        self._worker_wait_at = wait_s()
        self.limits = replace(self.limits, rows_per_worker=rows_per_worker,
                              max_workers=max_workers)

    def set_window(self, window: int) -> None:
        """Shards a shuffle window mixes."""
        self.limits = replace(self.limits, window=window)

    def waited(self, all_busy: bool) -> None:
        """The loop waits for a shard; ``all_busy``: every producer was at work (the wait for
        the very first shard counts, as with ``producers='auto'``: with one producer, shards
        generated ahead into a cache would otherwise keep it from the next shard)."""
        with self._lock:
            self._busy += all_busy

    def knobs(self) -> Knobs:
        return Knobs(self.target.prefetch, self.target.producers,
                     self.workers.active if self.workers is not None else 0)

    def shard_ready(self, key: object, nbytes: int, samples: int, wait_s: float,
                    produce_s: float, epoch: int, source_bytes: int = 0) -> None:
        """A shard is handed out: check the budget holds it, then maybe change the settings
        (``source_bytes``: its raw and transformed arrays, alive beside its copy while it was
        made).

        Raises:
            MemoryBudgetTooSmall: The budget cannot hold shards of this size.
        """
        with self._lock:
            grew = nbytes > self._shard_bytes or source_bytes > self._source_bytes
            if nbytes > self._shard_bytes:
                self._shard_bytes = nbytes
                self._sample_bytes = nbytes / samples if samples else 0.0
            self._source_bytes = max(self._source_bytes, source_bytes)
            self._shards += 1
            self._epoch = epoch
            self._wait_s += wait_s
            self._produce_s += produce_s
            now = self.clock()
            m = Measured(self._shard_bytes, self._sample_bytes, self._shards, now - self._since,
                         self._wait_s, self._busy, self._produce_s / self._shards, epoch,
                         self._worker_wait() - self._worker_wait_at, self._source_bytes)
            knobs = self.knobs()
            if grew:  # before the first batch of the shard that showed it
                check_room(key, m, knobs, self.limits)
            decision = decide(knobs, m, self.limits)
            if decision is not None and decision.knobs != knobs:
                self._apply(knobs, decision, now, epoch)
                self._reset(now)
            self._tell_rows()

    def _tell_rows(self) -> None:
        """Tell :attr:`on_rows` the bytes of the batches in flight at the settings now."""
        if self.on_rows is not None:
            rows = self.limits.rows_in_flight + self.limits.rows_per_worker * self.knobs().workers
            self.on_rows(int(rows * self._sample_bytes))

    def batch_taken(self) -> None:
        """A per-sample batch reached the loop (in its thread). Every :data:`EARLY_BATCHES`
        of them, once a shard's size is known, the workers grow at once if the loop waited
        for their batches :data:`CLEAR_WAIT_SHARE` or more of the time it held a shard (rule
        4 without waiting for the shard's end)."""
        with self._lock:
            self._batches += 1
            if self._batches % EARLY_BATCHES or not self._shard_bytes \
                    or self.workers is None:
                return
            now = self.clock()
            held = now - self._since - self._wait_s  # not waiting for a shard
            worker_wait = self._worker_wait() - self._worker_wait_at
            if held <= 0 or worker_wait < CLEAR_WAIT_SHARE * held:
                return
            m = Measured(self._shard_bytes, self._sample_bytes, self._shards, held,
                         epoch=self._epoch, worker_wait_s=worker_wait,
                         source_bytes=self._source_bytes)
            knobs = self.knobs()
            decision = _more_workers(knobs, m, self.limits, _room(m, self.limits),
                                     f"{self._batches} batches")
            if decision is None:  # it never returns the knobs unchanged
                return
            self._apply(knobs, decision, now, self._epoch)
            self._reset(now)
            self._tell_rows()

    def _apply(self, old: Knobs, decision: Decision, now: float, epoch: int) -> None:
        new = decision.knobs
        self.limited = decision.limited
        # shrink first what would briefly exceed the budget: the producers before prefetch
        setters = {"producers": self.target.set_producers, "prefetch": self.target.set_prefetch,
                   "num_workers": self.workers.set_active if self.workers is not None
                   else None}
        ahead = self.target.generate_ahead
        for name, before, after in sorted(
                (("producers", old.producers, new.producers),
                 ("prefetch", old.prefetch, new.prefetch),
                 ("num_workers", old.workers, new.workers)),
                key=lambda change: change[2] - change[1]):
            setter = setters[name]
            if before == after or setter is None:
                continue
            setter(after)
            self._log(now, epoch, name, before, after, decision)
        after_ahead = self.target.generate_ahead
        if after_ahead != ahead:
            self._log(now, epoch, "generate_ahead", ahead, after_ahead, replace(
                decision, reason=f"follows prefetch {new.prefetch}: {after_ahead} shards "
                                 "generated ahead into the cache (disk, not memory: outside "
                                 "the budget), two windows' worth within any cache_limit"))

    def _log(self, now: float, epoch: int, name: str, before: int, after: int,
             decision: Decision) -> None:
        """Log one change at INFO with its reason, and record it."""
        logger.info("%s %d\u2192%d: %s", name, before, after, decision.reason)
        self.record(TuningRecord(now, epoch, name, before, after, decision.reason,
                                 decision.limited))
