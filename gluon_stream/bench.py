"""``gluon-stream bench``: gluon_stream against MXNet's own ways of feeding a Gluon loop.

Every contender trains on the same workload, interleaved in one run (A B C ... A B C ...,
``--rounds`` times), and the table shows medians over rounds and ratios taken within each
round, so machine noise hits all contenders alike.

Pipeline scenarios (shards from the built-in generator, a real external process that sleeps
``delay`` seconds and writes a deterministic ``.npy``; ``make_windows`` as the transform;
a simulated training step per batch):

* ``balanced``: generation of a shard costs about as much as training on it;
* ``generation-bound``: generation costs 4x the training of a shard;
* ``training-bound``: generation costs a quarter of it.

Contenders: ``naive`` (generate, load, transform, ``DataLoader(num_workers=0)`` per shard in
turn), ``dataloader-per-shard`` (the usual advice: ``DataLoader(num_workers=N,
last_batch='rollover')`` rebuilt per shard), ``prefetching-iter`` (a hand-built pipeline:
generator threads fill a queue behind a custom ``mx.io.DataIter`` wrapped in
``mx.io.PrefetchingIter``), and ``StreamLoader``: ``gluon_stream`` (the library's defaults,
one producer), ``-nw`` (``num_workers=N`` as users copy it; batches are still slices),
``-batchify`` and ``-batchify-nw`` (a ``batchify_fn`` selects the per-shard DataLoader path, with
0 and N thread workers) and ``-recommended`` (P producers). ``ideal`` is the lower bound from
component costs measured in the same round (by ``naive``) for P producers: ``max(first shard's
generate+load+transform + all steps, ceil(shards / P) generations + one load+transform + one
shard's steps)``. ``wave bound`` counts the steps of every shard of the last wave of parallel
generations (they finish together), the bound no schedule beats.

``throughput``: arrays already in memory, no-op step: ``DataLoader`` with 0 and 2 workers,
``NDArrayIter``, a vectorised floor (one numpy gather per batch plus ``mx.nd.array``) and
``StreamLoader``, for large (30x16) and small (8) float32 samples.

``memory``: ``StreamLoader`` over ``--memory-epochs`` epochs; peak RSS against the process
baseline plus ``(prefetch + 2)`` shards, and the RSS slope per epoch.
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import logging
import math
import os
import resource
import statistics
import subprocess
import tempfile
import threading
import time
import zlib
from collections import deque
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from . import _compat
from .demo import small_regressor
from .errors import ShardError
from .generator import generator_command, make_windows
from .loader import StreamLoader
from .sources import CommandSource, FunctionSource

__all__ = ["PIPELINE_CONTENDERS", "SCENARIOS", "THROUGHPUT_CONTENDERS", "Workload",
           "format_results", "ideal_time", "register", "run_bench", "run_memory_scenario",
           "run_pipeline_scenario", "run_throughput_scenario", "wave_bound"]

logger = logging.getLogger(__name__)

PIPELINE_SCENARIOS = {"balanced": 1.0, "generation-bound": 4.0, "training-bound": 0.25}
SCENARIOS = (*PIPELINE_SCENARIOS, "throughput", "memory")
PIPELINE_CONTENDERS = ("naive", "dataloader-per-shard", "prefetching-iter", "gluon_stream",
                       "gluon_stream-nw", "gluon_stream-batchify", "gluon_stream-batchify-nw",
                       "gluon_stream-recommended")
THROUGHPUT_CONTENDERS = ("dataloader-nw0", "dataloader-nw2", "ndarrayiter", "vectorised-floor",
                         "gluon_stream")
THROUGHPUT_SHAPES = {"30x16": (30, 16), "8": (8,)}
RSS_INTERVAL_S = 0.01
GENERATOR_TIMEOUT_S = 600.0
_END = object()


@dataclass(frozen=True)
class Workload:
    """One pipeline workload: shards from the built-in generator, windows, a training step."""

    shards: int = 6
    rows: int = 2576
    inputs: int = 8
    time_steps: int = 16
    batch_size: int = 64
    delay: float = 0.0
    step: str = "sleep"
    step_ms: float = 8.0
    num_workers: int = 2
    producers: int = 2
    prefetch: int = 2
    seed: int = 0

    @property
    def samples_per_shard(self) -> int:
        return max(0, self.rows - self.time_steps)

    @property
    def steps(self) -> int:
        """Full batches in one epoch when leftovers cross shard boundaries."""
        return self.shards * self.samples_per_shard // self.batch_size

    @property
    def shard_bytes(self) -> int:
        """Bytes of one transformed shard (windows and labels, float32)."""
        return self.samples_per_shard * (self.time_steps * self.inputs + 1) * 4

    def keys(self) -> list[str]:
        return [f"s{i:04d}" for i in range(self.shards)]


def ideal_time(first_prep_s: float, generate_s: float, prep_s: float, step_s: float,
               steps: int, shards: int, producers: int) -> float:
    """The lower bound of an epoch with ``producers`` parallel generators (see module doc).

    Args:
        first_prep_s: The first shard's generate + load + transform seconds.
        generate_s: One shard's generation seconds (median).
        prep_s: One shard's load + transform seconds (median).
        step_s: One training step's seconds (median).
        steps: Training steps in the epoch.
        shards: Shards in the epoch.
        producers: Shards generated in parallel.

    Example:
        >>> ideal_time(1.0, 0.9, 0.1, 0.01, 600, 6, 2)
        7.0
    """
    per_shard = steps / max(shards, 1) * step_s
    return max(first_prep_s + steps * step_s,
               math.ceil(shards / producers) * generate_s + prep_s + per_shard)


def wave_bound(first_prep_s: float, generate_s: float, prep_s: float, step_s: float,
               steps: int, shards: int, producers: int) -> float:
    """Like :func:`ideal_time`, but the last wave of parallel generations finishes together.

    With every producer busy from the start, the last ``r = shards - producers * (waves - 1)``
    shards are all ready at ``waves * generate_s`` and their steps still follow, so no
    schedule beats this; :func:`ideal_time` counts one shard's steps there.

    Example:
        >>> wave_bound(1.0, 0.9, 0.1, 0.01, 600, 6, 2)
        7.0
    """
    waves = math.ceil(shards / producers)
    last_wave = shards - producers * (waves - 1)
    per_shard = steps / max(shards, 1) * step_s
    return max(first_prep_s + steps * step_s, waves * generate_s + prep_s + last_wave * per_shard)


# -- measurement helpers ----------------------------------------------------------------------
def _rss_bytes() -> int:
    """Resident set size of this process (Linux /proc; elsewhere the peak so far)."""
    try:
        fd = os.open("/proc/self/statm", os.O_RDONLY)
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    try:
        fields = os.read(fd, 256).split()
    finally:
        os.close(fd)
    return int(fields[1]) * os.sysconf("SC_PAGE_SIZE")


class _RssSampler:
    """Samples RSS in a thread until closed; ``peak`` is the largest value seen."""

    def __init__(self, interval: float = RSS_INTERVAL_S) -> None:
        self.peak = _rss_bytes()
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gluon_stream-bench-rss",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.peak = max(self.peak, _rss_bytes())

    def close(self) -> int:
        """Stop sampling; returns the peak RSS in bytes."""
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_bytes())
        return self.peak


class _Probe:
    """What a contender reports besides its batches: rotations and component costs."""

    def __init__(self) -> None:
        self.rotation_s: list[float] = []
        self.components: list[dict] = []
        self.boundary_excluded: float | None = None  # set before the first batch of a new shard

    def boundary(self, excluded_s: float) -> None:
        """The next batch starts a new shard; ``excluded_s`` of its wait was generation."""
        self.boundary_excluded = excluded_s


@dataclass
class RunRecord:
    """One contender's run: what the training loop saw."""

    wall_s: float
    first_batch_s: float
    stall_s: float
    stall_pct: float
    rotation_ms: float | None
    peak_rss_mb: float
    batches: int
    samples: int
    step_s: float


