"""Pure loader throughput: arrays already in memory, a no-op step."""
from __future__ import annotations

from typing import Any, Iterator, Sequence

import numpy as np

from ... import FunctionSource, StreamLoader
from ..._mx import require_mxnet
from ..._mx.dataloader import release_dataloader
from .measure import Probe, batch_arrays, drive, median

__all__ = ["THROUGHPUT_CONTENDERS", "THROUGHPUT_SHAPES", "run_throughput_scenario"]

THROUGHPUT_CONTENDERS = ("dataloader-nw0", "dataloader-nw2", "ndarrayiter", "vectorised-floor",
                         "gluon_stream")
THROUGHPUT_SHAPES = {"30x16": (30, 16), "8": (8,)}


def _throughput_batches(name: str, data: np.ndarray, label: np.ndarray, batch_size: int,
                        seed: int) -> Iterator[Any]:
    mx = require_mxnet()
    from mxnet import gluon

    if name in ("dataloader-nw0", "dataloader-nw2"):
        loader = gluon.data.DataLoader(gluon.data.ArrayDataset(data, label),
                                       batch_size=batch_size, shuffle=True,
                                       num_workers=0 if name == "dataloader-nw0" else 2)
        try:
            yield from loader
        finally:
            release_dataloader(loader)
    elif name == "ndarrayiter":
        it = mx.io.NDArrayIter(data, label, batch_size=batch_size, shuffle=True,
                               last_batch_handle="pad")
        for batch in it:
            keep = batch_size - batch.pad
            yield [batch.data[0][:keep], batch.label[0][:keep]] if batch.pad else \
                [batch.data[0], batch.label[0]]
    elif name == "vectorised-floor":
        perm = np.random.default_rng(seed).permutation(len(data))
        for begin in range(0, len(data), batch_size):
            idx = perm[begin:begin + batch_size]
            yield [mx.nd.array(data[idx]), mx.nd.array(label[idx])]
    elif name == "gluon_stream":
        with StreamLoader(FunctionSource([0], lambda key: (data, label)), batch_size=batch_size,
                          shuffle=True, seed=seed) as loader:
            yield from loader
    else:
        raise ValueError(f"unknown throughput contender {name!r}")


def run_throughput_scenario(samples: dict[str, int], batch_size: int, rounds: int, seed: int,
                            contenders: Sequence[str] | None = None) -> dict:
    """Samples/s of each contender on in-memory arrays, per sample shape; raw figures."""
    def no_step(batch: Any) -> None:
        for array in batch_arrays(batch):
            array.wait_to_read()

    chosen = [c for c in THROUGHPUT_CONTENDERS
              if contenders is None or c in contenders or c == "ndarrayiter"]
    out: dict[str, Any] = {}
    rng = np.random.default_rng(seed)
    for shape_name, shape in THROUGHPUT_SHAPES.items():
        n = samples[shape_name]
        data = rng.standard_normal((n, *shape), dtype=np.float32)
        label = rng.standard_normal((n,), dtype=np.float32)
        rates: dict[str, list[float]] = {c: [] for c in chosen}
        for _ in range(rounds):
            for contender in chosen:
                record = drive(_throughput_batches(contender, data, label, batch_size, seed),
                                no_step, Probe())
                if record.samples != n:
                    raise AssertionError(f"{contender} yielded {record.samples} of {n} samples")
                rates[contender].append(n / record.wall_s)
        base = rates["ndarrayiter"]
        out[shape_name] = {
            "samples": n, "batch_size": batch_size,
            "contenders": {c: {"samples_per_s": median(r),
                               "vs_ndarrayiter": median([a / b for a, b in zip(r, base)]),
                               "rounds": r} for c, r in rates.items()}}
        del data, label
    return out
