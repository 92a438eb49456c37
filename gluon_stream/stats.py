"""Counters and timeline spans of a stream: what was produced, how long, and who waited.

The stream's producers record one :class:`ShardRecord` per shard and a span per phase
(generate, load, transform); the loader records one :class:`EpochRecord` per epoch and
the training loop's busy/waiting spans. Nothing here imports MXNet. The clock is
injectable so tests can drive it without sleeping.
"""
from __future__ import annotations

import collections
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping, NamedTuple

from ._utils.timeline import TRAIN_LANE, plot_timeline, write_chrome_trace
from .diagnosis import Diagnosis, LoaderSettings, diagnose
from .records import EpochRecord, ShardRecord, TuningRecord

__all__ = ["EpochRecord", "ShardRecord", "ShardTotals", "Span", "Stats", "TuningRecord"]

MAX_SPANS = 50_000
MAX_SHARD_RECORDS = 10_000  # the latest ones; totals cover every shard ever produced
MAX_EPOCH_RECORDS = 10_000


class Span(NamedTuple):
    """One interval on the timeline (a tuple: compact, 50,000 of them are kept).

    Attributes:
        lane: The producer's lane (``gluon_stream-producer_<place>``), or ``"train"`` for the
            training loop.
        name: ``"generate"``, ``"load"`` or ``"transform"`` on a producer lane; ``"busy"``
            (the loop body ran) or ``"wait"`` (the loop waited for its next batch) on ``"train"``.
        start: Seconds since the :class:`Stats` was created.
        end: Seconds since the :class:`Stats` was created.
        key: The shard a producer span worked on (None on the ``"train"`` lane).
    """

    lane: str
    name: str
    start: float
    end: float
    key: Any = None


@dataclass
class ShardTotals:
    """Running totals over every shard recorded (records themselves are a bounded window).

    ``source_samples`` and ``source_shards`` count the shards of a
    :class:`~gluon_stream.MixSource` per source name (empty for a source used alone).
    """

    produced: int = 0
    skipped: int = 0
    cache_hits: int = 0
    samples: int = 0
    generate_s: float = 0.0
    load_s: float = 0.0
    transform_s: float = 0.0
    source_samples: dict[str, int] = field(default_factory=dict)
    source_shards: dict[str, int] = field(default_factory=dict)

    def add(self, record: ShardRecord) -> None:
        if record.error is not None:
            self.skipped += 1
            return
        self.produced += 1
        self.cache_hits += record.cache_hit
        self.samples += record.samples
        self.generate_s += record.generate_s
        self.load_s += record.load_s
        self.transform_s += record.transform_s
        if record.source is not None:
            name = record.source
            self.source_samples[name] = self.source_samples.get(name, 0) + record.samples
            self.source_shards[name] = self.source_shards.get(name, 0) + 1


