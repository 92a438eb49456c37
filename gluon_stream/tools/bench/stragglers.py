"""Stragglers: a few dates take much longer to produce than the others (issue 19, item 1).

15 dates, 15 batches of 64 per date, an 8 ms step (``--batch-size``, ``--step-ms``); every 5th
date's generator sleeps 7x the base delay, which makes it about 3x as long to generate as the
others (the base delay is half the generator's own start-up and writing cost). On average two
producers keep up with training: the table says by how much (``mean generation / 2`` against
one date's steps).

Contenders: ``naive`` (it measures each date's costs), ``prefetching-iter`` (the hand-built
pipeline: generator threads, a bounded queue, ``mx.io.PrefetchingIter``), ``gluon_stream``
(the library's defaults), ``gluon_stream-recommended`` (``producers=2, prefetch=2``) and
``dataloader-per-shard``. Every contender takes the dates in the order the StreamLoader reads
them (``shuffle=True`` shuffles the shard order: :meth:`Workload.shard_order`), so a straggler
falls at the same place for all. ``ideal``: two producers take the dates in that order, each
as soon as it is free, and each shard is trained on as soon as it exists and the one before
it is done (:func:`ideal_in_order`, from the costs ``naive`` measured in the same round).
"""
from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Sequence

from .measure import Probe
from .pipeline import generation_cost, run_stages_scenario
from .workload import Workload

__all__ = ["STRAGGLER_CONTENDERS", "ideal_in_order", "run_stragglers_scenario",
           "stragglers_workload"]

STRAGGLER_CONTENDERS = ("naive", "prefetching-iter", "gluon_stream", "gluon_stream-recommended",
                        "dataloader-per-shard")
DATES = 15
BATCHES_PER_DATE = 15
EVERY = 5  # every 5th date is a straggler
SLEEP_FACTOR = 7.0  # its generator sleeps this many times the base delay
PRODUCERS = 2


def stragglers_workload(base: Workload, delay: float, dates: int = DATES,
                        batches: int = BATCHES_PER_DATE) -> Workload:
    """``dates`` shards of ``batches`` full batches each; every ``EVERY``-th key sleeps
    ``SLEEP_FACTOR`` x ``delay``; two producers, prefetch 2."""
    keys = [f"s{i:04d}" for i in range(dates)]
    slow = tuple((key, SLEEP_FACTOR) for i, key in enumerate(keys) if (i + 1) % EVERY == 0)
    return replace(base, shards=dates, rows=batches * base.batch_size + base.time_steps,
                   delay=delay, delay_factors=slow, producers=PRODUCERS, prefetch=2,
                   per_epoch=False)


def ideal_in_order(costs: Sequence[float], steps: Sequence[int], step_s: float,
                   producers: int = PRODUCERS) -> float:
    """Epoch seconds when ``producers`` take the shards in order, each as soon as it is free
    (shard ``i`` costs ``costs[i]``), and shard ``i``'s ``steps[i]`` steps start as soon as it
    exists and shard ``i - 1``'s steps are done.

    Example:
        >>> ideal_in_order([1.0, 1.0, 3.0, 1.0], [1, 1, 1, 1], 0.5)
        5.0
    """
    free = [0.0] * producers
    end = 0.0
    for cost, count in zip(costs, steps):
        lane = min(range(producers), key=free.__getitem__)
        free[lane] += cost
        end = max(end, free[lane]) + count * step_s
    return end


def _ideal(workload: Workload, naive: Probe, step_s: float) -> tuple[float, float]:
    costs = [c["generate_s"] + c["load_s"] + c["transform_s"] for c in naive.components]
    per_shard = workload.samples_per_shard // workload.batch_size
    best = ideal_in_order(costs, [per_shard] * len(costs), step_s)
    return best, best


def run_stragglers_scenario(base: Workload, rounds: int, contenders: Sequence[str] | None = None,
                            delay: float | None = None, dates: int = DATES,
                            batches: int = BATCHES_PER_DATE) -> dict:
    """Run the stragglers scenario (see the module doc); raw figures as a pipeline scenario's,
    plus the generation costs of normal and straggling dates."""
    probe_workload = stragglers_workload(base, 0.0, dates, batches)
    if delay is None:  # a straggler's 7x sleep then costs about 3x a normal date
        delay = generation_cost(probe_workload) / 2
    workload = stragglers_workload(base, delay, dates, batches)
    chosen = [c for c in STRAGGLER_CONTENDERS if contenders is None or c in contenders]
    out = run_stages_scenario("stragglers", workload, rounds, chosen, ideal=_ideal)
    slow = {key for key, _ in workload.delay_factors}
    costs = [(k, c) for k, c in out["generate_s_by_key"].items() if c is not None]
    normal = [c for k, c in costs if k not in slow]
    late = [c for k, c in costs if k in slow]
    train = batches * out["contenders"]["naive"]["step_s"]
    mean = statistics.mean(c for _, c in costs) if costs else None
    out["stragglers"] = {
        "dates": dates, "batches_per_date": batches, "every": EVERY,
        "sleep_factor": SLEEP_FACTOR, "producers": PRODUCERS,
        "generate_s": statistics.median(normal) if normal else None,
        "straggler_generate_s": statistics.median(late) if late else None,
        "train_per_date_s": train,
        "keeps_up": (mean / PRODUCERS / train) if mean is not None and train else None}
    return out
