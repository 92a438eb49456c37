"""Hard to break: dead workers, slow batches, failing and drifting shards, interrupts, close()
mid-generation and many pool rotations, each ending in a clear error or a chosen policy with
nothing lost, duplicated or leaked (the autouse leak check in conftest runs after each test).

Hang-prone tests carry a ``pytest.mark.timeout`` upper bound; nothing here sleeps to synchronise.
"""
from __future__ import annotations

import collections
import gc
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import traceback

import mxnet as mx
import numpy as np
import psutil
import pytest

import gluon_stream as gs
from _helpers import JOIN_S, all_ids, batch_ids, dead, id_shards, leaks, snapshot, wait_for
from fake_generator import command, read_lines

pytestmark = pytest.mark.mxnet  # these tests use MXNet: warm its engine first

BATCHIFY = mx.gluon.data.dataloader.default_batchify_fn
PROCESS_POOL = {"num_workers": 2, "thread_pool": False, "batchify_fn": BATCHIFY}


def delivered(loader, limit=None):
    """Ids of every sample the loader yields (stops after ``limit`` batches)."""
    ids = []
    for i, batch in enumerate(loader):
        ids.extend(batch_ids(batch))
        if limit is not None and i + 1 == limit:
            break
    return ids


def pool_workers() -> list[psutil.Process]:
    """This process's children but multiprocessing's resource tracker, which a test of dask
    (earlier in the session) starts and which lives as long as the session."""
    return [p for p in psutil.Process().children()
            if "resource_tracker" not in " ".join(_cmdline(p))]


@pytest.fixture
def shards_in_flight(monkeypatch):
    """``shards_in_flight()``: shards copied into shared memory for the workers whose file is
    still open (one fd each). Each file made in the test is followed by its own finalizer, not
    found by ``gc.get_objects()``, which, while producers build tuples, may catch one half made
    (its ``tuple()`` then fails with SystemError)."""
    from gluon_stream._mx import shm
    made = []
    init = shm._MemoryFile.__init__

    def followed(self, fd):
        init(self, fd)
        made.append(self.close)  # alive while the fd is open

    monkeypatch.setattr(shm._MemoryFile, "__init__", followed)

    def count() -> int:
        gc.collect()
        return sum(1 for close in list(made) if close.alive)
    return count


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:  # gone meanwhile, or a zombie: not a tracker either way
        return []


def slow_sample(*sample):
    """A per-sample transform slow enough that the workers are busy when one is killed."""
    time.sleep(0.002)
    return sample


# -- dead workers and slow batches (process pools) ----------------------------------------

@pytest.mark.timeout(60)
def test_a_sigkilled_worker_raises_worker_died_within_10_s_and_leaves_no_zombie():
    src = gs.FunctionSource([0], id_shards([400]))
    with gs.StreamLoader(src, batch_size=4, sample_transform=slow_sample, **PROCESS_POOL) as loader:
        batches = iter(loader)
        for _ in range(3):
            next(batches)
        workers = pool_workers()
        assert len(workers) == 2
        victim = workers[0].pid
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        with pytest.raises(gs.WorkerDied,
                           match=r"worker process \d+ was killed by SIGKILL") as info:
            for _ in batches:
                pass
        noticed = time.monotonic() - killed_at
        del batches
    assert noticed < 10.0
    err = info.value
    assert err.pid == victim and err.signal == signal.SIGKILL
    assert "on_error=('retry', n)" in str(err)  # the fix is in the message
    assert pool_workers() == [] and dead(victim)


@pytest.mark.timeout(60)
def test_worker_died_names_the_shard():
    src = gs.FunctionSource(["day-7"], lambda k: np.arange(400.0))
    with gs.StreamLoader(src, batch_size=4, sample_transform=slow_sample, **PROCESS_POOL) as loader:
        batches = iter(loader)
        next(batches)
        os.kill(pool_workers()[0].pid, signal.SIGKILL)
        with pytest.raises(gs.WorkerDied) as info:
            for _ in batches:
                pass
        del batches
    assert info.value.key == "day-7" and "'day-7'" in str(info.value)


