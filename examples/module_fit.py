"""Train with the Module API (``mod.fit``) on shards produced on demand, through ``gs.StreamIter``.

Shards come from a Python function per key (features and a class label); ``StreamIter``
turns the StreamLoader into the ``mx.io.DataIter`` that ``Module.fit``, ``score`` and
``predict`` expect, with ``provide_data``/``provide_label`` taken from the first batch.
``--prefetching`` wraps it in ``mx.io.PrefetchingIter`` too (safe: batches are never
overwritten later).

    python examples/module_fit.py
    python examples/module_fit.py --tiny        # seconds, for CI
"""
from __future__ import annotations

import argparse
import logging
from typing import Sequence

import mxnet as mx
import numpy as np

import gluon_stream as gs

NUM_FEATURES, NUM_CLASSES = 16, 3


def make_shard(key: int, rows: int):
    """Features ``(rows, 16)`` float32 and labels from a fixed linear rule plus noise."""
    rng = np.random.default_rng(key)
    weights = np.random.default_rng(12345).standard_normal((NUM_FEATURES, NUM_CLASSES))
    x = rng.standard_normal((rows, NUM_FEATURES)).astype(np.float32)
    scores = x @ weights + rng.normal(0, 0.3, (rows, NUM_CLASSES))
    return x, scores.argmax(axis=1).astype(np.float32)


def stop_prefetching(pf: mx.io.PrefetchingIter) -> None:
    """End a PrefetchingIter's thread.

    Only its ``__del__`` does, and ``del`` never triggers it (the thread holds a reference).
    Calling it while the thread is fetching loses the wake-up (the thread clears the event
    after its fetch) and hangs, so wait for the fetch in flight first.
    """
    for ready in pf.data_ready:
        ready.wait()
    pf.__del__()


def mlp() -> mx.sym.Symbol:
    data = mx.sym.Variable("data")
    hidden = mx.sym.Activation(mx.sym.FullyConnected(data, num_hidden=32, name="fc1"), "relu")
    out = mx.sym.FullyConnected(hidden, num_hidden=NUM_CLASSES, name="fc2")
    return mx.sym.SoftmaxOutput(out, name="softmax")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, default=10,
                        help="training shards per epoch (default: 10)")
    parser.add_argument("--rows", type=int, default=2000,
                        help="samples per shard (default: 2000)")
    parser.add_argument("--batch-size", type=int, default=100,
                        help="samples per batch (default: 100)")
    parser.add_argument("--epochs", type=int, default=2, help="epochs (default: 2)")
    parser.add_argument("--prefetching", action="store_true",
                        help="wrap the training iterator in mx.io.PrefetchingIter")
    parser.add_argument("--tiny", action="store_true",
                        help="3 shards of 150 samples, batches of 32: seconds (CI)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.shards, args.rows, args.batch_size = 3, 150, 32
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # Module logs its epochs

    train_src = gs.FunctionSource(range(args.shards), lambda k: make_shard(k, args.rows))
    val_src = gs.FunctionSource([10_000], lambda k: make_shard(k, args.rows))
    with gs.StreamLoader(train_src, batch_size=args.batch_size, shuffle=True, seed=0) as train, \
            gs.StreamLoader(val_src, batch_size=args.batch_size) as val:
        train_iter = gs.StreamIter(train, data_names=["data"], label_names=["softmax_label"])
        val_iter = gs.StreamIter(val)
        it = mx.io.PrefetchingIter(train_iter) if args.prefetching else train_iter
        mod = mx.mod.Module(mlp(), data_names=["data"], label_names=["softmax_label"],
                            context=mx.cpu())
        try:
            mod.fit(it, eval_data=val_iter, num_epoch=args.epochs, optimizer="adam",
                    optimizer_params={"learning_rate": 0.01}, initializer=mx.init.Xavier(),
                    eval_metric="acc",
                    batch_end_callback=mx.callback.Speedometer(args.batch_size, 20))
            val_iter.reset()
            (name, value), = mod.score(val_iter, "acc")
            print(f"validation {name}: {value:.3f}")
            val_iter.reset()
            print(f"predictions: {mod.predict(val_iter).shape}")
        finally:
            if args.prefetching:
                stop_prefetching(it)
            train_iter.close()
            val_iter.close()
        print(train.stats.summary())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
