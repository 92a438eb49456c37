"""The pipeline scenarios: shards from the built-in generator, a training step per batch, and
every way of feeding the loop (the hand-written ones and StreamLoader's configurations)."""
from __future__ import annotations

import concurrent.futures as cf
import functools
import logging
import os
import statistics
import subprocess
import tempfile
import time
import zlib
from collections import deque
from dataclasses import asdict, replace
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from ... import CommandSource, ShardError, StreamLoader
from ..._mx import data_iter_base, import_mxnet
from ..generator import make_windows
from .dataloader import release_dataloader
from .measure import Probe, drive, make_step, median
from .workload import Workload, ideal_time, wave_bound

__all__ = ["GENERATOR_TIMEOUT_S", "PIPELINE_CONTENDERS", "PIPELINE_SCENARIOS", "IdealFn",
           "calibrate_delay", "generation_cost", "pipeline_ideal", "run_stages_scenario",
           "stream_loader"]

logger = logging.getLogger(__name__)

PIPELINE_SCENARIOS = {"balanced": 1.0, "generation-bound": 4.0, "training-bound": 0.25}
PIPELINE_CONTENDERS = ("naive", "dataloader-per-shard", "prefetching-iter", "gluon_stream",
                       "gluon_stream-nw", "gluon_stream-batchify", "gluon_stream-batchify-nw",
                       "gluon_stream-recommended", "gluon_stream-window4")
GENERATOR_TIMEOUT_S = 600.0


def _generate(workload: Workload, key: str, directory: str) -> tuple[str, float]:
    """Run the generator for ``key`` into ``directory``; returns (path, seconds)."""
    path = os.path.join(directory, f"{key}.npy")
    argv = [arg.replace("{key}", key).replace("{path}", path).replace("{epoch}", "0")
            for arg in workload.command()]
    t0 = time.perf_counter()
    done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, timeout=GENERATOR_TIMEOUT_S, check=False)
    if done.returncode != 0:
        tail = done.stderr.decode("utf-8", "replace")[-2000:]
        raise ShardError(f"shard {key!r}: the bench generator exited with {done.returncode}",
                         key=key, argv=argv, returncode=done.returncode, stderr_tail=tail)
    return path, time.perf_counter() - t0


def _prepare(workload: Workload, key: str, directory: str) -> tuple[np.ndarray, np.ndarray, dict]:
    """Generate, load and transform one shard; returns windows, labels and the costs."""
    path, generate_s = _generate(workload, key, directory)
    t0 = time.perf_counter()
    raw = np.load(path, allow_pickle=False)
    t1 = time.perf_counter()
    data, label = make_windows(raw, workload.time_steps)
    t2 = time.perf_counter()
    os.unlink(path)
    return data, label, {"generate_s": generate_s, "load_s": t1 - t0, "transform_s": t2 - t1}


# -- pipeline contenders: generators of batches -----------------------------------------------
def _naive(workload: Workload, directory: str, probe: Probe) -> Iterator[Any]:
    """Per shard in turn: generate, load, transform, ArrayDataset, DataLoader(num_workers=0)."""
    from mxnet import gluon

    for index, key in enumerate(workload.shard_order()):
        data, label, costs = _prepare(workload, key, directory)
        probe.components.append(dict(costs, key=key))
        loader = gluon.data.DataLoader(gluon.data.ArrayDataset(data, label),
                                       batch_size=workload.batch_size, shuffle=True,
                                       last_batch="rollover")
        for i, batch in enumerate(loader):
            if i == 0 and index > 0:
                probe.boundary(costs["generate_s"])
            yield batch


def _dataloader_per_shard(workload: Workload, directory: str, probe: Probe) -> Iterator[Any]:
    """The usual advice: DataLoader(num_workers=N, last_batch='rollover') rebuilt per shard."""
    from mxnet import gluon

    for index, key in enumerate(workload.shard_order()):
        data, label, costs = _prepare(workload, key, directory)
        loader = gluon.data.DataLoader(gluon.data.ArrayDataset(data, label),
                                       batch_size=workload.batch_size, shuffle=True,
                                       last_batch="rollover", num_workers=workload.num_workers)
        try:
            for i, batch in enumerate(loader):
                if i == 0 and index > 0:
                    probe.boundary(costs["generate_s"])
                yield batch
        finally:
            release_dataloader(loader)
            del loader


