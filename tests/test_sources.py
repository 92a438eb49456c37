"""CommandSource and the shard cache against a real, misbehaving generator process.

Every generator run is counted (``count`` file) and its pids logged, so the tests prove what
ran, how often and what is still alive, with events and files rather than sleeps.
"""
from __future__ import annotations

import errno
import os
import pickle
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import psutil
import pytest

import gluon_stream as gs
from conftest import JOIN_S, dead, wait_for
from fake_generator import command, read_lines, shard_values
from gluon_stream import sources

def hidden_files(directory) -> list[str]:
    """Temp and lock files (dot files) left in a cache directory."""
    return sorted(n for n in os.listdir(directory) if n.startswith("."))


def source(tmp_path, mode="ok", keys=("k1",), **kw):
    kw.setdefault("retries", 0)
    kw.setdefault("backoff", 0.01)
    kw.setdefault("timeout", 20)
    gate = kw.pop("gate", False)
    modes = kw.pop("modes", None)
    rows = kw.pop("rows", 10)
    return gs.CommandSource(list(keys), command(mode, workdir=tmp_path, modes=modes, gate=gate,
                                                rows=rows),
                            cache_dir=tmp_path / "cache", **kw)


def runs(tmp_path) -> list[str]:
    return read_lines(tmp_path / "count")


# -- generator failures ------------------------------------------------------------------------

def test_nonzero_exit_raises_shard_error_after_the_retries_with_the_stderr_tail(tmp_path):
    with source(tmp_path, "exit-nonzero", retries=2) as src:
        with pytest.raises(gs.ShardError, match=r"(?s)'k1'.*exit code 3.*upstream data missing") as info:
            src.produce("k1", 0)
    assert len(runs(tmp_path)) == 3  # one run plus two retries, then it gives up
    err = info.value
    assert err.key == "k1" and err.returncode == 3 and err.argv[0] == sys.executable
    assert err.stderr_tail.endswith("cannot produce k1: upstream data missing")
    assert "gave up after 3 attempts" in str(err)
    assert hidden_files(tmp_path / "cache") == [] and os.listdir(tmp_path / "cache") == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["hang", "grandchild-hang"])
def test_hang_raises_shard_timeout_and_kills_the_whole_process_group(tmp_path, mode):
    timeout = 1.0
    with source(tmp_path, mode, timeout=timeout) as src:
        start = time.monotonic()
        with pytest.raises(gs.ShardTimeout, match=r"'k1'.*timeout=1.0 s.*process group"):
            src.produce("k1", 0)
        elapsed = time.monotonic() - start
    assert elapsed < timeout + 1.0  # start-up is inside the timeout; killing takes milliseconds
    pids = [int(p) for p in read_lines(tmp_path / "pids")]
    assert len(pids) == (2 if mode == "grandchild-hang" else 1)
    for pid in pids:
        wait_for(lambda: dead(pid), 5, f"pid {pid} to die")
    assert os.listdir(tmp_path / "cache") == []


def test_a_grandchild_left_running_by_a_successful_generator_is_killed(tmp_path):
    with source(tmp_path, "grandchild") as src:
        raw = src.produce("k1", 0)
    np.testing.assert_array_equal(raw.arrays[0], shard_values("k1", 10, 3))
    generator, grandchild = (int(p) for p in read_lines(tmp_path / "pids"))
    wait_for(lambda: dead(grandchild), 5, "the grandchild to die")
    assert dead(generator)


def test_exit_zero_without_a_file_fails_at_once_without_polling(tmp_path):
    with source(tmp_path, "no-file", retries=1) as src:
        with pytest.raises(gs.ShardError, match=r"exited 0 but wrote no file"):
            src.produce("k1", 0)
    assert len(runs(tmp_path)) == 2  # each run checked once: no waiting for a file to appear
    assert os.listdir(tmp_path / "cache") == []


@pytest.mark.parametrize("mode, reason", [
    ("truncated", r"truncated"),
    ("empty", r"empty file"),
    ("junk", r"junk appended"),
    ("forged", r"truncated: header says \(100000, 100000\)"),
    ("garbage", r"bad magic"),
])
def test_bad_output_raises_corrupt_shard_and_leaves_no_file(tmp_path, mode, reason):
    with source(tmp_path, mode) as src:
        with pytest.raises(gs.CorruptShard, match=reason) as info:
            src.produce("k1", 0)
    assert "delete it" in str(info.value)  # the fix is in the message
    assert os.listdir(tmp_path / "cache") == []  # the bad temp file is gone, nothing cached


@pytest.mark.parametrize("mode", ["pickle", "object"])
def test_pickles_and_object_arrays_are_unsafe_and_never_unpickled(tmp_path, mode):
    with source(tmp_path, mode, retries=2) as src:
        with pytest.raises(gs.UnsafeShard, match=r"pickle"):
            src.produce("k1", 0)
    assert len(runs(tmp_path)) == 1  # unsafe output is not retried
    assert not list(tmp_path.rglob("*.marker"))
    assert os.listdir(tmp_path / "cache") == []


def test_the_pickle_payload_is_really_hostile(tmp_path):
    """Control for the test above: unpickling the generator's output does create the marker."""
    out = tmp_path / "p.npy"
    subprocess.run(command("pickle")[:2] + ["--mode", "pickle", "--key", "k", "--out", str(out)],
                   check=True, timeout=JOIN_S)
    pickle.loads(out.read_bytes())  # what np.load(allow_pickle=True) would do
    assert (tmp_path / "p.npy.marker").exists()
    with pytest.raises(gs.UnsafeShard):
        gs.load_shard(out)


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


