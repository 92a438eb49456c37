"""A real ``dist_sync`` job: scheduler, server and two workers as processes on 127.0.0.1.

Each test starts its own job, as MXNet 1.9.1's ``tools/launch.py --launcher local`` does (the
dmlc tracker's ``PSTracker`` and ``local.submit``): every process gets ``DMLC_PS_ROOT_URI``,
``DMLC_PS_ROOT_PORT``, ``DMLC_NUM_SERVER`` and ``DMLC_NUM_WORKER``, and its ``DMLC_ROLE``. The
scheduler and the server are ``python -c "import mxnet"``: importing MXNet with that role runs
ps-lite's scheduler or server loop and exits when the workers finalize. ``DMLC_NODE_HOST`` keeps
every node on the loopback interface (without it ps-lite binds the first other interface it
finds). Each worker runs ``_kvstore_worker.py``: a StreamLoader whose rank comes from
``kvstore=kv`` (``num_parts='auto'``, ``even_batches=True``) feeding a Gluon Trainer on that same
kvstore (issue 18 "Real engines", issue 17 item 5).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from _kvstore_worker import BATCH_SIZE, EPOCHS, PAD_SIZES, SIZES

pytestmark = pytest.mark.mxnet

JOB_TIMEOUT_S = 120  # the whole job; it takes seconds when all is well
POLL_S = 0.05
WORKER = str(Path(__file__).with_name("_kvstore_worker.py"))
NUM_WORKERS = 2
# What could give a process another rank than the kvstore's (distributed.ENV_PAIRS), or point
# ps-lite elsewhere: none of it is inherited from the machine running the tests.
FOREIGN = ("HOROVOD_", "OMPI_COMM_WORLD_", "PMI_", "DMLC_", "PS_")
FOREIGN_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass
class Node:
    """One process of the job and the files its output goes to."""

    name: str
    proc: subprocess.Popen
    stdout: Path
    stderr: Path

    def log(self, chars: int = 3000) -> str:
        parts = []
        for path in (self.stdout, self.stderr):
            text = path.read_text(errors="replace") if path.exists() else ""
            if text.strip():
                parts.append(f"--- {path.name} (last {chars} chars)\n{text[-chars:]}")
        return f"=== {self.name}: exit {self.proc.returncode}\n" + "\n".join(parts)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ps_env(role: str, port: int, workers: int = NUM_WORKERS) -> dict:
    """The environment the dmlc tracker gives a ``role`` process, on 127.0.0.1 only."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(FOREIGN) and k not in FOREIGN_NAMES}
    env.update(DMLC_ROLE=role, DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT=str(port),
               DMLC_NUM_SERVER="1", DMLC_NUM_WORKER=str(workers),
               DMLC_NODE_HOST="127.0.0.1",  # bind and announce loopback, not eth0
               PS_VERBOSE="1",  # connections and barriers in stderr, shown on failure
               OMP_NUM_THREADS="1")  # four MXNet processes share the machine's cores
    if role != "scheduler":
        env["DMLC_JOB_CLUSTER"] = "local"
    return env


def start(nodes: list[Node], name: str, argv: list[str], env: dict, logs: Path) -> None:
    out, err = logs / f"{name}.out", logs / f"{name}.err"
    with open(out, "wb") as fo, open(err, "wb") as fe:
        # its own session: on failure the whole group is killed, whatever it started
        proc = subprocess.Popen(argv, stdout=fo, stderr=fe, stdin=subprocess.DEVNULL, env=env,
                                cwd=logs, start_new_session=True)
    nodes.append(Node(name, proc, out, err))


