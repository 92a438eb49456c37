"""Measuring a training loop: waits, steps, rotations and resident memory."""
from __future__ import annotations

import gc
import os
import resource
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from ..._mx import import_mxnet
from ..models import small_regressor
from .workload import Workload

__all__ = ["Probe", "RssSampler", "RunRecord", "batch_arrays", "drive", "make_step", "median",
           "measure_step", "rss_bytes", "slope"]

RSS_INTERVAL_S = 0.01
_END = object()


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc; elsewhere the peak so far)."""
    try:
        fd = os.open("/proc/self/statm", os.O_RDONLY)
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    try:
        fields = os.read(fd, 256).split()
    finally:
        os.close(fd)
    return int(fields[1]) * os.sysconf("SC_PAGE_SIZE")


class RssSampler:
    """Samples RSS in a thread until closed; ``peak`` is the largest value seen."""

    def __init__(self, interval: float = RSS_INTERVAL_S) -> None:
        self.peak = rss_bytes()
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gluon_stream-bench-rss",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.peak = max(self.peak, rss_bytes())

    def close(self) -> int:
        """Stop sampling; returns the peak RSS in bytes."""
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())
        return self.peak


class Probe:
    """What a contender reports besides its batches: rotations and component costs."""

    def __init__(self) -> None:
        self.rotation_s: list[float] = []
        self.components: list[dict] = []
        self.boundary_excluded: float | None = None  # set before the first batch of a new shard

    def boundary(self, excluded_s: float) -> None:
        """The next batch starts a new shard; ``excluded_s`` of its wait was generation."""
        self.boundary_excluded = excluded_s


@dataclass
class RunRecord:
    """One contender's run: what the training loop saw."""

    wall_s: float
    first_batch_s: float
    stall_s: float
    stall_pct: float
    rotation_ms: float | None
    peak_rss_mb: float
    batches: int
    samples: int
    step_s: float


def batch_arrays(batch: Any) -> list:
    return list(batch) if isinstance(batch, (list, tuple)) else [batch]


def drive(batches: Iterator[Any], step: Callable[[Any], None], probe: Probe,
           clock: Callable[[], float] = time.perf_counter) -> RunRecord:
    """Run the training loop over ``batches``, timing waits, steps and RSS; closes ``batches``."""
    gc.collect()
    sampler = RssSampler()
    rss0 = rss_bytes()
    start = clock()
    first = None
    stall = 0.0
    count = samples = 0
    steps: list[float] = []
    try:
        while True:
            w0 = clock()
            batch = next(batches, _END)
            w1 = clock()
            if batch is _END:
                break
            stall += w1 - w0
            if first is None:
                first = w1 - start
            if probe.boundary_excluded is not None:
                probe.rotation_s.append(max(0.0, w1 - w0 - probe.boundary_excluded))
                probe.boundary_excluded = None
            step(batch)
            steps.append(clock() - w1)
            count += 1
            samples += int(batch_arrays(batch)[0].shape[0])
            del batch
    finally:
        close = getattr(batches, "close", None)  # a generator's: its loader ends now
        if close is not None:
            close()
        peak = sampler.close()
    wall = clock() - start
    first = wall if first is None else first
    after_first = wall - first
    stall_after = max(0.0, stall - first)
    rot = probe.rotation_s
    return RunRecord(
        wall_s=wall, first_batch_s=first, stall_s=stall,
        stall_pct=100.0 * stall_after / after_first if after_first > 0 else 0.0,
        rotation_ms=1000.0 * statistics.median(rot) if rot else None,
        peak_rss_mb=(peak - rss0) / 2 ** 20, batches=count, samples=samples,
        step_s=statistics.median(steps) if steps else 0.0)


def make_step(workload: Workload) -> Callable[[Any], None]:
    """The simulated training step: wait for the batch, then sleep or run a small Gluon net."""
    mx = import_mxnet()
    if workload.step == "sleep":
        seconds = workload.step_ms / 1000.0

        def sleep_step(batch: Any) -> None:
            for array in batch_arrays(batch):
                array.wait_to_read()
            if seconds > 0:
                time.sleep(seconds)
        return sleep_step

    train_step = small_regressor("sgd")
    ctx = mx.cpu()

    def cpu_step(batch: Any) -> None:
        # as a GPU step copies the batch to the device (worker batches live in cpu_shared)
        data, label = (a.as_in_context(ctx) for a in batch_arrays(batch)[:2])
        train_step(data, label).wait_to_read()
    return cpu_step


def median(values: Sequence[float | None]) -> float | None:
    """The median of the values that are not None (None if there are none)."""
    known = [v for v in values if v is not None]
    return float(statistics.median(known)) if known else None


def slope(values: Sequence[float]) -> float:
    """Least-squares slope per index (0 for fewer than two values)."""
    if len(values) < 2:
        return 0.0
    return float(np.polyfit(np.arange(len(values)), np.asarray(values, dtype=float), 1)[0])

def measure_step(workload: Workload, step: Callable[[Any], None]) -> float:
    nd = import_mxnet().nd
    batch = [nd.zeros((workload.batch_size, workload.time_steps, workload.inputs)),
             nd.zeros((workload.batch_size,))]
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        step(batch)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
