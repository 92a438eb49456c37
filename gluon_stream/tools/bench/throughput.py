"""Pure loader throughput: arrays already in memory, a no-op step."""
from __future__ import annotations

from typing import Any, Iterator, Sequence

import numpy as np

from ... import FunctionSource, StreamLoader
from ..._mx import import_mxnet
from .dataloader import release_dataloader
from .measure import Probe, batch_arrays, drive, median

__all__ = ["THROUGHPUT_CONTENDERS", "THROUGHPUT_SHAPES", "mixing", "run_throughput_scenario"]

THROUGHPUT_CONTENDERS = ("dataloader-nw0", "dataloader-nw2", "ndarrayiter", "vectorised-floor",
                         "gluon_stream", "gluon_stream-window4")
SHARDS = 8  # gluon_stream reads the arrays as this many shards (a window mixes them)
THROUGHPUT_SHAPES = {"30x16": (30, 16), "8": (8,)}


def _throughput_batches(name: str, data: np.ndarray, label: np.ndarray, batch_size: int,
                        seed: int) -> Iterator[Any]:
    mx = import_mxnet()
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
    elif name.startswith("gluon_stream"):
        parts = np.array_split(np.arange(len(data)), SHARDS)
        window = 4 if name.endswith("window4") else 1
        source = FunctionSource(range(SHARDS), lambda key: (data[parts[key]], label[parts[key]]))
        with StreamLoader(source, batch_size=batch_size, shuffle=True, seed=seed,
                          shuffle_window=window) as loader:
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


def mixing(windows: Sequence[int] = (1, 2, 4, 8), shards: int = 12, samples: int = 512,
           batch_size: int = 32, seed: int = 0) -> dict:
    """Mean distinct shards per full batch for each ``shuffle_window``."""
    out = {}
    for window in windows:
        source = FunctionSource(range(shards),
                                lambda key: np.full(samples, key, dtype=np.int64))
        with StreamLoader(source, batch_size=batch_size, shuffle=True, seed=seed,
                          shuffle_window=window) as loader:
            counts = [len(np.unique(b.asnumpy())) for b in loader if b.shape[0] == batch_size]
        out[window] = float(np.mean(counts))
    return {"shards": shards, "samples": samples, "batch_size": batch_size,
            "distinct_shards_per_batch": out}
