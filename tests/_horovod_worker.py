"""One rank of a real Horovod job (started by ``test_horovod.py`` through ``horovodrun``, gloo,
on 127.0.0.1; not a test itself)::

    horovodrun -np 2 -H localhost:2 --gloo python _horovod_worker.py OUT_DIR

It calls ``hvd.init()``, builds a StreamLoader whose rank comes from Horovod
(``num_parts='auto'``, ``part_index='auto'``, ``even_batches=True`` with the shard sizes known),
trains a tiny Dense net with ``hvd.DistributedTrainer`` for ``EPOCHS`` epochs and writes
``OUT_DIR/rank<r>.json``: the parts it resolved, ``len(loader)`` and the batches and sample ids
of each epoch, and the final parameters. Importing this module imports neither MXNet, Horovod
nor gluon_stream: the test reads ``SIZES``, ``BATCH_SIZE`` and ``EPOCHS`` from it.
"""
from __future__ import annotations

import json
import os
import sys

SIZES = [9, 5, 7, 11, 6, 8]  # unequal shards: the parts differ, even_batches evens them
BATCH_SIZE = 2
EPOCHS = 2
SEED = 5


def shard(key: int):
    """Shard ``key``: sample ids ``100 * key + i``, two features and a linear target."""
    import numpy as np

    ids = np.arange(SIZES[key], dtype=np.int64) + 100 * key
    x = np.stack([np.sin(ids), np.cos(ids)], axis=1).astype(np.float32)
    y = (x @ np.asarray([1.5, -0.5], dtype=np.float32)).reshape(-1, 1)
    return {"x": x, "y": y.astype(np.float32), "ids": ids}


def main(out_dir: str) -> None:
    import horovod.mxnet as hvd
    import mxnet as mx
    from mxnet import autograd, gluon

    import gluon_stream as gs

    hvd.init()
    net = gluon.nn.Dense(1)
    net.initialize(mx.init.Normal(0.5), ctx=mx.cpu())
    net(mx.nd.zeros((1, 2)))  # parameters exist before they are broadcast
    params = net.collect_params()
    hvd.broadcast_parameters(params, root_rank=0)
    trainer = hvd.DistributedTrainer(params, "sgd", {"learning_rate": 0.05})
    loss_fn = gluon.loss.L2Loss()
    src = gs.FunctionSource(range(len(SIZES)), shard, cache_dir=None)
    record: dict = {"rank": hvd.rank(), "size": hvd.size(), "epochs": []}
    with gs.StreamLoader(src, batch_size=BATCH_SIZE, shuffle=True, seed=SEED, num_parts="auto",
                         part_index="auto", even_batches=True,
                         shard_sizes=dict(enumerate(SIZES))) as loader:
        record["parts"] = [loader.stream.num_parts, loader.stream.part_index]
        for epoch in range(EPOCHS):
            loader.set_epoch(epoch)
            announced = len(loader)
            ids = []
            for x, y, batch_ids in loader:
                with autograd.record():
                    loss = loss_fn(net(x), y)
                loss.backward()
                trainer.step(x.shape[0])  # an allreduce: every rank must step alike
                ids.extend(int(i) for i in batch_ids.asnumpy())
            record["epochs"].append({"len": announced, "batches": len(ids) // BATCH_SIZE,
                                     "ids": ids})
    record["params"] = {name: p.data().asnumpy().ravel().tolist()
                        for name, p in sorted(params.items())}
    with open(os.path.join(out_dir, f"rank{hvd.rank()}.json"), "w", encoding="utf-8") as f:
        json.dump(record, f)
    hvd.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