@pytest.mark.timeout(90)
def test_with_retry_a_dead_workers_batches_are_redone_exactly_once():
    sizes = [150, 37, 150]
    src = gs.FunctionSource(range(3), id_shards(sizes))
    with gs.StreamLoader(src, batch_size=4, sample_transform=slow_sample, on_error=("retry", 2),
                         **PROCESS_POOL) as loader:
        ids = []
        for i, batch in enumerate(loader):
            ids.extend(batch_ids(batch))
            if i in (5, 60):  # once in the first shard, once in the last
                os.kill(pool_workers()[0].pid, signal.SIGKILL)
    assert sorted(ids) == all_ids(sizes)
    assert collections.Counter(ids).most_common(1)[0][1] == 1
    assert pool_workers() == []


def stuck_on_id(target, seconds):
    def transform(ids, values):
        if int(ids) == target:
            time.sleep(seconds)
        return ids, values
    return transform


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pool", ["processes", "threads"])
def test_a_slow_batch_raises_batch_timeout_naming_what_was_slow(pool):
    src = gs.FunctionSource([0], id_shards([40]))
    opts = PROCESS_POOL if pool == "processes" else dict(PROCESS_POOL, thread_pool=True)
    with gs.StreamLoader(src, batch_size=4, sample_transform=stuck_on_id(21, 3.0), timeout=1,
                         **opts) as loader:
        start = time.monotonic()
        with pytest.raises(gs.BatchTimeout, match=r"batch \d+ of 10 of shard 0 took longer than "
                                                  r"timeout=1 s .*sample_transform") as info:
            delivered(loader)
        assert time.monotonic() - start < 1 + 2.5
    assert isinstance(info.value, TimeoutError)


@pytest.mark.timeout(60)
def test_close_from_another_thread_while_a_worker_is_busy_gives_loader_closed():
    """The consumer (main thread: only it may fork a pool) waits on a stuck batch; another
    thread closes the loader."""
    src = gs.FunctionSource([0], id_shards([40]))
    loader = gs.StreamLoader(src, batch_size=4, sample_transform=stuck_on_id(21, 5.0), timeout=60,
                             **PROCESS_POOL)
    got, closed_at = [], []

    def close_once_waiting():
        wait_for(lambda: len(got) >= 5, 30, "the batches before the stuck one")
        closed_at.append(time.monotonic())
        loader.close()

    closer = threading.Thread(target=close_once_waiting, name="gluon_stream-test-closer")
    closer.start()
    try:
        with pytest.raises(gs.LoaderClosed, match=r"closed while waiting for batch 6 of 10"):
            for batch in loader:
                got.append(batch_ids(batch))
        elapsed = time.monotonic() - closed_at[0]
    finally:
        closer.join(JOIN_S)
        loader.close()
    assert got == [list(range(i, i + 4)) for i in range(0, 20, 4)]  # batch 6 holds the stuck id
    assert elapsed < 3.0
    assert pool_workers() == []


def test_a_process_pool_built_and_used_outside_the_main_thread_works():
    """MXNet's DataLoader can only fork from the main thread (it installs a signal handler);
    the loader's own worker pool has no such limit."""
    src = gs.FunctionSource(range(3), id_shards([8, 5, 7]))
    ids, errors = [], []

    def consume():
        try:
            with gs.StreamLoader(src, batch_size=4, **PROCESS_POOL) as loader:
                ids.extend(delivered(loader))
        except Exception as exc:  # relayed to the test thread below
            errors.append(exc)

    worker = threading.Thread(target=consume, name="gluon_stream-test-consumer")
    worker.start()
    worker.join(JOIN_S)
    assert not errors, errors
    assert sorted(ids) == all_ids([8, 5, 7]) and len(ids) == len(set(ids))


# -- shard failures, policies and where they surface --------------------------------------------

