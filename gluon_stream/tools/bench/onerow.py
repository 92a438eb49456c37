"""``one-row``: the loader's own work per shard, on shards of one row, beside a plain loop.

``N`` keys (default 3,000) whose ``FunctionSource`` function returns one row per shard
(``np.full((1, 4), k, 'float32'), np.array([k], 'float32')``), read by
``StreamLoader(batch_size=32, last_batch='keep')`` (its defaults otherwise: no shuffle), against
a plain loop that calls the same function and builds the same batches as NDArrays (32 rows
concatenated in numpy, ``mx.nd.array`` once per array per batch). The shards cost almost
nothing to make and the step does nothing, so the loader's time over the loop's is its own
work: key dealing, production, batch planning and bookkeeping, per shard.

A loader pass is timed from its construction to its close (one epoch), the loop from its first
call to its last batch. Each round runs both, interleaved (loader, loop, loader, loop ...); the
figures are medians over rounds, the differences and ratios taken within each round. An untimed
pass first checks both build the same batches (and warms MXNet up).
"""
from __future__ import annotations

import logging
import statistics
import time
from typing import Any, Callable, Iterator, NamedTuple

import numpy as np

from ... import FunctionSource, StreamLoader
from ..._mx import import_mxnet
from .measure import median

__all__ = ["BATCH", "KEYS", "Pass", "check_one_row", "loader_pass", "one_row", "one_row_lines",
           "plain_batches", "plain_pass", "run_one_row_scenario"]

logger = logging.getLogger(__name__)

KEYS = 3000
BATCH = 32


class Pass(NamedTuple):
    """One timed pass: wall seconds, this process's CPU seconds (every thread), its batches and
    samples."""

    wall_s: float
    cpu_s: float
    batches: int
    samples: int


def one_row(key: int) -> tuple[np.ndarray, np.ndarray]:
    """Shard ``key``: one row of 4 floats and its label, every value ``key``."""
    return np.full((1, 4), key, dtype="float32"), np.array([key], dtype="float32")


def plain_batches(keys: int, batch_size: int = BATCH,
                  make: Callable[[int], tuple[np.ndarray, np.ndarray]] = one_row) -> Iterator[Any]:
    """The loader's batches without it: ``make(k)`` for k in order, ``batch_size`` rows
    concatenated in numpy, one ``mx.nd.array`` per array per batch, the last batch kept."""
    mx = import_mxnet()
    rows: list[tuple[np.ndarray, np.ndarray]] = []
    for key in range(keys):
        rows.append(make(key))
        if len(rows) == batch_size:
            yield _batch(mx, rows)
            rows = []
    if rows:
        yield _batch(mx, rows)


def _batch(mx: Any, rows: list[tuple[np.ndarray, np.ndarray]]) -> tuple[Any, Any]:
    return (mx.nd.array(np.concatenate([data for data, _ in rows])),
            mx.nd.array(np.concatenate([label for _, label in rows])))


def loader_pass(keys: int, batch_size: int = BATCH) -> Pass:
    """One epoch of the loader, timed from its construction to its close."""
    batches = samples = 0
    source = FunctionSource(range(keys), one_row)
    start, cpu = time.perf_counter(), time.process_time()
    with StreamLoader(source, batch_size=batch_size, last_batch="keep") as loader:
        for data, _ in loader:
            batches += 1
            samples += data.shape[0]
    return Pass(time.perf_counter() - start, time.process_time() - cpu, batches, samples)


def plain_pass(keys: int, batch_size: int = BATCH) -> Pass:
    """The plain loop over the same keys, timed."""
    batches = samples = 0
    start, cpu = time.perf_counter(), time.process_time()
    for data, _ in plain_batches(keys, batch_size):
        batches += 1
        samples += data.shape[0]
    return Pass(time.perf_counter() - start, time.process_time() - cpu, batches, samples)


def check_one_row(keys: int, batch_size: int = BATCH) -> dict:
    """Untimed: the keys the loader's function was called with, every label it delivered, and
    whether its batches equal the plain loop's (values and order)."""
    made: list[int] = []

    def counted(key: int) -> tuple[np.ndarray, np.ndarray]:
        made.append(key)
        return one_row(key)

    with StreamLoader(FunctionSource(range(keys), counted), batch_size=batch_size,
                      last_batch="keep") as loader:
        got = [(data.asnumpy(), label.asnumpy()) for data, label in loader]
    want = [(data.asnumpy(), label.asnumpy()) for data, label in plain_batches(keys, batch_size)]
    labels = sorted(int(v) for _, label in got for v in label)
    return {"keys_made": len(set(made)), "calls": len(made), "samples": len(labels),
            "batches": len(got), "every_key_once": labels == list(range(keys)),
            "same_batches_as_plain": len(got) == len(want) and all(
                np.array_equal(g[0], w[0]) and np.array_equal(g[1], w[1])
                for g, w in zip(got, want))}


