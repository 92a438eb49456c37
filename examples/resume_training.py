"""Preemptible training: save the loader's state beside the parameters, resume exactly.

Run it once with ``--stop-after 7`` (it "gets preempted" after 7 batches and saves a
checkpoint), then again without: it loads the checkpoint and continues with exactly the batches
an uninterrupted run would have seen next.

    python examples/resume_training.py --workdir /tmp/ckpt --stop-after 7
    python examples/resume_training.py --workdir /tmp/ckpt
"""
from __future__ import annotations

import argparse
import json
import os

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import gluon_stream as gs


def make_shard(key: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(key)
    x = rng.standard_normal((50 + 7 * key, 8)).astype(np.float32)
    return x, x.sum(axis=1, keepdims=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True, help="where checkpoints go")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--stop-after", type=int, default=None,
                        help="simulate preemption after this many batches")
    args = parser.parse_args(argv)
    os.makedirs(args.workdir, exist_ok=True)
    params = os.path.join(args.workdir, "net.params")
    state_path = os.path.join(args.workdir, "loader_state.json")

    net = gluon.nn.Dense(1)
    net.initialize(mx.init.Xavier())
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.01})
    loss_fn = gluon.loss.L2Loss()
    loader = gs.StreamLoader(gs.FunctionSource(range(6), make_shard), batch_size=16,
                             shuffle=True, seed=42, last_batch="rollover")
    start_epoch = 0
    if os.path.exists(state_path):
        net(mx.nd.zeros((1, 8)))  # materialise shapes before loading
        net.load_parameters(params)
        with open(state_path) as fp:
            state = json.load(fp)
        loader.load_state_dict(state)
        start_epoch = state["epoch"]
        print(f"resumed at epoch {start_epoch}, batch {state['batches']}")
    seen = 0
    with loader:
        for epoch in range(start_epoch, args.epochs):
            loader.set_epoch(epoch)
            for data, label in loader:
                with autograd.record():
                    loss = loss_fn(net(data), label)
                loss.backward()
                trainer.step(data.shape[0])
                seen += 1
                if args.stop_after is not None and seen == args.stop_after:
                    net.save_parameters(params)
                    with open(state_path, "w") as fp:
                        json.dump(loader.state_dict(), fp)
                    print(f"preempted after {seen} batches; checkpoint in {args.workdir}")
                    return 0
            print(f"epoch {epoch} done, loss {float(loss.mean().asscalar()):.4f}")
    print(f"trained {seen} batches")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
