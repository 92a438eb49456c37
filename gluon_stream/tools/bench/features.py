"""What issue 21's capabilities cost in speed: each against the same loader without it.

In memory (a ``FunctionSource`` handing out precomputed shards: no generation), a no-op
step, so the figures are the loader's own pace, the worst case for any overhead. Each round
runs every contender once, interleaved, and a contender's figure is its samples per second
over the plain loader's in the same round (median over rounds):

* ``even_batches='pad'``: 2 parts, rank 0, against the same 2 parts without it;
* ``samples_per_epoch``: epochs of the same size as the key list's, against plain epochs;
* ``MixSource``: two sources at 3:1 taking the same shards, against one source;
* a state per checkpoint: ``state_dict()`` written as JSON, in milliseconds per save;
* ``stats.diagnose()`` after the pass, in milliseconds.
"""
from __future__ import annotations

import json
import logging
import time
from typing import Any, Callable

import numpy as np

from ... import FunctionSource, MixSource, StreamLoader
from .measure import median

__all__ = ["run_features_scenario"]

logger = logging.getLogger(__name__)

SHARDS = 16
ROWS = 4000
SHAPE = (30, 16)
BATCH = 64


def _shards(seed: int, rows: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((rows,) + SHAPE, dtype=np.float32),
             rng.integers(0, 10, rows).astype(np.float32)) for _ in range(SHARDS)]


def _contenders(shards: list) -> dict[str, Callable[[], StreamLoader]]:
    def source(keys: Any = range(SHARDS)) -> FunctionSource:
        return FunctionSource(keys, lambda k: shards[k % SHARDS])

    total = sum(len(x) for x, _ in shards)
    common: dict[str, Any] = {"batch_size": BATCH, "shuffle": True, "seed": 0}
    def mix() -> MixSource:  # a loader closes its source: new ones per pass
        return MixSource({"a": source(range(0, SHARDS, 2)), "b": source(range(1, SHARDS, 2))},
                         weights={"a": 3, "b": 1}, shards_per_epoch=SHARDS)

    return {
        "plain": lambda: StreamLoader(source(), **common),
        "2 parts": lambda: StreamLoader(source(), num_parts=2, part_index=0, **common),
        "2 parts, even_batches='pad'": lambda: StreamLoader(
            source(), num_parts=2, part_index=0, even_batches="pad", **common),
        "samples_per_epoch": lambda: StreamLoader(source(), samples_per_epoch=total, **common),
        "MixSource 3:1": lambda: StreamLoader(mix(), **common),
    }


def _pass(make: Callable[[], StreamLoader]) -> tuple[float, float, float]:
    """(samples/s of one epoch, ms per state saved as JSON, ms of diagnose())."""
    with make() as loader:
        samples, saves = 0, []
        start = time.perf_counter()
        for i, batch in enumerate(loader):
            samples += batch[0].shape[0]
            if i % 50 == 0:
                t = time.perf_counter()
                json.dumps(loader.state_dict())
                saves.append(time.perf_counter() - t)
        wall = time.perf_counter() - start - sum(saves)
        t = time.perf_counter()
        loader.stats.diagnose()
        diagnose_s = time.perf_counter() - t
    return samples / wall, 1e3 * float(np.median(saves)), 1e3 * diagnose_s


def run_features_scenario(rounds: int, seed: int = 0, rows: int = ROWS) -> dict:
    """Samples/s of each contender and its ratio to the plain loader (or to ``2 parts`` for
    padding); milliseconds per state and per diagnose(); medians over ``rounds``."""
    makers = _contenders(_shards(seed, rows))
    _pass(makers["plain"])  # warm-up: imports, MXNet's engine, allocator arenas
    rates: dict[str, list[float]] = {name: [] for name in makers}
    saves: list[float] = []
    diagnoses: list[float] = []
    for round_ in range(rounds):
        for name, make in makers.items():
            rate, save_ms, diagnose_ms = _pass(make)
            rates[name].append(rate)
            saves.append(save_ms)
            diagnoses.append(diagnose_ms)
            logger.info("features round %d %s: %.0f samples/s", round_, name, rate)
    baseline = {name: "2 parts" if "even_batches" in name else "plain" for name in makers}
    return {
        "rows": rows, "shards": SHARDS, "batch_size": BATCH, "rounds": rounds,
        "contenders": {name: {
            "samples_per_s": median(r), "against": baseline[name],
            "x_against": median([a / b for a, b in zip(r, rates[baseline[name]])]),
            "rounds": r} for name, r in rates.items()},
        "state_save_ms": median(saves), "diagnose_ms": median(diagnoses)}


def features_lines(result: dict | None) -> list[str]:
    """The scenario's lines in the bench report."""
    if not result:
        return []
    lines = [f"\nfeatures (in memory, {result['shards']} shards of {result['rows']} rows, "
             f"batch {result['batch_size']}, no-op step; speed against the same loader "
             "without the feature, medians of per-round ratios):"]
    for name, c in result["contenders"].items():
        lines.append(f"  {name:30s} {c['samples_per_s']:9.0f} samples/s  "
                     f"{c['x_against']:.3f}x {c['against']}")
    lines.append(f"  a state saved as JSON: {result['state_save_ms']:.2f} ms; stats.diagnose(): "
                 f"{result['diagnose_ms']:.2f} ms")
    return lines
