"""Shared fixtures: tiny shard makers and an autouse leak check around every test."""
from __future__ import annotations

import gc
import os
import sys
import threading
import time

import numpy as np
import psutil
import pytest

import gluon_stream as gs

SETTLE_S = 5.0  # grace for the OS to reap what a test closed; a leak lasts longer


def _snapshot() -> dict:
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
        now = _snapshot()
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


@pytest.fixture(scope="session", autouse=True)
def _warm_mxnet():
    """Start MXNet's engine once so its own lazily opened files do not count as leaks."""
    import mxnet as mx

    (mx.nd.ones((2, 2)) + 1).asnumpy()
    loader = gs.StreamLoader(gs.FunctionSource([0], lambda k: np.zeros((4, 2))), batch_size=2,
                             batchify_fn=mx.gluon.data.dataloader.default_batchify_fn,
                             num_workers=1)
    list(loader)
    loader.close()
    yield


@pytest.fixture(autouse=True)
def leak_check(request):
    """Fail a test that leaves threads, child processes, fds or /dev/shm entries behind."""
    before = _snapshot()
    yield
    if request.node.get_closest_marker("no_leak_check"):
        return
    found = leaks(before)
    assert not found, f"resources leaked by {request.node.name}: {found}"


JOIN_S = 30  # upper bound on joining a helper thread or process; never reached when all is well


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


def batch_ids(batch) -> list:
    first = batch[0] if isinstance(batch, (list, tuple)) else batch
    return [int(x) for x in first.asnumpy()]


@pytest.fixture
def python() -> str:
    return sys.executable
