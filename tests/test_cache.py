"""The shard cache: atomic publish, per-key cross-process locks, stale-file cleanup, symlinks,
and the bounded cache (cache_limit, LRU eviction that spares readers, an fsspec cache_dir).

Generator runs are counted (``count`` file) and pids logged, so the tests prove what ran with
events and files rather than sleeps.
"""
from __future__ import annotations

import errno
import itertools
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import gluon_stream as gs
from _helpers import JOIN_S, all_ids, batch_ids, dead, id_shards, wait_for
from fake_generator import command, hidden_files, read_lines, shard_values
from fake_generator import command_source as source
from fake_generator import generator_runs as runs
from gluon_stream._cache import LocalShardCache, RemoteShardCache, parse_cache_limit
from gluon_stream._cache import local as cache_local


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
from gluon_stream._cache import local as cache_local
from fake_generator import command
real_waiting = cache_local.LocalShardCache._waiting
def waiting(self, name):  # instrumented: announce the wait for the key's lock
    open({waiting!r}, "w").close()
    return real_waiting(self, name)
cache_local.LocalShardCache._waiting = waiting
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
    real_waiting = cache_local.LocalShardCache._waiting

    def announce(self, name):
        waiting.set()
        return real_waiting(self, name)

    monkeypatch.setattr(cache_local.LocalShardCache, "_waiting", announce)

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
    assert peak <= 6  # room is made before a shard is published
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
    # 3 fit; 2 when the producer had made room for the next epoch's first shard (generated
    # ahead) when the loader closed and gave that shard up
    assert sum(sizes) <= 3500 and len(sizes) in (2, 3) and set(sizes) == {1128}


def on_disk(cache) -> int:
    """Shards in ``cache`` with the ones being written: published and temp ``.npy`` files."""
    return sum(1 for f in os.listdir(cache) if f.endswith((".npy", ".npz")))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("limit, ahead", [(5, "auto"), (5, 1), ("4000B", 2)])
def test_cache_limit_counts_the_shards_being_made(tmp_path, limit, ahead):
    """Room is made before a generation starts, so the directory never holds more than the
    limit, temp files of shards being made included (was: 5 published + 1 being made).
    Watched as generations start (the shards already there plus the calls under way, whose
    temp files are about to appear) and by a thread polling the directory."""
    cache, lock = tmp_path / "cache", threading.Lock()
    cache.mkdir()
    state = {"making": 0, "peak": 0, "seen": 0}
    most = 5 if isinstance(limit, int) else 3  # a ~1.1 kB shard: 3 fit in 4000 B

    def note(count):
        with lock:
            state["peak"] = max(state["peak"], count)

    def make(key):
        with lock:
            state["making"] += 1
            making = state["making"]
        note(on_disk(cache) + making)
        time.sleep(0.01)  # generation: the others' reservations are counted meanwhile
        with lock:
            state["making"] -= 1
        return np.full(1000, key % 250, np.uint8)

    done = threading.Event()

    def watch():
        while not done.is_set():
            note(on_disk(cache))
            state["seen"] += 1
            time.sleep(0.001)

    watcher = threading.Thread(target=watch, name="gluon_stream-test-watcher")
    watcher.start()
    try:
        src = gs.FunctionSource(range(40), make, cache_dir=cache, cache_limit=limit)
        with gs.ShardStream(src, prefetch=2, producers=2, generate_ahead=ahead) as stream:
            got = [int(shard.arrays[0][0]) for shard in stream]
    finally:
        done.set()
        watcher.join(JOIN_S)
    assert got == [k % 250 for k in range(40)]  # nothing lost while shards came and went
    assert state["seen"] > 10 and 0 < state["peak"] <= most, state
    assert on_disk(cache) <= most and not [f for f in os.listdir(cache) if f.startswith(".")]


def test_a_reservation_is_counted_by_every_generation_until_published(tmp_path):
    """A shard being made holds its room: with cache_limit=2, one shard cached and one being
    made, the next generation evicts the cached one first (it could not fit beside both)."""
    cache = LocalShardCache(tmp_path, lock_timeout=30, limit=2)
    cache.get_or_create("a", maker(cache, "a"))
    seen = {}

    def make_b():
        seen["during b"] = sorted(os.listdir(tmp_path))
        cache.get_or_create("c", maker(cache, "c"))  # another key, made while b is
        seen["after c"] = cached(tmp_path)
        return gs.write_shard(cache.temp_path("b", ".npy"), np.zeros(3))

    cache.get_or_create("b", make_b)
    assert len([f for f in seen["during b"] if f.endswith(cache_local.RESERVATION)]) == 1
    assert seen["after c"] == ["c.npy"]  # a went before c was made: b's room was held
    assert cached(tmp_path) == ["b.npy", "c.npy"] and hidden_files(tmp_path) == []


def maker(cache, name, size=3):
    """A ``create`` for ``cache``: writes a shard of ``size`` zeros to a temp file."""
    return lambda: gs.write_shard(cache.temp_path(name, ".npy"), np.zeros(size))


