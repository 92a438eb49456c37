"""What ``provenance=True`` costs per batch (``gluon-stream bench --scenarios provenance``).

In memory (a ``FunctionSource`` handing out precomputed shards of small samples: the loader's
own pace, where a per-batch overhead shows most), a no-op step, ``shuffle=True``. Each round
runs every contender for one epoch, interleaved, for ``shuffle_window`` 1 and 4:

* ``off``: the default;
* ``on``: ``provenance=True``, the record not read (what the loop pays to be able to ask);
* ``on, read``: ``provenance=True`` and ``loader.last_provenance`` read after every batch (its
  arrays built: what a loop that logs every batch's origins pays).

Figures are microseconds per batch (the epoch's wall time over its batches), medians over
rounds, and each contender's extra microseconds over ``off`` in the same round (median).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

import numpy as np

from ... import FunctionSource, StreamLoader
from .measure import median

__all__ = ["run_provenance_scenario", "provenance_lines"]

logger = logging.getLogger(__name__)

SHARDS = 16
ROWS = 4000
BATCH = 32
WINDOWS = (1, 4)


def _contenders(shards: list) -> dict[str, tuple[Callable[[], StreamLoader], bool]]:
    """name -> (a new loader, whether the loop reads last_provenance)."""
    def make(window: int, on: bool) -> Callable[[], StreamLoader]:
        return lambda: StreamLoader(FunctionSource(range(SHARDS), lambda k: shards[k]),
                                    batch_size=BATCH, shuffle=True, seed=0,
                                    shuffle_window=window, provenance=on)

    out: dict[str, tuple[Callable[[], StreamLoader], bool]] = {}
    for w in WINDOWS:
        out[f"window {w}, off"] = (make(w, False), False)
        out[f"window {w}, on"] = (make(w, True), False)
        out[f"window {w}, on, read"] = (make(w, True), True)
    return out


def _pass(make: Callable[[], StreamLoader], read: bool) -> float:
    """Microseconds per batch of one epoch."""
    with make() as loader:
        batches = 0
        start = time.perf_counter()
        for _ in loader:
            if read:
                loader.last_provenance  # noqa: B018 (its arrays are built when read)
            batches += 1
        wall = time.perf_counter() - start
    return 1e6 * wall / max(1, batches)


def run_provenance_scenario(rounds: int, seed: int = 0, rows: int = ROWS) -> dict:
    """Microseconds per batch of each contender and its extra over ``off`` (same window,
    same round); medians over ``rounds``."""
    rng = np.random.default_rng(seed)
    shards = [rng.standard_normal((rows, 8), dtype=np.float32) for _ in range(SHARDS)]
    makers = _contenders(shards)
    _pass(*makers[f"window {WINDOWS[0]}, off"])  # warm-up: MXNet's engine, allocator arenas
    us: dict[str, list[float]] = {name: [] for name in makers}
    for round_ in range(rounds):
        for name, (make, read) in makers.items():
            us[name].append(_pass(make, read))
            logger.info("provenance round %d %s: %.1f us/batch", round_, name, us[name][-1])
    out: dict[str, Any] = {}
    for name, figures in us.items():
        off = us[name.split(",")[0] + ", off"]
        out[name] = {"us_per_batch": median(figures),
                     "extra_us": median([a - b for a, b in zip(figures, off)]),
                     "rounds": figures}
    return {"rows": rows, "shards": SHARDS, "batch_size": BATCH, "rounds": rounds,
            "contenders": out}


def provenance_lines(result: dict | None) -> list[str]:
    """The scenario's lines in the bench report."""
    if not result:
        return []
    lines = [f"\nprovenance (in memory, {result['shards']} shards of {result['rows']} rows of 8 "
             f"floats, batch {result['batch_size']}, shuffle, no-op step; medians):"]
    for name, c in result["contenders"].items():
        lines.append(f"  {name:22s} {c['us_per_batch']:8.1f} us/batch  "
                     f"{c['extra_us']:+7.1f} us against off")
    return lines
