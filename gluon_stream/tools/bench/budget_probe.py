"""Does ``memory_budget`` hold? A loader on shards of known size, in a new process, its
resident memory sampled every millisecond: the peak over the baseline (taken just before the
loader is built, MXNet warmed) against the budget. The new process runs with
``MALLOC_MMAP_THRESHOLD_`` low, so that freed shards go back to the OS and the resident memory
tracks what the loader holds, not what the allocator keeps for later.

``python -m gluon_stream.tools.bench.budget_probe BUDGET_BYTES SHARD_BYTES PATH GENERATE_S``
prints one JSON line (PATH: ``slices``, or ``processes``: the per-sample path with the tuner
choosing among worker processes); :func:`measure` runs it and returns that line as a dict.
The bench's ``tuning`` scenario and ``tests/test_tuning.py`` use it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np

from ... import FunctionSource, StreamLoader

__all__ = ["measure"]

PAGE = os.sysconf("SC_PAGE_SIZE")
COLUMNS = 256


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def run(budget: int, shard_bytes: int, path: str, generate_s: float, keys: int,
        epochs: int) -> tuple[int, list]:
    rows = shard_bytes // 4 // COLUMNS

    def fn(key):
        time.sleep(generate_s)
        return np.full((rows, COLUMNS), key, dtype=np.float32)

    kw: dict = {}
    if path == "processes":
        kw = dict(batchify_fn=np.stack, sample_transform=lambda x: x)
    base = rss()
    peak = [base]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    loader = StreamLoader(FunctionSource(range(keys), fn), batch_size=max(1, rows // 8),
                             memory_budget=budget, shuffle=True, seed=0, **kw)
    try:
        for _ in range(epochs):
            for _batch in loader:
                time.sleep(0.001)
    finally:
        stop.set()
        sampler.join()
        changes = [(c.setting, c.old, c.new) for c in loader.stats.tuning]
        loader.close()
    return peak[0] - base, changes


def measure(budget: int, shard_bytes: int, path: str = "slices", generate_s: float = 0.05,
            timeout: float = 300) -> dict:
    """Run the probe in a new process: ``{"over": peak bytes over the baseline, "changes":
    [[setting, old, new], ...]}``."""
    return in_new_process(__name__, [str(budget), str(shard_bytes), path, str(generate_s)],
                          "the budget probe", timeout)


def in_new_process(module: str, argv: list[str], what: str, timeout: float) -> dict:
    """Run ``python -m module *argv`` in a new process with ``MALLOC_MMAP_THRESHOLD_`` low
    (freed shards go back to the OS) and return the JSON line it prints last."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    done = subprocess.run([sys.executable, "-m", module, *argv], env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    budget, shard_bytes, path, generate_s = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3],
                                             float(sys.argv[4]))
    run(budget, shard_bytes, path, 0.0, keys=3, epochs=1)  # warm: MXNet's first allocations
    over, changes = run(budget, shard_bytes, path, generate_s, keys=14, epochs=2)
    print(json.dumps({"over": over, "changes": changes}))


if __name__ == "__main__":
    main()