def _batch_arrays(batch: Any) -> list:
    return list(batch) if isinstance(batch, (list, tuple)) else [batch]


def _drive(batches: Iterator[Any], step: Callable[[Any], None], probe: _Probe,
           clock: Callable[[], float] = time.perf_counter) -> RunRecord:
    """Run the training loop over ``batches``, timing waits, steps and RSS; closes ``batches``."""
    gc.collect()
    sampler = _RssSampler()
    rss0 = _rss_bytes()
    start = clock()
    first = None
    stall = 0.0
    count = samples = 0
    steps: list[float] = []
    try:
        while True:
            w0 = clock()
            batch = next(batches, _END)
            w1 = clock()
            if batch is _END:
                break
            stall += w1 - w0
            if first is None:
                first = w1 - start
            if probe.boundary_excluded is not None:
                probe.rotation_s.append(max(0.0, w1 - w0 - probe.boundary_excluded))
                probe.boundary_excluded = None
            step(batch)
            steps.append(clock() - w1)
            count += 1
            samples += int(_batch_arrays(batch)[0].shape[0])
            del batch
    finally:
        batches.close()
        peak = sampler.close()
    wall = clock() - start
    first = wall if first is None else first
    after_first = wall - first
    stall_after = max(0.0, stall - first)
    rot = probe.rotation_s
    return RunRecord(
        wall_s=wall, first_batch_s=first, stall_s=stall,
        stall_pct=100.0 * stall_after / after_first if after_first > 0 else 0.0,
        rotation_ms=1000.0 * statistics.median(rot) if rot else None,
        peak_rss_mb=(peak - rss0) / 2 ** 20, batches=count, samples=samples,
        step_s=statistics.median(steps) if steps else 0.0)