def waited_for_room(caplog) -> bool:
    return any("waits for one to be released" in r.getMessage() for r in caplog.records)


def test_room_is_made_before_publishing_never_over_the_limit(tmp_path, caplog):
    """cache_limit=2 holds a and b, both being read: making c waits for one of them rather than
    publish a third shard, then evicts the least recently used (was: c published, 3 files)."""
    caplog.set_level(logging.INFO, logger="gluon_stream")
    cache = LocalShardCache(tmp_path, lock_timeout=30, limit=2)
    a, _ = cache.get_or_create("a", maker(cache, "a"))
    b, _ = cache.get_or_create("b", maker(cache, "b"))
    os.utime(a, (1, 1))  # a is the least recently used
    result, errors = {}, []

    def make_c():
        try:
            result["c"] = cache.get_or_create("c", maker(cache, "c"))
        except Exception as exc:  # relayed to the test thread below
            errors.append(exc)

    thread = threading.Thread(target=make_c, name="gluon_stream-test-maker")
    with cache.reading(b), cache.reading(a):  # leaving the block releases both
        os.utime(a, (1, 1))
        thread.start()
        wait_for(lambda: (tmp_path / "c.npy").exists() or waited_for_room(caplog),
                 what="c to be published or to wait for room")
        assert cached(tmp_path) == ["a.npy", "b.npy"]  # never 3 shards
    thread.join(JOIN_S)
    assert not errors and result["c"] == (str(tmp_path / "c.npy"), False)
    assert cached(tmp_path) == ["b.npy", "c.npy"]  # a, the least recently used, went
    assert hidden_files(tmp_path) == []


def test_a_shard_just_made_is_not_evicted_before_it_is_read(tmp_path, caplog):
    """Another producer making room cannot take a shard made and not yet read."""
    caplog.set_level(logging.INFO, logger="gluon_stream")
    cache = LocalShardCache(tmp_path, lock_timeout=30, limit=1)
    with cache.pinned("a", maker(cache, "a")) as (a, hit):
        assert not hit
        maker_b = threading.Thread(target=cache.get_or_create, args=("b", maker(cache, "b")),
                                   name="gluon_stream-test-maker")
        maker_b.start()
        wait_for(lambda: waited_for_room(caplog), what="b to wait for room")
        with cache.reading(a) as local:
            np.testing.assert_array_equal(gs.load_shard(local)[0], np.zeros(3))
    maker_b.join(JOIN_S)
    assert cached(tmp_path) == ["b.npy"]


def test_a_cache_that_stays_pinned_raises_rather_than_exceed_its_limit(tmp_path):
    cache = LocalShardCache(tmp_path, lock_timeout=0.2, limit=1)
    a, _ = cache.get_or_create("a", maker(cache, "a"))
    with cache.reading(a), pytest.raises(gs.CacheFull, match=r"shard 'b': cache_limit \(1 "
                                                             r"shards\) leaves no room .*raise "
                                                             r"cache_limit"):
        cache.get_or_create("b", maker(cache, "b"))
    assert cached(tmp_path) == ["a.npy"] and hidden_files(tmp_path) == []
    small = LocalShardCache(tmp_path / "small", lock_timeout=10, limit="100B")
    with pytest.raises(gs.CacheFull, match=r"shard 'big' is \d+ bytes, more than cache_limit "
                                            r"\(100 bytes\)"):
        small.get_or_create("big", maker(small, "big", size=1000))
    assert os.listdir(tmp_path / "small") == []


def test_a_shard_in_use_elsewhere_counts_against_the_other_limit(tmp_path):
    """Another process (here another cache on the directory) reading a shard does not make
    this one wait: it evicts what it can and makes its shard (was: CacheFull after
    lock_timeout, or a hang beside a larger limit). Its own reads still fill its limit."""
    mine = LocalShardCache(tmp_path, lock_timeout=0.5, limit=1)
    other = LocalShardCache(tmp_path, lock_timeout=0.5, limit=3)
    a, _ = other.get_or_create("a", maker(other, "a"))
    c, _ = other.get_or_create("c", maker(other, "c"))
    with other.reading(a):
        assert mine.get_or_create("b", maker(mine, "b")) == (str(tmp_path / "b.npy"), False)
        assert cached(tmp_path) == ["a.npy", "b.npy"]  # c, unpinned, went; a is the other's
        with mine.reading(str(tmp_path / "b.npy")), pytest.raises(gs.CacheFull):
            mine.get_or_create("d", maker(mine, "d"))  # its own read fills its limit
    assert cached(tmp_path) == ["a.npy", "b.npy"] and hidden_files(tmp_path) == []


