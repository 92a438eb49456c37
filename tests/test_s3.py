"""Shards in S3, on a real S3 server (moto, on 127.0.0.1) reached through s3fs: FileSource over
``s3://`` URLs, an ``s3://`` cache_dir shared by two processes, and a dead endpoint.

The two processes are children driven line by line over their stdin (``produce KEY``, ``ls``),
so what each does, and in which order, is decided by the test, never by timing.
"""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import psutil
import pytest

import gluon_stream as gs
from _helpers import JOIN_S
from _servers import dead_s3, ends_with_the_process, s3, warm_fsspec  # noqa: F401, F811  (fixtures)

# s3fs runs on fsspec's event loop, whose thread pool (aiohttp's name lookups) grows and stays
# for the process: the leak check cannot tell it from ours, so these tests check their own.
pytestmark = [pytest.mark.timeout(120), pytest.mark.no_leak_check]

BUCKET = "gs-test"


def s3fs_here():
    """This process's s3fs filesystem (the cached instance gluon_stream's URLs use too)."""
    import fsspec

    return fsspec.filesystem("s3")


def put_npy(fs, path: str, array: np.ndarray) -> None:
    buf = io.BytesIO()
    np.save(buf, array)
    fs.pipe(path, buf.getvalue())


def gs_temp() -> str:
    import tempfile

    return tempfile.gettempdir()


@pytest.fixture(autouse=True)
def own_leak_check():
    """What the suite's leak check would say of gluon_stream's own threads and processes."""
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    yield
    assert not [t.name for t in threading.enumerate() if t.name.startswith("gluon_stream")]
    assert not [c.pid for c in psutil.Process().children(recursive=True) if c.pid not in before
                and not ends_with_the_process(c)]


def test_file_source_reads_s3_urls(s3):
    fs = s3fs_here()
    fs.mkdir(BUCKET)
    for k, n in enumerate([5, 3, 6]):
        put_npy(fs, f"{BUCKET}/shards/s{k}.npy", np.arange(n, dtype=np.int64) + 1000 * k)
    fs.pipe(f"{BUCKET}/shards/bad.npy", b"\x93NUMPY junk")
    src = gs.FileSource(f"s3://{BUCKET}/shards/s*.npy")
    keys = src.keys_for_epoch(0)[0]
    assert keys == [f"s3://{BUCKET}/shards/s{k}.npy" for k in range(3)]
    with src:
        got = [src.produce(key, 0).arrays[0].tolist() for key in keys]
    assert got == [list(range(1000 * k, 1000 * k + n)) for k, n in enumerate([5, 3, 6])]
    with gs.FileSource([f"s3://{BUCKET}/shards/bad.npy"]) as bad, \
            pytest.raises(gs.CorruptShard, match=rf"'s3://{BUCKET}/shards/bad.npy'"):
        bad.produce(bad.keys_for_epoch(0)[0][0], 0)
    with gs.FileSource([f"s3://{BUCKET}/shards/gone.npy"]) as gone, \
            pytest.raises(gs.CorruptShard, match=r"gone.npy' does not exist"):
        gone.produce(f"s3://{BUCKET}/shards/gone.npy", 0)
    assert not [f for f in os.listdir(gs_temp()) if f.startswith("gluon_stream_fetch_")]


# -- sizes of a filled s3:// cache_dir ----------------------------------------------------------

@pytest.mark.mxnet
@pytest.mark.parametrize("columns", [1, 2], ids=["npy", "npz"])
def test_len_of_a_fresh_loader_over_a_filled_s3_cache_dir_reads_the_headers(s3, columns):
    """len() raised SizeUnknown over an s3:// cache_dir holding every shard, while the same
    over a local cache knew it: the headers are read in place, as locally, not the shards."""
    s3fs_here().mkdir(BUCKET)
    url = f"s3://{BUCKET}/sized"
    sizes = {"a-0": 5, "a-1": 40000, "a-2": 3}  # a-1: 320 kB of data behind a 128-byte header

    def fn(key):
        ids = np.arange(sizes[key], dtype=np.int64)
        return (ids, ids.astype(np.float32))[:columns]
    filling = gs.FunctionSource(list(sizes), fn, cache_dir=url)
    with gs.StreamLoader(filling, batch_size=4) as loader:
        assert sum(1 for _ in loader) == 1 + 10000 + 1
    assert sorted(p.rsplit("/", 1)[1] for p in s3fs_here().ls(url, detail=False)) == \
        [f"{k}.{'npy' if columns == 1 else 'npz'}" for k in sizes]

    def refuse(key):
        raise AssertionError(f"{key} was made again: it is in the cache")
    fresh = gs.FunctionSource(list(sizes), refuse, cache_dir=url)
    assert [fresh.num_samples(k, 0) for k in sizes] == [5, 40000, 3]
    with gs.StreamLoader(fresh, batch_size=4, last_batch="discard") as loader:
        assert len(loader) == (5 + 40000 + 3) // 4
        assert not [f for f in os.listdir(gs_temp()) if f.startswith("gluon_stream_fetch_")]
        assert sum(1 for _ in loader) == len(loader)
    suffix = "npy" if columns == 1 else "npz"
    s3fs_here().pipe(f"{BUCKET}/sized/a-0.{suffix}", b"\x93NUMPY broken")
    with gs.FunctionSource(list(sizes), fn, cache_dir=url) as again:  # unknown until produced
        assert again.num_samples("a-0", 0) is None and again.num_samples("a-1", 0) == 40000