def _make_step(workload: Workload) -> Callable[[Any], None]:
    """The simulated training step: wait for the batch, then sleep or run a small Gluon net."""
    mx = _compat.require_mxnet()
    if workload.step == "sleep":
        seconds = workload.step_ms / 1000.0

        def sleep_step(batch: Any) -> None:
            for array in _batch_arrays(batch):
                array.wait_to_read()
            if seconds > 0:
                time.sleep(seconds)
        return sleep_step

    train_step = small_regressor("sgd")
    ctx = mx.cpu()

    def cpu_step(batch: Any) -> None:
        # as a GPU step copies the batch to the device (worker batches live in cpu_shared)
        data, label = (a.as_in_context(ctx) for a in _batch_arrays(batch)[:2])
        train_step(data, label).wait_to_read()
    return cpu_step


# -- shard production for the hand-written contenders -----------------------------------------
def _generate(workload: Workload, key: str, directory: str) -> tuple[str, float]:
    """Run the generator for ``key`` into ``directory``; returns (path, seconds)."""
    path = os.path.join(directory, f"{key}.npy")
    argv = [arg.replace("{key}", key).replace("{path}", path)
            for arg in generator_command(workload.rows, workload.inputs, workload.delay)]
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
def _naive(workload: Workload, directory: str, probe: _Probe) -> Iterator[Any]:
    """Per shard in turn: generate, load, transform, ArrayDataset, DataLoader(num_workers=0)."""
    from mxnet import gluon

    for index, key in enumerate(workload.keys()):
        data, label, costs = _prepare(workload, key, directory)
        probe.components.append(costs)
        loader = gluon.data.DataLoader(gluon.data.ArrayDataset(data, label),
                                       batch_size=workload.batch_size, shuffle=True,
                                       last_batch="rollover")
        for i, batch in enumerate(loader):
            if i == 0 and index > 0:
                probe.boundary(costs["generate_s"])
            yield batch


def _dataloader_per_shard(workload: Workload, directory: str, probe: _Probe) -> Iterator[Any]:
    """The usual advice: DataLoader(num_workers=N, last_batch='rollover') rebuilt per shard."""
    from mxnet import gluon

    for index, key in enumerate(workload.keys()):
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
            _compat.release_dataloader(loader)
            del loader


