"""Scale-out: a bounded cache for endless streams, several processes sharing one cache_dir,
and shard generation on a dask.distributed cluster."""
from __future__ import annotations

import itertools
import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest

import gluon_stream as gs
from conftest import batch_ids
from gluon_stream import sources

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


def cached(cache) -> list[str]:
    return sorted(f for f in os.listdir(cache) if not f.startswith("."))


def test_cache_limit_keeps_an_endless_stream_within_the_limit(tmp_path):
    cache = tmp_path / "cache"
    keys = (f"k-{i}" for i in itertools.count())
    src = gs.FunctionSource(itertools.islice(keys, 300),
                            lambda k: np.full((3,), int(k.split("-")[1])), cache_dir=cache,
                            cache_limit=6)
    peak, seen = 0, []
    with gs.StreamLoader(src, batch_size=3, prefetch=2) as loader:
        for batch in loader:
            seen.append(int(batch.asnumpy()[0]))
            peak = max(peak, len(cached(cache)))
    assert seen == list(range(300))  # nothing lost while shards came and went
    assert peak <= 6 + 1  # + the one just finished, before its generation evicts
    assert len(cached(cache)) <= 6
    assert not [f for f in os.listdir(cache) if f.startswith(".")]  # no temp or lock files


def test_cache_limit_in_bytes_and_bad_values(tmp_path):
    assert sources.parse_cache_limit("20GB") == (None, 20 * 10 ** 9)
    assert sources.parse_cache_limit("1.5GiB") == (None, int(1.5 * 2 ** 30))
    assert sources.parse_cache_limit(7) == (7, None)
    for bad in (0, "lots", "-1MB", True):
        with pytest.raises(ValueError, match="cache_limit"):
            sources.parse_cache_limit(bad)
    with pytest.raises(ValueError, match="cache_dir"):
        gs.FunctionSource([0], lambda k: np.zeros(2), cache_limit=3)
    src = gs.FunctionSource([f"k-{i}" for i in range(10)], lambda k: np.zeros(1000, np.uint8),
                            cache_dir=tmp_path, cache_limit="3500B")  # 3 shards of ~1.1 kB
    with gs.StreamLoader(src, batch_size=500) as loader:
        assert sum(1 for _ in loader) == 20
    sizes = [os.path.getsize(tmp_path / f) for f in cached(tmp_path)]
    assert sum(sizes) <= 3500 and len(sizes) == 3


def test_eviction_never_removes_a_shard_being_read(tmp_path):
    cache = sources._ShardCache(tmp_path, lock_timeout=10, limit=1)
    paths = []
    for name in ("a", "b", "c"):
        path, hit = cache.get_or_create(
            name, lambda n=name: gs.write_shard(cache.temp_path(n, ".npy"), np.zeros(3)))
        paths.append(path)
        os.utime(path, (len(paths), len(paths)))  # a is the least recently used
    with cache.reading(paths[0]):  # a reader holds 'a'
        cache.enforce_limit(keep=paths[2])
    assert cached(tmp_path) == ["a.npy", "c.npy"]  # b went; a was held, c was just made
    cache.enforce_limit(keep=paths[2])
    assert cached(tmp_path) == ["c.npy"]


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
        assert [k.rsplit("/", 1)[1] for k in src.keys_for_epoch(0)[0]] == ["s0.npy", "s1.npy", "s2.npy"]
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
    leftovers = [f for f in os.listdir(tempfile.gettempdir()) if f.startswith("gluon_stream_fetch_")]
    assert not leftovers


def test_cache_dir_on_an_fsspec_filesystem(tmp_path):
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    calls = []

    def fn(key):
        calls.append(key)
        return np.arange(4, dtype=np.int64) + 1000 * int(key.split("-")[1])

    try:
        for _ in range(2):
            src = gs.FunctionSource([f"k-{i}" for i in range(3)], fn, cache_dir="memory://gs-cache")
            with gs.StreamLoader(src, batch_size=4) as loader:
                assert [batch_ids(b) for b in loader] == [
                    [1000 * k + i for i in range(4)] for k in range(3)]
        assert calls == ["k-0", "k-1", "k-2"]  # the second pass read the uploaded shards
        assert sorted(p.rsplit("/", 1)[1] for p in fs.ls("/gs-cache", detail=False)) == [
            "k-0.npy", "k-1.npy", "k-2.npy"]
        keys = [f"k-{i}" for i in range(3, 12)]
        src = gs.FunctionSource(keys, fn, cache_dir="memory://gs-cache", cache_limit=4)
        with gs.StreamLoader(src, batch_size=4) as loader:
            assert sum(1 for _ in loader) == 9
        assert len(fs.ls("/gs-cache", detail=False)) <= 4
        fs.pipe("/gs-cache/k-20.npy", b"\x93NUMPY broken")  # a damaged object is made again
        src = gs.FunctionSource(["k-20"], fn, cache_dir="memory://gs-cache")
        with gs.StreamLoader(src, batch_size=4) as loader:
            assert [batch_ids(b) for b in loader] == [[20000, 20001, 20002, 20003]]
    finally:
        fs.rm("/gs-cache", recursive=True)
