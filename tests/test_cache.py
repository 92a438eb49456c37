"""The shard cache: atomic publish, per-key cross-process locks, stale-file cleanup, symlinks,
and the bounded cache (cache_limit, LRU eviction that spares readers, an fsspec cache_dir).

Generator runs are counted (``count`` file) and pids logged, so the tests prove what ran with
events and files rather than sleeps.
"""
from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

import gluon_stream as gs
from _helpers import JOIN_S, batch_ids, dead, wait_for
from fake_generator import (command_source as source, generator_runs as runs, hidden_files,
                            read_lines, shard_values)
from gluon_stream.cache import ShardCache, parse_cache_limit
from gluon_stream.cache import local as cache_local


def test_a_corrupt_cached_shard_is_deleted_and_regenerated(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "k1.npy").write_bytes(b"\x93NUMPY\x01\x00garbage")
    with source(tmp_path, "ok") as src:
        raw = src.produce("k1", 0)
        assert not raw.cache_hit
    np.testing.assert_array_equal(raw.arrays[0], shard_values("k1", 10, 3))
    assert len(runs(tmp_path)) == 1
    assert os.listdir(cache) == ["k1.npy"]


@pytest.mark.timeout(60)
def test_a_reader_polling_the_cache_never_sees_a_partial_file(tmp_path):
    src = source(tmp_path, "slow", rows=2000, gate=True)
    result = {}
    worker = threading.Thread(target=lambda: result.update(raw=src.produce("k1", 0)),
                              name="gluon_stream-test-producer")
    worker.start()
    try:
        wait_for(lambda: read_lines(tmp_path / "started"), what="the first half to be written")
        # half the shard is on disk now, in a temp file: the final name must not exist yet
        cache = tmp_path / "cache"
        temps = hidden_files(cache)
        assert len(temps) == 2 and any(".tmp" in t for t in temps)  # the temp file and the lock
        assert src._cache.lookup("k1") is None and not (cache / "k1.npy").exists()
        (tmp_path / "gate").touch()
        seen_partial = 0
        while worker.is_alive():  # poll as a concurrent reader would
            if (cache / "k1.npy").exists():
                try:
                    gs.inspect_shard(cache / "k1.npy")
                except gs.CorruptShard:
                    seen_partial += 1
        worker.join(JOIN_S)
    finally:
        (tmp_path / "gate").touch()
        worker.join(JOIN_S)
        src.close()
    assert seen_partial == 0
    np.testing.assert_array_equal(result["raw"].arrays[0], shard_values("k1", 2000, 3))
    assert hidden_files(tmp_path / "cache") == []


_CHILD = r"""
import sys, numpy as np
sys.path.insert(0, {tests!r})
import gluon_stream as gs
from gluon_stream.cache import local as cache_local
from fake_generator import command
real_acquire = cache_local.ShardCache._acquire
def acquire(self, lock, name):  # instrumented: announce the wait for the key's lock
    open({waiting!r}, "w").close()
    return real_acquire(self, lock, name)
cache_local.ShardCache._acquire = acquire
src = gs.CommandSource(["k1"], command("ok", workdir={work!r}, gate=True, rows=50),
                       cache_dir={cache!r}, retries=0, timeout=60)
raw = src.produce("k1", 0)
np.save({out!r}, raw.arrays[0])
print("hit" if raw.cache_hit else "generated")
src.close()
"""


def _spawn_child(tmp_path, name):
    code = _CHILD.format(tests=os.path.dirname(__file__), work=str(tmp_path),
                         waiting=str(tmp_path / f"waiting-{name}"),
                         cache=str(tmp_path / "cache"), out=str(tmp_path / f"{name}.npy"))
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.timeout(120)
def test_two_processes_on_the_same_key_share_one_generation(tmp_path):
    first = _spawn_child(tmp_path, "a")
    second = None
    try:
        wait_for(lambda: read_lines(tmp_path / "started"), 60, "the first generator to start")
        second = _spawn_child(tmp_path, "b")
        wait_for((tmp_path / "waiting-b").exists, 60, "the second process to wait on the lock")
        (tmp_path / "gate").touch()
        outs = [p.communicate(timeout=JOIN_S) for p in (first, second)]
    finally:
        (tmp_path / "gate").touch()
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
                p.communicate(timeout=JOIN_S)
    assert [p.returncode for p in (first, second)] == [0, 0], outs
    assert sorted(o[0].strip() for o in outs) == ["generated", "hit"]
    assert len(runs(tmp_path)) == 1  # the generator ran exactly once
    a, b = np.load(tmp_path / "a.npy"), np.load(tmp_path / "b.npy")
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, shard_values("k1", 50, 3))
    assert hidden_files(tmp_path / "cache") == []


