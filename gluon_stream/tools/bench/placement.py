"""Batches on the device: how long the loop itself spends getting each batch onto its context.

A loop that copies every batch itself (``batch.as_in_context(ctx)``, then waits for it, as the
first operation of a training step does) against ``StreamLoader(ctx=...)``, which starts the
next batch's copy before handing out the current one. A step that sleeps stands in for an
accelerator busy with the previous batch. Measured on ``mx.cpu(1)`` here (no GPU): a real host
to device copy costs more, and overlaps the same way.
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np

from ... import FunctionSource, StreamLoader
from ..._mx import import_mxnet
from .measure import batch_arrays, median

__all__ = ["run_placement_scenario"]


def run_placement_scenario(rounds: int, samples: int = 20000, batch_size: int = 256,
                           step_ms: float = 8.0, seed: int = 0) -> dict:
    """Milliseconds per batch the loop spends placing batches, with and without ``ctx=``."""
    mx = import_mxnet()
    target = mx.cpu(1)
    rng = np.random.default_rng(seed)
    data = rng.standard_normal((samples, 30, 16), dtype=np.float32)
    label = rng.standard_normal((samples,), dtype=np.float32)
    shards = np.array_split(np.arange(samples), 4)
    figures: dict[str, list[float]] = {"as_in_context in the loop": [], "ctx=": []}
    for _ in range(rounds):
        for name in figures:
            source = FunctionSource(range(4), lambda k: (data[shards[k]], label[shards[k]]))
            options: dict[str, Any] = {"ctx": target} if name == "ctx=" else {}
            placed_s, batches = 0.0, 0
            with StreamLoader(source, batch_size=batch_size, shuffle=True, seed=seed,
                              **options) as loader:
                for batch in loader:
                    t0 = time.perf_counter()
                    if name != "ctx=":
                        batch = [a.as_in_context(target) for a in batch]
                    for array in batch_arrays(batch):
                        array.wait_to_read()
                    placed_s += time.perf_counter() - t0
                    batches += 1
                    time.sleep(step_ms / 1000.0)  # the accelerator, busy with this batch
            figures[name].append(1000.0 * placed_s / batches)
    return {"context": str(target), "batch_size": batch_size, "step_ms": step_ms,
            "batch_mb": batch_size * 30 * 16 * 4 / 2 ** 20,
            "ms_per_batch": {n: median(v) for n, v in figures.items()}, "rounds": figures}