def kill(nodes: list[Node]) -> None:
    """Kill what still runs (its process group) and reap every process."""
    for node in nodes:
        if node.proc.poll() is None:
            try:
                os.killpg(node.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for node in nodes:
        node.proc.wait(timeout=JOB_TIMEOUT_S)


def wait_all(nodes: list[Node], timeout: float) -> None:
    """Return once every process has exited with 0; fail at the first other exit status, or
    when the deadline passes with some still running."""
    deadline = time.monotonic() + timeout
    while True:
        codes = {n.name: n.proc.poll() for n in nodes}
        failed = [name for name, code in codes.items() if code not in (None, 0)]
        running = [name for name, code in codes.items() if code is None]
        if failed or not running:
            break
        if time.monotonic() > deadline:
            kill(nodes)
            pytest.fail(f"dist_sync job still running after {timeout:.0f} s ({running}): "
                        "killed\n" + "\n".join(n.log() for n in nodes))
        time.sleep(POLL_S)  # polling exit status with a deadline, not synchronising
    if failed:
        kill(nodes)
        pytest.fail(f"{failed} failed\n" + "\n".join(n.log() for n in nodes))


def run_job(tmp_path: Path, case: str, workers: int = NUM_WORKERS
            ) -> tuple[list[dict], float]:
    """Scheduler, server and ``workers`` workers of ``case``; their records in rank order."""
    import mxnet as mx

    if not mx.runtime.Features().is_enabled("DIST_KVSTORE"):
        pytest.skip("this MXNet build has no distributed kvstore (DIST_KVSTORE): pip's has")
    logs = tmp_path / "job"
    logs.mkdir()
    cache, marks = tmp_path / "cache", tmp_path / "marks"
    marks.mkdir()
    port = free_port()
    nodes: list[Node] = []
    began = time.monotonic()
    try:
        start(nodes, "scheduler", [sys.executable, "-c", "import mxnet"],
              ps_env("scheduler", port, workers), logs)
        env = ps_env("server", port, workers)
        env["DMLC_TASK_ID"] = str(workers)  # the tracker numbers workers, then servers
        start(nodes, "server", [sys.executable, "-c", "import mxnet"], env, logs)
        for i in range(workers):
            env = ps_env("worker", port, workers)
            env["DMLC_TASK_ID"] = str(i)
            start(nodes, f"worker{i}",
                  [sys.executable, WORKER, "--case", case, "--out", str(logs / f"worker{i}.json"),
                   "--cache", str(cache), "--marks", str(marks)], env, logs)
        wait_all(nodes, JOB_TIMEOUT_S)
        elapsed = time.monotonic() - began
        records = [json.loads((logs / f"worker{i}.json").read_text())
                   for i in range(workers)]
    finally:
        kill(nodes)
    return sorted(records, key=lambda r: r["rank"]), elapsed


def check_job(records: list[dict[str, Any]], deal: str) -> list[list[int]]:
    """What holds in both cases; returns the batch counts per epoch per rank."""
    assert [r["rank"] for r in records] == list(range(NUM_WORKERS))
    for r in records:
        assert (r["type"], r["num_workers"], r["num_parts"], r["deal"]) == \
            ("dist_sync", NUM_WORKERS, NUM_WORKERS, deal)
        assert r["part_index"] == r["rank"]  # 'auto' read the rank from the kvstore
    counts = []
    for epoch in range(EPOCHS):
        rows = [r["epochs"][epoch] for r in records]
        assert all(row["epoch"] == epoch for row in rows)
        got = [len(row["batches"]) for row in rows]
        lens = [row["len"] for row in rows]
        counts.append(got)
        where = (f"epoch {epoch}: batches per rank {got}, len() per rank {lens}, "
                 f"part sizes {rows[0]['part_sizes']}")
        assert len(set(got)) == 1 and got[0] > 0, where
        for row in rows:  # len() before the pass is what the pass yields, where it is known
            assert row["len"] in (got[0], None), where
        if deal == "shards" or epoch > 0:  # unknown before the first pass with sizes unknown
            assert lens == got, f"{where}; {[row['len_unknown'] for row in rows]}"
        assert rows[0]["part_sizes"] == rows[1]["part_sizes"], where
        assert got[0] == min(rows[0]["part_sizes"]) // BATCH_SIZE, where
        sizes = [len(b) for row in rows for b in row["batches"]]
        assert set(sizes) == {BATCH_SIZE}, f"{where}: batch sizes {sizes}"
        ids = [[i for b in row["batches"] for i in b] for row in rows]
        assert all(len(p) == len(set(p)) for p in ids), f"{where}: a rank repeats a sample"
        assert not set(ids[0]) & set(ids[1]), f"{where}: the ranks share samples"
        for row, mine in zip(rows, ids):  # each rank's samples come from its own shards
            assert set(mine) <= {1000 * k + i for k in row["keys"] for i in range(SIZES[k])}
    assert records[0]["params"] == records[1]["params"]  # dist_sync: one model
    return counts


def test_dist_sync_with_shard_sizes_known(tmp_path):
    """shard_sizes= with shards that, dealt whole, could leave a part of 15 samples of 69: the
    ranks take balanced strides of every shard, yield equal counts of full batches, len() known
    before every pass, and leave out at most ``ranks * batch_size - 1`` samples an epoch
    (issue 35)."""
    records, elapsed = run_job(tmp_path, "known")
    counts = check_job(records, deal="balanced")
    for r in records:
        assert all(sorted(e["keys"]) == list(range(len(SIZES))) for e in r["epochs"])
    for epoch in range(EPOCHS):
        assert sum(SIZES) - NUM_WORKERS * counts[epoch][0] * BATCH_SIZE \
            <= NUM_WORKERS * BATCH_SIZE - 1, counts
    part_sizes = [records[0]["epochs"][e]["part_sizes"] for e in range(EPOCHS)]
    assert all(max(sizes) - min(sizes) <= 1 for sizes in part_sizes), part_sizes
    print(f"sizes known: batches per epoch per rank {counts}, part sizes {part_sizes}, "
          f"job {elapsed:.1f} s")


def test_dist_sync_with_sizes_unknown_and_a_shared_cache(tmp_path):
    """No size known: every rank produces every shard through the shared cache_dir (each
    generated once, under its lock) and takes its stride of each shard's samples, the strides
    going on from shard to shard."""
    records, elapsed = run_job(tmp_path, "unknown")
    counts = check_job(records, deal="balanced")
    for r in records:
        assert all(sorted(e["keys"]) == list(range(len(SIZES))) for e in r["epochs"])
    made: dict[int, int] = {}
    for marker in (tmp_path / "marks").iterdir():
        key = int(marker.name.split("-")[0][len("key"):])
        made[key] = made.get(key, 0) + 1
    assert made == {k: 1 for k in range(len(SIZES))}, f"generations per key: {made}"
    part_sizes = [records[0]["epochs"][e]["part_sizes"] for e in range(EPOCHS)]
    print(f"sizes unknown: batches per epoch per rank {counts}, part sizes {part_sizes}, "
          f"job {elapsed:.1f} s")


def test_dist_sync_pad_evaluation_with_more_ranks_than_shards(tmp_path):
    """Two shards, three ranks, even_batches='pad' with sizes known: the rank dealt no shard
    pads as the others do. Each step sums the ranks' real rows through the kvstore (a rank
    with fewer steps would leave the others waiting until the job's deadline): every rank
    runs the same steps, len() says them ahead, and the real rows hold every sample once."""
    workers = 3
    records, elapsed = run_job(tmp_path, "pad", workers)
    assert [r["part_index"] for r in records] == list(range(workers))
    assert all(r["num_parts"] == workers and r["type"] == "dist_sync" for r in records)
    for epoch in range(EPOCHS):
        rows = [r["epochs"][epoch] for r in records]
        steps = [len(row["batches"]) for row in rows]
        assert len(set(steps)) == 1 and steps[0] > 0, f"epoch {epoch}: steps per rank {steps}"
        assert [row["len"] for row in rows] == steps
        assert all(row["summed"] == rows[0]["summed"] for row in rows)
        assert sum(rows[0]["summed"]) == sum(PAD_SIZES)
        real = sorted(i for row in rows for ids, pad in row["batches"]
                      for i in ids[:len(ids) - pad])
        assert real == sorted(1000 * k + i for k, n in enumerate(PAD_SIZES) for i in range(n))
        assert any(all(pad == BATCH_SIZE for _, pad in row["batches"]) for row in rows), \
            "no rank was dealt nothing: the case does not test what it says"
    print(f"pad, {len(PAD_SIZES)} shards on {workers} ranks: steps per epoch "
          f"{[len(records[0]['epochs'][e]['batches']) for e in range(EPOCHS)]}, "
          f"job {elapsed:.1f} s")