class _ShardQueueIter(data_iter_base()):  # type: ignore[misc]
    """A hand-built ``mx.io.DataIter``: generator threads fill a bounded queue of shards."""

    def __init__(self, workload: Workload, directory: str) -> None:
        super().__init__(workload.batch_size)
        mx = import_mxnet()
        self.workload = workload
        self.directory = directory
        self.provide_data = [mx.io.DataDesc(
            "data", (workload.batch_size, workload.time_steps, workload.inputs))]
        self.provide_label = [mx.io.DataDesc("softmax_label", (workload.batch_size,))]
        self._pool = cf.ThreadPoolExecutor(workload.producers,
                                           thread_name_prefix="gluon_stream-bench-producer")
        self._keys = iter(workload.shard_order())
        self._pending: deque = deque()
        self._rng = np.random.default_rng(workload.seed)
        self._data = self._label = None
        self._pos = 0
        self._closed = False
        self._fill()

    def _fill(self) -> None:
        while len(self._pending) < self.workload.prefetch + 1:
            key = next(self._keys, None)
            if key is None:
                return
            self._pending.append(self._pool.submit(self._produce, key))

    def _produce(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        data, label, _ = _prepare(self.workload, key, self.directory)
        seed = [self.workload.seed, zlib.crc32(key.encode("utf-8"))]
        perm = np.random.default_rng(seed).permutation(len(data))
        return data[perm], label[perm]

    def next(self) -> Any:
        mx = import_mxnet()
        bs = self.batch_size
        while self._data is None or self._pos + bs > len(self._data):
            if self._closed or not self._pending:
                raise StopIteration
            future = self._pending.popleft()
            self._data, self._label = future.result()
            self._pos = 0
            self._fill()
        begin, self._pos = self._pos, self._pos + bs
        return mx.io.DataBatch([mx.nd.array(self._data[begin:self._pos])],
                               [mx.nd.array(self._label[begin:self._pos])])

    def reset(self) -> None:
        """One pass only (the bench runs one epoch per contender run)."""

    def close(self) -> None:
        self._closed = True
        for future in self._pending:
            future.cancel()
        self._pool.shutdown(wait=True, cancel_futures=True)


def _close_prefetching_iter(it: Any) -> None:
    """End a PrefetchingIter's thread now: ``del`` never frees it (its thread holds it)."""
    it.started = False
    for event in it.data_taken:
        event.set()
    for thread in it.prefetch_threads:
        thread.join()


def _prefetching_iter(workload: Workload, directory: str, probe: Probe) -> Iterator[Any]:
    """The hand-built pipeline: generator threads, a queue, ``mx.io.PrefetchingIter``."""
    mx = import_mxnet()
    inner = _ShardQueueIter(workload, directory)
    outer = None
    try:
        outer = mx.io.PrefetchingIter(inner)
        for batch in outer:
            yield [batch.data[0], batch.label[0]]
    finally:
        inner.close()
        if outer is not None:
            _close_prefetching_iter(outer)


def stream_loader(options: dict, workload: Workload, directory: str, probe: Probe,
                  epochs: int = 1) -> Iterator[Any]:
    """StreamLoader over a CommandSource running the built-in generator, for ``epochs``
    consecutive epochs of one loader."""
    source = CommandSource(workload.keys(), workload.command(), cache_dir=directory,
                           timeout=GENERATOR_TIMEOUT_S, retries=0)
    transform = functools.partial(make_windows, time_steps=workload.time_steps)
    with StreamLoader(source, batch_size=workload.batch_size, transform=transform,
                      shuffle=True, seed=workload.seed, **options) as loader:
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            yield from loader
            probe.rotation_s.extend(loader.stats.epochs[-1].rotation_s)


def _stages_contenders(workload: Workload) -> dict[str, tuple[Callable, dict]]:
    """name -> (batch generator factory, StreamLoader options shown in the JSON)."""
    from mxnet.gluon.data.dataloader import default_batchify_fn

    nw = workload.num_workers
    shared = {"producers": workload.producers, "prefetch": workload.prefetch}
    gs_options = {
        "gluon_stream": {},  # the library's defaults: producers='auto', prefetch 2, no workers
        "gluon_stream-nw": dict(shared, num_workers=nw),
        "gluon_stream-batchify": dict(shared, batchify_fn=default_batchify_fn),
        "gluon_stream-batchify-nw": dict(shared, batchify_fn=default_batchify_fn,
                                         num_workers=nw),
        "gluon_stream-recommended": dict(shared),
        "gluon_stream-window4": dict(shared, shuffle_window=4),  # batches mix 4 shards
    }
    out: dict[str, tuple[Callable, dict]] = {
        "naive": (_naive, {}),
        "dataloader-per-shard": (_dataloader_per_shard, {"num_workers": nw}),
        "prefetching-iter": (_prefetching_iter, {"producers": workload.producers,
                                                 "prefetch": workload.prefetch}),
    }
    for name, options in gs_options.items():
        out[name] = (functools.partial(stream_loader, options), options)
    return out



def pipeline_ideal(workload: Workload, naive_probe: Probe, step_s: float
                   ) -> tuple[float, float]:
    """(ideal, wave bound) from the component costs ``naive`` measured in this round."""
    comps = naive_probe.components
    first = comps[0]
    kwargs = dict(first_prep_s=first["generate_s"] + first["load_s"] + first["transform_s"],
                  generate_s=statistics.median(c["generate_s"] for c in comps),
                  prep_s=statistics.median(c["load_s"] + c["transform_s"] for c in comps),
                  step_s=step_s, steps=workload.steps, shards=workload.shards,
                  producers=workload.producers)
    return ideal_time(**kwargs), wave_bound(**kwargs)


def generation_cost(workload: Workload) -> float:
    """Seconds the generator takes for one shard of ``workload`` without sleeping (start-up and
    writing; median of 3)."""
    with tempfile.TemporaryDirectory(prefix="gluon_stream_bench_") as tmp:
        costs = [_generate(replace(workload, delay=0.0, delay_factors=()), f"cal{i}", tmp)[1]
                 for i in range(3)]
    return statistics.median(costs)


def calibrate_delay(workload: Workload, ratio: float, step_s: float) -> float:
    """Generator sleep that makes one shard's generation cost ``ratio`` x its training."""
    train = workload.samples_per_shard / workload.batch_size * step_s
    return max(0.0, ratio * train - generation_cost(workload))



IdealFn = Callable[[Workload, Probe, float], "tuple[float, float]"]


def run_stages_scenario(name: str, workload: Workload, rounds: int,
                          contenders: Sequence[str] | None = None,
                          ideal: IdealFn = pipeline_ideal) -> dict:
    """Run one pipeline scenario: contenders interleaved for ``rounds`` rounds; raw figures.

    ``ideal(workload, naive's probe, step s) -> (ideal s, wave bound s)`` from the component
    costs ``naive`` measured in the same round (it always runs)."""
    step = make_step(workload)
    all_contenders = _stages_contenders(workload)
    chosen = [c for c in all_contenders if contenders is None or c in contenders or c == "naive"]
    runs: dict[str, list[dict]] = {c: [] for c in chosen}
    ideals: list[float] = []
    bounds: list[float] = []
    components: list[dict] = []
    for round_ in range(rounds):
        for contender in chosen:
            factory, _ = all_contenders[contender]
            probe = Probe()
            with tempfile.TemporaryDirectory(prefix="gluon_stream_bench_") as tmp:
                record = drive(factory(workload, tmp, probe), step, probe)
            runs[contender].append(asdict(record))
            logger.info("%s round %d %s: %.2f s", name, round_, contender, record.wall_s)
            if contender == "naive":
                best, bound = ideal(workload, probe, record.step_s)
                ideals.append(best)
                bounds.append(bound)
                components.extend(probe.components)
    out: dict[str, Any] = {"workload": asdict(workload),
                           "ideal": {"rounds": ideals, "wall_s": median(ideals),
                                     "wave_bound_rounds": bounds,
                                     "wave_bound_s": median(bounds)},
                           "components": {k: median([c[k] for c in components])
                                          for k in ("generate_s", "load_s", "transform_s")},
                           "generate_s_by_key": {
                               key: median([c["generate_s"] for c in components
                                            if c["key"] == key]) for key in workload.keys()},
                           "contenders": {}}
    dl = runs.get("dataloader-per-shard")
    for contender in chosen:
        records = runs[contender]
        summary: dict[str, Any] = {key: median([r[key] for r in records])
                   for key in ("wall_s", "first_batch_s", "stall_s", "stall_pct", "rotation_ms",
                               "peak_rss_mb", "batches", "step_s")}
        summary["x_ideal"] = median([r["wall_s"] / i for r, i in zip(records, ideals)])
        summary["x_wave_bound"] = median([r["wall_s"] / b for r, b in zip(records, bounds)])
        summary["speedup_vs_dataloader_per_shard"] = (
            median([d["wall_s"] / r["wall_s"] for r, d in zip(records, dl)]) if dl else None)
        summary["options"] = {k: getattr(v, "__name__", v)
                              for k, v in all_contenders[contender][1].items()}
        summary["rounds"] = records
        out["contenders"][contender] = summary
    return out