def test_a_prefetch_failure_surfaces_after_the_whole_previous_shard(tmp_path):
    failed = threading.Event()

    def fn(key):
        if key == 1:
            failed.set()
            raise RuntimeError("upstream data missing for shard 1")
        return id_shards([10, 0, 10])(key)

    with gs.StreamLoader(gs.FunctionSource(range(3), fn), batch_size=4, prefetch=2) as loader:
        batches = iter(loader)
        ids = batch_ids(next(batches))
        assert failed.wait(JOIN_S)  # shard 1 has already failed in the background...
        with pytest.raises(gs.ShardError, match=r"shard 1: .*upstream data missing") as info:
            for batch in batches:
                ids.extend(batch_ids(batch))
        del batches
    # ...yet every sample of shard 0 came first: its two full batches, then the 2 samples that
    # waited for the next shard's first batch, as a short batch; the error comes after them
    assert ids == list(range(10))
    assert isinstance(info.value.__cause__, RuntimeError)


def test_command_failures_with_skip_drop_exactly_those_shards(tmp_path, caplog):
    keys = ["k0", "k1", "k2", "k3", "k4", "k5", "k6"]
    modes = {"k1": "exit-nonzero", "k3": "truncated", "k4": "pickle", "k6": "no-file"}
    src = gs.CommandSource(keys, command("ok", workdir=tmp_path, modes=modes, rows=7),
                           cache_dir=tmp_path / "cache", retries=0, timeout=20)
    caplog.set_level(logging.WARNING, logger="gluon_stream")
    with gs.StreamLoader(src, batch_size=4, on_error="skip") as loader:
        data = [b.asnumpy() for b in loader]
        record = loader.stats.epochs[-1]
    rows = np.concatenate(data)
    assert rows.shape == (3 * 7, 3)  # k0, k2, k5: every sample once
    assert [len(d) for d in data] == [4, 4, 4, 4, 4, 1]
    expected = np.concatenate([_values(k, 7) for k in ("k0", "k2", "k5")])
    np.testing.assert_array_equal(rows, expected)
    assert record.skipped_shards == 4 and loader.stats.skipped_shards == 4
    skips = [r for r in caplog.records if "skipping shard" in r.getMessage()]
    assert [r.levelno for r in skips] == [logging.WARNING] * 4
    bad = ("k1", "k3", "k4", "k6")
    assert {m for m in bad if any(repr(m) in r.getMessage() for r in skips)} == set(bad)
    assert "wrote no file" in skips[-1].getMessage()
    assert sorted(os.listdir(tmp_path / "cache")) == ["k0.npy", "k1.failed.json", "k2.npy",
                                                      "k3.failed.json", "k4.failed.json",
                                                      "k5.npy", "k6.failed.json"]


def _values(key, rows):
    from fake_generator import shard_values

    return shard_values(key, rows, 3)


_TIMEOUTS_REACH_THE_USER = r"""
import sys
import numpy as np
sys.path.insert(0, {tests!r})
import gluon_stream as gs
from fake_generator import command, shard_values

def rows(loader, out):
    for batch in loader:
        out.append(batch.asnumpy())

# 1. a generator timeout, policy 'raise': ShardTimeout after all of k0
src = gs.CommandSource(["k0", "k1", "k2"], command("ok", modes={{"k1": "hang"}}, rows=8),
                       cache_dir={cache!r} + "/a", retries=0, timeout=1)
out = []
with gs.StreamLoader(src, batch_size=4) as loader:
    try:
        rows(loader, out)
        sys.exit("no ShardTimeout")
    except gs.ShardTimeout as exc:
        assert "'k1'" in str(exc), exc
np.testing.assert_array_equal(np.concatenate(out), shard_values("k0", 8, 3))

# 2. the same with 'skip': k0 and k2 delivered, one shard skipped
src = gs.CommandSource(["k0", "k1", "k2"], command("ok", modes={{"k1": "hang"}}, rows=8),
                       cache_dir={cache!r} + "/b", retries=0, timeout=1)
out = []
with gs.StreamLoader(src, batch_size=4, on_error="skip") as loader:
    rows(loader, out)
    assert loader.stats.skipped_shards == 1
np.testing.assert_array_equal(np.concatenate(out),
                              np.concatenate([shard_values(k, 8, 3) for k in ("k0", "k2")]))

# 3. a user transform that raises the built-in TimeoutError
def transform(raw):
    raise TimeoutError("the feature service did not answer")

with gs.StreamLoader(gs.FunctionSource([0], lambda k: np.zeros(4)), batch_size=4,
                     transform=transform) as loader:
    try:
        rows(loader, [])
        sys.exit("no TimeoutError")
    except TimeoutError as exc:
        assert "feature service" in str(exc)
print("ok")
"""