class Stats:
    """Thread-safe record of shards, epochs and timeline spans; summary, plot and trace export.

    Every :class:`~gluon_stream.StreamLoader` and :class:`~gluon_stream.ShardStream` keeps one
    (``loader.stats``). Producers add a :class:`ShardRecord` and ``generate``/``load``/
    ``transform`` spans per shard; the loader adds an :class:`EpochRecord` per pass and a
    ``busy`` or ``wait`` span on the ``"train"`` lane around every batch. Memory stays bounded
    on endless streams: the latest ``MAX_SHARD_RECORDS`` shard records, ``MAX_EPOCH_RECORDS``
    epochs and ``MAX_SPANS`` spans are kept, and :attr:`totals_produced` counts them all.

    :meth:`diagnose` turns the records into a verdict: which stage holds the loop up, and the
    argument to change; the loader tells it its settings through :meth:`describe`.

    Args:
        clock: Returns seconds; defaults to ``time.perf_counter``. Tests pass a fake clock.

    Example:
        >>> clock = iter([0.0, 1.0, 3.0, 4.0]).__next__
        >>> stats = Stats(clock=clock)                      # origin 0.0
        >>> stats.add_span("train", "wait", clock(), clock())  # 1.0 .. 3.0
        >>> stats.totals()[("train", "wait")]
        2.0
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.origin = clock()
        self.shards: collections.deque[ShardRecord] = collections.deque(maxlen=MAX_SHARD_RECORDS)
        self.epochs: collections.deque[EpochRecord] = collections.deque(maxlen=MAX_EPOCH_RECORDS)
        self.spans: collections.deque[Span] = collections.deque(maxlen=MAX_SPANS)
        self.totals_produced = ShardTotals()
        self._delivered: dict[str, int] = {}  # samples the loop received, per MixSource source
        #: the settings ``memory_budget``'s tuner changed, in order (one record per change)
        self.tuning: collections.deque[TuningRecord] = collections.deque(maxlen=MAX_EPOCH_RECORDS)
        self.settings: LoaderSettings | None = None  # what the loader runs with (describe)
        self._lock = threading.Lock()

    # -- recording (called by the stream and the loader) -----------------------------------
    def add_span(self, lane: str, name: str, start: float, end: float, key: Any = None) -> None:
        """Record an interval; ``start``/``end`` are readings of :attr:`clock`."""
        span = Span(lane, name, start - self.origin, end - self.origin, key)
        with self._lock:
            self.spans.append(span)

    def add_shard(self, record: ShardRecord) -> None:
        """Record a produced (or skipped) shard: kept among the latest, added to the totals."""
        with self._lock:
            self.shards.append(record)
            self.totals_produced.add(record)

    def add_delivered(self, per_source: Mapping[str, int]) -> None:
        """Record samples a batch handed to the loop, per source of a MixSource."""
        if per_source:
            with self._lock:
                for name, samples in per_source.items():
                    self._delivered[name] = self._delivered.get(name, 0) + samples

    def add_tuning(self, record: TuningRecord) -> None:
        """Record a setting the ``memory_budget`` tuner changed."""
        with self._lock:
            self.tuning.append(record)

    def new_epoch(self, epoch: int) -> EpochRecord:
        """Start and return the record of a new pass."""
        record = EpochRecord(epoch, start_s=self.clock() - self.origin)
        with self._lock:
            self.epochs.append(record)
        return record

    def describe(self, **settings: Any) -> None:
        """Record what the loader runs with, for :meth:`diagnose`'s advice: the fields of
        :class:`~gluon_stream.diagnosis.LoaderSettings` by name (``producers=2, prefetch=2,
        num_workers=0, ...``). A :class:`~gluon_stream.StreamLoader` calls it once; the last
        call wins when loaders share one Stats.

        Raises:
            TypeError: A name that is not a setting.
        """
        self.settings = LoaderSettings(**settings)

    # -- reading ---------------------------------------------------------------------------
    @property
    def skipped_shards(self) -> int:
        """Shards dropped by ``on_error='skip'`` over all epochs."""
        return sum(e.skipped_shards for e in self.epochs)

    def per_source(self) -> dict[str, int]:
        """Samples the training loop received, per source of a :class:`~gluon_stream.MixSource`,
        in name order, over every batch (also beyond the records kept): not the samples of the
        shards produced (those made ahead, or the rest of the shard an epoch stopped in, count
        in :attr:`totals_produced` and the summary's lines per source). Empty when the source
        is not a mix.

        Example:
            >>> stats = Stats()
            >>> stats.add_delivered({"old": 10, "new": 30})
            >>> stats.add_delivered({"old": 4})
            >>> stats.per_source()
            {'new': 30, 'old': 14}
        """
        with self._lock:
            return dict(sorted(self._delivered.items()))

    def span_list(self) -> list[Span]:
        """A consistent copy of the spans recorded so far (oldest first)."""
        with self._lock:
            return list(self.spans)

    def lanes(self) -> list[str]:
        """Lane names: producers in name order, then ``"train"`` if it has spans."""
        names = {s.lane for s in self.span_list()}
        producers = sorted(names - {TRAIN_LANE})
        return producers + ([TRAIN_LANE] if TRAIN_LANE in names else [])

    def totals(self) -> dict[tuple[str, str], float]:
        """Seconds per ``(lane, span name)``, e.g. ``totals()[("train", "wait")]``."""
        out: dict[tuple[str, str], float] = collections.defaultdict(float)
        for s in self.span_list():
            out[(s.lane, s.name)] += s.end - s.start
        return dict(out)

    def to_dict(self) -> dict:
        """Plain data for logging or JSON: the latest shard records, the epochs, and totals.

        Example:
            >>> Stats().to_dict()["shards"]
            []
        """
        with self._lock:
            return {"shards": [asdict(s) for s in self.shards],
                    "epochs": [asdict(e) for e in self.epochs],
                    "tuning": [asdict(t) for t in self.tuning],
                    "totals": asdict(self.totals_produced)}

    def summary(self) -> str:
        """A readable table: one line per epoch, then shard production totals.

        Columns: batches, samples, wall seconds, seconds the loop waited for data (stall) and
        their share, samples/s, median shard rotation cost in ms, peak shards held, and shards
        skipped. A pass cut short (``break``, Ctrl-C, an error) is marked ``*``. The totals cover
        every shard produced, also on endless streams where only the latest
        ``MAX_SHARD_RECORDS`` records are kept. Shards of several sources (a
        :class:`~gluon_stream.MixSource`) add a line per source: its shards, its samples and
        their share of all samples.

        Example:
            >>> print(Stats().summary().split()[:3])
            ['epoch', 'batches', 'samples']
        """
        lines = [f"{'epoch':>5} {'batches':>8} {'samples':>9} {'wall s':>8} {'stall s':>8} "
                 f"{'stall %':>7} {'samples/s':>10} {'rot ms':>7} {'held':>4} {'skipped':>7}"]
        with self._lock:
            epochs = list(self.epochs)
            totals = ShardTotals(**asdict(self.totals_produced))
        for e in epochs:
            rate = e.samples / e.wall_s if e.wall_s > 0 else 0.0
            share = 100.0 * e.stall_s / e.wall_s if e.wall_s > 0 else 0.0
            rot = sorted(e.rotation_s)
            rot_ms = 1000.0 * rot[len(rot) // 2] if rot else 0.0
            epoch = f"{e.epoch}{'' if e.complete else '*'}"
            lines.append(f"{epoch:>5} {e.batches:>8} {e.samples:>9} {e.wall_s:>8.2f} "
                         f"{e.stall_s:>8.2f} {share:>6.1f}% {rate:>10.0f} {rot_ms:>7.1f} "
                         f"{e.peak_prefetch:>4} {e.skipped_shards:>7}")
        if totals.produced:
            lines.append(
                f"shards: {totals.produced} produced ({totals.cache_hits} cache hits); "
                f"generate {totals.generate_s:.2f} s, load {totals.load_s:.2f} s, "
                f"transform {totals.transform_s:.2f} s in total")
        if len(totals.source_samples) > 1:
            for name, samples in sorted(totals.source_samples.items()):
                share = 100.0 * samples / totals.samples if totals.samples else 0.0
                lines.append(f"source {name}: {totals.source_shards[name]} shards, "
                             f"{samples} samples ({share:.1f}%)")
        if any(not e.complete for e in epochs):
            lines.append("* a pass that was interrupted (break, Ctrl-C, an error) before its end")
        return "\n".join(lines)

    def diagnose(self) -> Diagnosis:
        """Why the training loop waits, and what to change: a :class:`~gluon_stream.Diagnosis`.

        Decided from every pass recorded (the one in progress included) and the shard records:
        below 10 % of wall time waiting (the very first batch's start-up left out), training
        is the bottleneck (``'none'``); otherwise the largest cause of waiting decides:
        shards (then the slowest phase per shard: ``'generation'``, ``'load'`` or
        ``'transform'``), a shuffle window's gather (``'transform'``), per-sample workers
        (``'workers'``) or placing batches on ``ctx`` (``'placement'``). The advice's value
        is computed from the figures, e.g. ``producers = ceil(production seconds per shard /
        the loop's seconds per shard)``, bounded by the cores this process may use. The rule
        in full: :mod:`gluon_stream.diagnosis`. One pass over the records kept (about 15 us
        for a few epochs, 7 ms for the most kept); nothing is recorded per batch for it.

        Example:
            >>> print(loader.stats.diagnose())  # doctest: +SKIP
            bottleneck: generation -> producers=4, prefetch=4 (a shard takes 31.2 ms to ...)
        """
        with self._lock:
            epochs, shards, settings = list(self.epochs), list(self.shards), self.settings
            tuning = list(self.tuning)
        return diagnose(epochs, shards, settings, now=self.clock() - self.origin,
                        tuning=tuning)

    # -- export ----------------------------------------------------------------------------
    def plot(self, path: str | os.PathLike | None = None, *, ax: Any = None,
             title: str | None = None) -> Any:
        """Draw the pipeline timeline.

        One lane per producer (generate/load/transform) and one for the training loop (busy,
        and red while it waits for data). Needs matplotlib: ``pip install 'gluon_stream[plot]'``.
        With ``path`` the figure is saved and built without pyplot; without, a pyplot figure is
        returned (shown inline in Jupyter).

        Example:
            >>> fig = loader.stats.plot("timeline.png")  # doctest: +SKIP
        """
        return plot_timeline(self, path, ax=ax, title=title)

    def to_chrome_trace(self, path: str | os.PathLike) -> str:
        """Write the spans as a Chrome/Perfetto trace (``chrome://tracing``, ui.perfetto.dev):
        one lane per producer and one for the training loop; returns the path.

        Example:
            >>> loader.stats.to_chrome_trace("trace.json")  # doctest: +SKIP
            'trace.json'
        """
        return write_chrome_trace(self, path)
