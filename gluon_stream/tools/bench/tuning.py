"""``tuning``: ``memory_budget`` alone against hand-picked settings, and what a tight budget costs.

Per workload (the pipeline scenarios' ``balanced``, ``generation-bound``, ``training-bound``,
the ``stragglers`` dates, and ``per-sample``: CIFAR-sized images made on demand with a numpy
augmentation per sample and a no-op step), one loader runs two consecutive epochs (the tuner
measures the first shards, then adjusts; the generator makes new shards every epoch) with:

* ``budget``: only ``memory_budget=1GiB`` (generous): the tuner picks ``prefetch``,
  ``producers`` and, on the per-sample path, the worker processes;
* a small grid of hand-picked settings: ``prefetch`` 1, 2, 4 and ``producers`` 1, 2 on the
  pipelines; ``num_workers`` 0 and 2 (and 2 with ``prefetch=4, producers=2``) per sample;
* ``tight``: ``memory_budget`` with room for 3 shards (and the batches in flight): the least
  the loader runs with, so the tuner cannot add anything.

Interleaved in rounds; the table shows medians. ``x best`` is the budget-only loader's epoch
time over the best grid setting's in the same round (the goal: within 3 %); ``tight x`` the
tight budget's over the generous one's; ``+RSS`` the peak resident memory over the run's
baseline (sampled every few ms). The allocator keeps memory a run freed for the next, and these
shards are small (1.3 MB), so those RSS figures are rough; whether a tight budget holds is
measured apart, per round, on 16 MiB shards in a new process whose freed memory goes back to
the OS (:mod:`.budget_probe`), on the slice path and on the per-sample path.
"""
from __future__ import annotations

import functools
import tempfile
import time
from dataclasses import asdict, replace
from typing import Any, Callable, Iterator

from ... import CommandSource, FunctionSource, StreamLoader
from ..generator import make_windows
from .budget_probe import measure as probe_budget
from .measure import Probe, drive, make_step, median
from .persample import augment, make_shards
from .pipeline import GENERATOR_TIMEOUT_S
from .workload import Workload

__all__ = ["GENEROUS", "PERSAMPLE_GRID", "PIPELINE_GRID", "run_tuning_scenario",
           "tuning_lines"]

GENEROUS = 2 ** 30
EPOCHS = 2
PIPELINE_GRID = {"f1-p1": dict(prefetch=1, producers=1), "f2-p1": dict(prefetch=2, producers=1),
                 "f2-p2": dict(prefetch=2, producers=2), "f4-p2": dict(prefetch=4, producers=2)}
PERSAMPLE_GRID = {"nw0": dict(num_workers=0), "nw2": dict(num_workers=2),
                  "nw2-f4-p2": dict(num_workers=2, prefetch=4, producers=2)}
PERSAMPLE_BATCH = 64
PROBE_SHARD_BYTES = 16 * 2 ** 20


def _loader(make: Callable[[dict], StreamLoader], options: dict, chosen: dict,
            epochs: int) -> Iterator[Any]:
    """``epochs`` epochs of one loader; what the tuner chose lands in ``chosen``."""
    with make(options) as loader:
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            yield from loader
        if "memory_budget" in options:
            settings = loader.stats.settings
            workers = settings.num_workers if settings is not None and settings.per_sample \
                else None
            for change in loader.stats.tuning:
                workers = change.new if change.setting == "num_workers" else workers
            chosen.update(prefetch=loader.stream.prefetch, producers=loader.stream.producers,
                          num_workers=workers, changes=[
                              f"{c.setting} {c.old}->{c.new}" for c in loader.stats.tuning],
                          limited=any(c.limited for c in loader.stats.tuning))


def _stages_maker(workload: Workload, directory: str) -> Callable[[dict], StreamLoader]:
    def make(options: dict) -> StreamLoader:
        source = CommandSource(workload.keys(), workload.command(), cache_dir=directory,
                               timeout=GENERATOR_TIMEOUT_S, retries=0)
        return StreamLoader(source, batch_size=workload.batch_size,
                            transform=functools.partial(make_windows,
                                                        time_steps=workload.time_steps),
                            shuffle=True, seed=workload.seed, **options)
    return make


