"""A failure, remembered: a shard whose generation failed is recorded beside it in the cache
(``<name>.failed.json``), and every later attempt (the next epoch, another process, another
rank) raises the recorded error instead of running the generator again, until it is retried
or the recipe changes. Generator runs are counted (``count`` file), so the tests prove what
ran."""
from __future__ import annotations

import json
import logging
import os
import shlex
import subprocess
import sys

import numpy as np
import pytest

import gluon_stream as gs
from fake_generator import command, command_source, generator_runs, hidden_files
from gluon_stream.cli import main

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)


def child_env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
        REPO, TESTS, os.environ.get("PYTHONPATH")]))}


def test_a_failed_shard_is_recorded_with_its_recipe_error_and_attempts(tmp_path):
    with command_source(tmp_path, "exit-nonzero", retries=1) as src:
        with pytest.raises(gs.ShardError, match="upstream data missing"):
            src.produce("k1", 0)
        record = json.loads((tmp_path / "cache" / "k1.failed.json").read_text())
        assert record["attempts"] == 2 and record["error_type"] == "ShardError"
        assert record["recipe"] == src.recipe("k1", 0) and record["returncode"] == 3
        assert "upstream data missing" in record["stderr_tail"] and record["key"] == "'k1'"
        with pytest.raises(gs.ShardError) as info:  # the same process: not run again
            src.produce("k1", 0)
    err = info.value
    assert len(generator_runs(tmp_path)) == 2
    assert err.key == "k1" and err.returncode == 3 and "upstream data missing" in err.stderr_tail
    message = str(err)
    for needle in ("shard 'k1'", "failed before", "exit code 3", "after 2 attempt(s)",
                   "k1.failed.json", "retry_failures()", "--retry-failed"):
        assert needle in message, (needle, message)
    assert hidden_files(tmp_path / "cache") == []


_OTHER_PROCESS = r"""
import sys
import gluon_stream as gs
from fake_generator import command_source
import pathlib
with command_source(pathlib.Path(sys.argv[1]), "exit-nonzero", retries=1) as src:
    try:
        src.produce("k1", 0)
    except gs.ShardError as exc:
        print(type(exc).__name__, str(exc).splitlines()[0])
"""


