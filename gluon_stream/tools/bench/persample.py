"""Per-sample work: CIFAR-sized images and a numpy augmentation per sample (the GluonCV case).

``in-memory``: six shards of 1,500 uint8 32x32x3 images, a per-sample augmentation in numpy
(random crop with 4-pixel reflect padding, random flip, HWC to CHW, normalise), batch 64, a
no-op step; Gluon's DataLoader over ``ArrayDataset(all).transform(aug)`` with 0 workers, 2
processes (Gluon's default) and 2 threads, against StreamLoader with 0 workers, 2 threads,
2 processes (its default for ``num_workers=2``) and 4 processes.

``streaming``: the same shards made on demand (a function that sleeps about as long as a
shard's augmentation takes), against the usual advice (a ``DataLoader(num_workers=2)`` per
shard, forked and fed again for each) and the ideal (the first shard's generation, then all
the augmentation at the rate the in-memory StreamLoader reaches in the same round).

``rotation``: what switching to the next shard costs on this path (num_workers=2), with the
shards in memory and a training step 1.5x a batch's augmentation, so that the workers can keep
ahead; the streaming run's no-op step makes every batch wait for the workers.

The limit of 2 processes on 2 cores is twice the single process's rate (``gluon_stream-nw0``,
the loop's own thread, measured in each round): ``x_two_core_limit`` is a contender's rate
against it. CPU time per batch (the loop's process, and its worker processes once reaped)
tells the same on a shared machine, where other jobs take cores: ``cpu_x_two_core_limit`` is
the single process's CPU per sample over the contender's, the fraction of the limit it
reaches when CPU is all that bounds it (worker processes only: one process, or threads
under the GIL, cannot fill 2 cores).
"""
from __future__ import annotations

import os
import time
from typing import Any, Iterator

import numpy as np

from ... import FunctionSource, StreamLoader
from ..._mx import import_mxnet
from .dataloader import release_dataloader
from .measure import Probe, batch_arrays, drive, median

__all__ = ["PERSAMPLE_CONTENDERS", "run_persample_scenario"]

PERSAMPLE_CONTENDERS = ("dataloader-nw0", "dataloader-nw2", "dataloader-nw2-threads",
                        "gluon_stream-nw0", "gluon_stream-nw2-threads", "gluon_stream-nw2",
                        "gluon_stream-nw4")
_MEAN = np.array([0.4914, 0.4822, 0.4465], np.float32)[:, None, None]
_STD = np.array([0.2023, 0.1994, 0.2010], np.float32)[:, None, None]


def augment(image: np.ndarray, label: Any) -> tuple[np.ndarray, Any]:
    """Random crop with 4-pixel reflect padding, random flip, HWC to CHW, normalise."""
    padded = np.pad(image, ((4, 4), (4, 4), (0, 0)), mode="reflect")
    y, x = np.random.randint(0, 9, 2)
    crop = padded[y:y + 32, x:x + 32]
    if np.random.rand() < 0.5:
        crop = crop[:, ::-1]
    return (crop.transpose(2, 0, 1).astype(np.float32) / 255 - _MEAN) / _STD, label


def make_shards(count: int, images: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, 255, (images, 32, 32, 3), dtype=np.uint8),
             rng.integers(0, 10, images).astype(np.float32)) for _ in range(count)]


def _in_memory(name: str, shards: list, batch_size: int, seed: int) -> Iterator[Any]:
    if name.startswith("dataloader"):
        gluon = import_mxnet().gluon
        data = gluon.data.ArrayDataset(np.concatenate([s[0] for s in shards]),
                                       np.concatenate([s[1] for s in shards])).transform(augment)
        workers = 0 if name == "dataloader-nw0" else 2
        loader = gluon.data.DataLoader(data, batch_size=batch_size, shuffle=True,
                                       num_workers=workers, thread_pool=name.endswith("threads"))
        try:
            yield from loader
        finally:
            release_dataloader(loader)
        return
    workers = int(name.split("-nw")[1].split("-")[0])
    with StreamLoader(FunctionSource(range(len(shards)), lambda k: shards[k]),
                      batch_size=batch_size, shuffle=True, seed=seed, sample_transform=augment,
                      num_workers=workers, thread_pool=name.endswith("threads")) as loader:
        yield from loader


def _known(value: float | None) -> float:
    """A median of measured rounds (None only when nothing was measured: a bug here)."""
    if value is None:
        raise RuntimeError("no round was measured")
    return value


def _no_step(batch: Any) -> None:
    for array in batch_arrays(batch):
        array.wait_to_read()


def _streaming(name: str, shards: list, batch_size: int, delay: float, seed: int,
               probe: Probe) -> Iterator[Any]:
    def make(key: int) -> tuple[np.ndarray, np.ndarray]:
        time.sleep(delay)  # stands in for generating the shard
        return shards[key]

    if name == "dataloader-per-shard":
        gluon = import_mxnet().gluon
        for index in range(len(shards)):
            t0 = time.perf_counter()
            images, labels = make(index)
            generate_s = time.perf_counter() - t0
            loader = gluon.data.DataLoader(
                gluon.data.ArrayDataset(images, labels).transform(augment),
                batch_size=batch_size, shuffle=True, num_workers=2, last_batch="rollover")
            try:
                for i, batch in enumerate(loader):
                    if i == 0 and index > 0:
                        probe.boundary(generate_s)
                    yield batch
            finally:
                release_dataloader(loader)
        return
    with StreamLoader(FunctionSource(range(len(shards)), make), batch_size=batch_size,
                      shuffle=True, seed=seed, sample_transform=augment,
                      num_workers=2) as loader:
        yield from loader
        probe.rotation_s.extend(loader.stats.epochs[-1].rotation_s)