def _persample_maker(shards: list, delay: float, seed: int) -> Callable[[dict], StreamLoader]:
    def generate(key: int) -> tuple:
        time.sleep(delay)  # stands in for generating the shard
        return shards[key]

    def make(options: dict) -> StreamLoader:
        return StreamLoader(FunctionSource(range(len(shards)), generate),
                            batch_size=PERSAMPLE_BATCH, shuffle=True, seed=seed,
                            sample_transform=augment, **options)
    return make


def _no_step(batch: Any) -> None:
    for array in batch if isinstance(batch, (list, tuple)) else [batch]:
        array.wait_to_read()


def _run_workload(name: str, make_of: Callable[[str], Callable[[dict], StreamLoader]],
                  grid: dict, tight: int, step: Callable[[Any], None], rounds: int,
                  epochs: int) -> dict:
    contenders = {**grid, "budget": dict(memory_budget=GENEROUS),
                  "tight": dict(memory_budget=tight)}
    runs: dict[str, list[dict]] = {c: [] for c in contenders}
    for _ in range(rounds):
        for contender, options in contenders.items():
            chosen: dict = {}
            with tempfile.TemporaryDirectory(prefix="gluon_stream_bench_") as tmp:
                record = drive(_loader(make_of(tmp), options, chosen, epochs), step, Probe())
            runs[contender].append(dict(asdict(record), chosen=chosen))
    best = [min(runs[c][r]["wall_s"] for c in grid) for r in range(rounds)]
    out: dict[str, Any] = {"tight_budget_mb": tight / 2 ** 20, "contenders": {}}
    for contender, records in runs.items():
        out["contenders"][contender] = {
            "options": dict(contenders[contender]),
            "wall_s": median([r["wall_s"] for r in records]),
            "stall_pct": median([r["stall_pct"] for r in records]),
            "peak_rss_mb": median([r["peak_rss_mb"] for r in records]),
            "max_peak_rss_mb": max(r["peak_rss_mb"] for r in records),
            "x_best": median([r["wall_s"] / b for r, b in zip(records, best)]),
            "chosen": records[-1]["chosen"], "rounds": records}
    budget, tight_c = out["contenders"]["budget"], out["contenders"]["tight"]
    out["best_grid"] = min(grid, key=lambda c: out["contenders"][c]["wall_s"])
    out["tight_x_generous"] = median([t["wall_s"] / g["wall_s"] for t, g in
                                      zip(tight_c["rounds"], budget["rounds"])])
    out["tight_within_budget"] = all(r["peak_rss_mb"] <= out["tight_budget_mb"]
                                     for r in tight_c["rounds"])
    return out


def run_tuning_scenario(workloads: dict[str, Workload], rounds: int, persample_images: int,
                        persample_shards: int = 6, seed: int = 0, epochs: int = EPOCHS,
                        probe_shard_bytes: int = PROBE_SHARD_BYTES) -> dict:
    """Run the scenario over the pipeline ``workloads`` (name -> workload, delays set) and
    the per-sample workload (see the module doc); raw figures per workload."""
    out: dict[str, Any] = {"epochs": epochs, "generous_mb": GENEROUS / 2 ** 20,
                           "workloads": {}}
    for name, workload in workloads.items():
        workload = replace(workload, per_epoch=True)  # every epoch's shards made anew
        sample = (workload.time_steps * workload.inputs + 1) * 4
        tight = 3 * workload.shard_bytes + 2 * workload.batch_size * sample + 4096
        out["workloads"][name] = _run_workload(
            name, functools.partial(_stages_maker, workload), PIPELINE_GRID, tight,
            make_step(workload), rounds, epochs)
        out["workloads"][name]["workload"] = asdict(workload)
    shards = make_shards(persample_shards, persample_images, seed)
    per_image = shards[0][0][0].nbytes + shards[0][1][:1].nbytes
    started = time.perf_counter()
    for image, label in zip(shards[0][0][:64], shards[0][1][:64]):
        augment(image, label)
    delay = (time.perf_counter() - started) / 64 * persample_images / 2  # half the augmenting
    # room for 3 shards and one worker's batches (2 in flight and its slot), the loop's two
    tight = 3 * persample_images * per_image + 5 * PERSAMPLE_BATCH * per_image + 4096
    res = _run_workload("per-sample", lambda _: _persample_maker(shards, delay, seed),
                        PERSAMPLE_GRID, tight, _no_step, rounds, epochs)
    res["workload"] = {"shards": persample_shards, "images": persample_images,
                       "generate_s": delay, "batch_size": PERSAMPLE_BATCH}
    out["workloads"]["per-sample"] = res
    out["probe"] = _probe(rounds, probe_shard_bytes)
    return out