@pytest.mark.timeout(60)
def test_shards_growing_past_their_reservations_publish_without_waiting(tmp_path, caplog):
    """Two producers make 704-byte shards at once under '1000B', room reserved at the 192
    bytes seen so far: each shard, already on disk, publishes (was: each waited for the other,
    counted at the new size, to publish: stuck for lock_timeout, then CacheFull)."""
    caplog.set_level(logging.INFO, logger="gluon_stream")
    both = threading.Barrier(2, timeout=10)

    def make(key):
        if key in (1, 2):
            both.wait()  # the two large shards are made at once
        return np.zeros(8 if key == 0 else 72)  # files of 192 bytes, then of 704

    src = gs.FunctionSource(range(4), make, cache_dir=tmp_path, cache_limit="1000B",
                            lock_timeout=5)
    with gs.ShardStream(src, producers=2, prefetch=1, generate_ahead=0) as stream:
        assert [len(shard.arrays[0]) for shard in stream] == [8, 72, 72, 72]
    assert sum(os.path.getsize(tmp_path / name) for name in cached(tmp_path)) <= 1000
    assert hidden_files(tmp_path) == []


_LOCKER = r"""
import sys, threading
from gluon_stream._cache.lock import exclusive
lock, log, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
closed = threading.Event()
for _ in range(rounds):
    with exclusive(lock, 30, closed, lambda: TimeoutError(lock)):
        with open(log, "a") as fp:  # two writes: another holder would land between them
            fp.write("in\n")
            fp.flush()
            fp.write("out\n")
"""