class _ShardQueueIter(_compat.DataIterBase):
    """A hand-built ``mx.io.DataIter``: generator threads fill a bounded queue of shards."""

    def __init__(self, workload: Workload, directory: str) -> None:
        import concurrent.futures as cf

        super().__init__(workload.batch_size)
        mx = _compat.require_mxnet()
        self.workload = workload
        self.directory = directory
        self.provide_data = [mx.io.DataDesc(
            "data", (workload.batch_size, workload.time_steps, workload.inputs))]
        self.provide_label = [mx.io.DataDesc("softmax_label", (workload.batch_size,))]
        self._pool = cf.ThreadPoolExecutor(workload.producers,
                                           thread_name_prefix="gluon_stream-bench-producer")
        self._keys = iter(workload.keys())
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
        mx = _compat.mx
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


def _prefetching_iter(workload: Workload, directory: str, probe: _Probe) -> Iterator[Any]:
    """The hand-built pipeline: generator threads, a queue, ``mx.io.PrefetchingIter``."""
    mx = _compat.require_mxnet()
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


def _stream_loader(options: dict, workload: Workload, directory: str, probe: _Probe
                   ) -> Iterator[Any]:
    """StreamLoader over a CommandSource running the built-in generator."""
    source = CommandSource(workload.keys(),
                           generator_command(workload.rows, workload.inputs, workload.delay),
                           cache_dir=directory, timeout=GENERATOR_TIMEOUT_S, retries=0)
    transform = functools.partial(make_windows, time_steps=workload.time_steps)
    with StreamLoader(source, batch_size=workload.batch_size, transform=transform,
                      shuffle=True, seed=workload.seed, **options) as loader:
        yield from loader
        probe.rotation_s.extend(loader.stats.epochs[-1].rotation_s)


def _pipeline_contenders(workload: Workload) -> dict[str, tuple[Callable, dict]]:
    """name -> (batch generator factory, StreamLoader options shown in the JSON)."""
    from mxnet.gluon.data.dataloader import default_batchify_fn

    nw = workload.num_workers
    shared = {"producers": workload.producers, "prefetch": workload.prefetch}
    gs_options = {
        "gluon_stream": {},  # the library's defaults: one producer, prefetch 2, no workers
        "gluon_stream-nw": dict(shared, num_workers=nw),
        "gluon_stream-batchify": dict(shared, batchify_fn=default_batchify_fn),
        "gluon_stream-batchify-nw": dict(shared, batchify_fn=default_batchify_fn,
                                         num_workers=nw),
        "gluon_stream-recommended": dict(shared),
    }
    out: dict[str, tuple[Callable, dict]] = {
        "naive": (_naive, {}),
        "dataloader-per-shard": (_dataloader_per_shard, {"num_workers": nw}),
        "prefetching-iter": (_prefetching_iter, {"producers": workload.producers,
                                                 "prefetch": workload.prefetch}),
    }
    for name, options in gs_options.items():
        out[name] = (functools.partial(_stream_loader, options), options)
    return out


