"""``gluon-stream demo``: stream shards from the built-in generator and train a small Gluon model.

The generator runs as a real external process per shard (it sleeps to stand in for an
expensive C++ program), the transform cuts sliding windows, and a small Gluon network
trains on the batches while the next shards are produced in the background.
"""
from __future__ import annotations

import argparse
import datetime
import logging
import tempfile
import time
from typing import Any

from . import _compat
from .generator import generator_command, make_windows
from .loader import StreamLoader
from .sources import CommandSource

__all__ = ["register", "run_demo"]

logger = logging.getLogger(__name__)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "demo", help="train a small Gluon model on shards generated on demand",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, default=6, help="shards (dates) per epoch")
    parser.add_argument("--rows", type=int, default=4000, help="raw rows per shard")
    parser.add_argument("--inputs", type=int, default=8, help="input columns")
    parser.add_argument("--time-steps", type=int, default=16, help="window length")
    parser.add_argument("--delay", type=float, default=0.3, help="generator seconds per shard")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--prefetch", type=int, default=2)
    parser.add_argument("--producers", type=int, default=2)
    parser.add_argument("--cache-dir", default=None,
                        help="keep shards here (default: a temporary directory, removed after)")
    parser.set_defaults(func=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    mx = _compat.require_mxnet()
    from mxnet import autograd, gluon

    start = datetime.date(2024, 1, 1)
    keys = [(start + datetime.timedelta(days=i)).isoformat() for i in range(args.shards)]
    with tempfile.TemporaryDirectory(prefix="gluon_stream_demo_") as tmp:
        cache_dir = args.cache_dir or tmp
        source = CommandSource(keys, generator_command(args.rows, args.inputs, args.delay),
                               cache_dir=cache_dir, timeout=120, retries=1)
        net = gluon.nn.HybridSequential()
        net.add(gluon.nn.Dense(64, activation="relu"), gluon.nn.Dense(1))
        net.initialize(mx.init.Xavier())
        net.hybridize()
        trainer = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": 1e-3})
        loss_fn = gluon.loss.L2Loss()
        with StreamLoader(source, batch_size=args.batch_size, shuffle=True, seed=0,
                          transform=lambda raw: make_windows(raw, args.time_steps),
                          prefetch=args.prefetch, producers=args.producers,
                          last_batch="rollover") as loader:
            for epoch in range(args.epochs):
                loader.set_epoch(epoch)
                t0 = time.perf_counter()
                total, samples = 0.0, 0
                for data, label in loader:
                    with autograd.record():
                        loss = loss_fn(net(data), label)
                    loss.backward()
                    trainer.step(data.shape[0])
                    total += float(loss.mean().asscalar()) * data.shape[0]
                    samples += data.shape[0]
                wall = time.perf_counter() - t0
                print(f"epoch {epoch}: {samples} samples in {wall:.2f} s = "
                      f"{samples / wall:,.0f} samples/s, loss {total / max(samples, 1):.4f}")
            print(loader.stats.summary())
    return 0