def per_shard(keys: int, loader: list[Pass], plain: list[Pass]) -> dict:
    """The figures of interleaved passes over ``keys`` shards: medians over rounds, the own
    work and the ratio taken within each round; CPU time too (every thread of this process:
    what other jobs on the machine change least)."""
    loader_s, plain_s = [p.wall_s for p in loader], [p.wall_s for p in plain]
    loader_med, plain_med = statistics.median(loader_s), statistics.median(plain_s)
    return {
        "keys": keys,
        "loader_shards_per_s": keys / loader_med, "plain_shards_per_s": keys / plain_med,
        "loader_us_per_shard": 1e6 * loader_med / keys,
        "plain_us_per_shard": 1e6 * plain_med / keys,
        "own_us_per_shard": median([1e6 * (a - b) / keys for a, b in zip(loader_s, plain_s)]),
        "x_plain": median([a / b for a, b in zip(loader_s, plain_s)]),
        "loader_cpu_us_per_shard": median([1e6 * p.cpu_s / keys for p in loader]),
        "plain_cpu_us_per_shard": median([1e6 * p.cpu_s / keys for p in plain]),
        "rounds": {"loader_s": loader_s, "plain_s": plain_s,
                   "loader_cpu_s": [p.cpu_s for p in loader],
                   "plain_cpu_s": [p.cpu_s for p in plain]}}


def interleaved(keys: int, rounds: int, batch_size: int = BATCH) -> dict:
    """Loader and plain loop over ``keys`` one-row shards, ``rounds`` times each, interleaved;
    :func:`per_shard`'s figures plus the batches and samples every pass counted."""
    loader: list[Pass] = []
    plain: list[Pass] = []
    counts: set[tuple[str, int, int]] = set()
    for round_ in range(rounds):
        for name, run, passes in (("loader", loader_pass, loader), ("plain", plain_pass, plain)):
            passes.append(run(keys, batch_size))
            counts.add((name, passes[-1].batches, passes[-1].samples))
        logger.info("one-row %d keys, round %d: loader %.3f s, plain %.3f s", keys, round_,
                    loader[-1].wall_s, plain[-1].wall_s)
    return {**per_shard(keys, loader, plain),
            "passes": sorted([{"who": w, "batches": b, "samples": s} for w, b, s in counts],
                             key=lambda p: p["who"])}


def run_one_row_scenario(rounds: int, keys: int = KEYS, batch_size: int = BATCH) -> dict:
    """The one-row figures (see the module doc): shards/s, µs per shard, the loader's own work
    per shard, loader/plain; ``check``: the untimed pass's counts."""
    import_mxnet()
    checked = check_one_row(keys, batch_size)  # also the warm-up
    return {"batch_size": batch_size, "rounds_run": rounds, "check": checked,
            **interleaved(keys, rounds, batch_size)}


def one_row_lines(result: dict | None) -> list[str]:
    """The scenario's lines in the bench report."""
    if not result:
        return []
    check = result["check"]
    return [
        f"\none-row shards ({result['keys']} keys of one row, batch {result['batch_size']}, "
        f"last_batch='keep', no-op step; medians of {result['rounds_run']} interleaved rounds):",
        f"  {'':<26}{'shards/s':>10}{'us/shard':>10}{'CPU us/shard':>14}",
        f"  {'StreamLoader':<26}{result['loader_shards_per_s']:>10.0f}"
        f"{result['loader_us_per_shard']:>10.1f}{result['loader_cpu_us_per_shard']:>14.1f}",
        f"  {'plain loop':<26}{result['plain_shards_per_s']:>10.0f}"
        f"{result['plain_us_per_shard']:>10.1f}{result['plain_cpu_us_per_shard']:>14.1f}",
        f"  the loader's own work: {result['own_us_per_shard']:.1f} us per shard; loader time "
        f"{result['x_plain']:.1f}x the plain loop's",
        f"  check: {check['keys_made']} keys made ({check['calls']} calls with those made "
        f"ahead for the next epoch), {check['samples']} samples in {check['batches']} batches, "
        f"every key once: {check['every_key_once']}, same batches as the plain loop: "
        f"{check['same_batches_as_plain']}"]