@pytest.mark.timeout(60)
def test_timeout_errors_from_generators_and_transforms_reach_the_user(tmp_path):
    """In a child process joined with a timeout: concurrent.futures.TimeoutError is the built-in
    TimeoutError since Python 3.11, so a wait that caught it took a ShardTimeout (or a
    transform's TimeoutError) for 'not ready yet' and spun forever."""
    code = _TIMEOUTS_REACH_THE_USER.format(tests=os.path.dirname(__file__),
                                           cache=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=JOIN_S)
        pytest.fail("the loader never surfaced the TimeoutError (killed after 20 s)")
    assert proc.returncode == 0 and out.strip() == "ok", err[-2000:]


class BadRow(KeyError):
    """A distinctive error type: it must reach the user unchanged."""


def transform_failing_on(bad_key_value):
    def transform(raw):
        ids, values = raw
        if int(ids[0]) == bad_key_value:
            raise BadRow(f"row {int(ids[0])} has no label")
        return ids, values
    return transform


def test_a_transform_that_raises_keeps_its_type_and_traceback_and_names_the_shard():
    sizes = [6, 6, 6]
    src = gs.FunctionSource(range(3), id_shards(sizes))
    with gs.StreamLoader(src, batch_size=4, transform=transform_failing_on(1000)) as loader:
        with pytest.raises(BadRow, match=r"row 1000 has no label") as info:
            delivered(loader)
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "transform" in frames  # the user's own frame is in the traceback
    assert any("shard 1" in note for note in getattr(info.value, "__notes__", []))


def test_skip_drops_exactly_the_shard_whose_transform_raised():
    sizes = [6, 6, 6]
    src = gs.FunctionSource(range(3), id_shards(sizes))
    with gs.StreamLoader(src, batch_size=4, transform=transform_failing_on(1000),
                         on_error="skip") as loader:
        ids = delivered(loader)
        assert loader.stats.epochs[-1].skipped_shards == 1
    assert sorted(ids) == all_ids([6, 0, 6])
    assert len(ids) == len(set(ids)) == 12


def test_schema_drift_raises_before_any_batch_of_that_shard(tmp_path):
    modes = {"k2": "wrong-dtype"}
    src = gs.CommandSource(["k0", "k1", "k2", "k3"], command("ok", workdir=tmp_path, modes=modes,
                                                             rows=8),
                           cache_dir=tmp_path / "cache", retries=0)
    rows = []
    with gs.StreamLoader(src, batch_size=4) as loader:
        with pytest.raises(gs.SchemaMismatch, match=r"'k2'.*<f8.*<f4"):
            for batch in loader:
                rows.append(batch.asnumpy())
    np.testing.assert_array_equal(np.concatenate(rows),
                                  np.concatenate([_values("k0", 8), _values("k1", 8)]))


def test_an_explicit_schema_is_checked_on_the_first_shard(tmp_path):
    src = gs.FunctionSource(range(2), lambda k: np.zeros((8, 5), np.float32))
    with gs.StreamLoader(src, batch_size=4, schema=[("float32", (4,))]) as loader:
        with pytest.raises(gs.SchemaMismatch, match=r"shard 0 .*\(5,\)"):
            delivered(loader)


# -- close(), garbage collection, interrupts --------------------------------------------------

