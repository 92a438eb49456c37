"""Preemptible training: save the loader's state beside the parameters, resume exactly.

Run it once with --stop-after 7 (it "gets preempted" after 7 batches and saves a checkpoint),
then again without: it loads the checkpoint and continues with exactly the batches an
uninterrupted run would have seen next.

    python examples/resume_training.py --workdir /tmp/ckpt --stop-after 7
    python examples/resume_training.py --workdir /tmp/ckpt
    python examples/resume_training.py --tiny     # both runs, checked against an uninterrupted one
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import gluon_stream as gs


def make_shard(key: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(key)
    x = rng.standard_normal((50 + 7 * key, 8)).astype(np.float32)
    return x, x.sum(axis=1, keepdims=True)


def train(workdir: str, epochs: int, stop_after: int | None = None) -> list[float]:
    """Train from the checkpoint in ``workdir`` if there is one; save one and stop after
    ``stop_after`` batches if asked. Returns a fingerprint (the data's sum) of each batch."""
    params = os.path.join(workdir, "net.params")
    state_path = os.path.join(workdir, "loader_state.json")
    net = gluon.nn.Dense(1)
    net.initialize(mx.init.Xavier())
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.01})
    loss_fn = gluon.loss.L2Loss()
    seen: list[float] = []
    with gs.StreamLoader(gs.FunctionSource(range(6), make_shard), batch_size=16,
                         shuffle=True, seed=42, last_batch="rollover") as loader:
        start_epoch = 0
        if os.path.exists(state_path):
            net(mx.nd.zeros((1, 8)))  # materialise shapes before loading
            net.load_parameters(params)
            with open(state_path) as fp:
                state = json.load(fp)
            loader.load_state_dict(state)
            start_epoch = state["epoch"]
            print(f"resumed at epoch {start_epoch}, batch {state['batches']}")
        for epoch in range(start_epoch, epochs):
            loader.set_epoch(epoch)
            for data, label in loader:
                with autograd.record():
                    loss = loss_fn(net(data), label)
                loss.backward()
                trainer.step(data.shape[0])
                seen.append(float(data.sum().asscalar()))
                if stop_after is not None and len(seen) == stop_after:
                    net.save_parameters(params)
                    with open(state_path, "w") as fp:
                        json.dump(loader.state_dict(), fp)
                    print(f"preempted after {len(seen)} batches; checkpoint in {workdir}")
                    return seen
            print(f"epoch {epoch} done, loss {float(loss.mean().asscalar()):.4f}")
    print(f"trained {len(seen)} batches")
    return seen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", help="where the checkpoint goes (required without --tiny)")
    parser.add_argument("--epochs", type=int, default=2, help="epochs in all (default: 2)")
    parser.add_argument("--stop-after", type=int, default=None,
                        help="simulate preemption after this many batches (default: never)")
    parser.add_argument("--tiny", action="store_true",
                        help="in a temporary directory: stop after 7 batches, resume, and check "
                             "the batches against an uninterrupted run")
    args = parser.parse_args(argv)
    if args.tiny:
        with tempfile.TemporaryDirectory() as stopped, tempfile.TemporaryDirectory() as whole:
            resumed = train(stopped, args.epochs, stop_after=7) + train(stopped, args.epochs)
            expected = train(whole, args.epochs)
        if resumed != expected:
            raise SystemExit(f"resume changed the batches: {resumed} != {expected}")
        print(f"resumed run = uninterrupted run: the same {len(expected)} batches")
        return 0
    if not args.workdir:
        parser.error("--workdir is required (or --tiny)")
    os.makedirs(args.workdir, exist_ok=True)
    train(args.workdir, args.epochs, args.stop_after)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
