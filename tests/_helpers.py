"""Helpers shared by the test modules (imported as ``from _helpers import ...``).

Nothing here imports MXNet, so the pure-Python parts can be tested where it is absent.
"""
from __future__ import annotations

import gc
import os
import re
import threading
import time
from typing import Any

import numpy as np
import psutil

SETTLE_S = 5.0  # grace for the OS to reap what a test closed; a leak lasts longer
JOIN_S = 30  # upper bound on joining a helper thread or process; never reached when all is well


SHM = "/dev/shm"
_MXNET_SHM = re.compile(r"mx_([0-9a-f]+)_")  # MXNet's /dev/shm/mx_<pid in hex>_<id>


def shm_entries() -> set:
    """The names in /dev/shm now: every process's (see :func:`made_here`)."""
    return set(os.listdir(SHM)) if os.path.isdir(SHM) else set()


def made_here(names) -> list:
    """Of ``names`` (entries of /dev/shm), those of this process and its children: all but
    those another process maps and none of these (the other pytest-xdist worker's, a dask
    cluster's named semaphores, anything else on the machine), and MXNet's ``mx_<pid>_*`` of
    another live process; gone ones are left out. What no process holds counts as ours: a
    leak is found, not hidden. Mappings are matched by inode: glibc maps a semaphore under a
    temporary name before it links it to its own."""
    by_inode = {}
    for name in names:
        try:
            by_inode[os.stat(os.path.join(SHM, name)).st_ino] = name
        except FileNotFoundError:  # gone meanwhile: nothing left behind
            continue
    if not by_inode:
        return []
    me = psutil.Process()
    ours = {me.pid} | {c.pid for c in me.children(recursive=True)}
    holders: dict = {name: set() for name in by_inode.values()}
    for pid in psutil.pids():
        try:
            with open(f"/proc/{pid}/maps") as maps:
                mapped = maps.read()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if f"{SHM}/" not in mapped:
            continue
        for line in mapped.splitlines():  # address perms offset dev inode path
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith(f"{SHM}/") \
                    and int(fields[4]) in by_inode:
                holders[by_inode[int(fields[4])]].add(pid)
    here = []
    for name, held in sorted(holders.items()):
        maker = _MXNET_SHM.match(name)
        if held and not held & ours:
            continue
        if not held and maker and int(maker.group(1), 16) not in ours \
                and psutil.pid_exists(int(maker.group(1), 16)):
            continue
        here.append(name)
    return here


def snapshot() -> dict:
    """Threads, child processes and open fds of this process now, and /dev/shm's entries."""
    proc = psutil.Process()
    return {
        "threads": {t.ident for t in threading.enumerate() if t.is_alive()},
        "children": {c.pid for c in proc.children(recursive=True)},
        "fds": proc.num_fds(),
        "shm": shm_entries(),
    }


def leaks(before: dict) -> dict:
    """What exists now that did not before: threads, child processes, fds, /dev/shm entries
    (those of this process and its children: :func:`made_here`)."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        gc.collect()
        now = snapshot()
        found = {
            "threads": [t.name for t in threading.enumerate()
                        if t.is_alive() and t.ident not in before["threads"]],
            "children": sorted(now["children"] - before["children"]),
            "fds": max(0, now["fds"] - before["fds"]),
            "shm": made_here(now["shm"] - before["shm"]),
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
    """A FunctionSource fn: shard k holds ids 1000*k .. 1000*k+sizes[k]-1 (and a float copy)."""
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