def _hanging_loader(tmp_path, **kw):
    src = gs.CommandSource(["k0", "k1"], command("grandchild-hang", workdir=tmp_path),
                           cache_dir=tmp_path / "cache", timeout=30, retries=0)
    return gs.StreamLoader(src, batch_size=4, **kw)


@pytest.mark.timeout(60)
def test_close_during_a_30_s_generator_run_returns_within_2_s(tmp_path):
    loader = _hanging_loader(tmp_path)
    errors = []

    def consume():
        try:
            delivered(loader)
        except gs.StreamError as exc:
            errors.append(exc)

    consumer = threading.Thread(target=consume, name="gluon_stream-test-consumer")
    consumer.start()
    try:
        wait_for(lambda: "grandchild" in read_lines(tmp_path / "started"), 30, "the generator")
        start = time.monotonic()
        loader.close()
        elapsed = time.monotonic() - start
        consumer.join(JOIN_S)
        loader.close()  # idempotent
    finally:
        loader.close()
        consumer.join(JOIN_S)
    assert elapsed < 2.0
    assert len(errors) == 1 and isinstance(errors[0], gs.LoaderClosed)
    for pid in map(int, read_lines(tmp_path / "pids")):
        wait_for(lambda pid=pid: dead(pid), 5, f"generator pid {pid} to die")
    assert os.listdir(tmp_path / "cache") == []  # no partial output, no lock file
    with pytest.raises(gs.LoaderClosed, match=r"closed"):
        iter(loader)


@pytest.mark.timeout(60)
def test_an_interrupted_then_dropped_loader_cleans_up_like_close(tmp_path, sigint):
    """Jupyter: next(it) blocks on a 30 s generator, Ctrl-C, then `del loader, it`."""
    loader = _hanging_loader(tmp_path, prefetch=1)
    started = lambda: "grandchild" in read_lines(tmp_path / "started")  # noqa: E731

    def interrupt_once_started():
        wait_for(started, 30, "the generator")
        _interrupt_me()

    interrupter = threading.Thread(target=interrupt_once_started,
                                   name="gluon_stream-test-interrupter")
    it = iter(loader)
    interrupter.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            next(it)
    finally:
        interrupter.join(JOIN_S)
    assert started()
    start = time.monotonic()
    del loader, it
    gc.collect()
    for pid in map(int, read_lines(tmp_path / "pids")):
        wait_for(lambda pid=pid: dead(pid), 5, f"generator pid {pid} to die")
    assert time.monotonic() - start < 2.0
    wait_for(lambda: os.listdir(tmp_path / "cache") == [], 5, "the temp and lock files to go")


def _flat_snapshot():
    me = psutil.Process()
    return {"fds": me.num_fds(), "children": len(pool_workers()),
            "threads": sum(t.name.startswith("gluon_stream") for t in threading.enumerate()),
            "all_threads": threading.active_count(),
            "shm": len(os.listdir("/dev/shm")), "rss_mb": me.memory_info().rss / 2 ** 20}


def _interrupt_me():
    os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.timeout(180)
