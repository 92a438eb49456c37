"""``gluon-stream demo``: stream shards from the built-in generator and train a small Gluon model.

The generator runs as a real external process per shard (it sleeps to stand in for an
expensive C++ program), the transform cuts sliding windows, and a small Gluon network
trains on the batches while the next shards are produced in the background. A progress
bar per epoch shows samples/s and the share of time the loop waited for data; at the end
the demo prints the stats table, the bottleneck verdict with its advice, and writes the
pipeline timeline as a PNG (and, with --trace, a Chrome/Perfetto trace). The loader runs within
a memory budget (--memory-budget) and tunes its producers and prefetch itself; the demo prints
what it chose and why.
"""
from __future__ import annotations

import argparse
import datetime
import logging
import os
import tempfile
import time
from typing import Any

from .. import CommandSource, StreamLoader
from .._mx import import_mxnet
from .._utils.validate import byte_size
from ..tools.generator import generator_command, make_windows
from ..tools.models import small_regressor
from ._args import (
    UsageError,
    ensure_writable_dir,
    non_negative_float,
    non_negative_int,
    output_path,
    plain_text,
    positive_int,
)

__all__ = ["DEFAULT_PLOT", "register", "run_demo"]

logger = logging.getLogger(__name__)

DEFAULT_PLOT = "gluon_stream_timeline.png"
DEFAULT_BUDGET = "256MiB"


