"""Scale-out: several processes sharing one cache_dir, shard generation on a dask.distributed
cluster, and shards read from fsspec URLs."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest

import gluon_stream as gs
from _helpers import batch_ids

GENERATOR = """\
import os, sys
import numpy as np
key, out, log = sys.argv[1], sys.argv[2], sys.argv[3]
with open(log, "a") as fp:
    fp.write(f"{key} {os.getpid()} {os.getppid()}\\n")
k = int(key.split("-")[1])
np.save(out, np.arange(5, dtype=np.int64) + 1000 * k)
"""


@pytest.fixture
def generator(tmp_path):
    script = tmp_path / "gen.py"
    script.write_text(GENERATOR)
    log = tmp_path / "runs.log"
    return [sys.executable, str(script), "{key}", "{path}", str(log)], log


def runs(log) -> list[list[str]]:
    return [line.split() for line in log.read_text().splitlines()] if log.exists() else []


WORKER = """
import sys
import gluon_stream as gs
cmd = {cmd!r}
src = gs.CommandSource([f"k-{{i}}" for i in range(6)], cmd, cache_dir={cache!r})
with gs.StreamLoader(src, batch_size=5, shuffle=True, seed=int(sys.argv[1])) as loader:
    print(sorted(int(v) for b in loader for v in b.asnumpy()))
"""


def test_processes_sharing_a_cache_generate_each_shard_once(tmp_path, generator):
    cmd, log = generator
    code = WORKER.format(cmd=cmd, cache=str(tmp_path / "cache"))
    procs = [subprocess.Popen([sys.executable, "-c", code, str(seed)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for seed in range(3)]
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        outs.append(out)
    want = str(sorted(1000 * k + i for k in range(6) for i in range(5)))
    assert [o.strip() for o in outs] == [want] * 3
    assert sorted(r[0] for r in runs(log)) == [f"k-{i}" for i in range(6)]  # once each


@pytest.mark.mxnet
@pytest.mark.no_leak_check  # dask keeps its offload thread and resource tracker for the process
def test_shards_generated_on_a_dask_cluster(tmp_path, generator):
    import threading

    distributed = pytest.importorskip("distributed")
    cmd, log = generator
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  dashboard_address=None) as cluster, \
            distributed.Client(cluster) as client:
        worker_pids = set(client.run(os.getpid).values())
        src = gs.CommandSource([f"k-{i}" for i in range(8)], cmd, cache_dir=tmp_path / "cache")
        with gs.StreamLoader(src, batch_size=5, producers=client.get_executor(),
                             prefetch=3) as loader:
            ids = [i for b in loader for i in batch_ids(b)]
        fn_src = gs.FunctionSource(range(3), lambda k: np.full((2,), os.getpid()))
        with gs.StreamLoader(fn_src, batch_size=2, producers=client.get_executor()) as loader:
            fn_pids = {int(b.asnumpy()[0]) for b in loader}
    assert ids == [1000 * k + i for k in range(8) for i in range(5)]  # in key order
    parents = {int(r[2]) for r in runs(log)}
    assert parents <= worker_pids and os.getpid() not in parents  # made on the workers
    assert fn_pids <= worker_pids
    assert not [t.name for t in threading.enumerate() if t.name.startswith("gluon_stream")]


@pytest.mark.mxnet
def test_file_source_reads_fsspec_urls(tmp_path):
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    for k, n in enumerate([5, 3, 6]):
        with fs.open(f"/gs-test/s{k}.npy", "wb") as fp:
            np.save(fp, np.arange(n, dtype=np.int64) + 1000 * k)
    with fs.open("/gs-test/bad.npy", "wb") as fp:
        fp.write(b"\x93NUMPY junk")
    try:
        src = gs.FileSource("memory://gs-test/s*.npy")
        names = [k.rsplit("/", 1)[1] for k in src.keys_for_epoch(0)[0]]
        assert names == ["s0.npy", "s1.npy", "s2.npy"]
        with gs.StreamLoader(src, batch_size=4) as loader:
            ids = [i for b in loader for i in batch_ids(b)]
        assert ids == [1000 * k + i for k, n in enumerate([5, 3, 6]) for i in range(n)]
        with gs.StreamLoader(gs.FileSource(["memory://gs-test/bad.npy"]), batch_size=4) as ld:
            with pytest.raises(gs.CorruptShard, match="bad.npy"):
                list(ld)
        np.save(tmp_path / "local.npy", np.arange(4))
        with gs.StreamLoader(gs.FileSource(f"file://{tmp_path}/*.npy"), batch_size=4) as ld:
            assert len(ld) == 1 and batch_ids(next(iter(ld))) == [0, 1, 2, 3]
    finally:
        fs.rm("/gs-test", recursive=True)
    leftovers = [f for f in os.listdir(tempfile.gettempdir())
                 if f.startswith("gluon_stream_fetch_")]
    assert not leftovers


