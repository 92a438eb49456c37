"""Counters and timeline spans of a stream: what was produced, how long, and who waited.

The stream's producers record one :class:`ShardRecord` per shard and a span per phase
(generate, load, transform); the loader records one :class:`EpochRecord` per epoch and
the training loop's busy/waiting spans. Nothing here imports MXNet. The clock is
injectable so tests can drive it without sleeping.
"""
from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

__all__ = ["EpochRecord", "ProgressBar", "ShardRecord", "Span", "Stats"]

logger = logging.getLogger(__name__)

MAX_SPANS = 50_000
TRAIN_LANE = "train"
PRODUCER_PHASES = ("generate", "load", "transform")
TRAIN_PHASES = ("busy", "wait")
COLORS = {"generate": "#e8a33d", "load": "#4c8bd6", "transform": "#59a14f",
          "busy": "#2f7d32", "wait": "#d62728"}


@dataclass(slots=True)
class Span:
    """One interval on the timeline.

    Attributes:
        lane: The producer thread's name, or ``"train"`` for the training loop.
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
class ShardRecord:
    """How one shard was produced.

    Attributes:
        key: The shard key.
        epoch: The epoch it was produced for.
        samples: Samples in the shard after the transform.
        cache_hit: Loaded from the cache instead of generated.
        generate_s: Seconds running the generator (or waiting for the cache lock).
        load_s: Seconds reading and validating the file.
        transform_s: Seconds in the transform, the shuffle and the copy into an NDArray.
        producer: The producer thread that made it.
        error: ``"Type: message"`` for a shard skipped by ``on_error='skip'``, else None.
    """

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
    """What one pass over the stream delivered and how long the consumer waited.

    Attributes:
        epoch: The epoch number.
        batches: Batches yielded.
        samples: Samples yielded.
        wall_s: Seconds from the start of the pass to its end (or to the latest batch).
        stall_s: Seconds the training loop waited for batches (the "wait" spans).
        first_batch_s: Seconds until the first batch (start-up latency), None before it.
        rotation_s: Per shard boundary, seconds the switch to the next shard cost beyond
            waiting for that shard to be produced.
        peak_prefetch: Most shards held at once (the current one plus those ready ahead).
        skipped_shards: Shards dropped by ``on_error='skip'``.
        complete: The pass ran to its end (not broken out of).
    """

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
    """Thread-safe record of shards, epochs and timeline spans; summary, plot and trace export.

    Every :class:`~gluon_stream.StreamLoader` and :class:`~gluon_stream.ShardStream` keeps one
    (``loader.stats``). Producers add a :class:`ShardRecord` and ``generate``/``load``/
    ``transform`` spans per shard; the loader adds an :class:`EpochRecord` per pass and a
    ``busy`` or ``wait`` span on the ``"train"`` lane around every batch.

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
        self.shards: list[ShardRecord] = []
        self.epochs: list[EpochRecord] = []
        self.spans: collections.deque[Span] = collections.deque(maxlen=MAX_SPANS)
        self._lock = threading.Lock()

    # -- recording (called by the stream and the loader) -----------------------------------
    def add_span(self, lane: str, name: str, start: float, end: float, key: Any = None) -> None:
        """Record an interval; ``start``/``end`` are readings of :attr:`clock`."""
        span = Span(lane, name, start - self.origin, end - self.origin, key)
        with self._lock:
            self.spans.append(span)

    def add_shard(self, record: ShardRecord) -> None:
        """Record a produced (or skipped) shard."""
        with self._lock:
            self.shards.append(record)

    def new_epoch(self, epoch: int) -> EpochRecord:
        """Start and return the record of a new pass."""
        record = EpochRecord(epoch)
        with self._lock:
            self.epochs.append(record)
        return record

    # -- reading ---------------------------------------------------------------------------
    @property
    def skipped_shards(self) -> int:
        """Shards dropped by ``on_error='skip'`` over all epochs."""
        return sum(e.skipped_shards for e in self.epochs)

    def span_list(self) -> list[Span]:
        """A consistent copy of the spans recorded so far (oldest first)."""
        with self._lock:
            return list(self.spans)

    def lanes(self) -> list[str]:
        """Lane names: producer threads in name order, then ``"train"`` if it has spans."""
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
        """Plain data for logging or JSON: ``{"shards": [...], "epochs": [...]}``.

        Example:
            >>> Stats().to_dict()
            {'shards': [], 'epochs': []}
        """
        with self._lock:
            return {"shards": [asdict(s) for s in self.shards],
                    "epochs": [asdict(e) for e in self.epochs]}

    def summary(self) -> str:
        """A readable table: one line per epoch, then shard production totals.

        Columns: batches, samples, wall seconds, seconds the loop waited for data (stall) and
        their share, samples/s, median shard rotation cost in ms, peak shards held, and shards
        skipped.

        Example:
            >>> print(Stats().summary().split()[:3])
            ['epoch', 'batches', 'samples']
        """
        lines = [f"{'epoch':>5} {'batches':>8} {'samples':>9} {'wall s':>8} {'stall s':>8} "
                 f"{'stall %':>7} {'samples/s':>10} {'rot ms':>7} {'held':>4} {'skipped':>7}"]
        with self._lock:
            epochs = list(self.epochs)
            shards = list(self.shards)
        for e in epochs:
            rate = e.samples / e.wall_s if e.wall_s > 0 else 0.0
            share = 100.0 * e.stall_s / e.wall_s if e.wall_s > 0 else 0.0
            rot = sorted(e.rotation_s)
            rot_ms = 1000.0 * rot[len(rot) // 2] if rot else 0.0
            lines.append(f"{e.epoch:>5} {e.batches:>8} {e.samples:>9} {e.wall_s:>8.2f} "
                         f"{e.stall_s:>8.2f} {share:>6.1f}% {rate:>10.0f} {rot_ms:>7.1f} "
                         f"{e.peak_prefetch:>4} {e.skipped_shards:>7}")
        produced = [s for s in shards if s.error is None]
        if produced:
            hits = sum(s.cache_hit for s in produced)
            lines.append(
                f"shards: {len(produced)} produced ({hits} cache hits); "
                f"generate {sum(s.generate_s for s in produced):.2f} s, "
                f"load {sum(s.load_s for s in produced):.2f} s, "
                f"transform {sum(s.transform_s for s in produced):.2f} s in total")
        return "\n".join(lines)

    # -- export ----------------------------------------------------------------------------
    def plot(self, path: str | os.PathLike | None = None, *, ax: Any = None,
             title: str | None = None) -> Any:
        """Draw the pipeline timeline: one lane per producer, one for the training loop.

        Producer lanes show ``generate``/``load``/``transform`` spans; the ``train`` lane shows
        ``busy`` (your loop body) and ``wait`` (waiting for the next batch): red on the
        bottom lane is time the accelerator sat idle for lack of data. Needs matplotlib
        (``pip install 'gluon_stream[plot]'``).

        Args:
            path: Save a PNG (or any format matplotlib infers from the suffix) there. The figure
                is then built without pyplot, so nothing is left open.
            ax: Draw into this matplotlib Axes instead of a new figure.
            title: Override the default title (the loop's waiting share).

        Returns:
            The matplotlib ``Figure``. Without ``path`` and ``ax`` it is a pyplot figure, so
            Jupyter shows it inline.

        Example:
            >>> fig = loader.stats.plot("timeline.png")  # doctest: +SKIP
        """
        try:
            import matplotlib  # noqa: F401
        except ImportError as exc:
            raise ImportError("Stats.plot needs matplotlib: pip install 'gluon_stream[plot]'"
                              ) from exc
        spans = self.span_list()
        lanes = self.lanes()
        if ax is not None:
            fig = ax.figure
        elif path is not None:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure

            fig = Figure(figsize=(10, 1.0 + 0.6 * max(len(lanes), 1)))
            FigureCanvasAgg(fig)
            ax = fig.subplots()
        else:
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(10, 1.0 + 0.6 * max(len(lanes), 1)))
        self._draw(ax, spans, lanes, title)
        fig.tight_layout()
        if path is not None:
            fig.savefig(os.fspath(path), dpi=100)
            logger.info("timeline written to %s", os.fspath(path))
        return fig

    def _draw(self, ax: Any, spans: list[Span], lanes: list[str], title: str | None) -> None:
        rows = {lane: len(lanes) - 1 - i for i, lane in enumerate(lanes)}  # train at the bottom
        labelled: set[str] = set()
        for lane in lanes:
            phases = TRAIN_PHASES if lane == TRAIN_LANE else PRODUCER_PHASES
            for name in phases:
                bars = [(s.start, s.end - s.start) for s in spans
                        if s.lane == lane and s.name == name and s.end > s.start]
                if not bars:
                    continue
                # white edges show shard boundaries on producer lanes; the train lane has
                # one span per batch, where edges would hide the bars
                edges = {} if lane == TRAIN_LANE else {"edgecolors": "white", "linewidth": 0.5}
                ax.broken_barh(bars, (rows[lane] - 0.35, 0.7), facecolors=COLORS[name],
                               label=None if name in labelled else name, **edges)
                labelled.add(name)
        ax.set_yticks(list(rows.values()))
        ax.set_yticklabels([_short_lane(lane) for lane in rows])
        ax.set_ylim(-0.6, max(len(lanes), 1) - 0.4)
        ax.set_xlabel("seconds since the stream was created")
        if title is None:
            totals = self.totals()
            wait = totals.get((TRAIN_LANE, "wait"), 0.0)
            busy = totals.get((TRAIN_LANE, "busy"), 0.0)
            title = (f"training loop waited {wait:.2f} s of {wait + busy:.2f} s "
                     f"({100.0 * wait / (wait + busy):.0f}%)" if wait + busy > 0
                     else "gluon_stream timeline (no training-loop spans yet)")
        ax.set_title(title)
        if labelled:
            ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
        if not spans:
            ax.text(0.5, 0.5, "no spans recorded", transform=ax.transAxes, ha="center")

    def to_chrome_trace(self, path: str | os.PathLike) -> str:
        """Write the spans as a Chrome/Perfetto trace (JSON), one thread per lane.

        Open it in ``chrome://tracing`` or https://ui.perfetto.dev, next to MXNet's own
        profiler output. Times are microseconds since the :class:`Stats` was created.

        Returns:
            The path written.

        Example:
            >>> loader.stats.to_chrome_trace("trace.json")  # doctest: +SKIP
            'trace.json'
        """
        pid = os.getpid()
        lanes = self.lanes()
        tids = {lane: i + 1 for i, lane in enumerate(lanes)}
        events: list[dict] = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                               "args": {"name": "gluon_stream"}}]
        for lane, tid in tids.items():
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                           "args": {"name": lane}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                           "args": {"sort_index": tid}})
        for s in self.span_list():
            event = {"name": s.name, "cat": "gluon_stream", "ph": "X", "pid": pid,
                     "tid": tids[s.lane], "ts": round(s.start * 1e6, 3),
                     "dur": round(max(0.0, s.end - s.start) * 1e6, 3)}
            if s.key is not None:
                event["args"] = {"key": str(s.key)}
            events.append(event)
        path = os.fspath(path)
        with open(path, "w", encoding="utf-8") as fp:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, fp)
        logger.info("chrome trace written to %s (%d spans)", path, len(events))
        return path


