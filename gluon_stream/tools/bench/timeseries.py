"""What ``context_rows`` costs: time-series shards windowed alone, and with the rows of the keys
before them, side by side in one run.

Each shard is one date of a series (``ROWS`` rows of ``INPUTS`` float32 columns), the transform
cuts windows of ``STEPS`` rows and their next row (as ``examples/timeseries_lstm.py`` does), the
step is a no-op, so the figures are the loader's own pace, the worst case for any overhead.
With ``context_rows=STEPS`` a producer also makes the previous date's shard and copies its last
rows before the shard's own: from memory (a ``FunctionSource`` handing out precomputed shards)
and from a ``cache_dir`` (the previous date loaded from its ``.npy`` file, as a job with a cache
reads it). Each round runs every contender once, interleaved; a context contender's figure is
its samples per second over the same source windowed alone in the same round (median over
rounds), and each says how many windows an epoch yields.
"""
from __future__ import annotations

import logging
import tempfile
import time
from typing import Any, Callable

import numpy as np

from ... import FunctionSource, StreamLoader
from .measure import median

__all__ = ["run_timeseries_scenario", "timeseries_lines"]

logger = logging.getLogger(__name__)

SHARDS = 32
ROWS = 3000
INPUTS = 8
STEPS = 24
BATCH = 128


def windows(raw: np.ndarray, steps: int = STEPS) -> tuple[np.ndarray, np.ndarray]:
    """Windows of ``steps`` rows and the row after each, from one shard's (and its context's)
    raw rows."""
    n = len(raw) - steps
    if n <= 0:
        return np.zeros((0, steps, raw.shape[1]), raw.dtype), np.zeros((0,), raw.dtype)
    view = np.lib.stride_tricks.sliding_window_view(raw[:-1], steps, axis=0)
    return np.ascontiguousarray(view.transpose(0, 2, 1)[:n]), np.ascontiguousarray(raw[steps:, 0])


def _contenders(shards: list[np.ndarray], cache_dir: str) -> dict[str, Callable[[], StreamLoader]]:
    def source(cached: bool) -> FunctionSource:
        return FunctionSource(range(SHARDS), lambda k: shards[k],
                              cache_dir=cache_dir if cached else None)

    common: dict[str, Any] = {"batch_size": BATCH, "shuffle": True, "seed": 0,
                              "transform": windows}
    return {
        "alone": lambda: StreamLoader(source(False), **common),
        "context": lambda: StreamLoader(source(False), context_rows=STEPS, **common),
        "alone, cache_dir": lambda: StreamLoader(source(True), **common),
        "context, cache_dir": lambda: StreamLoader(source(True), context_rows=STEPS, **common),
    }


def _pass(make: Callable[[], StreamLoader]) -> tuple[float, int]:
    """(samples/s of one epoch, windows it yielded)."""
    with make() as loader:
        samples = 0
        start = time.perf_counter()
        for batch in loader:
            samples += batch[0].shape[0]
        wall = time.perf_counter() - start
    return samples / wall, samples


def run_timeseries_scenario(rounds: int, seed: int = 0, rows: int = ROWS) -> dict:
    """Samples/s and windows per epoch of each contender (shards of ``rows`` rows), and each
    context contender's speed over the same source windowed alone; medians over ``rounds``."""
    rng = np.random.default_rng(seed)
    shards = [np.cumsum(rng.standard_normal((rows, INPUTS), dtype=np.float32), axis=0)
              for _ in range(SHARDS)]
    with tempfile.TemporaryDirectory(prefix="gluon_stream_bench_ts_") as cache_dir:
        makers = _contenders(shards, cache_dir)
        for make in makers.values():  # warm-up: imports, the engine, the cache filled
            _pass(make)
        rates: dict[str, list[float]] = {name: [] for name in makers}
        counts: dict[str, int] = {}
        for round_ in range(rounds):
            for name, make in makers.items():
                rate, counts[name] = _pass(make)
                rates[name].append(rate)
                logger.info("timeseries round %d %s: %.0f samples/s", round_, name, rate)
    against = {name: name.replace("context", "alone") for name in makers}
    return {
        "shards": SHARDS, "rows": rows, "inputs": INPUTS, "steps": STEPS, "batch_size": BATCH,
        "rounds": rounds,
        "contenders": {name: {
            "samples_per_s": median(r), "windows": counts[name], "against": against[name],
            "x_against": median([a / b for a, b in zip(r, rates[against[name]])]),
            "rounds": r} for name, r in rates.items()}}


def timeseries_lines(result: dict | None) -> list[str]:
    """The scenario's lines in the bench report."""
    if not result:
        return []
    lines = [f"\ntimeseries ({result['shards']} shards of {result['rows']} rows x "
             f"{result['inputs']}, windows of {result['steps']} rows, batch "
             f"{result['batch_size']}, no-op step; context_rows={result['steps']} against the "
             "same source windowed alone, medians of per-round ratios):"]
    for name, c in result["contenders"].items():
        lines.append(f"  {name:20s} {c['samples_per_s']:9.0f} samples/s  "
                     f"{c['x_against']:.3f}x {c['against']:18s} {c['windows']} windows/epoch")
    return lines