def register(subparsers: Any) -> None:
    """Add the ``demo`` subcommand to the CLI's subparsers."""
    parser = subparsers.add_parser(
        "demo", help="train a small Gluon model on shards generated on demand",
        description=plain_text(__doc__))
    parser.add_argument("--shards", type=positive_int, default=6,
                        help="shards (dates) per epoch")
    parser.add_argument("--rows", type=positive_int, default=4000,
                        help="raw rows per shard; a shard gives rows - time steps windows")
    parser.add_argument("--inputs", type=positive_int, default=8, help="input columns")
    parser.add_argument("--time-steps", type=positive_int, default=16,
                        help="window length, less than --rows")
    parser.add_argument("--delay", type=non_negative_float, default=0.1,
                        help="seconds the generator sleeps per shard (the cost of making it)")
    parser.add_argument("--epochs", type=positive_int, default=2, help="passes over the shards")
    parser.add_argument("--batch-size", type=positive_int, default=128, help="windows per batch")
    parser.add_argument("--prefetch", type=non_negative_int, default=None,
                        help="shards produced ahead of the one in use (default: tuned within "
                             "--memory-budget, or 2 without one)")
    parser.add_argument("--producers", type=positive_int, default=None,
                        help="shards generated in parallel (default: tuned within "
                             "--memory-budget, or 2 without one)")
    parser.add_argument("--memory-budget", default=DEFAULT_BUDGET, metavar="SIZE",
                        help="memory the loader may hold for data, e.g. 256MiB or 2GB; it tunes "
                             "the settings not given within it ('' for none; default: "
                             f"{DEFAULT_BUDGET})")
    parser.add_argument("--cache-dir", default=None,
                        help="keep the shards here, created if needed, and reuse them next time "
                             "(default: a temporary directory, removed after)")
    parser.add_argument("--plot", type=output_path, default=None, metavar="PATH",
                        help="write the timeline image here, in the format its suffix names "
                             f"(default: {DEFAULT_PLOT} when matplotlib is installed; '' for "
                             "none)")
    parser.add_argument("--trace", type=output_path, default=None, metavar="PATH",
                        help="also write a Chrome/Perfetto trace JSON here (default: none)")
    parser.add_argument("--no-progress", dest="progress", action="store_false",
                        help="no progress bars")
    parser.set_defaults(func=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo; prints per-epoch samples/s, the stats table, the bottleneck verdict and
    where the timeline went."""
    plot = _plot_path(args.plot)
    windows = args.rows - args.time_steps
    if windows <= 0:
        raise UsageError(f"--time-steps ({args.time_steps}) must be less than --rows "
                         f"({args.rows}): a shard of R rows gives R - time steps windows")
    if args.shards * windows < args.batch_size:
        raise UsageError(f"an epoch has {args.shards * windows} windows (--shards x (--rows - "
                         f"--time-steps)), fewer than --batch-size ({args.batch_size}): no batch "
                         "would be trained; raise --shards or --rows, or lower --batch-size")
    if args.cache_dir:
        ensure_writable_dir(args.cache_dir, "--cache-dir")
    settings = _settings(args)
    import_mxnet()

    start = datetime.date(2024, 1, 1)
    keys = [(start + datetime.timedelta(days=i)).isoformat() for i in range(args.shards)]
    with tempfile.TemporaryDirectory(prefix="gluon_stream_demo_") as tmp:
        cache_dir = args.cache_dir or tmp
        source = CommandSource(keys, generator_command(args.rows, args.inputs, args.delay),
                               cache_dir=cache_dir, timeout=120, retries=1)
        train_step = small_regressor("adam", lstm_hidden=64)
        with StreamLoader(source, batch_size=args.batch_size, shuffle=True, seed=0,
                          transform=lambda raw: make_windows(raw, args.time_steps),
                          last_batch="rollover", progress=args.progress, **settings) as loader:
            for epoch in range(args.epochs):
                loader.set_epoch(epoch)
                t0 = time.perf_counter()
                total, samples = 0.0, 0
                for data, label in loader:
                    loss = train_step(data, label)
                    total += float(loss.mean().asscalar()) * data.shape[0]
                    samples += data.shape[0]
                wall = time.perf_counter() - t0
                print(f"epoch {epoch}: {samples} samples in {wall:.2f} s = "
                      f"{samples / wall:,.0f} samples/s, loss {total / max(samples, 1):.4f}")
            print(loader.stats.summary())
            print(loader.stats.diagnose().headline)
            _print_tuning(loader, settings)
            _export(loader.stats, plot, args.trace)
    return 0


def _settings(args: argparse.Namespace) -> dict:
    """The loader's prefetch/producers/memory_budget: the ones given stay fixed; with a budget
    the others are tuned, without one they are 2 (checked before any work)."""
    settings = {name: value for name, value in (("prefetch", args.prefetch),
                                                ("producers", args.producers))
                if value is not None}
    if args.memory_budget:
        try:
            settings["memory_budget"] = byte_size("--memory-budget", args.memory_budget)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        return settings
    return {"prefetch": 2, "producers": 2, **settings}


def _print_tuning(loader: StreamLoader, settings: dict) -> None:
    """What the budget's tuner chose, and why (one line per change)."""
    if "memory_budget" not in settings:
        return
    changes = list(loader.stats.tuning)
    for change in changes:
        print(f"tuned {change.setting} {change.old}\u2192{change.new}: {change.reason}")
    if not changes:
        print("tuned: nothing changed (the loop did not wait for shards)")


def _plot_path(path: str | None) -> str:
    """The timeline's path, checked before any work: ``''`` for none.

    Without ``--plot`` the default is written when matplotlib is installed (a WARNING says why
    not otherwise); an explicit ``--plot`` needs matplotlib and a format it can write.
    """
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        if path:
            raise UsageError("--plot needs matplotlib: pip install 'gluon_stream[plot]' "
                             "(or --plot '' for no timeline)") from None
        if path is None:
            logger.warning("no timeline will be written: matplotlib is not installed "
                           "(pip install 'gluon_stream[plot]')")
        return ""
    if path is None:  # the default: checked here, as argparse checked an explicit --plot
        try:
            path = output_path(DEFAULT_PLOT)
        except argparse.ArgumentTypeError as exc:
            raise UsageError(f"--plot: {exc} (give --plot PATH, or '' for none)") from None
    suffix = os.path.splitext(path)[1].lstrip(".").lower()
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix and suffix not in formats:
        raise UsageError(f"--plot {path!r}: matplotlib cannot write .{suffix} files; use one of "
                         f"{', '.join('.' + f for f in sorted(formats))}")
    return path


def _export(stats: Any, plot: str, trace: str | None) -> None:
    if trace:
        print(f"chrome trace: {os.path.abspath(stats.to_chrome_trace(trace))}")
    if plot:
        stats.plot(plot)
        print(f"timeline: {os.path.abspath(plot)}")
