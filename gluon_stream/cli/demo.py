"""``gluon-stream demo``: stream shards from the built-in generator and train a small Gluon model.

The generator runs as a real external process per shard (it sleeps to stand in for an
expensive C++ program), the transform cuts sliding windows, and a small Gluon network
trains on the batches while the next shards are produced in the background. A progress
bar per epoch shows samples/s and the share of time the loop waited for data; at the end
the demo prints the stats table and writes the pipeline timeline as a PNG (and, with
--trace, a Chrome/Perfetto trace).
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
from .._mx import require_mxnet
from ..tools.generator import generator_command, make_windows
from ..tools.models import small_regressor
from ._args import UsageError, non_negative_float, positive_int

__all__ = ["register", "run_demo"]

logger = logging.getLogger(__name__)


def register(subparsers: Any) -> None:
    """Add the ``demo`` subcommand to the CLI's subparsers."""
    parser = subparsers.add_parser(
        "demo", help="train a small Gluon model on shards generated on demand",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=positive_int, default=6,
                        help="shards (dates) per epoch (default 6)")
    parser.add_argument("--rows", type=positive_int, default=4000,
                        help="raw rows per shard (default 4000)")
    parser.add_argument("--inputs", type=positive_int, default=8, help="input columns (default 8)")
    parser.add_argument("--time-steps", type=positive_int, default=16,
                        help="window length (default 16)")
    parser.add_argument("--delay", type=non_negative_float, default=0.1,
                        help="generator seconds per shard (default 0.1)")
    parser.add_argument("--epochs", type=positive_int, default=2, help="default 2")
    parser.add_argument("--batch-size", type=positive_int, default=128, help="default 128")
    parser.add_argument("--prefetch", type=int, default=2, help="shards ahead (default 2)")
    parser.add_argument("--producers", type=positive_int, default=2,
                        help="shards generated in parallel (default 2)")
    parser.add_argument("--cache-dir", default=None,
                        help="keep shards here (default: a temporary directory, removed after)")
    parser.add_argument("--plot", default="gluon_stream_timeline.png", metavar="PATH",
                        help="write the timeline PNG here (default: %(default)s; '' for none)")
    parser.add_argument("--trace", default=None, metavar="PATH",
                        help="also write a Chrome/Perfetto trace JSON here")
    parser.add_argument("--no-progress", dest="progress", action="store_false",
                        help="no progress bars")
    parser.set_defaults(func=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo; prints per-epoch samples/s, the stats table and where the timeline went."""
    require_mxnet()
    if args.prefetch < 0:
        raise UsageError(f"--prefetch must be >= 0, got {args.prefetch}")

    start = datetime.date(2024, 1, 1)
    keys = [(start + datetime.timedelta(days=i)).isoformat() for i in range(args.shards)]
    with tempfile.TemporaryDirectory(prefix="gluon_stream_demo_") as tmp:
        cache_dir = args.cache_dir or tmp
        source = CommandSource(keys, generator_command(args.rows, args.inputs, args.delay),
                               cache_dir=cache_dir, timeout=120, retries=1)
        train_step = small_regressor("adam", lstm_hidden=64)
        with StreamLoader(source, batch_size=args.batch_size, shuffle=True, seed=0,
                          transform=lambda raw: make_windows(raw, args.time_steps),
                          prefetch=args.prefetch, producers=args.producers,
                          last_batch="rollover", progress=args.progress) as loader:
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
            _export(loader.stats, args)
    return 0


def _export(stats: Any, args: argparse.Namespace) -> None:
    if args.trace:
        print(f"chrome trace: {os.path.abspath(stats.to_chrome_trace(args.trace))}")
    if not args.plot:
        return
    try:
        stats.plot(args.plot)
    except ImportError as exc:
        logger.warning("no timeline written: %s", exc)
        return
    print(f"timeline: {os.path.abspath(args.plot)}")