@pytest.mark.timeout(120)
def test_the_eviction_lock_excludes_other_processes(tmp_path):
    """Room is made under this lock in every process: it must be a true mutex, though each
    holder removes the lock file (a waiter that opened the removed file must not take it)."""
    lock, log = tmp_path / ".cache-evict.lock", tmp_path / "log"
    procs = [subprocess.Popen([sys.executable, "-c", _LOCKER, str(lock), str(log), "200"],
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    errs = [p.communicate(timeout=JOIN_S)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], errs
    assert log.read_text() == "in\nout\n" * 600
    assert not lock.exists()


def test_a_shard_dated_in_the_future_ages_like_the_others(tmp_path, caplog):
    """A restored shard stamped a day ahead used to count as the most recently used forever: the
    three keys then shared two places and were made again every epoch (9 runs, not 3)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    np.save(cache / "restored.npy", np.zeros(3))
    ahead = time.time() + 86400
    os.utime(cache / "restored.npy", (ahead, ahead))
    calls = []

    def fn(key):
        calls.append(key)
        return np.full(3, ord(key))

    with gs.FunctionSource(["a", "b", "c"], fn, cache_dir=cache, cache_limit=3) as src:
        for epoch in range(3):
            for key in "abc":
                assert src.produce(key, epoch).arrays[0].tolist() == [ord(key)] * 3
    assert calls == ["a", "b", "c"]
    assert cached(cache) == ["a.npy", "b.npy", "c.npy"]
    (note,) = [r for r in caplog.records if "modified in the future" in r.getMessage()]
    assert note.levelname == "WARNING" and "restored.npy" in note.getMessage()


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
        # once each (in any order: producers='auto' may make two at once): the second pass
        # read the uploaded shards
        assert sorted(calls) == ["k-0", "k-1", "k-2"]
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


@pytest.mark.mxnet
def test_an_fsspec_cache_dir_counts_samples_after_the_first_pass(tmp_path):
    """len(), progress=True and even_batches on a fresh loader over an fsspec cache_dir raised
    TypeError: RemoteShardCache.num_samples() takes 2 positional arguments but 3 were given."""
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    fn = id_shards([4, 3, 5])
    try:
        src = gs.FunctionSource(range(3), fn, cache_dir="memory://gs-len")
        with gs.StreamLoader(src, batch_size=2, last_batch="keep", progress=True) as loader:
            with pytest.raises(TypeError, match=r"unknown for epoch 0: .*not in the cache yet"):
                len(loader)
            assert sorted(i for b in loader for i in batch_ids(b)) == all_ids([4, 3, 5])
            assert len(loader) == 6  # 12 samples, known once seen
        src = gs.FunctionSource(range(3), fn, cache_dir="memory://gs-len")
        with gs.StreamLoader(src, batch_size=2, even_batches=True, num_parts=2,
                             part_index=1) as loader:
            # strides of 4, 3, 5 going on from shard to shard: 6 rows a rank, 3 full batches
            assert len([b for b in loader]) == len(loader) == 3
    finally:
        fs.rm("/gs-len", recursive=True)


@pytest.mark.mxnet
@pytest.mark.parametrize("columns", [1, 2], ids=["npy", "npz"])
def test_an_fsspec_cache_dir_knows_sizes_from_headers_read_in_place(columns):
    """A fresh loader over an fsspec cache_dir holding every shard knows len() as a local
    cache does, reading a few KiB of each object (its headers), not its data."""
    fsspec = pytest.importorskip("fsspec")
    from fsspec.implementations.memory import MemoryFileSystem

    read = []

    class Counted:
        """A file of the store whose reads are counted."""

        def __init__(self, f):
            self.f, self.size = f, len(f.getbuffer())

        def read(self, n=-1):
            data = self.f.read(n)
            read.append(len(data))
            return data

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    class CountingMemoryFileSystem(MemoryFileSystem):
        protocol = "countedmem"

        @classmethod
        def _strip_protocol(cls, path):
            return super()._strip_protocol(path.replace("countedmem://", "memory://", 1))

        def _open(self, path, mode="rb", *args, **kwargs):
            f = super()._open(path, mode, *args, **kwargs)
            return Counted(f) if "r" in mode else f

    fsspec.register_implementation("countedmem", CountingMemoryFileSystem, clobber=True)
    sizes = [6, 50000, 3]  # 400 kB of data in k-1
    fn = lambda k: (np.arange(sizes[k], dtype=np.int64), np.zeros(sizes[k], np.float32))[:columns]  # noqa: E731
    try:
        with gs.StreamLoader(gs.FunctionSource(range(3), fn, cache_dir="memory://gs-sized"),
                             batch_size=4) as loader:
            assert sum(1 for _ in loader) == 2 + 12500 + 1
        fresh = gs.FunctionSource(range(3), fn, cache_dir="countedmem://gs-sized")
        with gs.StreamLoader(fresh, batch_size=4) as loader:
            read.clear()
            assert len(loader) == 2 + 12500 + 1
            # headers and an .npz's directory only (zipfile reads a member 4 KiB at a time),
            # not the 400 kB (.npy) or 600 kB (.npz) of k-1
            assert 0 < sum(read) < 16384, read
            before = sum(read)
            assert len(loader) == 2 + 12500 + 1 and sum(read) == before  # remembered
    finally:
        fsspec.filesystem("memory").rm("/gs-sized", recursive=True)


@pytest.fixture
def gated_memory():
    """A memory filesystem (``gatedmem://``) whose writes stop once a file is open, until the
    test opens the gate: an upload caught in the middle, as a slow store would show it."""
    fsspec = pytest.importorskip("fsspec")
    from fsspec.implementations.memory import MemoryFileSystem

    class GatedMemoryFileSystem(MemoryFileSystem):
        protocol = "gatedmem"
        opened = threading.Event()
        gate = threading.Event()

        @classmethod
        def _strip_protocol(cls, path):
            return super()._strip_protocol(path.replace("gatedmem://", "memory://", 1))

        def _open(self, path, mode="rb", *args, **kwargs):
            f = super()._open(path, mode, *args, **kwargs)
            if "w" in mode:
                self.opened.set()
                assert self.gate.wait(JOIN_S), "the test never opened the gate"
            return f

    fsspec.register_implementation("gatedmem", GatedMemoryFileSystem, clobber=True)
    try:
        yield GatedMemoryFileSystem
    finally:
        GatedMemoryFileSystem.gate.set()
        fsspec.filesystem("memory").rm("/gs-gated", recursive=True)


def test_an_upload_in_progress_is_never_found(gated_memory):
    """On a filesystem whose files appear when opened (memory://), a shard being uploaded was
    found empty by another producer: 'CorruptShard ... empty file (0 bytes)'."""
    cache = RemoteShardCache("gatedmem://gs-gated", lock_timeout=10)
    other = RemoteShardCache("gatedmem://gs-gated", lock_timeout=10)
    done = {}
    upload = threading.Thread(
        target=lambda: done.update(r=cache.get_or_create("k", maker(cache, "k"))),
        name="gluon_stream-test-upload")
    upload.start()
    try:
        assert gated_memory.opened.wait(JOIN_S)
        assert other.lookup("k") is None  # mid-upload: not there yet
    finally:
        gated_memory.gate.set()
        upload.join(JOIN_S)
    assert done["r"] == ("/gs-gated/k.npy", False)
    with other.reading(other.lookup("k")) as local:
        np.testing.assert_array_equal(gs.load_shard(local)[0], np.zeros(3))
    assert [p.rsplit("/", 1)[1] for p in cache.fs.ls("/gs-gated", detail=False)] == ["k.npy"]


# -- what made a cached shard: recipes ------------------------------------------------------------

@pytest.fixture
def xattrs(tmp_path):
    """Skip where tmp_path's file system has no user extended attributes (recipes live there)."""
    probe = tmp_path / "probe"
    probe.touch()
    try:
        os.setxattr(probe, "user.gluon_stream.probe", b"1")
    except (AttributeError, OSError) as exc:
        pytest.skip(f"no user extended attributes here: {exc}")
    finally:
        probe.unlink()


def stale_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelname == "WARNING" and "different recipe" in r.getMessage()]


def test_a_changed_command_regenerates_the_shard_with_a_warning(tmp_path, xattrs, caplog):
    with source(tmp_path, "ok", rows=10) as src:
        assert not src.produce("k1", 0).cache_hit
    with source(tmp_path, "ok", rows=4) as src:  # the same key, another fixed argument
        assert src.num_samples("k1", 0) is None  # the cached shard is stale: size unknown
        raw = src.produce("k1", 0)
    assert not raw.cache_hit and raw.arrays[0].shape == (4, 3)
    np.testing.assert_array_equal(raw.arrays[0], shard_values("k1", 4, 3))
    (warning,) = stale_warnings(caplog)
    assert "k1.npy" in warning and "argument 9: '10' -> '4'" in warning
    with source(tmp_path, "ok", rows=4) as src:
        assert src.num_samples("k1", 0) == 4 and src.produce("k1", 0).cache_hit
    assert len(runs(tmp_path)) == 2
    assert os.listdir(tmp_path / "cache") == ["k1.npy"]


def test_on_change_raise_refuses_a_stale_shard_and_keeps_it(tmp_path, xattrs):
    with source(tmp_path, "ok", rows=10) as src:
        src.produce("k1", 0)
    with source(tmp_path, "ok", rows=4, on_change="raise") as src:
        with pytest.raises(gs.StaleShard, match=r"k1.npy' was made by a different recipe "
                                                r"\(command argument 9: '10' -> '4'\)") as info:
            src.produce("k1", 0)
    assert info.value.key == "k1" and "'10' -> '4'" in info.value.change
    assert len(runs(tmp_path)) == 1
    assert gs.load_shard(tmp_path / "cache" / "k1.npy")[0].shape == (10, 3)
    with pytest.raises(ValueError, match=r"on_change must be 'regenerate' or 'raise'"):
        source(tmp_path, "ok", on_change="ignore")


def test_version_and_env_are_part_of_the_recipe(tmp_path, xattrs, caplog):
    for kw in ({}, {"version": "2"}, {"version": "2", "env": dict(os.environ, A="1")},
               {"version": "2", "env": dict(os.environ, A="2")}):
        with source(tmp_path, "ok", **kw) as src:
            assert not src.produce("k1", 0).cache_hit, kw
    with source(tmp_path, "ok", version="2", env=dict(os.environ, A="2")) as src:
        assert src.produce("k1", 0).cache_hit
    changes = " | ".join(stale_warnings(caplog))
    assert "version None -> '2'" in changes and "env= given" in changes
    assert "env= changed" in " ".join(r.getMessage() for r in caplog.records)
    assert "A=2" not in changes  # env values never reach the recipe (they may be secrets)


def test_function_source_version_and_key_type(tmp_path, xattrs, caplog):
    cache = tmp_path / "cache"
    with gs.FunctionSource([1], lambda k: np.full(2, 1), cache_dir=cache, version="a") as src:
        src.produce(1, 0)
    with gs.FunctionSource([1], lambda k: np.full(2, 2), cache_dir=cache, version="a") as src:
        assert src.produce(1, 0).arrays[0].tolist() == [1, 1]  # same version: reused
    with gs.FunctionSource([1], lambda k: np.full(2, 3), cache_dir=cache, version="b") as src:
        assert src.produce(1, 0).arrays[0].tolist() == [3, 3]
    with gs.FunctionSource(["1"], lambda k: np.full(2, 4), cache_dir=cache, version="b") as src:
        assert src.produce("1", 0).arrays[0].tolist() == [4, 4]  # fn('1') is not fn(1)
    changes = " | ".join(stale_warnings(caplog))
    assert "version 'a' -> 'b'" in changes and "key_type 'int' -> 'str'" in changes
    with pytest.raises(gs.UnsafeKey,
                       match=r"keys 1 and '1' are different keys with one cache file"):
        gs.FunctionSource([1, "1"], lambda k: np.zeros(2), cache_dir=cache).keys_for_epoch(0)
    src = gs.FunctionSource([1, np.int64(1), 1], lambda k: np.zeros(2), cache_dir=cache)
    assert len(src.keys_for_epoch(0)[0]) == 3  # one key, spelled twice: fine
    with pytest.raises(ValueError, match=r"version= .* needs a cache_dir"):
        gs.FunctionSource([1], lambda k: np.zeros(2), version="a")


def test_a_shard_without_a_recipe_is_served_with_one_warning(tmp_path, caplog):
    cache = tmp_path / "cache"
    cache.mkdir()
    for key in ("k1", "k2"):  # as an older gluon_stream (or a plain cp) left them
        np.save(cache / f"{key}.npy", shard_values(key, 10, 3))
    with source(tmp_path, "ok", keys=("k1", "k2")) as src:
        assert src.produce("k1", 0).cache_hit and src.produce("k2", 0).cache_hit
    notes = [r for r in caplog.records if "carries no record" in r.getMessage()]
    assert len(notes) == 1 and notes[0].levelname == "WARNING"
    assert runs(tmp_path) == []


@pytest.mark.timeout(120)
def test_a_shard_made_by_another_process_with_another_command_is_regenerated(tmp_path, xattrs):
    (tmp_path / "gate").touch()
    child = _spawn_child(tmp_path, "a")  # rows=50
    out, err = child.communicate(timeout=JOIN_S)
    assert child.returncode == 0 and out.strip() == "generated", err
    with source(tmp_path, "ok", rows=10) as src:
        raw = src.produce("k1", 0)
    assert not raw.cache_hit and raw.arrays[0].shape == (10, 3)
    child = _spawn_child(tmp_path, "b")  # the child's command again: stale once more
    out, err = child.communicate(timeout=JOIN_S)
    assert child.returncode == 0 and out.strip() == "generated", err
    assert np.load(tmp_path / "b.npy").shape == (50, 3)
    assert len(runs(tmp_path)) == 3 and hidden_files(tmp_path / "cache") == []


def test_switching_suffix_leaves_no_older_shard_to_find_first(tmp_path, xattrs):
    with source(tmp_path, "ok", rows=10) as src:
        src.produce("k1", 0)  # k1.npy
    cache = tmp_path / "cache"
    for hit in (False, True):
        with gs.FunctionSource(["k1"], lambda k: (np.zeros(4), np.ones(4)), cache_dir=cache,
                               version="2") as src:
            raw = src.produce("k1", 0)
        assert raw.cache_hit is hit and len(raw.arrays) == 2
        assert os.listdir(cache) == ["k1.npz"]  # the stale k1.npy would be looked up first


def test_the_demo_generator_with_other_arguments_does_not_reuse_shards(tmp_path, xattrs):
    """The demo scenario, without the training: --rows 4000, then --rows 500 --inputs 3."""
    from gluon_stream.tools.generator import generate, generator_command

    cache = tmp_path / "cache"
    for rows, inputs in ((4000, 8), (500, 3)):
        with gs.CommandSource(["2024-01-01"], generator_command(rows, inputs),
                              cache_dir=cache) as src:
            raw = src.produce("2024-01-01", 0)
        assert not raw.cache_hit
        np.testing.assert_array_equal(raw.arrays[0], generate("2024-01-01", rows, inputs))


@pytest.mark.mxnet
@pytest.mark.timeout(300)
def test_demo_rerun_with_other_rows_trains_on_new_shards(tmp_path, xattrs, capsys):
    from gluon_stream.cli import main

    common = ["demo", "--shards", "1", "--epochs", "1", "--delay", "0", "--batch-size", "4",
              "--plot", "", "--no-progress", "--cache-dir", str(tmp_path / "cache")]
    assert main(common + ["--rows", "200"]) == 0
    assert "epoch 0: 184 samples" in capsys.readouterr().out  # 200 rows - 16 time steps
    assert main(common + ["--rows", "100", "--inputs", "3"]) == 0
    assert "epoch 0: 84 samples" in capsys.readouterr().out  # not the first run's 184


# -- a read-only cache -----------------------------------------------------------------------------

_READ_ONLY_CHILD = r"""
import json, logging, sys
sys.path.insert(0, {tests!r})
import gluon_stream as gs
from fake_generator import command
seen = []
class Keep(logging.Handler):
    def emit(self, record):
        seen.append((record.levelname, record.getMessage()))
logging.getLogger("gluon_stream").addHandler(Keep())
logging.getLogger("gluon_stream").setLevel(logging.INFO)
src = gs.CommandSource(["k1", "k2", "k3"], command("ok", rows=5), cache_dir={cache!r},
                       cache_limit=1, retries=0)
out = {{"hits": [], "shapes": []}}
for key in ("k1", "k2", "k1"):
    raw = src.produce(key, 0)
    out["hits"].append(raw.cache_hit)
    out["shapes"].append(list(raw.arrays[0].shape))
try:
    src.produce("k3", 0)
except gs.ShardError as exc:
    out["missing"] = str(exc)
src.close()
out["logs"] = seen
print(json.dumps(out))
"""


@pytest.mark.timeout(120)
def test_a_complete_cache_on_a_read_only_file_system_serves_its_shards(tmp_path):
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) for a read-only bind mount")
    cache, mnt = tmp_path / "cache", tmp_path / "ro"
    mnt.mkdir()
    with gs.CommandSource(["k1", "k2"], command("ok", rows=5), cache_dir=cache) as src:
        for key in ("k1", "k2"):
            src.produce(key, 0)
    (cache / ".k9.lock").touch()  # stale files a writable cache would clean up
    code = _READ_ONLY_CHILD.format(tests=os.path.dirname(__file__), cache=str(mnt))
    script = (f"mount --bind {shlex.quote(str(cache))} {shlex.quote(str(mnt))} && "
              f"mount -o remount,bind,ro {shlex.quote(str(mnt))} && "
              f"exec {shlex.quote(sys.executable)} -c {shlex.quote(code)}")
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=JOIN_S)
    if probe.returncode != 0:
        pytest.skip(f"unshare -rm is not allowed here: {probe.stderr.decode()[:200]}")
    done = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True,
                          timeout=JOIN_S)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    assert out["hits"] == [True, True, True] and out["shapes"] == [[5, 3]] * 3
    assert "read-only cache_dir" in out["missing"] and "cannot be generated" in out["missing"]
    infos = [m for level, m in out["logs"] if "is read-only" in m]
    assert len(infos) == 1 and [lv for lv, m in out["logs"] if "is read-only" in m] == ["INFO"]
    assert not [m for level, m in out["logs"] if level in ("WARNING", "ERROR")]
    assert sorted(os.listdir(cache)) == [".k9.lock", "k1.npy", "k2.npy"]  # nothing evicted


