"""Does ``memory_budget`` hold in every shape? One loader per shape, each in a new process, its
memory sampled every 2 ms: the peak over the baseline (taken after a warm-up run, MXNet warmed)
against the budget.

Memory is what the loader makes: the anonymous resident memory of the process (``RssAnon``),
what its worker processes (children running this same program; a ``CommandSource``'s
generator programs are not the loader's) hold beyond what they had when first seen (the
pages shared with the parent since their fork count once, in the parent), and the shared
memory it holds (the ``memfd`` files open in the process). The new process runs with
``MALLOC_MMAP_THRESHOLD_`` low, so that freed shards go back to the OS and resident memory tracks
what the loader holds.

Shapes (see :data:`SHAPES`): shards that grow mid-stream (2 MiB, then 20 MiB) on the slice
path, and with worker processes; a transform that halves the shard (float64 made, float32
kept); a shuffle window; a ``CommandSource`` whose shards grow.

``python -m gluon_stream.tools.bench.budget_shapes SHAPE`` prints one JSON line;
:func:`measure_shape` runs it and returns that line as a dict (``ratio``: peak / budget).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np

from ... import CommandSource, FunctionSource, StreamLoader
from .budget_probe import in_new_process

__all__ = ["SHAPES", "measure_shape"]

MIB = 1 << 20
COLUMNS = 256  # float32 columns per row: 1 KiB rows
STEP_S = 0.004  # the loop's seconds per batch (8 batches a small shard)

#: shape -> its budget, keys, shard bytes (``small`` before key ``grow_at``, ``large`` from
#: it), the loop's seconds per batch (``step_s``), and what it exercises
SHAPES: dict[str, dict[str, Any]] = {
    "growing": dict(budget=64 * MIB, keys=12, small=2 * MIB, large=20 * MIB, grow_at=4,
                    step_s=0.001),
    "growing-processes": dict(budget=68 * MIB, keys=12, small=2 * MIB, large=20 * MIB,
                              grow_at=4, processes=True),
    "shrinking-transform": dict(budget=48 * MIB, keys=10, small=8 * MIB, large=8 * MIB,
                                grow_at=0, shrink=True),
    "window": dict(budget=60 * MIB, keys=12, small=8 * MIB, large=8 * MIB, grow_at=0,
                   window=3),
    "command": dict(budget=64 * MIB, keys=12, small=2 * MIB, large=20 * MIB, grow_at=4,
                    command=True),
}

_GENERATOR = """
import sys
import numpy as np
rows, path = int(sys.argv[1]), sys.argv[2]
np.save(path, np.full((rows, {columns}), float(sys.argv[3]), dtype=np.float32))
"""


def _anon(pid: str) -> int:
    """A process's anonymous resident memory (``RssAnon``, read in microseconds)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # ended meanwhile
        return 0
    return 0


def _workers(own_cmdline: bytes) -> list[str]:
    """Children of this process running this same program (forked worker processes)."""
    pids = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                pids.extend(f.read().split())
        except OSError:
            continue
    same = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read() == own_cmdline:
                    same.append(pid)
        except OSError:
            continue
    return same


def _shared_bytes() -> int:
    """Bytes of the memfd files open in this process (shards in shared memory)."""
    total, seen = 0, set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:gluon_stream"):
                continue
            st = os.stat(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total


class Sampler:
    """The memory the loader makes, sampled in a thread until :meth:`close`: the peak."""

    def __init__(self) -> None:
        with open("/proc/self/cmdline", "rb") as f:
            self._cmdline = f.read()
        self._seen: set[str] = set()
        self._first: dict[str, int] = {}  # a worker's anonymous memory when first seen
        self.base = self.now()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="budget-sampler", daemon=True)
        self._thread.start()

    def now(self) -> int:
        # a child seen in two samples in a row: not one between its fork (or vfork, which
        # shares this process's memory) and its exec of a generator program
        seen = set(_workers(self._cmdline))
        workers, self._seen = seen & self._seen, seen
        grown = 0
        for pid in workers:  # a worker's growth over what it had when first seen (its fork)
            now = _anon(pid)
            grown += max(0, now - self._first.setdefault(pid, now))
        return _anon("self") + grown + _shared_bytes()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            time.sleep(0.002)

    def close(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak - self.base


def _rows(spec: dict, key: int) -> int:
    nbytes = spec["large"] if key >= spec["grow_at"] else spec["small"]
    return nbytes // 4 // COLUMNS


def _loader(spec: dict, tmp: str, keys: int, generate_s: float) -> StreamLoader:
    options: dict = {}
    if spec.get("command"):
        script = os.path.join(tmp, "gen.py")
        with open(script, "w") as f:
            f.write(_GENERATOR.format(columns=COLUMNS))
        # argv per key: the key is its rows and its value ("rows-value")
        source: Any = CommandSource(
            [f"{_rows(spec, k)}-{k}" for k in range(keys)],
            [sys.executable, "-c", "import runpy, sys; k = sys.argv[1].split('-'); "
             f"sys.argv = ['gen', k[0], sys.argv[2], k[1]]; runpy.run_path({script!r})",
             "{key}", "{path}"], cache_dir=os.path.join(tmp, "cache"))
    else:
        dtype = np.float64 if spec.get("shrink") else np.float32

        def fn(key: int) -> np.ndarray:
            time.sleep(generate_s)
            return np.full((_rows(spec, key), COLUMNS), key, dtype=dtype)

        source = FunctionSource(range(keys), fn)
        if spec.get("shrink"):
            options["transform"] = lambda a: a.astype(np.float32)
    if spec.get("processes"):
        options.update(batchify_fn=np.stack, sample_transform=lambda x: x)
    if spec.get("window"):
        options.update(shuffle_window=spec["window"], shuffle=True, seed=0)
    rows = spec["small"] // 4 // COLUMNS
    # shards in key order: the growth comes mid-stream
    return StreamLoader(source, batch_size=max(1, rows // 8), memory_budget=spec["budget"],
                        **options)


def run_shape(shape: str, generate_s: float = 0.01) -> dict:
    """One shape in this process: a warm-up, then the measured run."""
    spec = SHAPES[shape]
    with tempfile.TemporaryDirectory(prefix="gluon_stream_budget_") as tmp:
        with _loader(dict(spec, large=spec["small"]), tmp, 3, 0.0) as warm:
            for _ in warm:
                pass
    with tempfile.TemporaryDirectory(prefix="gluon_stream_budget_") as tmp:
        sampler = Sampler()
        with _loader(spec, tmp, spec["keys"], generate_s) as loader:
            try:
                for _batch in loader:  # slower than production: shards wait ahead
                    time.sleep(spec.get("step_s", STEP_S))
                    del _batch
            finally:
                over = sampler.close()
                changes = [(c.setting, c.old, c.new) for c in loader.stats.tuning]
    return {"shape": shape, "budget": spec["budget"], "peak": over,
            "ratio": round(over / spec["budget"], 3), "changes": changes}


def measure_shape(shape: str, timeout: float = 300) -> dict:
    """:func:`run_shape` in a new process (``MALLOC_MMAP_THRESHOLD_=65536``)."""
    return in_new_process(__name__, [shape], f"the budget probe of {shape!r}", timeout)


def main() -> None:
    print(json.dumps(run_shape(sys.argv[1])))


if __name__ == "__main__":
    main()