def test_stderr_capture_is_bounded(tmp_path):
    with source(tmp_path, "stderr-flood") as src:
        with pytest.raises(gs.ShardError, match=r"exit code 4") as info:
            src.produce("k1", 0)
    tail = info.value.stderr_tail
    assert tail.endswith("flood done") and len(tail) <= sources.STDERR_TAIL_BYTES


# -- atomic writes, locks, cleanup ---------------------------------------------------------

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
from gluon_stream import sources
from fake_generator import command
real_acquire = sources._ShardCache._acquire
def acquire(self, lock, name):  # instrumented: announce the wait for the key's lock
    open({waiting!r}, "w").close()
    return real_acquire(self, lock, name)
sources._ShardCache._acquire = acquire
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
    real_acquire = sources._ShardCache._acquire

    def acquire(self, lock, name):
        waiting.set()
        return real_acquire(self, lock, name)

    monkeypatch.setattr(sources._ShardCache, "_acquire", acquire)

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


def test_disk_full_in_the_generator_is_reported_as_such_and_not_retried(tmp_path):
    with source(tmp_path, "enospc", retries=3) as src:
        with pytest.raises(gs.ShardError, match=r"(?s)disk full.*No space left on device") as info:
            src.produce("k1", 0)
    assert info.value.disk_full
    assert len(runs(tmp_path)) == 1
    assert os.listdir(tmp_path / "cache") == []  # the partial output is removed


def test_disk_full_while_caching_a_function_shard_leaves_no_partial_file(tmp_path, monkeypatch):
    real_write = np.lib.format.write_array

    def write_then_fill_disk(fp, array, **kw):
        real_write(fp, array[: len(array) // 2], **kw)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(np.lib.format, "write_array", write_then_fill_disk)
    src = gs.FunctionSource(["k1"], lambda k: np.ones((100, 3)), cache_dir=tmp_path / "cache")
    with src, pytest.raises(gs.ShardError, match=r"disk full.*free space") as info:
        src.produce("k1", 0)
    assert info.value.disk_full
    assert os.listdir(tmp_path / "cache") == []


# -- hostile keys and paths --------------------------------------------------------------------

HOSTILE_KEYS = ["a;touch X", "$(id)", "../../x", "a/b", "", "a\0b", "-rf", "k" * 300,
                ".hidden", "a b", "x\ny", "..", "`id`"]


@pytest.mark.parametrize("key", HOSTILE_KEYS)
def test_hostile_keys_are_refused_before_any_process_starts(tmp_path, key, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = set(os.listdir(tmp_path))
    src = source(tmp_path, "ok", keys=["good", key])
    with src:
        with pytest.raises(ValueError, match=r"shard key .* is not allowed"):
            src.keys_for_epoch(0)  # the whole epoch is refused up front
        with pytest.raises(ValueError, match=r"not allowed"):
            src.produce(key, 0)
        with pytest.raises(ValueError, match=r"not allowed"), \
                gs.ShardStream(src) as stream:
            list(stream)
    assert runs(tmp_path) == []  # no generator ever ran, not even for the good key
    assert set(os.listdir(tmp_path)) == before | {"cache"}
    assert os.listdir(tmp_path / "cache") == []


def test_arguments_are_substituted_literally_in_one_pass(tmp_path):
    cache = tmp_path / "{epoch}-{key}"
    src = gs.CommandSource(["k1"], ["gen", "--out={path}", "{key}", "$HOME;{epoch}"],
                           cache_dir=cache)
    with src:
        argv = src.argv_for("k1", 3, str(cache / "x.npy"))
    assert argv == ["gen", f"--out={cache}/x.npy", "k1", "$HOME;3"]


def test_ordinary_keys_pass():
    import datetime

    for key in ["2024-01-01", 17, datetime.date(2024, 1, 2), "user@host", "a.b_c-d", "x=1,y=2"]:
        assert sources.validate_key(key) == str(key)


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


# -- close() and waiting ---------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_close_during_a_30_s_generator_run_returns_fast_and_kills_it(tmp_path):
    src = source(tmp_path, "grandchild-hang", timeout=30)
    errors = []

    def produce():
        try:
            src.produce("k1", 0)
        except gs.StreamError as exc:
            errors.append(exc)

    worker = threading.Thread(target=produce, name="gluon_stream-test-producer")
    worker.start()
    try:
        wait_for(lambda: "grandchild" in read_lines(tmp_path / "started"), 30, "the grandchild")
        start = time.monotonic()
        src.close()
        worker.join(JOIN_S)
        elapsed = time.monotonic() - start
        src.close()  # idempotent
    finally:
        src.close()
        worker.join(JOIN_S)
    assert elapsed < 2.0
    assert len(errors) == 1 and isinstance(errors[0], gs.LoaderClosed)
    for pid in (int(p) for p in read_lines(tmp_path / "pids")):
        wait_for(lambda: dead(pid), 5, f"pid {pid} to die")
    assert os.listdir(tmp_path / "cache") == []
    with pytest.raises(gs.LoaderClosed):
        src.produce("k1", 0)


@pytest.mark.timeout(60)
def test_waiting_for_a_slow_generator_does_not_busy_wait(tmp_path):
    src = source(tmp_path, "ok", gate=True)
    worker = threading.Thread(target=src.produce, args=("k1", 0), name="gluon_stream-test-producer")
    worker.start()
    try:
        wait_for(lambda: read_lines(tmp_path / "started"), 30, "the generator to start")
        me = psutil.Process()
        cpu0 = sum(me.cpu_times()[:2])
        time.sleep(1.0)  # the measured window: the producer thread waits on the generator
        cpu = sum(me.cpu_times()[:2]) - cpu0
    finally:
        (tmp_path / "gate").touch()
        worker.join(JOIN_S)
        src.close()
    assert cpu < 0.25, f"{cpu:.2f} s of CPU spent waiting 1 s for a generator"
