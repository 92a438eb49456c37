"""A worker process killed at any moment (mid-step, while making the batch the loop waits for,
between epochs): WorkerDied at once without retry, every sample exactly once with retry, the
pool whole again for the next pass either way, and the retry budget counted per shard per
epoch."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

import gluon_stream as gs
from _helpers import JOIN_S, all_ids, batch_ids, dead, id_shards, wait_for

pytestmark = pytest.mark.mxnet  # these tests use MXNet: warm its engine first

SIZES = [8] * 6  # batch_size=4: two batches a shard, so a new shard is attached every other batch
MOMENTS = ["mid-step", "while making a batch", "between epochs"]
STUCK_ID = 3005  # in batch 2 of shard 3


def stuck_when_armed(arm, claimed):
    """A per-sample transform that blocks on STUCK_ID when ``arm`` exists (once per arming),
    after writing its pid to ``claimed``: a worker busy in user code, to be killed."""
    def transform(ids, half):
        if int(ids) == STUCK_ID:
            try:
                os.rename(arm, f"{claimed}.tmp")  # atomic: one worker takes it up
            except FileNotFoundError:
                return ids, half
            with open(f"{claimed}.tmp", "w") as fp:
                fp.write(str(os.getpid()))
            os.replace(f"{claimed}.tmp", claimed)
            time.sleep(60)  # stuck in user code until killed (never waited out)
        return ids, half
    return transform


def make(tmp_path, retries=0):
    kw = {"on_error": ("retry", retries)} if retries else {}
    transform = stuck_when_armed(tmp_path / "arm", tmp_path / "claimed")
    return gs.StreamLoader(gs.FunctionSource(range(len(SIZES)), id_shards(SIZES)), batch_size=4,
                           sample_transform=transform, num_workers=2, **kw)


def gone(pid):
    """Dead with all its threads, so its files are closed (a zombie's main thread can be
    reported dead while its other threads, which share its files, still exit)."""
    try:
        return dead(pid) and os.listdir(f"/proc/{pid}/task") == [str(pid)]
    except FileNotFoundError:  # reaped
        return True


def kill(pid, kills):
    os.kill(pid, signal.SIGKILL)
    kills.append((pid, time.monotonic()))
    wait_for(lambda: gone(pid), what=f"worker {pid} to die")


class Killer:
    """Kills the worker that takes up the stuck sample, ``times`` times (arming the sample
    again before each kill but the last), from a thread: the loop meanwhile waits for that
    batch, as a loop does when a worker dies while making the batch it needs."""

    def __init__(self, tmp_path, kills, times=1):
        self.errors = []
        self._dir, self._kills = tmp_path, kills
        (tmp_path / "arm").touch()
        self._thread = threading.Thread(target=self._run, args=(times,),
                                        name="gluon_stream-test-killer")
        self._thread.start()

    def _run(self, times):
        claimed = self._dir / "claimed"
        try:
            for n in range(times):
                wait_for(claimed.exists, what="a worker to take up the stuck sample")
                pid = int(claimed.read_text())
                claimed.unlink()
                if n + 1 < times:
                    (self._dir / "arm").touch()
                kill(pid, self._kills)
        except Exception as exc:  # relayed to the test by join()
            self.errors.append(exc)

    def join(self):
        self._thread.join(JOIN_S)
        assert not self.errors, self.errors


def kill_an_idle_worker(loader, kills):
    """The step is slower than the workers: they made everything they were given."""
    workers = loader._path.workers
    wait_for(lambda: workers.in_flight() == 0, what="the workers to finish their batches")
    kill(workers.pids[0], kills)


def killed_pass(loader, moment, tmp_path, out, kills, times=1):
    """One pass into ``out`` with a worker killed at ``moment`` (appended to ``kills``)."""
    if moment == "between epochs":
        first = [i for b in loader for i in batch_ids(b)]
        assert sorted(first) == all_ids(SIZES)
        kill_an_idle_worker(loader, kills)
        out.extend(i for b in loader for i in batch_ids(b))
    elif moment == "mid-step":
        for i, batch in enumerate(loader):
            out.extend(batch_ids(batch))
            if i == 4:
                kill_an_idle_worker(loader, kills)
    else:
        killer = Killer(tmp_path, kills, times)
        try:
            for batch in loader:
                out.extend(batch_ids(batch))
        finally:
            killer.join()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("moment", MOMENTS)
def test_a_killed_worker_without_retry_raises_worker_died_at_once_and_the_next_pass_works(
        moment, tmp_path):
    kills = []
    with make(tmp_path) as loader:
        with pytest.raises(gs.WorkerDied, match=r"worker process \d+ was killed by SIGKILL") \
                as info:
            killed_pass(loader, moment, tmp_path, [], kills)
        raised_at = time.monotonic()
        again = [i for b in loader for i in batch_ids(b)]
        pids = loader._path.workers.pids
    [(victim, killed_at)] = kills
    print(f"\n{moment}: WorkerDied {(raised_at - killed_at) * 1000:.1f} ms after SIGKILL")
    assert info.value.pid == victim and info.value.signal == signal.SIGKILL
    assert "on_error=('retry', n)" in str(info.value)
    assert raised_at - killed_at < 0.5  # a fraction of a second, whatever the loop was doing
    assert len(pids) == 2 and victim not in pids  # the pool is whole again
    assert sorted(again) == all_ids(SIZES)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("moment", MOMENTS)
def test_a_killed_worker_with_retry_loses_nothing_and_the_next_pass_works(moment, tmp_path):
    kills, ids = [], []
    with make(tmp_path, retries=1) as loader:
        killed_pass(loader, moment, tmp_path, ids, kills)
        again = [i for b in loader for i in batch_ids(b)]
        workers = loader._path.workers
        pids, forks = workers.pids, workers.forks
    [(victim, _)] = kills
    assert sorted(ids) == all_ids(SIZES)  # every sample exactly once
    assert sorted(again) == all_ids(SIZES)
    assert len(pids) == 2 and victim not in pids and forks == 3


@pytest.mark.timeout(120)
def test_the_retry_budget_is_per_shard_per_epoch(tmp_path):
    """on_error=('retry', 1) and a worker killed on the same shard in every epoch (one OOM kill
    per epoch): each epoch redoes it (the budget used to last the loader's whole life)."""
    kills = []
    with make(tmp_path, retries=1) as loader:
        for epoch in range(3):
            loader.set_epoch(epoch)
            ids = []
            killed_pass(loader, "while making a batch", tmp_path, ids, kills)
            assert sorted(ids) == all_ids(SIZES), epoch
        forks = loader._path.workers.forks
    assert len(kills) == 3 and forks == 2 + 3


@pytest.mark.timeout(120)
def test_a_second_death_on_one_shard_in_one_epoch_is_past_a_budget_of_one(tmp_path):
    kills = []
    with make(tmp_path, retries=1) as loader:
        with pytest.raises(gs.WorkerDied, match=r"allows 1 worker death\(s\) per shard per "
                                                r"epoch") as info:
            killed_pass(loader, "while making a batch", tmp_path, [], kills, times=2)
        again = [i for b in loader for i in batch_ids(b)]
    assert len(kills) == 2 and info.value.pid == kills[1][0] and info.value.key == 3
    assert sorted(again) == all_ids(SIZES)
