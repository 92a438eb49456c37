"""The pipeline timeline as a picture (matplotlib) or a Chrome/Perfetto trace (JSON).

Both read a :class:`~gluon_stream.Stats` through its public readers (``span_list``, ``lanes``,
``totals``); ``Stats.plot`` and ``Stats.to_chrome_trace`` call them.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any

__all__ = ["COLORS", "PRODUCER_PHASES", "TRAIN_LANE", "TRAIN_PHASES", "epoch_starts",
           "plot_timeline", "shard_extents", "write_chrome_trace"]

logger = logging.getLogger(__name__)

TRAIN_LANE = "train"
PRODUCER_PHASES = ("generate", "load", "transform")
TRAIN_PHASES = ("busy", "wait")
# Told apart also by colour-blind eyes: the loop's busy/wait differ in lightness and blue, and
# no producer phase shares a hue with them (transform was a second green).
COLORS = {"generate": "#e8a33d", "load": "#4c8bd6", "transform": "#b07aa1",
          "busy": "#1b9e77", "wait": "#d62728"}
LABEL_PT = 7  # font size of the shard keys and epoch marks
TUNING_COLOR = "#7a5195"  # the memory_budget tuner's changes


def plot_timeline(stats: Any, path: str | os.PathLike | None = None, *, ax: Any = None,
                  title: str | None = None) -> Any:
    """Draw the pipeline timeline: one lane per producer, one for the training loop.

    Producer lanes show ``generate``/``load``/``transform`` spans, each shard labelled with
    its key (or its end, ``…01-12``, where the bar is short; the Chrome trace has every key);
    the ``train`` lane shows ``busy`` (your loop body) and ``wait`` (waiting for the next
    batch): red on the bottom lane is time the accelerator sat idle for lack of data. A
    dashed line marks where
    each epoch started, ``*`` one that was interrupted; a dotted one, labelled at the bottom,
    each setting the ``memory_budget`` tuner changed (``producers 1→2``). Needs matplotlib
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
        >>> fig = plot_timeline(loader.stats, "timeline.png")  # doctest: +SKIP
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ImportError("Stats.plot needs matplotlib: pip install 'gluon_stream[plot]'"
                          ) from exc
    spans = stats.span_list()
    lanes = stats.lanes()
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
    epochs = epoch_starts(list(stats.epochs), spans)
    _draw(ax, spans, lanes, title, stats.totals(), epochs)
    fig.tight_layout()
    _mark_epochs(ax, epochs)
    _mark_tuning(ax, list(getattr(stats, "tuning", ())))
    _label_shards(ax, spans, lanes)
    if path is not None:
        fig.savefig(os.fspath(path), dpi=100)
        logger.info("timeline written to %s", os.fspath(path))
    return fig


def _rows(lanes: list[str]) -> dict[str, int]:
    return {lane: len(lanes) - 1 - i for i, lane in enumerate(lanes)}  # train at the bottom


def _draw(ax: Any, spans: list, lanes: list[str], title: str | None,
          totals: dict, epochs: list[tuple[float, str]]) -> None:
    rows = _rows(lanes)
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
    interrupted = any(label.endswith("*") for _, label in epochs)
    ax.set_xlabel("seconds since the stream was created"
                  + ("   (* an epoch interrupted before its end)" if interrupted else ""))
    if title is None:
        wait = totals.get((TRAIN_LANE, "wait"), 0.0)
        busy = totals.get((TRAIN_LANE, "busy"), 0.0)
        title = (f"training loop waited {wait:.2f} s of {wait + busy:.2f} s "
                 f"({100.0 * wait / (wait + busy):.0f}%)" if wait + busy > 0
                 else "gluon_stream timeline (no training-loop spans yet)")
    ax.set_title(title, pad=2 * LABEL_PT + 8 if epochs else 6)
    if labelled:
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    if not spans:
        ax.text(0.5, 0.5, "no spans recorded", transform=ax.transAxes, ha="center")


def epoch_starts(epochs: list, spans: list) -> list[tuple[float, str]]:
    """Where each epoch began on the timeline, and its label (``"epoch 2*"`` if interrupted).

    The loader records one ``wait`` span per batch it delivers, the first from the start of
    its pass, so epoch e began where its first batch's wait did. Counted back from the latest
    span, as the oldest spans may have been dropped (``Stats.MAX_SPANS``); epochs without a
    batch, or older than the spans kept, are left out.
    """
    waits = [s.start for s in spans if s.lane == TRAIN_LANE and s.name == "wait"]
    marks: list[tuple[float, str]] = []
    end = len(waits)
    for record in reversed(epochs):
        first = end - record.batches
        if first < 0:
            break
        if record.batches:
            marks.append((waits[first], f"epoch {record.epoch}{'' if record.complete else '*'}"))
        end = first
    return marks[::-1]


