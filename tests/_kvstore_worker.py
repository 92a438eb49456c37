"""One worker of a real ``dist_sync`` job (started by ``test_kvstore.py``, not a test itself).

Run with ``DMLC_ROLE=worker`` and the ps-lite environment set, as MXNet's ``tools/launch.py``
starts a worker::

    python _kvstore_worker.py --case known|unknown|pad --out rank.json [--cache DIR --marks DIR]

It creates ``mx.kv.create('dist_sync')``, builds a StreamLoader whose rank comes from that
kvstore (``num_parts='auto'``), trains a tiny Dense net through a Trainer on the same kvstore for
``EPOCHS`` epochs and writes, per epoch, ``len(loader)`` before the pass, the batches' sample ids,
this rank's shards and every part's size (known once the pass is done) and, at the end, the final
parameters. The ``pad`` case evaluates instead: ``even_batches='pad'`` over ``PAD_SIZES``, fewer
shards than ranks, each step summing the ranks' real rows through the kvstore (a push and a
pull per batch: a rank with fewer steps would leave the others waiting). Importing this module
imports neither MXNet nor gluon_stream: the test reads ``SIZES``, ``BATCH_SIZE`` and ``EPOCHS``
from it.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

SIZES = [7, 2, 0, 9, 5, 6, 11, 3, 1, 8, 13, 4]  # awkward sizes, one empty shard: parts differ
PAD_SIZES = [5, 3]  # two held-out dates for three ranks: one rank is dealt no shard
BATCH_SIZE = 4
EPOCHS = 2
SEED = 11
WEIGHTS = (1.0, -2.0, 0.5)


def shard(key: int, sizes=SIZES):
    """Shard ``key``: sample ids ``1000 * key + i``, three features and a linear target."""
    import numpy as np

    ids = np.arange(sizes[key], dtype=np.int64) + 1000 * key
    x = np.stack([np.sin(ids), np.cos(ids), (ids % 7) / 7.0], axis=1).astype(np.float32)
    y = (x @ np.asarray(WEIGHTS, dtype=np.float32) + 0.3).reshape(-1, 1).astype(np.float32)
    return ids, x, y


def counting(fn, marks: str):
    """``fn`` that leaves one marker file per call in ``marks`` (named by key, unique per call),
    so the test counts generations across processes without any shared lock of its own."""
    def call(key):
        fd, _ = tempfile.mkstemp(prefix=f"key{key}-", suffix=f"-pid{os.getpid()}", dir=marks)
        os.close(fd)
        return fn(key)
    return call


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=["known", "unknown", "pad"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--cache")
    parser.add_argument("--marks")
    args = parser.parse_args()
    times = {"start": time.time()}

    import mxnet as mx
    from mxnet import autograd, gluon

    import gluon_stream as gs

    kv = mx.kv.create("dist_sync")
    times["kvstore"] = time.time()
    if args.case == "pad":
        record = evaluate(mx, gs, kv)
        record["times"] = {**times, "end": time.time()}
        write(record, args.out)
        return
    mx.random.seed(SEED)
    keys = range(len(SIZES))
    if args.case == "known":
        src = gs.FunctionSource(keys, shard)
        options = {"shard_sizes": dict(enumerate(SIZES))}
    else:
        src = gs.FunctionSource(keys, counting(shard, args.marks), cache_dir=args.cache)
        options = {}
    net = gluon.nn.Dense(1, in_units=3)
    net.initialize(mx.init.Xavier())
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.05}, kvstore=kv)
    loss_fn = gluon.loss.L2Loss()
    epochs = []
    with gs.StreamLoader(src, batch_size=BATCH_SIZE, shuffle=True, seed=SEED,
                         num_parts="auto", part_index="auto", kvstore=kv, even_batches=True,
                         num_epochs=EPOCHS, **options) as loader:
        stream = loader.stream
        for epoch in range(EPOCHS):
            loader.set_epoch(epoch)
            try:
                expected = len(loader)
            except TypeError as exc:  # sizes unknown before the first pass
                expected = None
                unknown = str(exc)
            else:
                unknown = None
            batches = []
            for ids, x, y in loader:
                with autograd.record():
                    loss = loss_fn(net(x), y)
                loss.backward()
                trainer.step(BATCH_SIZE)
                batches.append([int(i) for i in ids.asnumpy()])
            epochs.append({"epoch": epoch, "len": expected, "len_unknown": unknown,
                           "batches": batches, "keys": stream.dealer.epoch_keys(epoch)[2],
                           "part_sizes": stream.sizes.part_sizes(epoch)})
            times[f"epoch{epoch}"] = time.time()
        parts = {"num_parts": stream.num_parts, "part_index": stream.part_index,
                 "deal": stream.deal}
    params = {name: p.data().asnumpy().tolist() for name, p in net.collect_params().items()}
    record = {"rank": kv.rank, "num_workers": kv.num_workers, "type": kv.type, **parts,
              "epochs": epochs, "params": params, "times": times}
    write(record, args.out)
    # Then exit as a training script does: the kvstore's destructor holds the barrier that
    # ps-lite's Finalize needs, and rank 0 tells the server to stop.


def evaluate(mx, gs, kv) -> dict:
    """even_batches='pad' evaluation with fewer shards than ranks, the loader held as a script
    holds it (a name, no ``with``): per epoch ``len()``, each batch's ids and padding, and the
    real rows of all ranks summed at each step through the kvstore."""
    kv.init("real", mx.nd.zeros((1,)))
    src = gs.FunctionSource(range(len(PAD_SIZES)), lambda k: shard(k, PAD_SIZES))
    loader = gs.StreamLoader(src, batch_size=BATCH_SIZE, shuffle=True, seed=SEED,
                             num_parts="auto", part_index="auto", kvstore=kv,
                             even_batches="pad", shard_sizes=dict(enumerate(PAD_SIZES)))
    epochs = []
    for epoch in range(EPOCHS):
        loader.set_epoch(epoch)
        expected = len(loader)
        batches, summed = [], []
        for ids, _, _ in loader:
            real = BATCH_SIZE - loader.pad
            kv.push("real", mx.nd.array([real]))  # dist_sync: waits for every rank's push
            total = mx.nd.zeros((1,))
            kv.pull("real", out=total)
            summed.append(int(total.asscalar()))
            batches.append([[int(i) for i in ids.asnumpy()], loader.pad])
        epochs.append({"epoch": epoch, "len": expected, "batches": batches, "summed": summed})
    loader.close()
    return {"rank": kv.rank, "num_workers": kv.num_workers, "type": kv.type,
            "num_parts": loader.stream.num_parts, "part_index": loader.stream.part_index,
            "epochs": epochs}


def write(record: dict, out: str) -> None:
    tmp = f"{out}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, out)


if __name__ == "__main__":
    main()
