"""Helpers shared by the test modules (imported as ``from _helpers import ...``).

Nothing here imports MXNet, so the pure-Python parts can be tested where it is absent.
"""
from __future__ import annotations

import gc
import os
import threading
import time
from typing import Any

import numpy as np
import psutil

SETTLE_S = 5.0  # grace for the OS to reap what a test closed; a leak lasts longer
JOIN_S = 30  # upper bound on joining a helper thread or process; never reached when all is well


def snapshot() -> dict:
    """Threads, child processes, open fds and /dev/shm entries of this process now."""
    proc = psutil.Process()
    return {
        "threads": {t.ident for t in threading.enumerate() if t.is_alive()},
        "children": {c.pid for c in proc.children(recursive=True)},
        "fds": proc.num_fds(),
        "shm": set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set(),
    }


def leaks(before: dict) -> dict:
    """What exists now that did not before: threads, child processes, fds, /dev/shm entries."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        gc.collect()
        now = snapshot()
        found = {
            "threads": [t.name for t in threading.enumerate()
                        if t.is_alive() and t.ident not in before["threads"]],
            "children": sorted(now["children"] - before["children"]),
            "fds": max(0, now["fds"] - before["fds"]),
            "shm": sorted(now["shm"] - before["shm"]),
        }
        if not any(found.values()) or time.monotonic() > deadline:
            return {k: v for k, v in found.items() if v}
        time.sleep(0.05)


def wait_for(predicate, timeout=20.0, what="condition"):
    """Poll an event-like predicate (a file appearing, a process dying) with an upper bound."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def dead(pid: int) -> bool:
    """True once a process has exited (gone, or a zombie not yet reaped)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def id_shards(sizes, start=0):
    """A FunctionSource fn whose shard k holds ids 1000*k .. 1000*k+sizes[k]-1 (and a float copy)."""
    def fn(key):
        n = sizes[key]
        ids = np.arange(n, dtype=np.int64) + 1000 * key + start
        return ids, ids.astype(np.float32) * 0.5
    return fn


def all_ids(sizes, start=0):
    """Every id ``id_shards(sizes)`` makes, sorted."""
    return sorted(1000 * k + i + start for k, n in enumerate(sizes) for i in range(n))


def batch_ids(batch) -> list:
    first = batch[0] if isinstance(batch, (list, tuple)) else batch
    return [int(x) for x in first.asnumpy()]


def epoch_batch_ids(loader, epochs, start_epoch=0, stop_after=None) -> list:
    """Batch ids of epochs ``start_epoch .. epochs - 1``, stopping after ``stop_after`` batches
    (the loader then sits mid-epoch, ready for ``state_dict()``)."""
    batches = []
    for epoch in range(start_epoch, epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            batches.append(batch_ids(batch))
            if stop_after is not None and len(batches) == stop_after:
                return batches
    return batches


class FakeClock:
    """A clock only the test moves (reads from any thread are safe)."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def known_stats() -> Any:
    """Two producers and the training loop with hand-written spans (origin 100.0)."""
    from gluon_stream.stats import EpochRecord, ShardRecord, Stats

    stats = Stats(clock=FakeClock())
    for lane, name, a, b in [("gluon_stream-producer_0", "generate", 100.0, 102.0),
                             ("gluon_stream-producer_0", "load", 102.0, 102.5),
                             ("gluon_stream-producer_0", "transform", 102.5, 103.0),
                             ("gluon_stream-producer_1", "generate", 100.0, 103.5),
                             ("gluon_stream-producer_1", "load", 103.5, 103.5),
                             ("gluon_stream-producer_1", "transform", 103.5, 104.0),
                             ("train", "wait", 100.0, 103.0),
                             ("train", "busy", 103.0, 105.0),
                             ("train", "wait", 105.0, 105.5),
                             ("train", "busy", 105.5, 107.5)]:
        stats.add_span(lane, name, a, b)
    stats.add_shard(ShardRecord("a", 0, 10, False, 2.0, 0.5, 0.5, "gluon_stream-producer_0"))
    stats.add_shard(ShardRecord("b", 0, 6, True, 3.5, 0.0, 0.5, "gluon_stream-producer_1"))
    stats.epochs.append(EpochRecord(0, batches=2, samples=16, wall_s=7.5, stall_s=3.5,
                                    first_batch_s=3.0, rotation_s=[0.002], peak_prefetch=2,
                                    complete=True))
    return stats