def _probe(rounds: int, shard_bytes: int) -> dict:
    """Peak resident memory over the baseline against a tight budget (room for 3 shards and
    the batches in flight: a batch is an eighth of a shard), in a new process per round where
    freed memory goes back to the OS (see :mod:`.budget_probe`)."""
    out: dict[str, Any] = {"shard_mb": shard_bytes / 2 ** 20}
    for path, batches in (("slices", 2), ("processes", 5)):  # the loop's 2, a worker's 3
        budget = 3 * shard_bytes + batches * shard_bytes // 8 + 4096
        overs = [probe_budget(budget, shard_bytes, path)["over"] for _ in range(rounds)]
        out[path] = {"budget_mb": budget / 2 ** 20, "peak_over_baseline_mb": [
            o / 2 ** 20 for o in overs], "within": all(o <= budget for o in overs)}
    return out


def tuning_lines(result: dict | None) -> list[str]:
    """The scenario's tables in the bench report."""
    if not result:
        return []
    lines = [f"\ntuning ({result['epochs']} epochs per loader; medians over rounds; x best: "
             "against the best grid setting of the same round):",
             f"  {'workload':<18}{'setting':<12}{'epoch s':>8}{'x best':>8}{'stall %':>8}"
             f"{'+RSS MB':>8}  chosen"]
    for name, res in result["workloads"].items():
        for contender, c in res["contenders"].items():
            chosen = c["chosen"]
            picked = "" if not chosen else (
                f"prefetch {chosen['prefetch']}, producers {chosen['producers']}"
                + (f", workers {chosen['num_workers']}" if chosen.get("num_workers") else "")
                + (" (budget-limited)" if chosen.get("limited") else ""))
            lines.append(f"  {name:<18}{contender:<12}{c['wall_s'] / result['epochs']:8.2f}"
                         f"{c['x_best']:8.3f}{c['stall_pct']:8.1f}{c['peak_rss_mb']:8.1f}"
                         f"  {picked}")
    lines.append(f"  {'workload':<18}{'budget-only x best':>19}{'tight budget MB':>16}"
                 f"{'peak +RSS MB (max)':>19}{'within':>8}{'tight x generous':>18}")
    for name, res in result["workloads"].items():
        tight = res["contenders"]["tight"]
        lines.append(f"  {name:<18}{res['contenders']['budget']['x_best']:19.3f}"
                     f"{res['tight_budget_mb']:16.1f}{tight['max_peak_rss_mb']:19.1f}"
                     f"{'yes' if res['tight_within_budget'] else 'NO':>8}"
                     f"{res['tight_x_generous']:18.3f}")
    probe = result.get("probe")
    if probe:
        for path in ("slices", "processes"):
            p = probe[path]
            peaks = ", ".join(f"{o:.1f}" for o in p["peak_over_baseline_mb"])
            lines.append(f"  tight budget, {probe['shard_mb']:.0f} MiB shards, new process "
                         f"({path}): peak over baseline {peaks} MiB per round against "
                         f"{p['budget_mb']:.1f} MiB: {'within' if p['within'] else 'OVER'}")
    return lines
