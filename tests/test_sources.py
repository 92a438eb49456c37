"""CommandSource and the shard cache against a real, misbehaving generator process.

Every generator run is counted (``count`` file) and its pids logged, so the tests prove what
ran, how often and what is still alive, with events and files rather than sleeps.
"""
from __future__ import annotations

import errno
import os
import pickle
import re
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import psutil
import pytest

import gluon_stream as gs
from _helpers import JOIN_S, dead, wait_for
from fake_generator import command, hidden_files, read_lines, shard_values
from fake_generator import command_source as source
from fake_generator import generator_runs as runs
from gluon_stream.sources import _process

# -- generator failures ------------------------------------------------------------------------

FAILED_K1 = ["k1.failed.json"]  # only the failure, recorded beside the shard (no temp file)


def test_nonzero_exit_raises_shard_error_after_the_retries_with_the_stderr_tail(tmp_path):
    with source(tmp_path, "exit-nonzero", retries=2) as src:
        with pytest.raises(gs.ShardError,
                           match=r"(?s)'k1'.*exit code 3.*upstream data missing") as info:
            src.produce("k1", 0)
    assert len(runs(tmp_path)) == 3  # one run plus two retries, then it gives up
    err = info.value
    assert err.key == "k1" and err.returncode == 3 and err.argv[0] == sys.executable
    assert err.stderr_tail.endswith("cannot produce k1: upstream data missing")
    assert "gave up after 3 attempts" in str(err)
    assert hidden_files(tmp_path / "cache") == [] and os.listdir(tmp_path / "cache") == FAILED_K1


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
        wait_for(lambda pid=pid: dead(pid), 5, f"pid {pid} to die")
    assert os.listdir(tmp_path / "cache") == FAILED_K1


def test_a_grandchild_left_running_by_a_successful_generator_is_killed(tmp_path):
    with source(tmp_path, "grandchild") as src:
        raw = src.produce("k1", 0)
    np.testing.assert_array_equal(raw.arrays[0], shard_values("k1", 10, 3))
    generator, grandchild = (int(p) for p in read_lines(tmp_path / "pids"))
    wait_for(lambda: dead(grandchild), 5, "the grandchild to die")
    assert dead(generator)


def test_a_generator_runs_in_a_process_group_of_its_own_in_this_session(tmp_path):
    """Its own group, so that a kill reaches its children too; on Python 3.11+ in the loader's
    session (a new session is a new scheduling autogroup on Linux, which slowed generators
    started together), on 3.9 and 3.10 in a session of its own."""
    groups = tmp_path / "groups"
    src = gs.CommandSource(["k1", "k2"], command("ok") + ["--groups", str(groups)],
                           cache_dir=str(tmp_path / "cache"))
    with src:
        for key in ("k1", "k2"):
            src.produce(key, 0)
    runs_seen = [tuple(int(x) for x in line.split()) for line in read_lines(groups)]
    assert len(runs_seen) == 2
    for pid, pgid, sid in runs_seen:
        assert pgid == pid != os.getpgid(0)
        assert (sid == os.getsid(0)) == (sys.version_info >= (3, 11))


def test_exit_zero_without_a_file_fails_at_once_without_polling(tmp_path):
    with source(tmp_path, "no-file", retries=1) as src:
        with pytest.raises(gs.ShardError, match=r"exited 0 but wrote no file"):
            src.produce("k1", 0)
    assert len(runs(tmp_path)) == 2  # each run checked once: no waiting for a file to appear
    assert os.listdir(tmp_path / "cache") == FAILED_K1


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
    assert os.listdir(tmp_path / "cache") == FAILED_K1  # the bad temp file is gone, nothing cached


@pytest.mark.parametrize("mode", ["pickle", "object"])
def test_pickles_and_object_arrays_are_unsafe_and_never_unpickled(tmp_path, mode):
    with source(tmp_path, mode, retries=2) as src:
        with pytest.raises(gs.UnsafeShard, match=r"pickle"):
            src.produce("k1", 0)
    assert len(runs(tmp_path)) == 1  # unsafe output is not retried
    assert not list(tmp_path.rglob("*.marker"))
    assert os.listdir(tmp_path / "cache") == FAILED_K1


def test_the_pickle_payload_is_really_hostile(tmp_path):
    """Control for the test above: unpickling the generator's output does create the marker."""
    out = tmp_path / "p.npy"
    subprocess.run(command("pickle")[:2] + ["--mode", "pickle", "--key", "k", "--out", str(out)],
                   check=True, timeout=JOIN_S)
    pickle.loads(out.read_bytes())  # what np.load(allow_pickle=True) would do
    assert (tmp_path / "p.npy.marker").exists()
    with pytest.raises(gs.UnsafeShard):
        gs.load_shard(out)


