"""``growth``: how the loader's costs grow with the keys, the shards per epoch, the ranks merged
and the run's length.

Every shard is one row (the ``one-row`` scenario's function), so the figures are the loader's
own work. Only the public API is used (``FunctionSource``, ``StreamLoader``, ``len()``,
``set_epoch``, ``state_dict``, ``load_state_dict``, ``merge_states``), so the same script
measures any version of the core. States are measured as JSON (``json.dumps``), in bytes.

* keys (10^3 to 10^6, ``shard_sizes=1`` so ``len()`` is known, ``shuffle=True``, seed 0;
  reading every shard of 10^6 would take minutes): the loader's construction, ``len()``, its
  first batch, ``state_dict()`` there, and an epoch's start on rank 0 of 8 (``set_epoch(1)``,
  then the first batch: the keys dealt to 8 ranks with the shuffle);
* shards per epoch (100, 1,000, 10,000): the ``one-row`` loader and plain loop, per shard;
* ranks merged (8 to 1,024): each rank's state after its first batch (``num_parts=R``,
  ``part_index=r``, 2 keys per rank, batch 1, seed 0, shuffled; the default deal, whole
  shards), then ``merge_states`` over them, and a resume from the merged state (one new rank
  loads it and reads its first batch);
* run length (1, 10, 100 epochs of 16 keys, batch 4, shuffled): ``state_dict()`` after the
  first batch of that epoch, and that epoch's time.

Each round measures every size of every part; the figures are medians over rounds (the states
to merge are built once per rank count, in the first round).
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from ... import FunctionSource, StreamLoader, merge_states
from ..._mx import import_mxnet
from .measure import median
from .onerow import BATCH, Pass, loader_pass, one_row, per_shard, plain_pass

__all__ = ["GrowthSizes", "growth_lines", "run_growth_scenario"]

logger = logging.getLogger(__name__)

EPOCH_KEYS = 16  # run length: keys per epoch
EPOCH_BATCH = 4


@dataclass(frozen=True)
class GrowthSizes:
    """The sizes each part of the scenario measures."""

    keys: Sequence[int] = (10 ** 3, 10 ** 4, 10 ** 5, 10 ** 6)
    shards: Sequence[int] = (100, 1000, 10000)
    ranks: Sequence[int] = (8, 64, 256, 1024)
    epochs: Sequence[int] = (1, 10, 100)


def _ms(start: float) -> float:
    return 1e3 * (time.perf_counter() - start)


def _bytes(state: Any) -> int:
    return len(json.dumps(state).encode())


def _loader(keys: int, **options: Any) -> StreamLoader:
    return StreamLoader(FunctionSource(range(keys), one_row), shuffle=True, seed=0, **options)


def keys_costs(keys: int) -> dict[str, float]:
    """Costs that grow with the key count, without reading an epoch (see the module doc)."""
    start = time.perf_counter()
    with _loader(keys, batch_size=BATCH, shard_sizes=1) as loader:
        construct_ms, start = _ms(start), time.perf_counter()
        length = len(loader)
        len_ms, start = _ms(start), time.perf_counter()
        batches = iter(loader)
        next(batches)
        first_ms, start = _ms(start), time.perf_counter()
        state = loader.state_dict()
        state_ms = _ms(start)
    with _loader(keys, batch_size=BATCH, shard_sizes=1, num_parts=8, part_index=0) as rank:
        next(iter(rank))
        rank.set_epoch(1)
        start = time.perf_counter()
        next(iter(rank))
        epoch_start_ms = _ms(start)
    return {"construct_ms": construct_ms, "len_ms": len_ms, "first_batch_ms": first_ms,
            "state_ms": state_ms, "state_bytes": _bytes(state),
            "epoch_start_8_ranks_ms": epoch_start_ms, "len": length}


def rank_states(ranks: int) -> list[dict]:
    """Every rank's state after its first batch, ``ranks`` ranks over ``2 * ranks`` keys."""
    states = []
    for rank in range(ranks):
        with _loader(2 * ranks, batch_size=1, num_parts=ranks, part_index=rank) as loader:
            next(iter(loader))
            states.append(loader.state_dict())
    return states


def merge_costs(states: list[dict]) -> dict[str, float]:
    """``merge_states`` over ``states`` (ms, bytes), and a resume: one new rank loads the
    merged state and reads its first batch (ms)."""
    start = time.perf_counter()
    merged = merge_states(states)
    merge_ms, start = _ms(start), time.perf_counter()
    with _loader(2 * len(states), batch_size=1) as loader:
        loader.load_state_dict(merged)
        next(iter(loader))
    return {"merge_ms": merge_ms, "merged_bytes": _bytes(merged), "resume_ms": _ms(start),
            "rank_state_bytes": _bytes(states[0])}