# an interrupt that lands inside MXNet's NDArray.__del__ is reported as "Exception ignored"
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("path", ["vectorised", "process-pool"])
def test_jupyter_style_interrupts_20_times_leak_nothing(path, record_property, sigint,
                                                        shards_in_flight):
    """SIGINT after k batches, catch KeyboardInterrupt, iterate again: 20 times, then a full
    epoch; fds, threads, children and /dev/shm stay flat, and RSS does not grow."""
    sizes = [40, 25, 40, 30]
    calls = collections.Counter()

    def fn(key):
        calls[key] += 1
        if path == "vectorised" and calls[key] % 2 == 0 and key == 2:
            _interrupt_me()  # lands wherever the main thread is: inside the library's waits too
        return id_shards(sizes)(key)

    opts = PROCESS_POOL if path == "process-pool" else {}
    src = gs.FunctionSource(range(4), fn)
    gc.collect()
    figures = [("before", _flat_snapshot())]
    with gs.StreamLoader(src, batch_size=4, **opts) as loader:
        for i in range(20):
            try:
                for k, _batch in enumerate(loader):
                    if k == 3 + (i * 3) % 20:  # sometimes in the first shard, sometimes later
                        _interrupt_me()
            except KeyboardInterrupt:
                pass
            else:
                pytest.fail("the interrupt was not delivered")
            if i in (0, 4, 19):
                gc.collect()
                # fds less the shards in flight (one each): where an interrupt lands decides
                # whether the next shard is made yet, which is data, not a leak
                figures.append((i + 1, dict(_flat_snapshot(), in_flight=shards_in_flight())))
            if i == 0:  # the loader's own producer thread exists from the first pass on
                before = snapshot()
        _batch = None  # the last batch holds shared-memory fds: let it go
        found = leaks(before)  # after 20 interrupted passes: nothing more than after the first
        # but the shards in flight: where a pass stopped decides whether the next epoch's first
        # shard is already made (one fd each, bounded by prefetch); any other fd is a leak
        in_flight = shards_in_flight()
        assert in_flight <= 2 + 2, in_flight  # prefetch + 2
        found["fds"] = max(0, found.get("fds", 0) - in_flight)
        # the pool's threads start as shards queue up, up to twice the producers (a thread
        # may wait for a shard's generation ahead): the loader's own, bounded, closed with it
        producer_threads = [t for t in threading.enumerate()
                            if t.name.startswith("gluon_stream-producer")]
        assert len(producer_threads) <= 2 * min(2, os.cpu_count()), producer_threads
        found["threads"] = [name for name in found.get("threads", ())
                            if not name.startswith("gluon_stream-producer")]
        found = {k: v for k, v in found.items() if v}
        # a whole epoch then (its end prefetches the next epoch's first shards, which hold
        # their shared memory: data in flight, counted above only if interrupts leaked it)
        ids = delivered(loader) if path == "process-pool" else None
    gc.collect()
    figures.append(("closed", _flat_snapshot()))
    record_property("leak_figures", figures)
    print(f"\n{path}: interrupts -> {figures}")
    assert not found, found
    if ids is not None:  # after all that, a full epoch is still exact
        assert sorted(ids) == all_ids(sizes)
    (_, first), (_, at5), (_, at20), (_, closed) = figures[0], figures[2], figures[3], figures[4]
    assert closed["fds"] == first["fds"] and closed["children"] == 0 and closed["threads"] == 0
    # the worker processes are the loader's for its whole life (forked once): flat, not zero
    workers = PROCESS_POOL["num_workers"] if path == "process-pool" else 0
    # producer threads: at most twice producers='auto''s bound, min(prefetch=2, cores),
    # however many passes were interrupted
    assert at20["fds"] - at20["in_flight"] <= at5["fds"] - at5["in_flight"], figures
    assert at20["threads"] <= 2 * min(2, os.cpu_count()), figures
    assert at20["children"] == at5["children"] == workers, figures
    assert at20["rss_mb"] - at5["rss_mb"] < 25, figures


@pytest.mark.timeout(60)
def test_a_loader_waiting_for_a_slow_generator_sleeps(tmp_path):
    src = gs.CommandSource(["k0"], command("ok", workdir=tmp_path, gate=True),
                           cache_dir=tmp_path / "cache", retries=0)
    out = []
    with gs.StreamLoader(src, batch_size=4) as loader:
        consumer = threading.Thread(target=lambda: out.extend(b.shape[0] for b in loader),
                                    name="gluon_stream-test-consumer")
        consumer.start()
        try:
            wait_for(lambda: read_lines(tmp_path / "started"), 30, "the generator to start")
            me = psutil.Process()
            cpu0 = sum(me.cpu_times()[:2])
            time.sleep(1.0)  # the measured window: consumer and producer both wait
            cpu = sum(me.cpu_times()[:2]) - cpu0
        finally:
            (tmp_path / "gate").touch()
            consumer.join(JOIN_S)
    assert cpu < 0.25, f"{cpu:.2f} s of CPU while waiting 1 s for a generator"
    assert sum(out) == 10


