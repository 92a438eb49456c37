"""Counters and timeline spans of a stream: what was produced, how long, and who waited.

The stream's producers record one :class:`ShardRecord` per shard and a span per phase
(generate, load, transform); the loader records one :class:`EpochRecord` per epoch and
the training loop's busy/waiting spans. Nothing here imports MXNet. The clock is
injectable so tests can drive it without sleeping.
"""
from __future__ import annotations

import collections
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

__all__ = ["EpochRecord", "ProgressBar", "ShardRecord", "Span", "Stats"]

MAX_SPANS = 200_000


@dataclass
class Span:
    """One interval on the timeline: ``lane`` is a producer thread or ``"train"``."""

    lane: str
    name: str
    start: float
    end: float


@dataclass
class ShardRecord:
    """How one shard was produced."""

    key: Any
    epoch: int
    samples: int = 0
    cache_hit: bool = False
    generate_s: float = 0.0
    load_s: float = 0.0
    transform_s: float = 0.0
    producer: str = ""
    error: str | None = None


@dataclass
class EpochRecord:
    """What one pass over the stream delivered and how long the consumer waited."""

    epoch: int
    batches: int = 0
    samples: int = 0
    wall_s: float = 0.0
    stall_s: float = 0.0
    first_batch_s: float | None = None
    rotation_s: list = field(default_factory=list)
    peak_prefetch: int = 0
    skipped_shards: int = 0
    complete: bool = False


class Stats:
    """Thread-safe record of shards, epochs and timeline spans.

    Args:
        clock: Returns seconds; defaults to ``time.perf_counter``.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.origin = clock()
        self.shards: list[ShardRecord] = []
        self.epochs: list[EpochRecord] = []
        self.spans: collections.deque[Span] = collections.deque(maxlen=MAX_SPANS)
        self._lock = threading.Lock()

    def add_span(self, lane: str, name: str, start: float, end: float) -> None:
        self.spans.append(Span(lane, name, start - self.origin, end - self.origin))

    def add_shard(self, record: ShardRecord) -> None:
        with self._lock:
            self.shards.append(record)

    def new_epoch(self, epoch: int) -> EpochRecord:
        record = EpochRecord(epoch)
        with self._lock:
            self.epochs.append(record)
        return record

    @property
    def skipped_shards(self) -> int:
        """Shards dropped by ``on_error='skip'`` over all epochs."""
        return sum(e.skipped_shards for e in self.epochs)

    def to_dict(self) -> dict:
        """Plain data for logging or JSON."""
        with self._lock:
            return {"shards": [asdict(s) for s in self.shards],
                    "epochs": [asdict(e) for e in self.epochs]}

    def summary(self) -> str:
        """A readable table: one line per epoch, then shard production totals."""
        lines = [f"{'epoch':>5} {'batches':>8} {'samples':>9} {'wall s':>8} {'stall s':>8} "
                 f"{'stall %':>7} {'samples/s':>10} {'rot ms':>7} {'skipped':>7}"]
        for e in self.epochs:
            rate = e.samples / e.wall_s if e.wall_s > 0 else 0.0
            share = 100.0 * e.stall_s / e.wall_s if e.wall_s > 0 else 0.0
            rot = sorted(e.rotation_s)
            rot_ms = 1000.0 * rot[len(rot) // 2] if rot else 0.0
            lines.append(f"{e.epoch:>5} {e.batches:>8} {e.samples:>9} {e.wall_s:>8.2f} "
                         f"{e.stall_s:>8.2f} {share:>6.1f}% {rate:>10.0f} {rot_ms:>7.1f} "
                         f"{e.skipped_shards:>7}")
        produced = [s for s in self.shards if s.error is None]
        if produced:
            hits = sum(s.cache_hit for s in produced)
            lines.append(
                f"shards: {len(produced)} produced ({hits} cache hits); "
                f"generate {sum(s.generate_s for s in produced):.2f} s, "
                f"load {sum(s.load_s for s in produced):.2f} s, "
                f"transform {sum(s.transform_s for s in produced):.2f} s in total")
        return "\n".join(lines)


class ProgressBar:
    """A tqdm bar for one epoch: samples/s, the share of time the loop waited, shards ready ahead.

    ``tqdm.auto`` renders a widget in Jupyter and text in a terminal.
    """

    def __init__(self, epoch: int, total: int | None) -> None:
        from tqdm.auto import tqdm

        self._bar = tqdm(total=total, desc=f"epoch {epoch}", unit="batch", leave=True,
                         dynamic_ncols=True)

    def update(self, record: EpochRecord, ahead: int) -> None:
        wall = record.wall_s or 1e-9
        self._bar.set_postfix(samples_s=f"{record.samples / wall:,.0f}",
                              waiting=f"{100.0 * record.stall_s / wall:.0f}%", ahead=ahead,
                              refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()
