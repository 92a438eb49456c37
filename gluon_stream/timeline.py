"""The pipeline timeline as a picture (matplotlib) or a Chrome/Perfetto trace (JSON).

Both read a :class:`~gluon_stream.Stats` through its public readers (``span_list``, ``lanes``,
``totals``); ``Stats.plot`` and ``Stats.to_chrome_trace`` call them.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any

__all__ = ["COLORS", "PRODUCER_PHASES", "TRAIN_LANE", "TRAIN_PHASES", "plot_timeline",
           "write_chrome_trace"]

logger = logging.getLogger(__name__)

TRAIN_LANE = "train"
PRODUCER_PHASES = ("generate", "load", "transform")
TRAIN_PHASES = ("busy", "wait")
COLORS = {"generate": "#e8a33d", "load": "#4c8bd6", "transform": "#59a14f",
          "busy": "#2f7d32", "wait": "#d62728"}


def plot_timeline(stats: Any, path: str | os.PathLike | None = None, *, ax: Any = None,
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
    _draw(ax, spans, lanes, title, stats.totals())
    fig.tight_layout()
    if path is not None:
        fig.savefig(os.fspath(path), dpi=100)
        logger.info("timeline written to %s", os.fspath(path))
    return fig


def _draw(ax: Any, spans: list, lanes: list[str], title: str | None,
          totals: dict) -> None:
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
