"""``shuffle_window`` over several epochs (issue 19, item 4).

One loader runs 4 consecutive epochs (``set_epoch``) of each pipeline scenario's workload
(balanced, generation-bound, training-bound: the same delays), the generator making new data
every epoch (``{epoch}`` in its command, so no epoch is read back from the cache), with
``producers=2, prefetch=2`` and ``shuffle_window=4`` against ``shuffle_window=1``, interleaved
per round. A window's ramp at an epoch's start is hidden in later epochs by the next epoch's
first shards, made while the current one ends; what is left is the ratio of the two walls.
"""
from __future__ import annotations

import functools
import logging
import tempfile
from dataclasses import asdict, replace
from typing import Any, Mapping, Sequence

from .measure import Probe, drive, make_step, median
from .pipeline import stream_loader
from .workload import Workload

__all__ = ["WINDOW_EPOCHS", "WINDOW_EPOCHS_CONTENDERS", "run_window_epochs_scenario"]

logger = logging.getLogger(__name__)

WINDOW_EPOCHS = 4
WINDOW = 4
# contender -> shuffle_window (the pipeline scenarios' names for these configurations)
WINDOW_EPOCHS_CONTENDERS = {"gluon_stream-recommended": 1, "gluon_stream-window4": WINDOW}


def run_window_epochs_scenario(workloads: Mapping[str, Workload], rounds: int,
                               epochs: int = WINDOW_EPOCHS,
                               contenders: Sequence[str] | None = None) -> dict:
    """Per pipeline workload: the wall of ``epochs`` epochs with each window, and their ratio
    (medians over ``rounds`` interleaved rounds); raw figures."""
    chosen = {c: k for c, k in WINDOW_EPOCHS_CONTENDERS.items()
              if contenders is None or c in contenders or k == 1}
    out: dict[str, Any] = {"epochs": epochs, "window": WINDOW, "scenarios": {}}
    for name, base in workloads.items():
        workload = replace(base, per_epoch=True)
        step = make_step(workload)
        walls: dict[str, list[float]] = {c: [] for c in chosen}
        batches: dict[str, list[int]] = {c: [] for c in chosen}
        for round_ in range(rounds):
            for contender, window in chosen.items():
                options = {"producers": workload.producers, "prefetch": workload.prefetch,
                           "shuffle_window": window}
                probe = Probe()
                with tempfile.TemporaryDirectory(prefix="gluon_stream_bench_") as tmp:
                    batches_of = functools.partial(stream_loader, options, workload, tmp, probe,
                                                   epochs=epochs)
                    record = drive(batches_of(), step, probe)
                walls[contender].append(record.wall_s)
                batches[contender].append(record.batches)
                logger.info("window-epochs %s round %d %s: %.2f s", name, round_, contender,
                            record.wall_s)
        one = walls["gluon_stream-recommended"]
        out["scenarios"][name] = {
            "workload": asdict(workload),
            "contenders": {c: {"shuffle_window": chosen[c], "wall_s": median(w),
                               "per_epoch_s": median([x / epochs for x in w]),
                               "batches": median(batches[c]), "rounds": w}
                           for c, w in walls.items()},
            "window_vs_1": (median([a / b for a, b in zip(walls["gluon_stream-window4"], one)])
                            if "gluon_stream-window4" in walls else None)}
    return out