# -- one s3:// cache_dir, two processes ----------------------------------------------------------

_CHILD = r"""
import json, os, sys
import numpy as np
import fsspec
import gluon_stream as gs
url, runs = sys.argv[1], sys.argv[2]
def fn(key):
    with open(runs, "a") as fp:
        fp.write(f"{key} {os.getpid()}\n")
    return np.arange(4, dtype=np.int64) + 100 * int(key.split("-")[1])
src = gs.FunctionSource([f"k-{i}" for i in range(9)], fn, cache_dir=url, cache_limit=2)
fs, root = fsspec.core.url_to_fs(url)  # the instance the cache shares with the whole program
for line in sys.stdin:
    command, key = line.split()
    try:
        if command == "produce":
            raw = src.produce(key, 0)
            out = {"hit": raw.cache_hit, "values": raw.arrays[0].tolist()}
        else:  # another part of the program lists the bucket: s3fs keeps the listing
            out = {"names": sorted(p.rsplit("/", 1)[1] for p in fs.ls(root, detail=False))}
    except Exception as exc:
        out = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(out), flush=True)
src.close()
"""


class Child:
    """A process with an s3:// cache, doing what the test tells it, one line at a time."""

    def __init__(self, url: str, runs: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _CHILD, url, runs], text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE)

    def __call__(self, command: str, key: str = "-") -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{command} {key}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"child died: {self.close()}"
        return json.loads(line)

    def close(self) -> str:
        """End the child; its stderr, for messages."""
        out, err = self.proc.communicate(timeout=JOIN_S)
        assert self.proc.returncode == 0, err[-3000:]
        return err


def values(k: int) -> list:
    return [100 * k + i for i in range(4)]


def test_two_processes_share_an_s3_cache_dir(s3, tmp_path):
    """A shard another process just uploaded is a hit, and one another process evicted is made
    again, even when this process's s3fs listing of the cache is stale (it was listed before)."""
    s3fs_here().mkdir(BUCKET)
    url, runs = f"s3://{BUCKET}/cache", str(tmp_path / "runs.log")
    a, b = Child(url, runs), Child(url, runs)
    try:
        assert a("produce", "k-0") == {"hit": False, "values": values(0)}
        assert b("ls") == {"names": ["k-0.npy"]}  # b's filesystem now caches that listing
        assert a("produce", "k-1") == {"hit": False, "values": values(1)}
        assert b("produce", "k-1") == {"hit": True, "values": values(1)}  # was: made again
        assert b("ls") == {"names": ["k-0.npy", "k-1.npy"]}
        assert a("produce", "k-2") == {"hit": False, "values": values(2)}  # evicts k-0
        # was: "evicted 3 times before it could be read; raise cache_limit ..."
        assert b("produce", "k-0") == {"hit": False, "values": values(0)}
        assert b("ls") == {"names": ["k-0.npy", "k-2.npy"]}  # never more than cache_limit=2
    finally:
        errs = [a.close(), b.close()]
    made = sorted(line.split()[0] for line in open(runs))
    assert made == ["k-0", "k-0", "k-1", "k-2"], errs  # k-0 twice: evicted between


# -- a dead endpoint ----------------------------------------------------------------------------

def test_a_dead_s3_endpoint_is_a_shard_error_naming_key_and_url(dead_s3):
    start = time.monotonic()
    with gs.FileSource([f"s3://{BUCKET}/shards/s0.npy"]) as src, \
            pytest.raises(gs.ShardError, match=rf"shard 's3://{BUCKET}/shards/s0.npy': reading "
                                               rf"s3://{BUCKET}/shards/s0.npy failed: "
                                               r"EndpointConnectionError") as info:
        src.produce(f"s3://{BUCKET}/shards/s0.npy", 0)
    assert info.value.key == f"s3://{BUCKET}/shards/s0.npy"
    with gs.FunctionSource(["k-0"], lambda key: np.zeros(3),
                           cache_dir=f"s3://{BUCKET}/cache") as src, \
            pytest.raises(gs.ShardError, match=rf"shard 'k-0': looking up s3://{BUCKET}/cache/"
                                               r"k-0.npy failed: EndpointConnectionError"):
        src.produce("k-0", 0)
    with pytest.raises(gs.ShardError, match=rf"listing s3://{BUCKET}/\*.npy failed"):
        gs.FileSource(f"s3://{BUCKET}/*.npy")
    assert time.monotonic() - start < 10  # one refused connection each, nothing retried on top