def run_length(epochs: Sequence[int]) -> dict[int, dict[str, float]]:
    """Per epoch count in ``epochs``: the state after that epoch's first batch, and the
    epoch's time (without the state's)."""
    out: dict[int, dict[str, float]] = {}
    with _loader(EPOCH_KEYS, batch_size=EPOCH_BATCH) as loader:
        for epoch in range(1, max(epochs) + 1):
            loader.set_epoch(epoch - 1)
            start, state_ms = time.perf_counter(), 0.0
            for index, _ in enumerate(loader):
                if index == 0 and epoch in epochs:
                    at = time.perf_counter()
                    state = loader.state_dict()
                    state_ms = _ms(at)
                    out[epoch] = {"state_ms": state_ms, "state_bytes": _bytes(state)}
            if epoch in out:
                out[epoch]["epoch_ms"] = _ms(start) - state_ms
    return out


def _medians(rounds: list[dict[str, float]]) -> dict[str, Any]:
    return {name: median([r[name] for r in rounds]) for name in rounds[0]}


def run_growth_scenario(rounds: int, sizes: GrowthSizes = GrowthSizes()) -> dict:
    """Medians over ``rounds`` of every part's figures (see the module doc), keyed by size."""
    import_mxnet()
    loader_pass(100)  # warm-up: imports, MXNet's engine, the loader's threads
    keys: dict[int, list[dict]] = {n: [] for n in sizes.keys}
    shards: dict[int, tuple[list[Pass], list[Pass]]] = {n: ([], []) for n in sizes.shards}
    states = {n: rank_states(n) for n in sizes.ranks}
    merges: dict[int, list[dict]] = {n: [] for n in sizes.ranks}
    epochs: dict[int, list[dict]] = {n: [] for n in sizes.epochs}
    for round_ in range(rounds):
        for n in sizes.keys:
            keys[n].append(keys_costs(n))
        for n in sizes.shards:
            shards[n][0].append(loader_pass(n))
            shards[n][1].append(plain_pass(n))
        for n in sizes.ranks:
            merges[n].append(merge_costs(states[n]))
        for n, figures in run_length(sizes.epochs).items():
            epochs[n].append(figures)
        logger.info("growth round %d done", round_)
    return {"sizes": {k: list(v) for k, v in asdict(sizes).items()}, "rounds_run": rounds,
            "keys": {str(n): _medians(r) for n, r in keys.items()},
            "shards": {str(n): per_shard(n, *times) for n, times in shards.items()},
            "ranks": {str(n): _medians(r) for n, r in merges.items()},
            "epochs": {str(n): _medians(r) for n, r in epochs.items()}}


def growth_lines(result: dict | None) -> list[str]:
    """The scenario's tables in the bench report."""
    if not result:
        return []
    lines = [f"\ngrowth: the loader's costs (one-row shards, medians of {result['rounds_run']} "
             "rounds; states as JSON)",
             f"  {'keys':>9}{'construct ms':>14}{'len() ms':>10}{'1st batch ms':>14}"
             f"{'state ms':>10}{'state B':>9}{'epoch start, 8 ranks ms':>25}"]
    for n, k in result["keys"].items():
        lines.append(f"  {int(n):>9,}{k['construct_ms']:>14.2f}{k['len_ms']:>10.2f}"
                     f"{k['first_batch_ms']:>14.2f}{k['state_ms']:>10.2f}"
                     f"{k['state_bytes']:>9.0f}{k['epoch_start_8_ranks_ms']:>25.2f}")
    lines.append(f"  {'shards/epoch':>12}{'loader us/shard':>17}{'plain us/shard':>16}"
                 f"{'own us/shard':>14}{'x plain':>9}{'CPU us/shard loader':>21}{'plain':>7}")
    for n, s in result["shards"].items():
        lines.append(f"  {int(n):>12,}{s['loader_us_per_shard']:>17.1f}"
                     f"{s['plain_us_per_shard']:>16.1f}{s['own_us_per_shard']:>14.1f}"
                     f"{s['x_plain']:>9.1f}{s['loader_cpu_us_per_shard']:>21.1f}"
                     f"{s['plain_cpu_us_per_shard']:>7.1f}")
    lines.append(f"  {'ranks':>9}{'merge ms':>10}{'merged B':>10}{'rank state B':>14}"
                 f"{'resume ms':>11}")
    for n, r in result["ranks"].items():
        lines.append(f"  {int(n):>9,}{r['merge_ms']:>10.2f}{r['merged_bytes']:>10.0f}"
                     f"{r['rank_state_bytes']:>14.0f}{r['resume_ms']:>11.2f}")
    lines.append(f"  {'epochs':>9}{'state ms':>10}{'state B':>9}{'epoch ms':>10}")
    for n, e in result["epochs"].items():
        lines.append(f"  {int(n):>9,}{e['state_ms']:>10.3f}{e['state_bytes']:>9.0f}"
                     f"{e['epoch_ms']:>10.2f}")
    return lines
