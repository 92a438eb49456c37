"""Memory over many epochs: peak RSS against the design bound, and the RSS slope.

The bound is ``(prefetch + 2)`` shards: the shard in use, ``prefetch`` more produced ahead, and
one being copied into its NDArray (its source and its copy exist together for a moment).

Two sources: the built-in generator through a CommandSource (``make_windows``: the windows are
views of a raw array 16x smaller, so a shard's source is small), and ``function_source``: a
FunctionSource whose function allocates every shard, six ``(20000, 30, 16)`` float32 arrays and
a label (38.5 MB), batch 256, so that a shard's source is as large as its copy: handed over
(``fresh_arrays=True``, its copy gives the source's memory back as it goes) and, as
``function_source_kept``, not (the default: the loader never touches what the function
returns, so a shard and its copy exist whole together while it is copied).
Before the measured run the same loader runs 2 epochs of near-empty shards: what it costs
(imports on first use, threads, the allocator's per-thread arenas) is ``overhead_mb``, which the
measured run's baseline then includes. ``peak_over_import_baseline_mb`` counts it too (the
baseline taken before the warm-up, after ``import mxnet``, as earlier releases measured).
"""
from __future__ import annotations

import functools
import gc
import tempfile
from dataclasses import asdict, replace
from typing import Any

import numpy as np

from ... import CommandSource, FunctionSource, StreamLoader
from ..generator import make_windows
from .measure import RssSampler, batch_arrays, rss_bytes, slope
from .pipeline import GENERATOR_TIMEOUT_S
from .workload import Workload

__all__ = ["FUNCTION_SHAPE", "run_memory_scenario"]

WARMUP_EPOCHS = 2
FUNCTION_SHAPE = (30, 16)  # per sample, in the FunctionSource variant
FUNCTION_BATCH = 256


def _random_shard(rows: int, key: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(key)
    return (rng.standard_normal((rows,) + FUNCTION_SHAPE, dtype=np.float32),
            rng.standard_normal(rows, dtype=np.float32))


def _run(workload: Workload, epochs: int, function_rows: int | None = None,
         fresh: bool = True) -> tuple[int, int, list[int]]:
    """(baseline, peak RSS, RSS after each epoch) of a StreamLoader over ``epochs`` epochs:
    over the generator, or over a FunctionSource of ``function_rows`` rows a shard (``fresh``:
    its arrays handed over)."""
    with tempfile.TemporaryDirectory(prefix="gluon_stream_bench_") as tmp:
        if function_rows is None:
            source: Any = CommandSource(workload.keys(), replace(workload, delay=0.0).command(),
                                        cache_dir=tmp, timeout=GENERATOR_TIMEOUT_S, retries=0)
            transform: Any = functools.partial(make_windows, time_steps=workload.time_steps)
        else:
            source = FunctionSource(range(workload.shards),
                                    functools.partial(_random_shard, function_rows),
                                    fresh_arrays=fresh)
            transform = None
        gc.collect()
        baseline = rss_bytes()
        sampler = RssSampler()
        per_epoch = []
        try:
            with StreamLoader(source, batch_size=workload.batch_size, transform=transform,
                              shuffle=True, seed=workload.seed, prefetch=workload.prefetch,
                              producers=workload.producers) as loader:
                for epoch in range(epochs):
                    loader.set_epoch(epoch)
                    for batch in loader:
                        for array in batch_arrays(batch):
                            array.wait_to_read()
                        del batch
                    per_epoch.append(rss_bytes())
        finally:
            peak = sampler.close()
    return baseline, peak, per_epoch


def _measure(workload: Workload, epochs: int, shard_bytes: int,
             function_rows: int | None = None, fresh: bool = True) -> dict:
    gc.collect()
    first = rss_bytes()
    tiny_rows = workload.time_steps + 2 * workload.batch_size
    warm_base, warm_peak, _ = _run(replace(workload, rows=tiny_rows), WARMUP_EPOCHS,
                                   None if function_rows is None else tiny_rows, fresh)
    baseline, peak, per_epoch = _run(workload, epochs, function_rows, fresh)
    mb = 2 ** 20
    bound = (workload.prefetch + 2) * shard_bytes
    return {"epochs": epochs, "baseline_mb": baseline / mb, "shard_mb": shard_bytes / mb,
            "peak_over_baseline_mb": (peak - baseline) / mb,
            "peak_over_import_baseline_mb": (peak - first) / mb,
            "overhead_mb": (warm_peak - warm_base) / mb,
            "bound_mb": bound / mb, "within_bound": bool(peak - baseline <= bound),
            "rss_slope_mb_per_epoch": slope(per_epoch) / mb,
            "rss_slope_second_half_mb_per_epoch": slope(per_epoch[len(per_epoch) // 2:]) / mb,
            "rss_per_epoch_mb": [round((r - baseline) / mb, 2) for r in per_epoch]}


def run_memory_scenario(workload: Workload, epochs: int,
                        function_rows: int | None = 20000) -> dict:
    """Peak RSS and RSS slope of a StreamLoader rotating through ``epochs`` epochs, over the
    generator and (unless ``function_rows`` is None) over a FunctionSource (module doc)."""
    out = {"workload": asdict(workload),
           **_measure(workload, epochs, workload.shard_bytes)}
    if function_rows is not None:
        rows_bytes = function_rows * (int(np.prod(FUNCTION_SHAPE)) + 1) * 4
        function = replace(workload, batch_size=FUNCTION_BATCH)
        out["function_source"] = {"rows": function_rows, "batch_size": FUNCTION_BATCH,
                                  **_measure(function, epochs, rows_bytes, function_rows)}
        out["function_source_kept"] = {"rows": function_rows, "batch_size": FUNCTION_BATCH,
                                       **_measure(function, epochs, rows_bytes, function_rows,
                                                  fresh=False)}
    return out