# -- many rotations -------------------------------------------------------------------------

@pytest.mark.timeout(240)
def test_200_shard_rotations_with_two_worker_processes_keep_fds_and_children_flat():
    """A process pool is forked per shard while the producer thread prepares the next shards."""
    produced = []

    def fn(key):
        rng = np.random.default_rng(key)  # some numpy work in the producer during the forks
        rng.standard_normal((200, 50)).sum()
        produced.append(key)
        return id_shards([6] * 200)(key)

    src = gs.FunctionSource(range(200), fn)
    me = psutil.Process()
    counts = [("before", me.num_fds(), len(pool_workers()))]
    with gs.StreamLoader(src, batch_size=4, prefetch=2, **PROCESS_POOL) as loader:
        ids = []
        for i, batch in enumerate(loader):
            ids.extend(batch_ids(batch))
            if i % 60 == 0:  # 300 batches over 200 shards: samples at shards 0, 40, 80, ...
                counts.append((len(produced), me.num_fds(), len(pool_workers())))
        del batch  # the last batch holds shared-memory fds
    counts.append(("closed", me.num_fds(), len(pool_workers())))
    print(f"\n(shards produced, fds, children) during 200 rotations: {counts}")
    assert sorted(ids) == all_ids([6] * 200)
    fds = [c[1] for c in counts[2:-1]]
    assert max(fds) - min(fds) <= 4, counts  # flat: no per-shard fd leak
    assert max(c[2] for c in counts) <= 2, counts  # one pool of two workers at a time
    assert counts[-1][1:] == counts[0][1:], counts  # closed: back to where it started
    assert pool_workers() == []


_KILLED_LOADER = r"""
import signal, sys
sys.path.insert(0, {tests!r})
signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as `kill` finds a plain training script
import gluon_stream as gs
from fake_generator import command
src = gs.CommandSource(["k0", "k1", "k2", "k3"], command("slow", workdir={work!r}, gate=True),
                       cache_dir={cache!r}, timeout=600, retries=0)
for batch in gs.StreamLoader(src, batch_size=4, producers=2):
    pass
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_generators_die_with_a_loader_killed_outright(tmp_path, how):
    """A loader killed by SIGTERM (default disposition) or SIGKILL runs no code: its generators
    (a process group of their own each) get SIGKILL from the parent-death signal set in them,
    within a few seconds; the next loader on the cache removes their temp files and makes every
    shard (was: the generators ran on, their temp files in the cache)."""
    cache = tmp_path / "cache"
    code = _KILLED_LOADER.format(tests=os.path.dirname(__file__), work=str(tmp_path),
                                 cache=str(cache))
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        wait_for(lambda: len(read_lines(tmp_path / "started")) == 2 or proc.poll() is not None,
                 60, "two generators to write half a shard")
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        generators = [int(pid) for pid in read_lines(tmp_path / "pids")]
        assert len(generators) == 2 and not any(dead(pid) for pid in generators)
        os.kill(proc.pid, how)
        proc.communicate(timeout=JOIN_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=JOIN_S)
    assert proc.returncode == -how
    try:
        wait_for(lambda: all(dead(pid) for pid in generators), 5, "the generators to die")
    finally:
        for pid in generators:  # a failure must not leave them running
            if not dead(pid):
                os.kill(pid, signal.SIGKILL)
    assert [n for n in os.listdir(cache) if ".tmp" in n]  # half-written shards left behind
    (tmp_path / "gate").touch()
    keys = ["k0", "k1", "k2", "k3"]
    with gs.ShardStream(gs.CommandSource(keys, command("ok"), cache_dir=cache)) as stream:
        assert [shard.key for shard in stream] == keys
    assert sorted(os.listdir(cache)) == [f"{k}.npy" for k in keys]  # no temp or lock files