@pytest.mark.timeout(60)
def test_another_process_sharing_the_cache_sees_the_failure_instead_of_regenerating(tmp_path):
    with command_source(tmp_path, "exit-nonzero", retries=1) as src:
        with pytest.raises(gs.ShardError):
            src.produce("k1", 0)
    assert len(generator_runs(tmp_path)) == 2
    done = subprocess.run([sys.executable, "-c", _OTHER_PROCESS, str(tmp_path)], env=child_env(),
                          capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.startswith("ShardError shard 'k1': its generation failed before"), \
        done.stdout + done.stderr
    assert len(generator_runs(tmp_path)) == 2  # (was: 4, the other process ran it twice again)


@pytest.mark.mxnet
def test_later_epochs_begun_early_do_not_make_a_failed_shard_again(tmp_path):
    """on_error='skip' over three epochs: the failing shard's generator ran once (was: once per
    epoch, each begun early while the one before was read)."""
    keys = ["k0", "k1", "k2"]
    src = gs.CommandSource(keys, command("ok", workdir=tmp_path, modes={"k1": "exit-nonzero"}),
                           cache_dir=tmp_path / "cache", retries=0)
    with gs.StreamLoader(src, batch_size=5, on_error="skip") as loader:
        counts = [sum(len(b) for b in loader) for _ in range(3)]
        assert loader.stats.skipped_shards == 3
    assert counts == [20, 20, 20]
    runs = [line.split()[0] for line in generator_runs(tmp_path)]
    assert sorted(runs) == ["k0", "k1", "k2"]


def flaky(failures: int):
    """A FunctionSource fn that fails its first ``failures`` calls, then returns a shard."""
    calls = []

    def fn(key):
        calls.append(key)
        if len(calls) <= failures:
            raise RuntimeError(f"upstream data for {key} not there yet")
        return np.arange(4.0) + 10 * key
    fn.calls = calls
    return fn


def test_retry_failures_makes_the_shard_again(tmp_path):
    fn = flaky(1)
    with gs.FunctionSource([3], fn, cache_dir=tmp_path, version="1") as src:
        with pytest.raises(gs.ShardError, match="not there yet"):
            src.produce(3, 0)
        with pytest.raises(gs.ShardError, match="failed before.*not there yet"):
            src.produce(3, 0)
        assert len(fn.calls) == 1 and os.listdir(tmp_path) == ["3.failed.json"]
        assert src.retry_failures() == ["3"]
        assert src.produce(3, 0).arrays[0].tolist() == [30.0, 31.0, 32.0, 33.0]
    assert len(fn.calls) == 2 and os.listdir(tmp_path) == ["3.npy"]


def test_a_changed_recipe_drops_the_record(tmp_path, caplog):
    with gs.FunctionSource([3], flaky(1), cache_dir=tmp_path, version="1") as src:
        with pytest.raises(gs.ShardError):
            src.produce(3, 0)
    caplog.set_level(logging.INFO, logger="gluon_stream")
    fn = flaky(0)
    with gs.FunctionSource([3], fn, cache_dir=tmp_path, version="2") as src:
        assert src.produce(3, 0).arrays[0].tolist() == [30.0, 31.0, 32.0, 33.0]
    assert fn.calls == [3] and os.listdir(tmp_path) == ["3.npy"]
    assert any("failed before with another recipe (version '1' -> '2')" in r.getMessage()
               for r in caplog.records)


def test_on_error_retry_makes_a_recorded_failure_again(tmp_path):
    """('retry', n) asks for the shard again: the record of its own failure does not answer."""
    fn = flaky(1)
    src = gs.FunctionSource([3], fn, cache_dir=tmp_path)
    with gs.ShardStream(src, on_error=("retry", 1)) as stream:
        assert [shard.key for shard in stream] == [3]
    assert len(fn.calls) == 2 and os.listdir(tmp_path) == ["3.npy"]


@pytest.mark.parametrize("damage", ["garbage", "list", "missing field", "symlink", "huge"])
def test_a_damaged_record_is_ignored_and_the_shard_made(tmp_path, damage, caplog):
    record = tmp_path / "3.failed.json"
    good = {"key": "3", "error_type": "ShardError", "error": "boom", "attempts": 1,
            "time": 0, "where": "pid 1 on h", "recipe": None}
    if damage == "garbage":
        record.write_bytes(b"\x00not json")
    elif damage == "list":
        record.write_text("[1, 2]")
    elif damage == "missing field":
        record.write_text(json.dumps({k: v for k, v in good.items() if k != "error"}))
    elif damage == "symlink":
        (tmp_path / "elsewhere.json").write_text(json.dumps(good))
        record.symlink_to(tmp_path / "elsewhere.json")
    else:
        record.write_text(json.dumps(dict(good, error="x" * 100_000)))
    fn = flaky(0)
    with gs.FunctionSource([3], fn, cache_dir=tmp_path) as src:
        assert src.produce(3, 0).arrays[0].tolist() == [30.0, 31.0, 32.0, 33.0]
    assert fn.calls == [3] and not record.exists()
    assert any("failure record" in r.getMessage() for r in caplog.records)


def test_generate_retry_failed_runs_recorded_failures_again(tmp_path, capsys):
    flag = tmp_path / "fixed"
    gen = shlex.join([sys.executable, "-c",
                      "import os, sys, numpy as np\n"
                      f"os.path.exists({str(flag)!r}) or sys.exit('not yet')\n"
                      "np.save(open(sys.argv[1], 'wb'), np.zeros(3))", "{path}"])
    argv = ["generate", "--command", gen, "--keys", "a", "--cache-dir", str(tmp_path / "c"),
            "--retries", "0", "--no-progress"]
    assert main(argv) == 1
    flag.touch()
    assert main(argv) == 1  # recorded: not run again
    err = capsys.readouterr().err
    assert "failed before" in err and "pass --retry-failed to run them" in err
    assert main(argv + ["--retry-failed"]) == 0
    assert sorted(os.listdir(tmp_path / "c")) == [".gluon_stream-sizes.json", "a.npy"]


_RANK = r"""
import json, sys
import numpy as np
import gluon_stream as gs
cache, rank = sys.argv[1], int(sys.argv[2])

def fn(key):
    if key == 3 and rank == 0:  # fails on this rank only, as a flaky upstream may
        raise RuntimeError("upstream data missing")
    return np.arange(5, dtype=np.int64) + 1000 * key

src = gs.FunctionSource(range(6), fn, cache_dir=cache)
with gs.StreamLoader(src, batch_size=2, num_parts=2, part_index=rank, even_batches=True,
                     on_error="skip") as loader:
    print(json.dumps([b.asnumpy().tolist() for b in loader]))
"""


@pytest.mark.mxnet
@pytest.mark.timeout(120)
def test_skip_agrees_across_ranks_with_strides_through_the_record(tmp_path):
    """Each rank its own process, strides of every shard (sizes unknown), even_batches=True and
    on_error='skip': refused before (one rank alone would skip). With a shared cache the failure
    rank 0 met is recorded, rank 1 skips the same shard, and both yield the same count."""
    cache = tmp_path / "cache"
    outs = []
    for rank in (0, 1):
        done = subprocess.run([sys.executable, "-c", _RANK, str(cache), str(rank)],
                              env=child_env(), capture_output=True, text=True, timeout=90)
        assert done.returncode == 0, done.stderr[-3000:]
        outs.append(json.loads(done.stdout.splitlines()[-1]))
    assert len(outs[0]) == len(outs[1])  # synchronous training would not hang
    rows = [v for out in outs for batch in out for v in batch]
    expected = {1000 * k + i for k in (0, 1, 2, 4, 5) for i in range(5)}  # not shard 3's
    assert len(set(rows)) == len(rows) and set(rows) <= expected
    assert len(rows) >= len(expected) - 3  # equal counts drop at most ranks*(batch-1)+ranks-1
    assert sorted(os.listdir(cache)) == ["0.npy", "1.npy", "2.npy", "3.failed.json", "4.npy",
                                         "5.npy"]


def test_skip_with_strides_is_still_refused_where_ranks_cannot_agree(tmp_path):
    fn = flaky(0)
    for kwargs in ({}, {"cache_dir": tmp_path, "cache_limit": 4}):
        with pytest.raises(ValueError, match="shared cache_dir without cache_limit"):
            gs.StreamLoader(gs.FunctionSource(range(4), fn, **kwargs), batch_size=2,
                            num_parts=2, part_index=0, even_batches=True, on_error="skip")
