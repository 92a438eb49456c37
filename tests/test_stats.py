"""Stats: numbers against known spans, summary/to_dict, exact timing by an injected clock, logs."""
from __future__ import annotations

import json
import logging
import threading
import time

import numpy as np
import pytest

import gluon_stream as gs
from _helpers import FakeClock, known_stats, wait_for
from gluon_stream.stats import Stats


def test_totals_lanes_and_summary_from_known_spans():
    stats = known_stats()
    assert stats.lanes() == ["gluon_stream-producer_0", "gluon_stream-producer_1", "train"]
    totals = stats.totals()
    assert totals[("train", "wait")] == pytest.approx(3.5)
    assert totals[("train", "busy")] == pytest.approx(4.0)
    assert totals[("gluon_stream-producer_1", "generate")] == pytest.approx(3.5)
    table = stats.summary().splitlines()
    assert table[0].split()[:3] == ["epoch", "batches", "samples"]
    row = table[1].split()
    assert row[:6] == ["0", "2", "16", "7.50", "3.50", "46.7%"]
    assert row[6:9] == ["2", "2.0", "2"]  # samples/s, median rotation ms, peak shards held
    assert table[2] == ("shards: 2 produced (1 cache hits); generate 5.50 s, load 0.50 s, "
                        "transform 1.00 s in total")
    data = json.loads(json.dumps(stats.to_dict()))
    assert [s["key"] for s in data["shards"]] == ["a", "b"]
    assert data["epochs"][0]["stall_s"] == 3.5


@pytest.mark.mxnet
def test_loader_records_exact_busy_time_with_an_injected_clock():
    """Only the loop moves the fake clock (2 s per batch): busy = 2 s x batches, no waiting."""
    clock = FakeClock()
    stats = Stats(clock=clock)
    src = gs.FunctionSource(range(3), lambda k: np.arange(10.0) + 100 * k)
    with gs.StreamLoader(src, batch_size=4, stats=stats) as loader:
        batches = 0
        for _ in loader:
            clock.t += 2.0
            batches += 1
    epoch, = stats.epochs
    assert (batches, epoch.batches, epoch.samples, epoch.complete) == (8, 8, 30, True)
    assert epoch.wall_s == pytest.approx(16.0) and epoch.stall_s == 0.0
    totals = stats.totals()
    assert totals[("train", "busy")] == pytest.approx(16.0)
    assert totals[("train", "wait")] == 0.0
    assert [s.end - s.start for s in stats.spans if s.name == "busy"] == [2.0] * 8
    assert "0.0%" in stats.summary().splitlines()[1]
    assert [s.samples for s in stats.shards] == [10, 10, 10]


@pytest.mark.mxnet
def test_a_generator_that_sleeps_shows_at_least_that_time():
    """Real clock: each shard's generate time and the loop's first wait include the sleep."""
    delay = 0.05

    def slow(key):
        time.sleep(delay)  # the cost being measured, not synchronisation
        return np.ones((6, 2), np.float32)

    with gs.StreamLoader(gs.FunctionSource(range(3), slow), batch_size=4) as loader:
        assert sum(len(b) for b in loader) == 18
        stats = loader.stats
    assert len(stats.shards) == 3
    for rec in stats.shards:
        assert rec.generate_s >= delay and not rec.cache_hit
        assert rec.producer.startswith("gluon_stream-producer")
    gen = [s for s in stats.spans if s.name == "generate"]
    # the next epoch's first shard may have been started ahead too: it slept as well
    assert {s.key for s in gen} == {0, 1, 2} and all(s.end - s.start >= delay for s in gen)
    epoch = stats.epochs[0]
    # the first shard is only requested once the pass starts: the loop waited for it
    assert epoch.first_batch_s >= delay and epoch.stall_s >= delay
    first_wait = next(s for s in stats.spans if s.lane == "train")
    assert first_wait.name == "wait" and first_wait.end - first_wait.start >= delay
    assert stats.totals()[("train", "wait")] == pytest.approx(epoch.stall_s)


@pytest.mark.mxnet
def test_one_info_line_per_shard_and_a_warning_per_retry(caplog):
    calls = {}

    def flaky(key):
        calls[key] = calls.get(key, 0) + 1
        if key == 1 and calls[key] == 1:
            raise OSError("transient")
        return np.ones((3, 1))

    with caplog.at_level(logging.INFO, logger="gluon_stream"):
        with gs.StreamLoader(gs.FunctionSource(range(3), flaky), batch_size=3,
                             on_error=("retry", 1)) as loader:
            assert sum(len(b) for b in loader) == 9
    ready = [r for r in caplog.records if r.levelno == logging.INFO and "ready" in r.getMessage()]
    assert len(ready) == 3 and all(r.name.startswith("gluon_stream") for r in ready)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "retry 1/1" in warnings[0].getMessage()




def test_endless_streams_keep_a_bounded_window_of_records_and_exact_totals():
    from gluon_stream.stats import MAX_SHARD_RECORDS, ShardRecord

    stats = Stats(clock=FakeClock())
    n = MAX_SHARD_RECORDS + 2500
    for i in range(n):
        stats.add_shard(ShardRecord(i, 0, samples=3, cache_hit=i % 2 == 0, generate_s=0.5))
    stats.add_shard(ShardRecord("bad", 0, error="ShardError: boom"))
    assert len(stats.shards) == MAX_SHARD_RECORDS  # the latest records only ...
    assert stats.shards[-1].key == "bad" and stats.shards[0].key == n + 1 - MAX_SHARD_RECORDS
    totals = stats.totals_produced  # ... but the totals count every shard
    assert (totals.produced, totals.skipped, totals.samples) == (n, 1, 3 * n)
    assert totals.cache_hits == (n + 1) // 2 and totals.generate_s == pytest.approx(0.5 * n)
    assert f"shards: {n} produced ({(n + 1) // 2} cache hits)" in stats.summary()
    assert stats.to_dict()["totals"]["produced"] == n


def test_an_interrupted_pass_is_marked_in_the_summary():
    from gluon_stream.stats import EpochRecord

    stats = Stats(clock=FakeClock())
    stats.epochs.append(EpochRecord(0, batches=3, samples=12, wall_s=1.0, complete=False))
    stats.epochs.append(EpochRecord(0, batches=9, samples=36, wall_s=2.0, complete=True))
    rows = stats.summary().splitlines()
    assert rows[1].split()[0] == "0*" and rows[2].split()[0] == "0"
    assert rows[-1].startswith("* a pass that was interrupted")


@pytest.mark.mxnet
def test_rotation_is_timed_only_at_boundaries_whose_shard_was_ready():
    """A boundary that waited for production is a stall, not a slow switch."""
    gate = threading.Event()

    def fn(key):
        if key == 2:
            assert gate.wait(30), "the loop never waited for shard 2"
        return np.arange(8.0) + 10 * key

    with gs.StreamLoader(gs.FunctionSource(range(3), fn), batch_size=4, producers=2) as loader:
        it = iter(loader)
        next(it), next(it)  # shard 0
        wait_for(loader._path.ready, what="shard 1 produced")
        next(it), next(it)  # shard 1, produced before the loop asked for it
        real = loader.stream.waited

        def waited(key, *args):  # shard 2 is released only once the loop waits for it
            gate.set()
            real(key, *args)

        loader.stream.waited = waited
        assert [b.asnumpy().tolist() for b in it] == [[20.0, 21, 22, 23], [24.0, 25, 26, 27]]
    record = loader.stats.epochs[-1]
    assert len(record.rotation_s) == 1 and record.stall_s > 0
