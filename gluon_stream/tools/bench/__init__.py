"""Benchmarks: gluon_stream against MXNet's own ways to feed a Gluon loop (``gluon-stream bench``).

Every contender trains on the same workload, interleaved in one run (A B C ... A B C ...,
``--rounds`` times), and the table shows medians over rounds and ratios taken within each
round, so machine noise hits all contenders alike.

Pipeline scenarios (shards from the built-in generator, a real external process that sleeps
``delay`` seconds and writes a deterministic ``.npy``; ``make_windows`` as the transform;
a simulated training step per batch):

* ``balanced``: generation of a shard costs about as much as training on it;
* ``generation-bound``: generation costs 4x the training of a shard;
* ``training-bound``: generation costs a quarter of it.

Contenders: ``naive`` (generate, load, transform, ``DataLoader(num_workers=0)`` per shard in
turn), ``dataloader-per-shard`` (the usual advice: ``DataLoader(num_workers=N,
last_batch='rollover')`` rebuilt per shard), ``prefetching-iter`` (a hand-built pipeline:
generator threads fill a queue behind a custom ``mx.io.DataIter`` wrapped in
``mx.io.PrefetchingIter``), and ``StreamLoader``: ``gluon_stream`` (the library's defaults,
``producers='auto'``), ``-nw`` (``num_workers=N`` as users copy it; batches are still
slices), ``-batchify`` and ``-batchify-nw`` (a ``batchify_fn`` selects the per-sample path: in
the loop's thread, and in N worker processes), ``-recommended`` (P producers) and ``-window4``
(P producers, ``shuffle_window=4``: batches mix four shards). ``ideal`` is the lower bound from
component costs measured in the same round (by ``naive``) for P producers: ``max(first shard's
generate+load+transform + all steps, ceil(shards / P) generations + one load+transform + one
shard's steps)``. ``wave bound`` counts the steps of every shard of the last wave of parallel
generations (they finish together), the bound no schedule beats.

``throughput``: arrays already in memory, no-op step: ``DataLoader`` with 0 and 2 workers,
``NDArrayIter``, a vectorised floor (one numpy gather per batch plus ``mx.nd.array``) and
``StreamLoader``, for large (30x16) and small (8) float32 samples.

``memory``: ``StreamLoader`` over ``--memory-epochs`` epochs; peak RSS against the process
baseline plus ``(prefetch + 2)`` shards, and the RSS slope per epoch (see :mod:`.memory`).

``stragglers``: 15 dates of 15 batches, every 5th date about 3x as long to generate, against
an ideal of two producers taking the dates in order (see :mod:`.stragglers`).
``window-epochs``: ``shuffle_window=4`` against 1 over 4 consecutive epochs of each pipeline
scenario's workload (see :mod:`.window_epochs`).

``per-sample``: CIFAR-sized images with a numpy augmentation per sample, in memory against
Gluon's DataLoader (0 workers, 2 processes, 2 threads) and streamed against a DataLoader per
shard (see :mod:`.persample`). ``placement``: milliseconds per batch the loop spends getting a
batch onto its context, copying it itself or with ``ctx=`` (see :mod:`.placement`).
``throughput`` also runs ``shuffle_window=4`` beside 1 and measures how many shards a batch
mixes for windows of 1, 2, 4 and 8. ``features``: what ``even_batches='pad'``,
``samples_per_epoch`` and ``MixSource`` cost in speed, and a saved state and ``diagnose()`` in
milliseconds (see :mod:`.features`). ``tuning``: ``memory_budget`` alone (1 GiB) against a grid
of hand-picked ``prefetch``/``producers``/``num_workers`` per workload, and a tight budget's
peak memory and cost (see :mod:`.tuning`). ``provenance``: microseconds per batch with
``provenance=True`` (read every batch or not) against without (see :mod:`.provenance`).

``one-row``: ``--one-row-keys`` shards of one row each (default 3000) through
``StreamLoader(batch_size=32, last_batch='keep')`` beside a plain loop that calls the same
function and builds the same batches as NDArrays: shards/s and the loader's own work per shard
in µs (see :mod:`.onerow`). ``growth``: how the loader's costs grow with the keys (10^3-10^6:
construction, ``len()``, first batch, state, an epoch's start on 8 ranks), the shards per epoch,
the ranks merged by ``merge_states`` (8-1024) and the run's length in epochs (state size), each
size list an option (see :mod:`.growth`).
peak memory and cost (see :mod:`.tuning`). ``timeseries``: ``context_rows`` (windows across
the shards' boundaries) against the same shards windowed alone, from memory and from a
``cache_dir`` (see :mod:`.timeseries`).

Every run first records the machine's single-process reference rate (see :mod:`.reference`),
printed above the tables and stored as ``reference``, so runs on different days compare.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from ..._mx import import_mxnet
from .features import run_features_scenario
from .growth import GrowthSizes, run_growth_scenario
from .measure import make_step, measure_step
from .memory import run_memory_scenario
from .onerow import KEYS as ONE_ROW_KEYS
from .onerow import run_one_row_scenario
from .persample import PERSAMPLE_CONTENDERS, run_persample_scenario
from .pipeline import (
    PIPELINE_CONTENDERS,
    PIPELINE_SCENARIOS,
    calibrate_delay,
    generation_cost,
    run_stages_scenario,
)
from .placement import run_placement_scenario
from .provenance import run_provenance_scenario
from .reference import reference_rate
from .report import format_results, targets
from .stragglers import (
    STRAGGLER_CONTENDERS,
    ideal_in_order,
    run_stragglers_scenario,
    stragglers_workload,
)
from .throughput import THROUGHPUT_CONTENDERS, THROUGHPUT_SHAPES, mixing, run_throughput_scenario
from .timeseries import run_timeseries_scenario
from .tuning import run_tuning_scenario
from .window_epochs import WINDOW_EPOCHS, WINDOW_EPOCHS_CONTENDERS, run_window_epochs_scenario
from .workload import Workload, ideal_time, wave_bound

__all__ = ["BenchConfig", "GrowthSizes", "PERSAMPLE_CONTENDERS", "PIPELINE_CONTENDERS",
           "PIPELINE_SCENARIOS", "SCENARIOS", "STRAGGLER_CONTENDERS", "THROUGHPUT_CONTENDERS",
           "THROUGHPUT_SHAPES", "WINDOW_EPOCHS_CONTENDERS", "Workload", "format_results",
           "ideal_in_order", "ideal_time", "run_bench", "run_memory_scenario",
           "run_stages_scenario", "run_stragglers_scenario", "run_throughput_scenario",
           "run_window_epochs_scenario", "wave_bound"]

logger = logging.getLogger(__name__)

SCENARIOS = (*PIPELINE_SCENARIOS, "throughput", "per-sample", "placement", "memory", "stragglers",
             "window-epochs", "features", "tuning", "one-row", "growth",
             "provenance", "timeseries")


@dataclass(frozen=True)
class BenchConfig:
    """What one bench run measures (the CLI's options)."""

    workload: Workload = Workload()
    scenarios: Sequence[str] = SCENARIOS
    contenders: Sequence[str] | None = None
    rounds: int = 3
    delay: float | None = None
    throughput_samples: int = 20000
    throughput_batch_size: int = 256
    memory_rows: int = 78000  # 38.4 MB shards: large enough that shards, not overheads, dominate
    memory_epochs: int = 20
    persample_images: int = 1500
    stragglers_dates: int = 15
    stragglers_batches: int = 15  # full batches per date
    window_epochs: int = WINDOW_EPOCHS
    one_row_keys: int = ONE_ROW_KEYS
    growth: GrowthSizes = GrowthSizes()
    warmup: bool = True
    argv: dict = field(default_factory=dict)


def run_bench(config: BenchConfig) -> dict:
    """Run the chosen scenarios; returns every raw figure and the targets (see the module doc)."""
    import_mxnet()
    base = config.workload
    results: dict[str, Any] = {"argv": dict(config.argv), "reference": reference_rate()}
    logger.info("reference rate: %.0f images/s", results["reference"]["images_per_s"])
    step_s = measure_step(base, make_step(base))
    if config.warmup:
        logger.info("warm-up pass")
        run_stages_scenario("warm-up", replace(base, shards=2, delay=0.0), 1, config.contenders)
    delays: dict[str, float] = {}

    def delay_of(scenario: str) -> float:  # the generator's sleep in a pipeline scenario
        if scenario not in delays:
            delays[scenario] = config.delay if config.delay is not None else calibrate_delay(
                base, PIPELINE_SCENARIOS[scenario], step_s)
        return delays[scenario]

    for scenario in config.scenarios:
        t0 = time.perf_counter()
        if scenario in PIPELINE_SCENARIOS:
            results[scenario] = run_stages_scenario(scenario,
                                                      replace(base, delay=delay_of(scenario)),
                                                      config.rounds, config.contenders)
        elif scenario == "throughput":
            results[scenario] = run_throughput_scenario(
                {"30x16": config.throughput_samples, "8": 5 * config.throughput_samples},
                config.throughput_batch_size, config.rounds, base.seed, config.contenders)
            results["mixing"] = mixing(seed=base.seed)
        elif scenario == "per-sample":
            results[scenario] = run_persample_scenario(config.rounds,
                                                       images=config.persample_images,
                                                       seed=base.seed,
                                                       contenders=config.contenders)
        elif scenario == "placement":
            results[scenario] = run_placement_scenario(config.rounds,
                                                       samples=config.throughput_samples,
                                                       batch_size=config.throughput_batch_size,
                                                       step_ms=base.step_ms, seed=base.seed)
        elif scenario == "memory":
            # the FunctionSource variant's shards scale with --memory-rows (78000: 20000 rows)
            results[scenario] = run_memory_scenario(
                replace(base, rows=config.memory_rows), config.memory_epochs,
                function_rows=max(1, round(config.memory_rows * 20000 / 78000)))
        elif scenario == "stragglers":
            results[scenario] = run_stragglers_scenario(
                base, config.rounds, config.contenders, delay=config.delay,
                dates=config.stragglers_dates, batches=config.stragglers_batches)
        elif scenario == "window-epochs":
            workloads = {name: replace(base, delay=delay_of(name)) for name in PIPELINE_SCENARIOS}
            results[scenario] = run_window_epochs_scenario(workloads, config.rounds,
                                                           config.window_epochs,
                                                           config.contenders)
        elif scenario == "features":
            # 16 shards of a fifth of --throughput-samples rows each (default 4000)
            results[scenario] = run_features_scenario(
                config.rounds, seed=base.seed, rows=max(2 * 64, config.throughput_samples // 5))
        elif scenario == "tuning":
            workloads = {name: replace(base, delay=delay_of(name)) for name in PIPELINE_SCENARIOS}
            workloads["stragglers"] = stragglers_workload(
                base, generation_cost(stragglers_workload(base, 0.0)) / 2
                if config.delay is None else config.delay, batches=config.stragglers_batches,
                dates=min(config.stragglers_dates, 10))
            results[scenario] = run_tuning_scenario(workloads, config.rounds,
                                                    config.persample_images, seed=base.seed)
        elif scenario == "one-row":
            results[scenario] = run_one_row_scenario(config.rounds, keys=config.one_row_keys)
        elif scenario == "growth":
            results[scenario] = run_growth_scenario(config.rounds, config.growth)
        elif scenario == "provenance":
            # 16 shards of a fifth of --throughput-samples rows each (default 4000)
            results[scenario] = run_provenance_scenario(
                config.rounds, seed=base.seed, rows=max(64, config.throughput_samples // 5))
        elif scenario == "timeseries":
            results[scenario] = run_timeseries_scenario(config.rounds, seed=base.seed)
        else:
            raise ValueError(f"unknown bench scenario {scenario!r}; choose from "
                             f"{', '.join(SCENARIOS)}")
        logger.info("%s done in %.1f s", scenario, time.perf_counter() - t0)
    results["targets"] = targets(results)
    return results