def _median(values: Sequence[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return float(statistics.median(values)) if values else None


def _pipeline_ideal(workload: Workload, naive_probe: _Probe, step_s: float
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


def _calibrate_delay(workload: Workload, ratio: float, step_s: float) -> float:
    """Generator sleep that makes one shard's generation cost ``ratio`` x its training."""
    with tempfile.TemporaryDirectory(prefix="gluon_stream_bench_") as tmp:
        costs = [_generate(replace(workload, delay=0.0), f"cal{i}", tmp)[1] for i in range(3)]
    base = statistics.median(costs)
    train = workload.samples_per_shard / workload.batch_size * step_s
    return max(0.0, ratio * train - base)


def _measure_step(workload: Workload, step: Callable[[Any], None]) -> float:
    nd = _compat.require_mxnet().nd
    batch = [nd.zeros((workload.batch_size, workload.time_steps, workload.inputs)),
             nd.zeros((workload.batch_size,))]
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        step(batch)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_pipeline_scenario(name: str, workload: Workload, rounds: int,
                          contenders: Sequence[str] | None = None) -> dict:
    """Run one pipeline scenario: contenders interleaved for ``rounds`` rounds; raw figures."""
    step = _make_step(workload)
    all_contenders = _pipeline_contenders(workload)
    chosen = [c for c in all_contenders if contenders is None or c in contenders or c == "naive"]
    runs: dict[str, list[dict]] = {c: [] for c in chosen}
    ideals: list[float] = []
    bounds: list[float] = []
    components: list[dict] = []
    for round_ in range(rounds):
        for contender in chosen:
            factory, _ = all_contenders[contender]
            probe = _Probe()
            with tempfile.TemporaryDirectory(prefix="gluon_stream_bench_") as tmp:
                record = _drive(factory(workload, tmp, probe), step, probe)
            runs[contender].append(asdict(record))
            logger.info("%s round %d %s: %.2f s", name, round_, contender, record.wall_s)
            if contender == "naive":
                ideal, bound = _pipeline_ideal(workload, probe, record.step_s)
                ideals.append(ideal)
                bounds.append(bound)
                components.extend(probe.components)
    out: dict[str, Any] = {"workload": asdict(workload),
                           "ideal": {"rounds": ideals, "wall_s": _median(ideals),
                                     "wave_bound_rounds": bounds,
                                     "wave_bound_s": _median(bounds)},
                           "components": {k: _median([c[k] for c in components])
                                          for k in ("generate_s", "load_s", "transform_s")},
                           "contenders": {}}
    dl = runs.get("dataloader-per-shard")
    for contender in chosen:
        records = runs[contender]
        summary = {key: _median([r[key] for r in records])
                   for key in ("wall_s", "first_batch_s", "stall_s", "stall_pct", "rotation_ms",
                               "peak_rss_mb", "batches", "step_s")}
        summary["x_ideal"] = _median([r["wall_s"] / i for r, i in zip(records, ideals)])
        summary["x_wave_bound"] = _median([r["wall_s"] / b for r, b in zip(records, bounds)])
        summary["speedup_vs_dataloader_per_shard"] = (
            _median([d["wall_s"] / r["wall_s"] for r, d in zip(records, dl)]) if dl else None)
        summary["options"] = {k: getattr(v, "__name__", v)
                              for k, v in all_contenders[contender][1].items()}
        summary["rounds"] = records
        out["contenders"][contender] = summary
    return out


# -- pure loader throughput ---------------------------------------------------------------------
def _throughput_batches(name: str, data: np.ndarray, label: np.ndarray, batch_size: int,
                        seed: int) -> Iterator[Any]:
    mx = _compat.require_mxnet()
    from mxnet import gluon

    if name in ("dataloader-nw0", "dataloader-nw2"):
        loader = gluon.data.DataLoader(gluon.data.ArrayDataset(data, label),
                                       batch_size=batch_size, shuffle=True,
                                       num_workers=0 if name == "dataloader-nw0" else 2)
        try:
            yield from loader
        finally:
            _compat.release_dataloader(loader)
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
        for array in _batch_arrays(batch):
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
                record = _drive(_throughput_batches(contender, data, label, batch_size, seed),
                                no_step, _Probe())
                if record.samples != n:
                    raise AssertionError(f"{contender} yielded {record.samples} of {n} samples")
                rates[contender].append(n / record.wall_s)
        base = rates["ndarrayiter"]
        out[shape_name] = {
            "samples": n, "batch_size": batch_size,
            "contenders": {c: {"samples_per_s": _median(r),
                               "vs_ndarrayiter": _median([a / b for a, b in zip(r, base)]),
                               "rounds": r} for c, r in rates.items()}}
        del data, label
    return out


# -- memory ------------------------------------------------------------------------------------
def _slope(values: Sequence[float]) -> float:
    """Least-squares slope per index (0 for fewer than two values)."""
    if len(values) < 2:
        return 0.0
    return float(np.polyfit(np.arange(len(values)), np.asarray(values, dtype=float), 1)[0])


def run_memory_scenario(workload: Workload, epochs: int) -> dict:
    """Peak RSS and RSS slope of a StreamLoader rotating through ``epochs`` epochs."""
    with tempfile.TemporaryDirectory(prefix="gluon_stream_bench_") as tmp:
        source = CommandSource(workload.keys(),
                               generator_command(workload.rows, workload.inputs, 0.0),
                               cache_dir=tmp, timeout=GENERATOR_TIMEOUT_S, retries=0)
        transform = functools.partial(make_windows, time_steps=workload.time_steps)
        gc.collect()
        baseline = _rss_bytes()
        sampler = _RssSampler()
        per_epoch = []
        try:
            with StreamLoader(source, batch_size=workload.batch_size, transform=transform,
                              shuffle=True, seed=workload.seed, prefetch=workload.prefetch,
                              producers=workload.producers) as loader:
                for epoch in range(epochs):
                    loader.set_epoch(epoch)
                    for batch in loader:
                        for array in _batch_arrays(batch):
                            array.wait_to_read()
                        del batch
                    per_epoch.append(_rss_bytes())
        finally:
            peak = sampler.close()
    mb = 2 ** 20
    slope = _slope(per_epoch) / mb
    late = _slope(per_epoch[len(per_epoch) // 2:]) / mb
    bound = (workload.prefetch + 2) * workload.shard_bytes
    return {"workload": asdict(workload), "epochs": epochs, "baseline_mb": baseline / mb,
            "shard_mb": workload.shard_bytes / mb, "peak_over_baseline_mb": (peak - baseline) / mb,
            "bound_mb": bound / mb, "within_bound": bool(peak - baseline <= bound),
            "rss_slope_mb_per_epoch": slope, "rss_slope_second_half_mb_per_epoch": late,
            "rss_per_epoch_mb": [round(r / mb, 2) for r in per_epoch]}


# -- targets and the table ------------------------------------------------------------------
def _targets(results: dict) -> list[dict]:
    """Each target of issue 4 with the measured figure and whether it is met."""
    out = []

    def add(what: str, value: float | None, limit: float, cmp: str) -> None:
        if value is None:
            return
        met = value <= limit if cmp == "<=" else value >= limit
        out.append({"target": what, "value": round(value, 4), "limit": limit, "met": met})

    limits = {"balanced": 1.05, "generation-bound": 1.08, "training-bound": 1.03}
    for scenario, limit in limits.items():
        res = results.get(scenario)
        if not res:
            continue
        producers = res["workload"]["producers"]
        for name, c in res["contenders"].items():
            if not name.startswith("gluon_stream"):
                continue
            if scenario == "generation-bound" and c["options"].get("producers", 1) != producers:
                continue  # the ideal assumes the workload's producers; defaults have one
            add(f"{scenario}: {name} x ideal", c["x_ideal"], limit, "<=")
            if scenario == "balanced":
                add(f"balanced: {name} speed-up vs dataloader-per-shard",
                    c["speedup_vs_dataloader_per_shard"], 2.0, ">=")
                add(f"balanced: {name} stall % after first batch", c["stall_pct"], 5.0, "<=")
            if scenario == "training-bound":
                add(f"training-bound: {name} rotation ms (prefetched)", c["rotation_ms"],
                    5.0, "<=")
    for shape, res in results.get("throughput", {}).items():
        add(f"throughput {shape}: gluon_stream vs NDArrayIter",
            res["contenders"].get("gluon_stream", {}).get("vs_ndarrayiter"), 1.0, ">=")
    mem = results.get("memory")
    if mem:
        add("memory: peak RSS over baseline, MB (limit: (prefetch+2) shards)",
            mem["peak_over_baseline_mb"], round(mem["bound_mb"], 2), "<=")
    return out


def _fmt(value: float | None, spec: str) -> str:
    if value is None:
        width = spec.split(".")[0]
        return format("-", f">{width}") if width else "-"
    return format(value, spec)


def format_results(results: dict) -> str:
    """The human-readable tables of a bench run."""
    lines = []
    for scenario in PIPELINE_SCENARIOS:
        res = results.get(scenario)
        if not res:
            continue
        w = res["workload"]
        comp = res["components"]
        lines.append(
            f"\n{scenario}: {w['shards']} shards x {w['rows'] - w['time_steps']} samples "
            f"({w['time_steps']}x{w['inputs']}), batch {w['batch_size']}, step "
            f"{w['step_ms'] if w['step'] == 'sleep' else 'cpu'} ms, generator delay "
            f"{w['delay']:.3f} s (generate {_fmt(comp['generate_s'], '.3f')} s, load "
            f"{_fmt(comp['load_s'], '.4f')} s, transform {_fmt(comp['transform_s'], '.4f')} s "
            f"per shard), producers {w['producers']}, num_workers {w['num_workers']}; "
            f"medians of {len(res['ideal']['rounds'])} rounds")
        lines.append(f"  {'contender':<26}{'epoch s':>8}{'x ideal':>8}{'x wave':>7}{'vs dl':>7}"
                     f"{'1st batch s':>12}{'stall %':>8}{'rot ms':>8}{'+RSS MB':>8}{'batches':>8}")
        lines.append(f"  {'ideal':<26}{_fmt(res['ideal']['wall_s'], '8.2f')}{1.0:>8.2f}")
        lines.append(f"  {'wave bound':<26}{_fmt(res['ideal']['wave_bound_s'], '8.2f')}"
                     f"{'':>8}{1.0:>7.2f}")
        for name, c in res["contenders"].items():
            lines.append(
                f"  {name:<26}{_fmt(c['wall_s'], '8.2f')}{_fmt(c['x_ideal'], '8.2f')}"
                f"{_fmt(c['x_wave_bound'], '7.2f')}"
                f"{_fmt(c['speedup_vs_dataloader_per_shard'], '7.2f')}"
                f"{_fmt(c['first_batch_s'], '12.3f')}{_fmt(c['stall_pct'], '8.1f')}"
                f"{_fmt(c['rotation_ms'], '8.1f')}{_fmt(c['peak_rss_mb'], '8.1f')}"
                f"{_fmt(c['batches'], '8.0f')}")
    thr = results.get("throughput")
    if thr:
        lines.append("\nthroughput (in-memory arrays, no-op step), M samples/s and ratio to "
                     "NDArrayIter:")
        shapes = list(thr)
        lines.append(f"  {'contender':<26}" + "".join(f"{s + ' M/s':>12}{'ratio':>8}"
                                                      for s in shapes))
        for name in thr[shapes[0]]["contenders"]:
            row = f"  {name:<26}"
            for s in shapes:
                c = thr[s]["contenders"][name]
                row += (f"{_fmt(c['samples_per_s'] / 1e6, '12.3f')}"
                        f"{_fmt(c['vs_ndarrayiter'], '8.2f')}")
            lines.append(row)
    mem = results.get("memory")
    if mem:
        lines.append(
            f"\nmemory ({mem['epochs']} epochs, shard {mem['shard_mb']:.1f} MB): peak RSS "
            f"baseline + {mem['peak_over_baseline_mb']:.1f} MB (bound {mem['bound_mb']:.1f} MB: "
            f"{'within' if mem['within_bound'] else 'OVER'}), RSS slope "
            f"{mem['rss_slope_mb_per_epoch']:+.3f} MB/epoch (second half "
            f"{mem['rss_slope_second_half_mb_per_epoch']:+.3f})")
    targets = results.get("targets")
    if targets:
        lines.append("\ntargets:")
        for t in targets:
            lines.append(f"  [{'met ' if t['met'] else 'MISS'}] {t['target']}: {t['value']:.3f} "
                         f"(limit {t['limit']})")
    return "\n".join(lines)


# -- the command ---------------------------------------------------------------------------------
def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def register(subparsers: Any) -> None:
    """Add the ``bench`` subcommand to the CLI's subparsers."""
    from .cli import positive_int

    parser = subparsers.add_parser(
        "bench", help="benchmark gluon_stream against MXNet's own ways, interleaved",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", type=_csv, default=list(SCENARIOS),
                        help=f"comma-separated, from {','.join(SCENARIOS)} (default: all)")
    parser.add_argument("--contenders", type=_csv, default=None,
                        help="comma-separated subset (naive and ndarrayiter always run: "
                             "they are the references)")
    parser.add_argument("--rounds", type=positive_int, default=3, help="interleaved rounds (medians)")
    parser.add_argument("--shards", type=positive_int, default=6)
    parser.add_argument("--rows", type=int, default=2576,
                        help="raw rows per shard (samples = rows - time steps)")
    parser.add_argument("--inputs", type=positive_int, default=8, help="input columns of the series")
    parser.add_argument("--time-steps", type=positive_int, default=16, help="window length")
    parser.add_argument("--batch-size", type=positive_int, default=64)
    parser.add_argument("--step", choices=("sleep", "cpu"), default="sleep",
                        help="training step: sleep (an accelerator) or a small Gluon net")
    parser.add_argument("--step-ms", type=float, default=8.0, help="sleep per batch (ms)")
    parser.add_argument("--delay", type=float, default=None,
                        help="generator seconds per shard for every scenario (default: set per "
                             "scenario from the generation/training ratio)")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--producers", type=positive_int, default=2)
    parser.add_argument("--prefetch", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--throughput-samples", type=positive_int, default=20000,
                        help="samples of the 30x16 throughput array (the 8-float one gets 5x)")
    parser.add_argument("--throughput-batch-size", type=positive_int, default=256)
    parser.add_argument("--memory-rows", type=int, default=20000, help="raw rows per shard")
    parser.add_argument("--memory-epochs", type=positive_int, default=50)
    parser.add_argument("--no-warmup", dest="warmup", action="store_false",
                        help="skip the untimed warm-up pass")
    parser.add_argument("--json", metavar="PATH", default=None, help="write the raw figures here")
    parser.set_defaults(func=run_bench)


def _validate(args: argparse.Namespace) -> None:
    """Checks argparse types cannot make (counts are positive_int already)."""
    from .cli import UsageError

    unknown = set(args.scenarios) - set(SCENARIOS)
    if unknown:
        raise UsageError(f"--scenarios: unknown {sorted(unknown)}; choose from {SCENARIOS}")
    if args.contenders is not None:
        unknown = set(args.contenders) - set(PIPELINE_CONTENDERS) - set(THROUGHPUT_CONTENDERS)
        if unknown:
            raise UsageError(f"--contenders: unknown {sorted(unknown)}; choose from "
                             f"{PIPELINE_CONTENDERS + THROUGHPUT_CONTENDERS}")
    if args.rows <= args.time_steps:
        raise UsageError(f"--rows must exceed --time-steps ({args.time_steps}), got {args.rows}")


def run_bench(args: argparse.Namespace) -> int:
    """Run the chosen scenarios, print the tables, write ``--json``; returns 0."""
    _compat.require_mxnet()
    _validate(args)  # a UsageError: cli.main prints it in one line, exit status 2
    base = Workload(shards=args.shards, rows=args.rows, inputs=args.inputs,
                    time_steps=args.time_steps, batch_size=args.batch_size, step=args.step,
                    step_ms=args.step_ms, num_workers=args.num_workers, producers=args.producers,
                    prefetch=args.prefetch, seed=args.seed)
    results: dict[str, Any] = {"argv": {k: v for k, v in vars(args).items() if k != "func"}}
    step_s = _measure_step(base, _make_step(base))
    if args.warmup:
        logger.info("warm-up pass")
        run_pipeline_scenario("warm-up", replace(base, shards=2, delay=0.0), 1, args.contenders)
    for scenario in args.scenarios:
        t0 = time.perf_counter()
        if scenario in PIPELINE_SCENARIOS:
            delay = args.delay if args.delay is not None else _calibrate_delay(
                base, PIPELINE_SCENARIOS[scenario], step_s)
            results[scenario] = run_pipeline_scenario(scenario, replace(base, delay=delay),
                                                      args.rounds, args.contenders)
        elif scenario == "throughput":
            results[scenario] = run_throughput_scenario(
                {"30x16": args.throughput_samples, "8": 5 * args.throughput_samples},
                args.throughput_batch_size, args.rounds, args.seed, args.contenders)
        else:
            results[scenario] = run_memory_scenario(replace(base, rows=args.memory_rows),
                                                    args.memory_epochs)
        logger.info("%s done in %.1f s", scenario, time.perf_counter() - t0)
    results["targets"] = _targets(results)
    print(format_results(results))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fp:
            json.dump(results, fp, indent=1, default=str)
    return 0