def test_a_cache_whose_shards_cannot_be_touched_still_serves_them(tmp_path, monkeypatch, caplog):
    with source(tmp_path, "ok", keys=("k1", "k2")) as src:
        src.produce("k1", 0)
        src.produce("k2", 0)

    def read_only_utime(path, *a, **kw):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(os, "utime", read_only_utime)
    caplog.set_level(logging.INFO, logger="gluon_stream")
    with source(tmp_path, "ok", keys=("k1", "k2")) as src:
        assert [src.produce(k, 0).cache_hit for k in ("k1", "k2", "k1")] == [True] * 3
    notes = [r for r in caplog.records if "cannot update the last-used time" in r.getMessage()]
    assert len(notes) == 1 and notes[0].levelname == "INFO"
    assert len(runs(tmp_path)) == 2


def test_a_cache_remounted_read_only_while_running_says_so(tmp_path, monkeypatch):
    def read_only(self, name, timed_out):
        raise OSError(errno.EROFS, "Read-only file system", self.lock_path(name))

    with source(tmp_path, "ok") as src:
        monkeypatch.setattr(cache_local.LocalShardCache, "_locked", read_only)
        with pytest.raises(gs.ShardError, match=r"'k1' is not in the read-only cache_dir .* "
                                                r"cannot be generated there"):
            src.produce("k1", 0)
    assert runs(tmp_path) == []


