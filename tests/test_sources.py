"""CommandSource and the shard cache against a real, misbehaving generator process.

Every generator run is counted (``count`` file) and its pids logged, so the tests prove what
ran, how often and what is still alive, with events and files rather than sleeps.
"""
from __future__ import annotations

import errno
import os
import pickle
import subprocess
import sys
import threading
import time

import numpy as np
import psutil
import pytest

import gluon_stream as gs
from _helpers import JOIN_S, dead, wait_for
from fake_generator import (command, command_source as source, generator_runs as runs,
                            hidden_files, read_lines, shard_values)
from gluon_stream.sources import _process

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


def test_stderr_capture_is_bounded(tmp_path):
    with source(tmp_path, "stderr-flood") as src:
        with pytest.raises(gs.ShardError, match=r"exit code 4") as info:
            src.produce("k1", 0)
    tail = info.value.stderr_tail
    assert tail.endswith("flood done") and len(tail) <= _process.STDERR_TAIL_BYTES


# -- atomic writes, locks, cleanup ---------------------------------------------------------


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