def make_tqdm(**kwargs: Any) -> Any:
    """A ``tqdm.auto`` bar without tqdm's monitor thread (which outlives the bar by seconds)."""
    from tqdm.auto import tqdm

    class _Tqdm(tqdm):  # type: ignore[misc, valid-type]
        monitor_interval = 0

    return _Tqdm(**kwargs)


def _short_lane(lane: str) -> str:
    return lane.replace("gluon_stream-", "")


class ProgressBar:
    """A tqdm bar for one epoch: batches, samples/s, the share of time the loop waited for data,
    and the shards already produced ahead.

    ``tqdm.auto`` renders a widget in Jupyter (with ipywidgets installed) and text in a
    terminal. ``StreamLoader(..., progress=True)`` creates one per epoch.

    Args:
        epoch: Shown as the bar's description.
        total: Batches in the epoch, if known.
        disable: As in tqdm: False shows the bar; None hides it when the output is not a
            terminal. An explicit ``progress=True`` shows it (the default False).
        file: Where to write (default: stderr).

    Example:
        >>> bar = ProgressBar(0, total=2, disable=True)
        >>> bar.update(EpochRecord(0, batches=1, samples=32, wall_s=0.5), ahead=1)
        >>> bar.close()
    """

    REFRESH_S = 0.2

    def __init__(self, epoch: int, total: int | None, *, disable: bool | None = False,
                 file: Any = None) -> None:
        self._bar = make_tqdm(total=total, desc=f"epoch {epoch}", unit="batch", leave=True,
                              dynamic_ncols=True, disable=disable, file=file)
        self._last = -float("inf")
        self._postfix: dict = {}
        self._record: EpochRecord | None = None

    def update(self, record: EpochRecord, ahead: int) -> None:
        """Advance by one batch; refresh samples/s, waiting share and shards ahead."""
        self._record = record
        now = time.monotonic()
        if now - self._last >= self.REFRESH_S:
            self._last = now
            self._set_postfix(record, ahead)
        self._bar.update(1)

    def _set_postfix(self, record: EpochRecord, ahead: int) -> None:
        wall = record.wall_s if record.wall_s > 0 else 1e-9
        self._postfix = {"samples/s": f"{record.samples / wall:,.0f}",
                         "waiting": f"{100.0 * record.stall_s / wall:.0f}%", "ahead": ahead}
        self._bar.set_postfix(self._postfix, refresh=False)

    @property
    def postfix(self) -> dict:
        """The figures shown last (samples/s, waiting share, shards ahead)."""
        return dict(self._postfix)

    def close(self, record: EpochRecord | None = None) -> None:
        """Show the epoch's final figures and close the bar.

        Args:
            record: The finished epoch's record; default: the one last passed to
                :meth:`update` (the loader completes it before closing the bar).
        """
        record = record if record is not None else self._record
        if record is not None:
            self._set_postfix(record, 0)
        self._bar.close()