def test_stderr_capture_is_bounded(tmp_path):
    with source(tmp_path, "stderr-flood") as src:
        with pytest.raises(gs.ShardError, match=r"exit code 4") as info:
            src.produce("k1", 0)
    tail = info.value.stderr_tail
    assert tail.endswith("flood done") and len(tail) <= _process.STDERR_TAIL_BYTES


# -- atomic writes, locks, cleanup ---------------------------------------------------------


@pytest.mark.parametrize("mode, text", [
    ("enospc", "No space left on device"),
    ("short-write", "8192 requested and 0 written"),  # numpy's tofile on a full disk: no errno
])
def test_disk_full_in_the_generator_is_reported_as_such_and_not_retried(tmp_path, mode, text):
    with source(tmp_path, mode, retries=3) as src:
        with pytest.raises(gs.ShardError, match=rf"(?s)disk full.*{text}") as info:
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


def test_arguments_are_substituted_literally_in_one_pass(tmp_path):
    cache = tmp_path / "{epoch}-{key}"
    src = gs.CommandSource(["k1"], ["gen", "--out={path}", "{key}", "$HOME;{epoch}"],
                           cache_dir=cache)
    with src:
        argv = src.argv_for("k1", 3, str(cache / "x.npy"))
    assert argv == ["gen", f"--out={cache}/x.npy", "k1", "$HOME;3"]


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
        wait_for(lambda pid=pid: dead(pid), 5, f"pid {pid} to die")
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


# -- what a generator leaves at {path}, and the file system around it ---------------------------

def test_a_directory_at_path_is_a_shard_error_and_is_removed(tmp_path):
    with source(tmp_path, "directory") as src:
        with pytest.raises(gs.ShardError, match=r"made a directory at .*\(removed\); it must "
                                                r"write a regular file"):
            src.produce("k1", 0)
    assert os.listdir(tmp_path / "cache") == FAILED_K1


def test_a_directory_left_at_a_temp_path_by_a_crashed_run_is_cleaned_up(tmp_path):
    dead_pid = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True).stdout.strip()
    left = tmp_path / "cache" / f".k1.{dead_pid}.deadbeef.tmp.npy"
    left.mkdir(parents=True)
    (left / "inside.npy").write_bytes(b"partial")
    with source(tmp_path, "ok") as src:  # the constructor used to raise IsADirectoryError
        raw = src.produce("k1", 0)
    np.testing.assert_array_equal(raw.arrays[0], shard_values("k1", 10, 3))
    assert os.listdir(tmp_path / "cache") == ["k1.npy"]


@pytest.mark.timeout(60)
def test_a_fifo_at_path_is_never_opened(tmp_path):
    with source(tmp_path, "fifo") as src:
        with pytest.raises(gs.ShardError, match=r"made a FIFO, socket or device at .*\(removed\)"):
            src.produce("k1", 0)
    assert os.listdir(tmp_path / "cache") == FAILED_K1


@pytest.mark.timeout(60)
def test_file_source_refuses_a_fifo_without_blocking_and_reads_a_directory(tmp_path):
    np.save(tmp_path / "b.npy", np.arange(3.0))
    np.savez(tmp_path / "a.npz", x=np.zeros((2, 2)), y=np.arange(2))
    (tmp_path / "notes.txt").write_text("not a shard")
    os.mkfifo(tmp_path / "pipe.npy")
    with gs.FileSource([str(tmp_path / "pipe.npy")]) as src:
        with pytest.raises(gs.CorruptShard, match=r"FIFO"):
            src.produce(str(tmp_path / "pipe.npy"), 0)
        with pytest.raises(gs.CorruptShard, match=r"FIFO"):
            src.num_samples(str(tmp_path / "pipe.npy"), 0)
    with gs.FileSource(str(tmp_path)) as src:  # a directory means its .npy/.npz files
        keys, finite = src.keys_for_epoch(0)
        assert finite and keys == [str(tmp_path / "a.npz"), str(tmp_path / "b.npy")]
        assert [len(src.produce(k, 0).arrays) for k in keys] == [2, 1]
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no .npy/.npz files in"):
        gs.FileSource(str(tmp_path / "empty"))


@pytest.mark.parametrize("mode, suffix, found", [("np-savez", ".npy", ".tmp.npy.npz"),
                                                 ("np-save", ".npz", ".tmp.npz.npy")])
