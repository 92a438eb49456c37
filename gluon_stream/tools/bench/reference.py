"""The machine's single-process reference rate, recorded with every bench run.

A shared machine's speed moves from day to day (other jobs, a slower host), and so do every
contender's figures; ratios taken side by side in one run do not. The reference rate is a
short fixed CPU workload, the per-sample augmentation of :mod:`.persample` on 500 fixed images
in this process, timed 5 times: its median images per wall second says how fast the machine
ran this time, and its images per CPU second how fast its cores are when they are ours. Two
runs on different days compare through it: divide a figure by its run's reference rate.
"""
from __future__ import annotations

import statistics
import time

import numpy as np

from .persample import augment, make_shards

__all__ = ["REFERENCE_IMAGES", "REFERENCE_REPEATS", "reference_rate"]

REFERENCE_IMAGES = 500
REFERENCE_REPEATS = 5


def reference_rate(images: int = REFERENCE_IMAGES, repeats: int = REFERENCE_REPEATS) -> dict:
    """Images augmented per wall second and per CPU second in one thread, medians of
    ``repeats`` passes over ``images`` fixed images (the seed is fixed: the same work always)."""
    data, labels = make_shards(1, images, seed=0)[0]
    state = np.random.get_state()
    np.random.seed(0)
    walls, cpus = [], []
    try:
        for _ in range(repeats):
            w0, c0 = time.perf_counter(), time.thread_time()
            for image, label in zip(data, labels):
                augment(image, label)
            walls.append(time.perf_counter() - w0)
            cpus.append(time.thread_time() - c0)
    finally:
        np.random.set_state(state)
    wall, cpu = statistics.median(walls), statistics.median(cpus)
    return {"workload": f"per-sample augmentation of {images} 32x32x3 images, one thread",
            "images_per_s": images / wall, "images_per_cpu_s": images / max(cpu, 1e-9),
            "cpu_share": cpu / wall, "repeats": repeats}