@pytest.mark.timeout(120)
def test_when_the_lock_holder_is_killed_the_waiter_takes_over(tmp_path, monkeypatch):
    holder = _spawn_child(tmp_path, "a")
    result, errors = {}, []
    waiting = threading.Event()
    real_acquire = cache_local.ShardCache._acquire

    def acquire(self, lock, name):
        waiting.set()
        return real_acquire(self, lock, name)

    monkeypatch.setattr(cache_local.ShardCache, "_acquire", acquire)

    def wait_then_produce():
        try:
            with source(tmp_path, "ok", rows=50) as src:
                result["raw"] = src.produce("k1", 0)
        except Exception as exc:  # relayed to the test thread below
            errors.append(exc)

    waiter = threading.Thread(target=wait_then_produce, name="gluon_stream-test-waiter")
    try:
        wait_for(lambda: read_lines(tmp_path / "started"), 60, "the holder's generator to start")
        generator_pid = int(read_lines(tmp_path / "pids")[0])
        waiter.start()
        assert waiting.wait(JOIN_S), "the waiter never asked for the lock"
        holder.kill()  # SIGKILL: no cleanup runs; the OS drops its lock
        holder.communicate(timeout=JOIN_S)
        os.killpg(generator_pid, signal.SIGKILL)  # the orphaned generator (its own session)
        waiter.join(JOIN_S)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.communicate(timeout=JOIN_S)
        (tmp_path / "gate").touch()
        if waiter.is_alive() or waiter.ident is not None:
            waiter.join(JOIN_S)
    assert not errors, errors
    assert holder.returncode == -signal.SIGKILL
    np.testing.assert_array_equal(result["raw"].arrays[0], shard_values("k1", 50, 3))
    assert len(runs(tmp_path)) == 2  # the dead holder's run, then the waiter's own
    wait_for(lambda: dead(generator_pid), 5, "the orphaned generator to die")
    # the dead holder's temp file remains until the next start cleans it up
    source(tmp_path, "ok").close()
    assert hidden_files(tmp_path / "cache") == []


def test_stale_temp_and_lock_files_are_removed_at_start_but_live_ones_kept(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    dead_pid = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True).stdout.strip()
    stale = cache / f".k1.{dead_pid}.deadbeef.tmp.npy"
    live = cache / f".k2.{os.getpid()}.cafecafe.tmp.npy"
    lock = cache / ".k3.lock"
    for path in (stale, live, lock):
        path.write_bytes(b"partial")
    source(tmp_path).close()
    assert hidden_files(cache) == [live.name]
    live.unlink()


def test_a_symlink_in_the_cache_is_not_followed(tmp_path):
    outside = tmp_path / "outside.npy"
    np.save(outside, np.arange(4.0))
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "k1.npy").symlink_to(outside)
    with source(tmp_path, "ok") as src, pytest.raises(gs.UnsafeShard, match=r"symlink"):
        src.produce("k1", 0)
    assert runs(tmp_path) == [] and outside.exists()


def test_a_generator_that_writes_a_symlink_is_refused(tmp_path):
    with source(tmp_path, "symlink") as src, pytest.raises(gs.UnsafeShard, match=r"symlink"):
        src.produce("k1", 0)
    assert not (tmp_path / "cache" / "k1.npy").exists()
    for name in os.listdir(tmp_path / "cache"):  # only the generator's own outside file is left
        assert name.endswith(".outside.npy")
        os.unlink(tmp_path / "cache" / name)


def cached(cache) -> list[str]:
    return sorted(f for f in os.listdir(cache) if not f.startswith("."))


@pytest.mark.mxnet
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


@pytest.mark.mxnet
def test_cache_limit_in_bytes_and_bad_values(tmp_path):
    assert parse_cache_limit("20GB") == (None, 20 * 10 ** 9)
    assert parse_cache_limit("1.5GiB") == (None, int(1.5 * 2 ** 30))
    assert parse_cache_limit(7) == (7, None)
    for bad in (0, "lots", "-1MB", True):
        with pytest.raises(ValueError, match="cache_limit"):
            parse_cache_limit(bad)
    with pytest.raises(ValueError, match="cache_dir"):
        gs.FunctionSource([0], lambda k: np.zeros(2), cache_limit=3)
    src = gs.FunctionSource([f"k-{i}" for i in range(10)], lambda k: np.zeros(1000, np.uint8),
                            cache_dir=tmp_path, cache_limit="3500B")  # 3 shards of ~1.1 kB
    with gs.StreamLoader(src, batch_size=500) as loader:
        assert sum(1 for _ in loader) == 20
    sizes = [os.path.getsize(tmp_path / f) for f in cached(tmp_path)]
    assert sum(sizes) <= 3500 and len(sizes) == 3


def test_eviction_never_removes_a_shard_being_read(tmp_path):
    cache = ShardCache(tmp_path, lock_timeout=10, limit=1)
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


@pytest.mark.mxnet
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