def test_a_shard_evicted_between_its_lookup_and_its_recipe_is_made_again(tmp_path, monkeypatch):
    """Another shard's room-making may evict a shard between finding it and reading what made
    it: that is a miss (made again), not a FileNotFoundError out of the loop."""
    made = []

    def fn(key):
        made.append(key)
        return np.arange(3, dtype=np.int64)

    with gs.ShardStream(gs.FunctionSource(["a"], fn, cache_dir=tmp_path)) as stream:
        assert [len(s) for s in stream] == [3]
    real = cache_local.LocalShardCache.recipe_of
    vanished = []

    def evicted_meanwhile(self, path):
        if not vanished:
            vanished.append(path)
            os.unlink(path)
        return real(self, path)

    monkeypatch.setattr(cache_local.LocalShardCache, "recipe_of", evicted_meanwhile)
    with gs.ShardStream(gs.FunctionSource(["a"], fn, cache_dir=tmp_path)) as stream:
        assert [len(s) for s in stream] == [3]
    assert vanished and made == ["a", "a"]


_PICKLED_CACHE_CHILD = """
import os, pickle, sys
import numpy as np
cache = pickle.loads(sys.stdin.buffer.read())
def make(name):
    def create():
        tmp = cache.temp_path(name, ".npy")
        np.save(tmp, np.arange(3, dtype=np.int64))
        return tmp
    return create
hits = [cache.get_or_create(key, make(key))[1] for key in ("a", "b")]
print(hits, sorted(os.listdir(cache.root)))
"""