def shard_extents(spans: list) -> list[tuple[str, float, float, Any]]:
    """``(lane, start, end, key)`` per shard a producer made: from its ``generate`` span to
    the end of the spans that follow it on that lane with the same key (load, transform)."""
    extents: list[list] = []
    for s in sorted((s for s in spans if s.lane != TRAIN_LANE and s.key is not None),
                    key=lambda s: (s.lane, s.start, PRODUCER_PHASES.index(s.name)
                                   if s.name in PRODUCER_PHASES else 0)):
        last = extents[-1] if extents else None
        if s.name == "generate" or last is None or (last[0], last[3]) != (s.lane, s.key):
            extents.append([s.lane, s.start, s.end, s.key])
        else:
            last[2] = max(last[2], s.end)
    return [tuple(e) for e in extents]


def _label_shards(ax: Any, spans: list, lanes: list[str]) -> None:
    """Write each shard's key over its bar, or the end of the key that fits (``…01-12``)."""
    rows = _rows(lanes)
    px_per_s, char_px = _scale(ax)
    for lane, start, end, key in shard_extents(spans):
        room = int((end - start) * px_per_s / char_px) - 1  # characters, a margin kept
        text = str(key)
        if len(text) > room:
            text = "…" + text[len(text) - room + 1:] if room >= 3 else ""
        if text:
            ax.text((start + end) / 2, rows[lane], text, ha="center", va="center",
                    fontsize=LABEL_PT, color="black", clip_on=True)


def _mark_epochs(ax: Any, epochs: list[tuple[float, str]]) -> None:
    """A dashed line where each epoch began, its label above the axes (a second row where
    two labels would overlap)."""
    from matplotlib.transforms import offset_copy

    px_per_s, char_px = _scale(ax)
    rows = [ax.get_xaxis_transform(),
            offset_copy(ax.get_xaxis_transform(), fig=ax.figure, y=LABEL_PT + 2, units="points")]
    free = [-float("inf")] * 2  # where each row of labels is free again, in seconds
    for start, label in epochs:
        ax.axvline(start, color="#555555", linestyle="--", linewidth=0.8)
        row = 0 if start >= free[0] else 1
        free[row] = start + (len(label) + 2) * char_px / px_per_s
        ax.text(start, 1.0, f" {label}", transform=rows[row], ha="left", va="bottom",
                fontsize=LABEL_PT, color="#555555")


def _mark_tuning(ax: Any, changes: list) -> None:
    """A dotted line where the tuner changed a setting, ``setting old→new`` at the bottom."""
    for change in changes:
        ax.axvline(change.time_s, color=TUNING_COLOR, linestyle=":", linewidth=1.0)
        ax.text(change.time_s, 0.0, f" {change.setting} {change.old}\u2192{change.new}",
                transform=ax.get_xaxis_transform(), ha="left", va="bottom", rotation=90,
                fontsize=LABEL_PT, color=TUNING_COLOR)


def _scale(ax: Any) -> tuple[float, float]:
    """Pixels per second on the x axis, and the (estimated) width of a label character."""
    lo, hi = ax.get_xlim()
    fig = ax.figure
    px_per_s = ax.get_position().width * fig.get_figwidth() * fig.dpi / max(hi - lo, 1e-12)
    return px_per_s, 0.62 * LABEL_PT * fig.dpi / 72


def write_chrome_trace(stats: Any, path: str | os.PathLike) -> str:
    """Write the spans as a Chrome/Perfetto trace (JSON), one thread per lane.

    Open it in ``chrome://tracing`` or https://ui.perfetto.dev, next to MXNet's own
    profiler output. Times are microseconds since the :class:`Stats` was created.

    Returns:
        The path written.

    Example:
        >>> write_chrome_trace(loader.stats, "trace.json")  # doctest: +SKIP
        'trace.json'
    """
    pid = os.getpid()
    lanes = stats.lanes()
    tids = {lane: i + 1 for i, lane in enumerate(lanes)}
    events: list[dict] = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                           "args": {"name": "gluon_stream"}}]
    for lane, tid in tids.items():
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                       "args": {"name": lane}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                       "args": {"sort_index": tid}})
    for s in stats.span_list():
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


def _short_lane(lane: str) -> str:
    return lane.replace("gluon_stream-", "")
