"""Memory over many epochs: peak RSS against the design bound, and the RSS slope."""
from __future__ import annotations

import functools
import gc
import tempfile
from dataclasses import asdict

from ... import CommandSource, StreamLoader
from ..generator import generator_command, make_windows
from .measure import RssSampler, batch_arrays, rss_bytes, slope
from .pipeline import GENERATOR_TIMEOUT_S
from .workload import Workload

__all__ = ["run_memory_scenario"]


def run_memory_scenario(workload: Workload, epochs: int) -> dict:
    """Peak RSS and RSS slope of a StreamLoader rotating through ``epochs`` epochs."""
    with tempfile.TemporaryDirectory(prefix="gluon_stream_bench_") as tmp:
        source = CommandSource(workload.keys(),
                               generator_command(workload.rows, workload.inputs, 0.0),
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
    mb = 2 ** 20
    rate = slope(per_epoch) / mb
    late = slope(per_epoch[len(per_epoch) // 2:]) / mb
    bound = (workload.prefetch + 2) * workload.shard_bytes
    return {"workload": asdict(workload), "epochs": epochs, "baseline_mb": baseline / mb,
            "shard_mb": workload.shard_bytes / mb, "peak_over_baseline_mb": (peak - baseline) / mb,
            "bound_mb": bound / mb, "within_bound": bool(peak - baseline <= bound),
            "rss_slope_mb_per_epoch": rate, "rss_slope_second_half_mb_per_epoch": late,
            "rss_per_epoch_mb": [round(r / mb, 2) for r in per_epoch]}
