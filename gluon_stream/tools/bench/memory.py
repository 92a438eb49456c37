"""Memory over many epochs: peak RSS against the design bound, and the RSS slope.

The bound is ``(prefetch + 2)`` shards: the shard in use, ``prefetch`` more produced ahead, and
one being copied into its NDArray (its source and its copy exist together for a moment).
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

from ... import CommandSource, StreamLoader
from ..generator import make_windows
from .measure import RssSampler, batch_arrays, rss_bytes, slope
from .pipeline import GENERATOR_TIMEOUT_S
from .workload import Workload

__all__ = ["run_memory_scenario"]

WARMUP_EPOCHS = 2


def _run(workload: Workload, epochs: int) -> tuple[int, int, list[int]]:
    """(baseline, peak RSS, RSS after each epoch) of a StreamLoader over ``epochs`` epochs."""
    with tempfile.TemporaryDirectory(prefix="gluon_stream_bench_") as tmp:
        source = CommandSource(workload.keys(), replace(workload, delay=0.0).command(),
                               cache_dir=tmp, timeout=GENERATOR_TIMEOUT_S, retries=0)
        transform = functools.partial(make_windows, time_steps=workload.time_steps)
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


def run_memory_scenario(workload: Workload, epochs: int) -> dict:
    """Peak RSS and RSS slope of a StreamLoader rotating through ``epochs`` epochs."""
    gc.collect()
    first = rss_bytes()
    tiny = replace(workload, rows=workload.time_steps + 2 * workload.batch_size)
    warm_base, warm_peak, _ = _run(tiny, WARMUP_EPOCHS)
    baseline, peak, per_epoch = _run(workload, epochs)
    mb = 2 ** 20
    rate = slope(per_epoch) / mb
    late = slope(per_epoch[len(per_epoch) // 2:]) / mb
    bound = (workload.prefetch + 2) * workload.shard_bytes
    return {"workload": asdict(workload), "epochs": epochs, "baseline_mb": baseline / mb,
            "shard_mb": workload.shard_bytes / mb, "peak_over_baseline_mb": (peak - baseline) / mb,
            "peak_over_import_baseline_mb": (peak - first) / mb,
            "overhead_mb": (warm_peak - warm_base) / mb,
            "bound_mb": bound / mb, "within_bound": bool(peak - baseline <= bound),
            "rss_slope_mb_per_epoch": rate, "rss_slope_second_half_mb_per_epoch": late,
            "rss_per_epoch_mb": [round((r - baseline) / mb, 2) for r in per_epoch]}
