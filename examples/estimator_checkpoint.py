"""Estimator checkpoints that hold the loader's position: a preempted run resumes exactly.

``gs.StreamCheckpoint`` is gluon's ``CheckpointHandler`` (same arguments, after the loader)
that also writes the loader's state beside each ``model-epochXbatchY.params``/``.states``
(as ``model-epochXbatchY.loader.json``); with ``resume_from_checkpoint=True`` it loads all
three, so the resumed run trains on exactly the batches an uninterrupted run would have.

    python examples/estimator_checkpoint.py --model-dir /tmp/ckpt --stop-after 200  # preempted
    python examples/estimator_checkpoint.py --model-dir /tmp/ckpt                   # resumes
    python examples/estimator_checkpoint.py --tiny   # both, checked against an uninterrupted run
    python examples/estimator_checkpoint.py --tiny --batch-period 4   # checkpoints by batches
"""
from __future__ import annotations

import argparse
import tempfile
from typing import Sequence

import mxnet as mx
import numpy as np
from mxnet import gluon
from mxnet.gluon.contrib.estimator import BatchEnd, Estimator

import gluon_stream as gs

FEATURES = 8


class Preempted(Exception):
    """Stands in for the job being killed."""


class Watch(BatchEnd):
    """Fingerprints each batch (the sum of its data) and raises Preempted after ``stop_after``
    batches. Priority 1 runs it after StreamCheckpoint (0): a checkpoint due at that batch is
    written first."""

    priority = 1

    def __init__(self, stop_after: int | None) -> None:
        self.stop_after = stop_after
        self.seen: list[float] = []

    def batch_end(self, estimator: Estimator, *args, **kwargs) -> bool:
        self.seen.append(round(float(kwargs["batch"][0].sum().asscalar()), 3))
        if len(self.seen) == self.stop_after:
            raise Preempted
        return False


def make_shard(key: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """One shard, made on demand: features and a linear target."""
    x = np.random.default_rng(key).standard_normal((rows, FEATURES)).astype(np.float32)
    return x, x.sum(axis=1, keepdims=True)


def train(args: argparse.Namespace, model_dir: str, stop_after: int | None = None) -> list:
    """Train from the newest checkpoint in ``model_dir`` (from scratch if none); returns the
    fingerprints of the batches trained on."""
    net = gluon.nn.Dense(1, in_units=FEATURES)
    net.initialize(mx.init.Xavier())
    net.hybridize()  # so that CheckpointHandler saves model-symbol.json too
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.01})
    estimator = Estimator(net, loss=gluon.loss.L2Loss(), trainer=trainer, context=mx.cpu())
    watch = Watch(stop_after)
    source = gs.FunctionSource(range(args.shards), lambda key: make_shard(key, args.rows))
    with gs.StreamLoader(source, batch_size=args.batch_size, shuffle=True, seed=42,
                         last_batch="rollover", shard_sizes=args.rows) as loader:
        # MXNet resumes only "epochs with epoch checkpoints" or "batches with batch checkpoints"
        checkpoint = gs.StreamCheckpoint(loader, model_dir, resume_from_checkpoint=True,
                                         epoch_period=None if args.batch_period else 1,
                                         batch_period=args.batch_period)
        length = ({"batches": args.epochs * len(loader)} if args.batch_period
                  else {"epochs": args.epochs})
        try:
            estimator.fit(train_data=loader, event_handlers=[checkpoint, watch], **length)
        except Preempted:
            print(f"preempted after {len(watch.seen)} batches; checkpoints in {model_dir}")
    return watch.seen


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", help="where the checkpoints go (required without --tiny)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs in all (default: 3)")
    parser.add_argument("--shards", type=int, default=8, help="shards per epoch (default: 8)")
    parser.add_argument("--rows", type=int, default=500, help="samples per shard (default: 500)")
    parser.add_argument("--batch-size", type=int, default=32, help="default: 32")
    parser.add_argument("--batch-period", type=int, default=None,
                        help="checkpoint every this many batches and train epochs x len(loader) "
                             "batches (default: checkpoint at every epoch's end)")
    parser.add_argument("--stop-after", type=int, default=None,
                        help="simulate preemption after this many batches (default: never)")
    parser.add_argument("--tiny", action="store_true",
                        help="4 shards of 45 samples in temporary directories: preempted after "
                             "14 batches, resumed, and checked against an uninterrupted run")
    args = parser.parse_args(argv)
    if args.tiny:
        args.shards, args.rows, args.batch_size = 4, 45, 16
        with tempfile.TemporaryDirectory() as stopped, tempfile.TemporaryDirectory() as whole:
            first = train(args, stopped, stop_after=args.stop_after or 14)
            resumed = train(args, stopped)
            expected = train(args, whole)
        cut = len(expected) - len(resumed)  # batches before the checkpoint it resumed from
        if not 0 <= cut <= len(first) or first[:cut] + resumed != expected:
            raise SystemExit(f"resume changed the batches: {first[:cut]} + {resumed} != "
                             f"{expected}")
        print(f"resumed from the checkpoint after batch {cut}: the same {len(expected)} batches "
              "as an uninterrupted run")
        return 0
    if not args.model_dir:
        parser.error("--model-dir is required (or --tiny)")
    seen = train(args, args.model_dir, args.stop_after)
    print(f"trained {len(seen)} batches")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
