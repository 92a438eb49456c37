"""A smoke run of an installed gluon_stream: what must work on every Python that setup.cfg admits.

.ci/run runs it on the Pythons other than the one the whole suite runs on, each in a fresh
venv made by the README's demo command. It exits non-zero, with a traceback, at the first thing
that does not work:

* ``import mxnet`` comes first, as in a user's script: on numpy >= 1.24 (Python 3.12) it works
  only through the import hook that installing gluon_stream puts in site-packages;
* a StreamLoader trains a small Gluon network for a few batches (shuffled, across shards);
* the per-sample path with two worker processes (a fork per shard) gives the same samples;
* an exception raised by the user's transform reaches the loop with its own type and a note;
* the Module API trains from a StreamIter.
"""
from __future__ import annotations

import sys

import mxnet as mx  # before gluon_stream: the import hook restores numpy's aliases
import numpy as np

import gluon_stream as gs

ROWS, SHARDS, BATCH = 40, 3, 16


def shard(key: int) -> tuple[np.ndarray, np.ndarray]:
    x = np.random.default_rng(key).standard_normal((ROWS, 4)).astype(np.float32)
    return x, x.sum(axis=1)


def source() -> gs.FunctionSource:
    return gs.FunctionSource(range(SHARDS), shard)


class BadShard(ValueError):
    """A user's own exception type."""


def refuse(arrays: tuple) -> tuple:
    raise BadShard("this shard is bad")


def main() -> int:
    with gs.StreamLoader(source(), batch_size=BATCH, shuffle=True, seed=0) as loader:
        net = mx.gluon.nn.Dense(1)
        net.initialize()
        trainer = mx.gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.05})
        loss_fn = mx.gluon.loss.L2Loss()
        losses = []
        for data, label in loader:
            with mx.autograd.record():
                loss = loss_fn(net(data), label)
            loss.backward()
            trainer.step(data.shape[0])
            losses.append(float(loss.mean().asscalar()))
    assert len(losses) == -(-SHARDS * ROWS // BATCH) and all(np.isfinite(losses)), losses

    with gs.StreamLoader(source(), batch_size=BATCH, sample_transform=lambda x, y: (x * 2, y),
                         num_workers=2, thread_pool=False) as loader:
        doubled = np.concatenate([data.asnumpy() for data, _ in loader])
    np.testing.assert_allclose(doubled, 2 * np.concatenate([shard(k)[0] for k in range(SHARDS)]))

    try:
        with gs.StreamLoader(source(), batch_size=BATCH, transform=refuse) as loader:
            list(loader)
    except BadShard as exc:
        assert any("shard 0" in note for note in getattr(exc, "__notes__", [])), exc.__notes__
    else:
        raise AssertionError("the transform's BadShard did not reach the loop")

    with gs.StreamLoader(source(), batch_size=BATCH) as loader:
        it = gs.StreamIter(loader, data_names=["data"], label_names=["lin_reg_label"])
        data = mx.sym.Variable("data")
        out = mx.sym.LinearRegressionOutput(mx.sym.FullyConnected(data, num_hidden=1),
                                            name="lin_reg")
        mod = mx.mod.Module(out, data_names=["data"], label_names=["lin_reg_label"])
        mod.fit(it, num_epoch=1, optimizer="sgd", optimizer_params={"learning_rate": 0.05})
        it.close()

    print(f"smoke run passed: Python {sys.version.split()[0]}, numpy {np.__version__}, "
          f"mxnet {mx.__version__}, gluon_stream {gs.__version__}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
