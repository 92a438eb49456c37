"""An elastic ``dist_sync`` job: 2 workers stopped mid-epoch, resumed on 3, stopped again
while reading the rest of that epoch, resumed on 2 to the end.

Each phase is a real job (scheduler, server and workers as processes on 127.0.0.1, started as
``test_kvstore.py`` starts one); the workers checkpoint with ``gs.do_checkpoint`` (each rank
its own loader state) and resume with ``gs.load_checkpoint``, which merges the states of a job
of another size. Every sample of each epoch is trained once (``even_batches='pad'``: counted
among the real rows), every rank of a phase yields as many batches, and every shard is
generated once in the whole run, through the shared cache.
"""
from __future__ import annotations

import collections
import json
import sys
import time
from pathlib import Path

import pytest

import gluon_stream as gs
from _elastic_worker import BATCH_SIZE, EPOCHS, SEED
from _kvstore_worker import SIZES
from test_kvstore import Node, free_port, kill, ps_env, start, wait_all

pytestmark = pytest.mark.mxnet

WORKER = str(Path(__file__).with_name("_elastic_worker.py"))
PHASE_TIMEOUT_S = 120  # each phase; it takes seconds when all is well
# (workers, batches before the stop; None: to the end), resuming from the phase before
PHASES = [(2, 3), (3, 2), (2, None)]


def run_phase(tmp_path: Path, index: int, workers: int, stop: int | None) -> list[dict]:
    logs = tmp_path / f"phase{index}"
    logs.mkdir()
    port = free_port()
    nodes: list[Node] = []

    def env(role: str) -> dict:
        out = ps_env(role, port)
        out["DMLC_NUM_WORKER"] = str(workers)
        return out

    try:
        start(nodes, "scheduler", [sys.executable, "-c", "import mxnet"], env("scheduler"), logs)
        server = env("server")
        server["DMLC_TASK_ID"] = str(workers)
        start(nodes, "server", [sys.executable, "-c", "import mxnet"], server, logs)
        for i in range(workers):
            worker = env("worker")
            worker["DMLC_TASK_ID"] = str(i)
            worker["PYTHONPATH"] = str(Path(__file__).parent) + ":" + worker.get("PYTHONPATH", "")
            argv = [sys.executable, WORKER, "--out", str(logs / f"worker{i}.json"),
                    "--prefix", str(tmp_path / "ckpt" / "net"), "--cache", str(tmp_path / "cache"),
                    "--marks", str(tmp_path / "marks")]
            argv += ["--resume", str(index)] if index else []
            argv += ["--stop", str(stop)] if stop is not None else []
            start(nodes, f"worker{i}", argv, worker, logs)
        wait_all(nodes, PHASE_TIMEOUT_S)
        records = [json.loads((logs / f"worker{i}.json").read_text()) for i in range(workers)]
    finally:
        kill(nodes)
    return sorted(records, key=lambda r: r["rank"])


def test_two_workers_resumed_on_three_then_on_two(tmp_path):
    import mxnet as mx

    if not mx.runtime.Features().is_enabled("DIST_KVSTORE"):
        pytest.skip("this MXNet build has no distributed kvstore (DIST_KVSTORE): pip's has")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "marks").mkdir()
    began = time.monotonic()
    phases = [run_phase(tmp_path, i, workers, stop) for i, (workers, stop) in enumerate(PHASES)]
    elapsed = time.monotonic() - began
    everything = {1000 * k + i for k, n in enumerate(SIZES) for i in range(n)}
    figures = []
    for epoch in range(EPOCHS):
        trained: collections.Counter = collections.Counter()
        for index, records in enumerate(phases):
            assert [r["num_parts"] for r in records] == [PHASES[index][0]] * len(records)
            rows = [r["epochs"].get(str(epoch), []) for r in records]
            counts = [len(batches) for batches in rows]
            assert len(set(counts)) == 1, f"epoch {epoch}, phase {index}: batches {counts}"
            figures.append(f"epoch {epoch}, phase {index} ({len(records)} workers): "
                           f"{counts} batches per rank")
            trained.update(i for batches in rows for batch in batches for i in batch)
        twice = sorted(i for i, c in trained.items() if c > 1)
        assert not twice, f"epoch {epoch}: trained more than once: {twice}"
        assert set(trained) == everything, f"epoch {epoch}: missing {everything - set(trained)}"
        figures.append(f"epoch {epoch}: {len(trained)} of {len(everything)} samples trained once")
    # the epoch after the resizes is what a fresh 2-rank job reads
    last = phases[-1]
    for rank, record in enumerate(last):
        loader = gs.StreamLoader(gs.FunctionSource(range(len(SIZES)), _ids), batch_size=BATCH_SIZE,
                                 shuffle=True, seed=SEED, num_parts=2, part_index=rank,
                                 even_batches="pad", shard_sizes=dict(enumerate(SIZES)))
        try:
            loader.set_epoch(EPOCHS - 1)
            expected = [[int(i) for i in b.asnumpy()[:BATCH_SIZE - loader.pad]] for b in loader]
        finally:
            loader.close()
        assert record["epochs"][str(EPOCHS - 1)] == expected
    # every rank's state says its job steps together: merge_states compares their positions
    saved = sorted((tmp_path / "ckpt").glob("*.rank*of*.loader.json"))
    assert saved and all(json.loads(p.read_text()).get("job") == "dist_sync" for p in saved)
    made = collections.Counter(p.name.split("-")[0] for p in (tmp_path / "marks").iterdir())
    assert made == {f"key{k}": 1 for k in range(len(SIZES))}, made
    print("\n" + "\n".join(figures) + f"\nthree phases in {elapsed:.1f} s")


def _ids(key):
    import numpy as np

    return np.arange(SIZES[key], dtype=np.int64) + 1000 * key