def test_a_pickled_cache_keeps_its_limit_in_another_process(tmp_path):
    """A cache travels to a remote executor's worker by pickle: there it still evicts to stay
    within cache_limit (the room it holds comes along), and its closed flag is a fresh one."""
    import pickle

    cache = LocalShardCache(tmp_path / "c", lock_timeout=10, limit=1)
    with cache.pinned("a", lambda: _saved(cache, "a")) as (_, hit):
        assert not hit
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
        os.path.dirname(os.path.dirname(gs.__file__)), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", _PICKLED_CACHE_CHILD], input=pickle.dumps(cache),
                          capture_output=True, env=env, timeout=120, check=True)
    assert done.stdout.decode().split() == ["[True,", "False]", "['b.npy']"]
    assert sorted(os.listdir(cache.root)) == ["b.npy"]


def _saved(cache: LocalShardCache, name: str) -> str:
    tmp = cache.temp_path(name, ".npy")
    np.save(tmp, np.arange(3, dtype=np.int64))
    return tmp


@pytest.mark.mxnet
def test_cache_limit_1_with_shards_made_at_once_does_not_deadlock(tmp_path):
    """cache_limit=1 while 2 shards are made at once (default prefetch, producers=2): the one
    waiting for room waits with the eviction lock released, so the shard being made publishes
    (it waited holding the lock, the other could not publish: stuck for lock_timeout, then
    CacheFull)."""
    def shard(key):
        time.sleep(0.05)
        return np.arange(100, dtype=np.float32) + 1000 * key

    src = gs.FunctionSource(range(4), shard, cache_dir=str(tmp_path), cache_limit=1,
                            lock_timeout=5)
    loader = gs.StreamLoader(src, batch_size=10, producers=2)
    try:
        rows = [v for batch in loader for v in batch.asnumpy().tolist()]
    finally:
        loader.close()
    assert sorted(rows) == sorted(v for k in range(4) for v in shard(k).tolist())
    assert len([p for p in tmp_path.iterdir() if p.suffix == ".npy"]) <= 1