def test_numpy_adding_a_suffix_to_path_is_explained_and_cleaned_up(tmp_path, mode, suffix, found):
    with source(tmp_path, mode, suffix=suffix) as src:
        with pytest.raises(gs.ShardError, match=rf"wrote '[^']*{re.escape(found)}' \(removed\) "
                                                r"instead of .*np.save/np.savez add .*open file"
                           ) as info:
            src.produce("k1", 0)
    assert ("suffix='.npz'" in str(info.value)) is (mode == "np-savez")
    assert os.listdir(tmp_path / "cache") == FAILED_K1


def test_a_short_write_while_caching_a_function_shard_is_disk_full(tmp_path, monkeypatch):
    def short_write(fp, array, **kw):
        raise OSError("800 requested and 0 written")  # numpy's tofile sets no errno

    monkeypatch.setattr(np.lib.format, "write_array", short_write)
    src = gs.FunctionSource(["k1"], lambda k: np.ones((100, 3)), cache_dir=tmp_path / "cache")
    with src, pytest.raises(gs.ShardError, match=r"disk full") as info:
        src.produce("k1", 0)
    assert info.value.disk_full and gs._utils.retry.is_permanent(info.value)
    assert os.listdir(tmp_path / "cache") == []


def test_a_missing_program_is_not_retried(tmp_path, monkeypatch):
    starts = []
    real_run = _process.ProgramRunner.run

    def counting_run(self, argv, **kw):
        starts.append(argv[0])
        return real_run(self, argv, **kw)

    monkeypatch.setattr(_process.ProgramRunner, "run", counting_run)
    src = gs.CommandSource(["k1"], [str(tmp_path / "no-such-gen"), "{path}"],
                           cache_dir=tmp_path / "cache", retries=2, backoff=0.01)
    with src, pytest.raises(gs.CommandNotFound, match=r"cannot start .*no-such-gen.*not retried"):
        src.produce("k1", 0)
    assert starts == [str(tmp_path / "no-such-gen")]  # once, not three times
    assert isinstance(gs.CommandNotFound("x"), gs.ShardError)


def test_cache_dir_deleted_mid_run_is_recreated(tmp_path, caplog):
    cache = tmp_path / "cache"
    src = gs.FunctionSource(["k1", "k2"], lambda k: np.full(3, int(k[1])), cache_dir=cache)
    with src:
        src.produce("k1", 0)
        shutil.rmtree(cache)
        raw = src.produce("k2", 0)
    assert raw.arrays[0].tolist() == [2, 2, 2] and os.listdir(cache) == ["k2.npy"]
    assert any("was deleted" in r.getMessage() for r in caplog.records)


def test_cache_dir_deleted_while_a_generator_runs_is_recreated(tmp_path, caplog):
    with source(tmp_path, "delete-cache-once") as src:
        raw = src.produce("k1", 0)
    np.testing.assert_array_equal(raw.arrays[0], shard_values("k1", 10, 3))
    assert len(runs(tmp_path)) == 2  # the run whose output went with the directory, then one more
    assert os.listdir(tmp_path / "cache") == ["k1.npy"]
    assert any("was deleted" in r.getMessage() and r.levelname == "WARNING"
               for r in caplog.records)


def test_through_the_parent_death_wrapper_the_program_sees_its_own_env_and_errors(tmp_path):
    """On Linux a program starts through a small Python image that sets its parent-death
    signal: it must see exactly the env it was given (no LC_CTYPE from Python's locale
    coercion), and a program that cannot be started is still the OSError Popen raised."""
    out, closed = tmp_path / "env", threading.Event()
    runner = _process.ProgramRunner()
    env = {"PATH": "/usr/bin:/bin", "GS_TEST": "1"}
    result = runner.run(["sh", "-c", 'env > "$0"', str(out)], timeout=30, env=env, closed=closed)
    assert result.returncode == 0, result.stderr_tail
    seen = dict(line.split("=", 1) for line in out.read_text().splitlines() if "=" in line)
    assert seen["GS_TEST"] == "1" and "LC_CTYPE" not in seen
    assert not [name for name in seen if name.startswith("PYTHON")]
    script = tmp_path / "not-executable"
    script.write_text("#!/bin/sh\n")
    with pytest.raises(PermissionError):
        runner.run([str(script)], timeout=30, env=None, closed=closed)
    with pytest.raises(FileNotFoundError):
        runner.run([str(tmp_path / "missing")], timeout=30, env=None, closed=closed)