def _rotations(shards: list, batch_size: int, seed: int, step_s: float) -> list[float]:
    """Seconds each switch to the next shard cost, with a training step the workers keep
    ahead of (in a loop bound by the workers every batch waits for one, boundary or not)."""
    with StreamLoader(FunctionSource(range(len(shards)), lambda k: shards[k]),
                      batch_size=batch_size, shuffle=True, seed=seed, sample_transform=augment,
                      num_workers=2) as loader:
        for batch in loader:
            _no_step(batch)
            time.sleep(step_s)  # stands in for the accelerator's step
        return list(loader.stats.epochs[-1].rotation_s)


REFERENCES = ("dataloader-nw2", "gluon_stream-nw0")  # always run: the ratios' denominators


def _in_processes(name: str) -> bool:
    """Whether a contender spreads its work over processes (its CPU can fill 2 cores)."""
    return not name.endswith(("-nw0", "-threads"))


def _cpu_s() -> tuple[float, float]:
    """CPU seconds of this process and of its children reaped so far."""
    t = os.times()
    return t.user + t.system, t.children_user + t.children_system


def run_persample_scenario(rounds: int, shards: int = 6, images: int = 1500,
                           batch_size: int = 64, seed: int = 0,
                           contenders: Any = None) -> dict:
    """Samples/s and CPU per batch in memory, and the streaming run against the usual advice
    and the ideal."""
    data = make_shards(shards, images, seed)
    chosen = [c for c in PERSAMPLE_CONTENDERS
              if contenders is None or c in contenders or c in REFERENCES]
    rates: dict[str, list[float]] = {c: [] for c in chosen}
    cpu: dict[str, list[tuple[float, float]]] = {c: [] for c in chosen}  # per sample
    total = shards * images
    for _ in range(rounds):
        for name in chosen:
            loop0, workers0 = _cpu_s()
            record = drive(_in_memory(name, data, batch_size, seed), _no_step, Probe())
            loop1, workers1 = _cpu_s()
            rates[name].append(record.samples / record.wall_s)
            cpu[name].append(((loop1 - loop0) / record.samples,
                              (workers1 - workers0) / record.samples))
    base, single = rates["dataloader-nw2"], rates["gluon_stream-nw0"]
    single_cpu = [sum(c) for c in cpu["gluon_stream-nw0"]]
    in_memory = {c: {"samples_per_s": median(r),
                     "vs_dataloader_nw2": median([a / b for a, b in zip(r, base)]),
                     "x_two_core_limit": median([a / (2 * b) for a, b in zip(r, single)]),
                     "cpu_ms_per_batch": {
                         "loop": median([1e3 * batch_size * x for x, _ in cpu[c]]),
                         "workers": median([1e3 * batch_size * w for _, w in cpu[c]])},
                     "cpu_x_two_core_limit": (median([s / sum(x) for x, s in
                                                      zip(cpu[c], single_cpu)])
                                              if _in_processes(c) else None),
                     "rounds": r} for c, r in rates.items()}
    gs_rate = _known(median(rates.get("gluon_stream-nw2", base)))
    delay = images / gs_rate  # generating a shard costs about as much as augmenting it
    walls: dict[str, list[float]] = {"dataloader-per-shard": [], "gluon_stream": []}
    ideals: list[float] = []
    rotations: list[float] = []
    for _ in range(rounds):  # each round measures its own in-memory rate: the same noise
        record = drive(_in_memory("gluon_stream-nw2", data, batch_size, seed), _no_step, Probe())
        ideals.append(delay + total / (record.samples / record.wall_s))
        for name in walls:
            probe = Probe()
            record = drive(_streaming(name, data, batch_size, delay, seed, probe), _no_step,
                           probe)
            walls[name].append(record.wall_s)
            if name == "gluon_stream" and record.rotation_ms is not None:
                rotations.append(record.rotation_ms)
    streaming = {"delay_s": delay, "ideal_s": median(ideals), "ideal_rounds": ideals,
                 "contenders": {n: {"wall_s": median(w),
                                    "x_ideal": median([a / i for a, i in zip(w, ideals)]),
                                    "rounds": w} for n, w in walls.items()}}
    streaming["speedup_vs_dataloader_per_shard"] = median(
        [d / g for d, g in zip(walls["dataloader-per-shard"], walls["gluon_stream"])])
    streaming["rotation_ms"] = median(rotations)  # in a worker-bound loop: a batch's wait
    step_s = 1.5 * batch_size / gs_rate  # a step the workers keep ahead of
    switches = [s for _ in range(rounds) for s in _rotations(data, batch_size, seed, step_s)]
    rotation = {"step_ms": step_s * 1e3, "boundaries": len(switches),
                "rotation_ms": median([s * 1e3 for s in switches])}
    return {"shards": shards, "images": images, "batch_size": batch_size,
            "in_memory": in_memory, "streaming": streaming, "rotation": rotation}