_SHARER = r"""
import json, os, sys, threading, time
import numpy as np
import gluon_stream as gs
from gluon_stream._cache import LocalShardCache
from gluon_stream._cache.room import RESERVATION

cache, gate, limit, producers, prefetch, ahead = sys.argv[1:7]
limit = int(limit) if limit.isdigit() else limit
mine = f".{os.getpid()}."
seen = {"reserved": 0}
done = threading.Event()

def watch():  # the shards this process is making, as its reservations show them
    while not done.is_set():
        names = os.listdir(cache)
        seen["reserved"] = max(seen["reserved"], sum(1 for n in names
                                                     if mine in n and n.endswith(RESERVATION)))
        time.sleep(0.001)

def shard(key):
    time.sleep(0.02)
    return np.arange(7, dtype=np.int64) + 100 * key

checks = {"additions": 0, "broken": []}
make_room = LocalShardCache._make_room

def checked(self, name, size, replacing=True, **older):
    # the rule of docs/caches.md, checked where room is made for a new shard, under the lock
    # (so no shard or reservation is added meanwhile): everything fits the limit, or every
    # shard left was pinned when eviction tried it and this process's own shards being made,
    # with the new one, fit the limit
    if replacing or not isinstance(limit, int):
        return make_room(self, name, size, replacing, **older)
    refused, try_evict = set(), self.try_evict
    def trying(path):
        gone = try_evict(path)
        if not gone:
            refused.add(path)
        return gone
    self.try_evict = trying
    try:
        fits = make_room(self, name, size, replacing, **older)
    finally:
        del self.try_evict
    if fits:
        finished = {path for _, path, _ in self.listing()}
        making = sum(1 for n in os.listdir(cache) if n.endswith(RESERVATION))
        own = len(self._room._reserved) + 1
        if len(finished) + making + 1 > limit and (finished - refused or own > limit):
            checks["broken"].append((name, len(finished), making, own))
        checks["additions"] += 1
    return fits

LocalShardCache._make_room = checked

open(os.path.join(gate, f"ready-{os.getpid()}"), "x").close()
deadline = time.monotonic() + 60
while not os.path.exists(os.path.join(gate, "go")) and time.monotonic() < deadline:
    time.sleep(0.005)  # all start at once (imports take different times)

src = gs.FunctionSource(range(24), shard, cache_dir=cache, cache_limit=limit, lock_timeout=60)
watcher = threading.Thread(target=watch, name="gluon_stream-test-watcher")
watcher.start()
try:
    with gs.ShardStream(src, producers=int(producers), prefetch=int(prefetch),
                        generate_ahead=ahead if ahead == "auto" else int(ahead)) as stream:
        with gs.StreamLoader(stream, batch_size=5) as loader:
            batches = [b.asnumpy().tolist() for b in loader]
finally:
    done.set()
    watcher.join()
print(json.dumps({"batches": batches, "reserved": seen["reserved"], **checks}))
"""


@pytest.mark.mxnet
@pytest.mark.timeout(240)
def test_processes_with_different_limits_on_one_cache_all_finish(tmp_path):
    """Real processes share one cache_dir with different cache_limits, producers and
    prefetch. Each finishes with every batch exact, never making more shards at once than its
    own limit (was: the limit-2 process waited for room holding the eviction lock, which the
    limit-6 one needed to publish the shard that would end the wait: both stuck until
    lock_timeout). Each checks the rule of docs/caches.md wherever it makes room. A hang fails
    the test at the timeout instead of hanging the suite."""
    cache = tmp_path / "cache"
    cache.mkdir()
    settings = [(2, 2, 2, "auto"), (6, 2, 2, "auto"), (1, 3, 2, "0"), ("400B", 3, 3, "1")]
    rows = [v for k in range(24) for v in range(100 * k, 100 * k + 7)]
    expected = [rows[i:i + 5] for i in range(0, len(rows), 5)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
        os.path.dirname(os.path.dirname(gs.__file__)), os.environ.get("PYTHONPATH")]))}
    procs = [subprocess.Popen([sys.executable, "-c", _SHARER, str(cache), str(tmp_path)]
                              + [str(s) for s in setting], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env)
             for setting in settings]
    try:
        wait_for(lambda: len(list(tmp_path.glob("ready-*"))) == len(procs)
                 or any(p.poll() is not None for p in procs), 60, "the processes to start")
        (tmp_path / "go").touch()
        outs = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            if not p.stdout.closed:  # its pipes, on the way out of a failure
                p.communicate(timeout=JOIN_S)
    assert [p.returncode for p in procs] == [0] * len(procs), [err[-2000:] for _, err in outs]
    for setting, (out, _) in zip(settings, outs):
        result = json.loads(out)
        assert result["batches"] == expected, setting
        assert result["reserved"] >= 1 and result["broken"] == [], (setting, result)
        if isinstance(setting[0], int):  # a byte limit counts bytes, not shards
            assert result["reserved"] <= setting[0] and result["additions"] >= 1, setting
    assert hidden_files(cache) == []
