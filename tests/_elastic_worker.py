"""One worker of a phase of an elastic ``dist_sync`` job (started by ``test_elastic_kvstore.py``).

Run with ``DMLC_ROLE=worker`` and the ps-lite environment set::

    python _elastic_worker.py --out rank.json --prefix CKPT --cache DIR --marks DIR
                              [--resume N] [--stop K]

It builds a StreamLoader whose rank comes from ``mx.kv.create('dist_sync')``, resumes it (and a
tiny Dense net) with ``gs.load_checkpoint(prefix, N, loader)`` when ``--resume`` is given,
whatever number of ranks saved that checkpoint, trains through a Trainer on the same kvstore,
and after ``K`` batches (``--stop``) writes ``gs.do_checkpoint``'s files (each rank its own
loader state) numbered ``N + 1`` and stops, as a preempted job does. It records the sample ids
of the real rows of every batch, per epoch. Importing this module imports neither MXNet nor
gluon_stream: the test reads ``BATCH_SIZE``, ``EPOCHS`` and ``make_loader`` from it.
"""
from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import os
import signal

from _kvstore_worker import SIZES, counting, shard

BATCH_SIZE = 4
EPOCHS = 2
SEED = 11
EVEN = "pad"  # even_batches: every sample once among the real rows


def make_loader(kv, cache: str, marks: str):
    import gluon_stream as gs

    src = gs.FunctionSource(range(len(SIZES)), counting(shard, marks), cache_dir=cache)
    return gs.StreamLoader(src, batch_size=BATCH_SIZE, shuffle=True, seed=SEED,
                           num_parts="auto", part_index="auto", kvstore=kv, even_batches=EVEN,
                           shard_sizes=dict(enumerate(SIZES)), num_epochs=EPOCHS)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--cache", required=True)
    parser.add_argument("--marks", required=True)
    parser.add_argument("--resume", type=int)
    parser.add_argument("--stop", type=int)
    args = parser.parse_args()
    faulthandler.register(signal.SIGUSR1)  # a hung worker shows where it waits

    import mxnet as mx
    from mxnet import autograd, gluon

    import gluon_stream as gs

    kv = mx.kv.create("dist_sync")
    mx.random.seed(SEED)
    net = gluon.nn.Dense(1, in_units=3, prefix="dense_")
    net.initialize(mx.init.Xavier())
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.05}, kvstore=kv)
    loader = make_loader(kv, args.cache, args.marks)
    try:
        if args.resume is not None:
            _, arg_params, _ = gs.load_checkpoint(args.prefix, args.resume, loader)
            for name, param in net.collect_params().items():
                param.set_data(arg_params[name])
        loss_fn = gluon.loss.L2Loss()
        epochs: dict = {}
        done, stopped = 0, False
        for epoch in range(loader.epoch, EPOCHS):
            loader.set_epoch(epoch)
            rows = epochs.setdefault(str(epoch), [])
            for ids, x, y in loader:
                with autograd.record():
                    loss = loss_fn(net(x), y)
                loss.backward()
                trainer.step(BATCH_SIZE)
                rows.append([int(i) for i in ids.asnumpy()[:BATCH_SIZE - loader.pad]])
                done += 1
                if done == args.stop:
                    sym = net(mx.sym.var("data"))
                    arg = {name: p.data() for name, p in net.collect_params().items()}
                    gs.do_checkpoint(args.prefix, loader)((args.resume or 0), sym, arg, {})
                    stopped = True
                    break
            if stopped:
                break
        record = {"rank": kv.rank, "num_workers": kv.num_workers,
                  "num_parts": loader.stream.num_parts, "epochs": epochs, "stopped": stopped}
    finally:
        loader.close()
    tmp = f"{args.out}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, args.out)
    # The kvstore's destructor holds the barrier ps-lite's Finalize needs: run it now, with
    # every worker still alive, not in a garbage collection at interpreter exit (a hang)
    del trainer, loader, net, loss_fn
    gc.collect()
    del kv
    gc.collect()


if __name__ == "__main__":
    main()
