"""stats.diagnose(): the decision rule on hand-made records (an injected clock, no sleeping),
then real StreamLoaders over workloads whose bottleneck is known by construction."""
from __future__ import annotations

import dataclasses
import json
import math
import re
import threading
import time

import numpy as np
import pytest

import gluon_stream as gs
from _helpers import JOIN_S, FakeClock
from gluon_stream.diagnosis import BOTTLENECKS, TRAINING, LoaderSettings, available_cores, diagnose
from gluon_stream.stats import EpochRecord, ShardRecord, Stats


def made(epochs, shards=(), settings=None, cores=8, **kw):
    """The diagnosis of hand-made records (settings: LoaderSettings fields)."""
    return diagnose(epochs, list(shards), LoaderSettings(**(settings or {})), cores=cores, **kw)


def shards(n=10, samples=100, generate=0.0, load=0.0, transform=0.0):
    return [ShardRecord(k, 0, samples, False, generate, load, transform, "p0") for k in range(n)]


def shard_bound(**kw):
    """10 s of wall, 6 s waiting for shards, 1000 samples: the loop uses 0.4 s per 100-sample
    shard; a shard takes 1 s to make, so ceil(1 / 0.4) = 3 producers keep up."""
    epoch = EpochRecord(0, batches=100, samples=1000, wall_s=10.0, stall_s=6.0, shard_wait_s=6.0,
                        first_batch_s=0.0, complete=True)
    return [epoch], shards(**kw)


# -- the rule, on hand-made records -----------------------------------------------------------
def test_a_loop_that_rarely_waits_is_training_bound():
    d = made([EpochRecord(0, batches=50, samples=500, wall_s=10.0, stall_s=0.9,
                          shard_wait_s=0.9, first_batch_s=0.0)], shards(generate=0.1))
    assert (d.bottleneck, d.advice) == ("none", TRAINING)
    assert d.evidence["wait_share"] == pytest.approx(0.09)


def test_shard_waits_name_the_slowest_phase_and_producers_from_the_ratio():
    for phase, kw in [("generation", dict(generate=0.9, load=0.05, transform=0.05)),
                      ("load", dict(generate=0.05, load=0.9, transform=0.05)),
                      ("transform", dict(generate=0.05, load=0.05, transform=0.9))]:
        d = made(*shard_bound(**kw), settings=dict(producers=1, prefetch=2))
        assert d.bottleneck == phase
        assert d.advice.startswith("producers=3, prefetch=3 ("), d.advice
        assert d.evidence["loop_s_per_shard"] == pytest.approx(0.4)
        assert d.evidence["producers_needed"] == 3
        assert d.evidence["shard_wait_share"] == pytest.approx(0.6)


def test_producers_are_bounded_by_the_cores_and_the_advice_says_what_else_helps():
    d = made(*shard_bound(generate=1.0), settings=dict(producers=1), cores=2)
    assert d.bottleneck == "generation"
    assert d.advice.startswith("producers=2 (") and "3 producers would keep up" in d.advice
    assert "cache_dir=" in d.advice and d.evidence["cores"] == 2
    at_cap = made(*shard_bound(generate=1.0), settings=dict(producers=2), cores=2)
    assert at_cap.advice.startswith("make generation cheaper or cache the shards for the next "
                                    "epochs (cache_dir=) ("), at_cap.advice
    epochs, records = shard_bound(generate=1.0)
    records[0].cache_hit = True  # already cached
    cached = made(epochs, records, settings=dict(producers=2), cores=2)
    assert cached.advice.startswith("make generation cheaper ("), cached.advice


def test_enough_producers_on_average_means_a_deeper_prefetch():
    d = made(*shard_bound(generate=1.0), settings=dict(producers=4, prefetch=4))
    assert d.bottleneck == "generation" and d.advice.startswith("prefetch=5 ("), d.advice


def test_auto_producers_are_fixed_at_what_keeps_up_from_the_start():
    epochs, records = shard_bound(generate=1.0)
    epochs[0].producers = 2  # grown to 2 by the end of the pass
    d = made(epochs, records, settings=dict(producers=1, auto_producers=True, prefetch=2))
    assert d.advice.startswith("producers=3, prefetch=3"), d.advice
    assert d.evidence["producers"] == 2


def test_an_executor_is_advised_more_workers_not_producers():
    d = made(*shard_bound(generate=1.0), settings=dict(remote=True))
    assert d.bottleneck == "generation" and d.advice.startswith("more workers behind the ")


def test_a_window_gather_is_transform_and_asks_for_shards_ahead():
    epoch = EpochRecord(0, batches=100, samples=1000, wall_s=10.0, stall_s=5.0, mix_wait_s=4.0,
                        shard_wait_s=0.5, first_batch_s=0.0)
    d = made([epoch], shards(generate=0.1), settings=dict(prefetch=2, shuffle_window=4))
    assert d.bottleneck == "transform" and d.advice.startswith("prefetch=5 ("), d.advice


@pytest.mark.parametrize("workers, wait, want", [(0, 8.0, 4), (2, 5.0, 4), (1, 9.0, 10)])
def test_workers_needed_from_the_share_of_time_the_loop_waits_for_them(workers, wait, want):
    """Inline (0 workers) the waits are the making itself: 8 s against 2 s of the loop's own
    -> 4. With W busy workers making W x 10 s of batches against the loop's 10 - wait."""
    epoch = EpochRecord(0, batches=100, samples=1000, wall_s=10.0, stall_s=wait,
                        worker_wait_s=wait, first_batch_s=0.0)
    d = made([epoch], settings=dict(per_sample=True, num_workers=workers), cores=16)
    assert d.bottleneck == "workers" and d.advice.startswith(f"num_workers={want} ("), d.advice
    assert d.evidence["workers_needed"] == want
    capped = made([epoch], settings=dict(per_sample=True, num_workers=workers), cores=3)
    assert capped.advice.startswith("num_workers=3 (") and f"{want} would keep up" in \
        capped.advice


def test_workers_at_every_core_are_told_to_do_less_per_sample():
    epoch = EpochRecord(0, batches=100, samples=1000, wall_s=10.0, stall_s=5.0,
                        worker_wait_s=5.0, first_batch_s=0.0)
    d = made([epoch], settings=dict(per_sample=True, num_workers=2), cores=2)
    assert d.bottleneck == "workers" and d.advice.startswith("make sample_transform"), d.advice


@pytest.mark.parametrize("settings, want", [
    (dict(contexts=1), "shards_on_ctx=True ("),
    (dict(contexts=2), "pin_memory=True ("),
    (dict(contexts=1, per_sample=True), "pin_memory=True ("),
    (dict(contexts=1, shards_on_ctx=True, pin_memory=True, batch_size=64), "batch_size=128 ("),
])
def test_placement_advice_follows_the_settings(settings, want):
    epoch = EpochRecord(0, batches=100, samples=1000, wall_s=10.0, stall_s=3.0, place_s=2.5,
                        first_batch_s=0.0)
    d = made([epoch], settings=settings)
    assert d.bottleneck == "placement" and d.advice.startswith(want), d.advice
    assert "25.00 ms" in d.advice  # 2.5 s over 100 batches


def test_a_wait_no_stage_explains_is_the_loaders_own_per_batch_work():
    epoch = EpochRecord(0, batches=1000, samples=64000, wall_s=1.0, stall_s=0.5,
                        shard_wait_s=0.05, first_batch_s=0.0)
    d = made([epoch], settings=dict(batch_size=64))
    assert d.bottleneck == "none" and d.advice.startswith("batch_size=128 (no stage"), d.advice
    assert "450 us per batch" in d.advice


def test_the_first_batch_start_up_is_left_out():
    """3 s waiting for the very first shard, then 0.2 s of 10 s: training-bound."""
    first = EpochRecord(0, batches=100, samples=1000, wall_s=6.0, stall_s=3.1, shard_wait_s=3.1,
                        first_batch_s=3.0)
    second = EpochRecord(1, batches=100, samples=1000, wall_s=7.0, stall_s=0.1,
                         shard_wait_s=0.1, first_batch_s=0.05)
    d = made([first, second], shards(generate=0.1))
    assert (d.bottleneck, d.advice) == ("none", TRAINING)
    assert d.evidence["startup_s"] == 3.0 and d.evidence["wall_s"] == pytest.approx(10.0)
    assert d.evidence["wait_share"] == pytest.approx(0.02)


def test_causes_never_add_up_to_more_than_the_wait():
    epoch = EpochRecord(0, batches=100, samples=1000, wall_s=10.0, stall_s=4.0, shard_wait_s=6.0,
                        place_s=2.0, first_batch_s=0.0)
    d = made([epoch], shards(generate=1.0), settings=dict(producers=1))
    assert d.evidence["shard_wait_share"] == pytest.approx(0.3)  # 6 of 8, scaled to 4
    assert d.evidence["place_share"] == pytest.approx(0.1)
    assert d.evidence["other_wait_share"] == 0.0
    assert d.evidence["loop_s_per_shard"] == pytest.approx(0.7)  # (10 - 3) s / 1000 x 100


def test_nothing_to_judge_before_a_batch():
    assert made([]).advice.startswith("nothing yet")
    assert made([EpochRecord(0)]).bottleneck == "none"


def test_stats_diagnose_counts_a_pass_in_progress_up_to_now():
    """Without a progress bar a running pass has no wall time yet: it counts until now (the
    injected clock), from when new_epoch began it."""
    clock = FakeClock()
    stats = Stats(clock=clock)
    stats.describe(producers=1, prefetch=2, batch_size=10)
    clock.t += 1.0
    record = stats.new_epoch(0)
    assert record.start_s == 1.0
    for k in range(4):
        stats.add_shard(ShardRecord(k, 0, 100, False, 0.5, 0.0, 0.0, "p0"))
    record.batches, record.samples, record.first_batch_s = 40, 400, 0.0
    record.stall_s = 1.5  # its split by cause comes when the pass ends
    clock.t += 2.0
    d = stats.diagnose()
    assert d.evidence["wall_s"] == pytest.approx(2.0)
    assert d.evidence["wait_share"] == pytest.approx(0.75)
    record.shard_wait_s, record.wall_s = 1.5, 2.0  # the pass ended
    clock.t += 100.0  # later calls change nothing
    d = stats.diagnose()
    assert d.bottleneck == "generation"
    # 0.5 s not waiting over 400 samples: 0.125 s per 100-sample shard; 0.5 s to make one -> 4
    assert d.evidence["producers_needed"] == 4
    assert count(d.advice, "producers") == min(4, d.evidence["cores"])


def test_describe_takes_only_known_settings():
    stats = Stats()
    with pytest.raises(TypeError, match="producer"):
        stats.describe(producer=2)
    stats.describe(producers=2)
    assert stats.settings == LoaderSettings(producers=2)


def test_a_diagnosis_is_frozen_plain_data_with_a_readable_text():
    d = made(*shard_bound(generate=1.0), settings=dict(producers=1), cores=4)
    assert d.bottleneck in BOTTLENECKS
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.bottleneck = "none"
    data = json.loads(json.dumps(dataclasses.asdict(d)))
    assert gs.Diagnosis(**data) == d
    assert all(isinstance(v, float) for v in d.evidence.values())
    text = str(d).splitlines()
    assert text[0] == d.headline == f"bottleneck: generation -> {d.advice}"
    assert text[1].startswith("  the loop waited 60% of 10.00 s")
    assert text[2].startswith("  per shard: generate 1000.0 ms") and len(text) == 4


def test_the_cores_are_this_process_s():
    assert 1 <= available_cores() <= (__import__("os").cpu_count() or 1)


def test_diagnose_costs_microseconds():
    """O(records): a typical run (3 passes, 30 shards) well under a millisecond per call."""
    stats = Stats()
    for e in range(3):
        stats.epochs.append(EpochRecord(e, batches=300, samples=3000, wall_s=3.0, stall_s=1.0,
                                        shard_wait_s=1.0, first_batch_s=0.1))
        for k in range(10):
            stats.add_shard(ShardRecord(k, e, 100, False, 0.1, 0.01, 0.01, "p0"))
    times = []
    for _ in range(100):
        t0 = time.perf_counter()
        stats.diagnose()
        times.append(time.perf_counter() - t0)
    assert sorted(times)[50] < 1e-3


@pytest.mark.mxnet  # tools.bench imports MXNet
def test_the_bench_report_ends_with_the_defaults_verdicts():
    from gluon_stream.tools.bench import format_results

    d = made(*shard_bound(generate=1.0), settings=dict(producers=1), cores=4)
    results = {"generation-bound": {
        "workload": {"shards": 6, "rows": 100, "time_steps": 4, "inputs": 2, "batch_size": 8,
                     "step": "sleep", "step_ms": 1.0, "delay": 0.1, "producers": 2,
                     "num_workers": 2},
        "components": {"generate_s": 0.1, "load_s": 0.0, "transform_s": 0.0},
        "ideal": {"rounds": [1.0], "wall_s": 1.0, "wave_bound_s": 1.0},
        "contenders": {}}}
    assert "diagnose" not in format_results(results)  # no verdict recorded: no line
    results["generation-bound"]["contenders"]["gluon_stream"] = {
        k: None for k in ("wall_s", "x_ideal", "x_wave_bound", "speedup_vs_dataloader_per_shard",
                          "first_batch_s", "stall_pct", "rotation_ms", "peak_rss_mb", "batches")}
    results["generation-bound"]["contenders"]["gluon_stream"]["diagnosis"] = \
        json.loads(json.dumps(dataclasses.asdict(d)))
    lines = format_results(results).splitlines()
    assert lines[-2] == "stats.diagnose() of gluon_stream (the library's defaults), last round:"
    assert lines[-1] == f"  generation-bound: {d.headline}"


# -- real loaders over workloads whose bottleneck is known --------------------------------------
def run(loader, step_s=0.0, after_step=None):
    """Train on every batch (``step_s``: the step's seconds); ``after_step(i)`` runs after
    batch ``i``'s step. The diagnosis of the pass."""
    with loader:
        for i, _ in enumerate(loader):
            if step_s:
                time.sleep(step_s)  # the training step
            if after_step is not None:
                after_step(i)
    return loader.stats.diagnose()


def count(advice, name):
    return int(re.match(rf"{name}=(\d+)", advice).group(1))


def arrays(key):
    return np.full((64, 4), key, dtype="float32")


@pytest.mark.mxnet
def test_a_slow_generator_is_generation_and_more_producers():
    """A shard takes 30 ms to make once the loop has trained on the one before (4 batches of
    1 ms each): the loop waits for every shard, on a busy machine too (a plain 30 ms, made
    ahead, lost to the loader's own per-batch work there: verdict 'none')."""
    trained = [threading.Event() for _ in range(10)]

    def slow(key):
        if key:
            assert trained[key - 1].wait(JOIN_S), f"the loop never trained on shard {key - 1}"
        time.sleep(0.03)
        return arrays(key)

    def after_step(i):
        if i % 4 == 3:  # the last of a shard's 4 batches of 16
            trained[i // 4].set()

    d = run(gs.StreamLoader(gs.FunctionSource(range(10), slow), batch_size=16), step_s=0.001,
            after_step=after_step)
    assert d.bottleneck == "generation", d
    needed = d.evidence["producers_needed"]
    assert needed > 1 and d.evidence["generate_s"] >= 0.03
    assert count(d.advice, "producers") == min(needed, d.evidence["cores"])
    assert count(d.advice, "producers") > 1 or d.evidence["cores"] == 1


@pytest.mark.mxnet
def test_a_slow_transform_is_transform():
    def slow(raw):
        time.sleep(0.03)
        return raw

    d = run(gs.StreamLoader(gs.FunctionSource(range(10), arrays), batch_size=16, transform=slow),
            step_s=0.001)
    assert d.bottleneck == "transform", d
    assert d.evidence["transform_s"] > 10 * d.evidence["generate_s"]
    assert d.advice.startswith("producers=")


@pytest.mark.mxnet
def test_slow_per_sample_work_on_one_worker_is_workers():
    """2 ms per sample on one worker thread, 8 samples per batch; the loop trains in no time."""
    def slow(x):
        time.sleep(0.002)
        return x

    loader = gs.StreamLoader(gs.FunctionSource(range(4), lambda k: arrays(k)[:24]),
                             batch_size=8, sample_transform=slow, num_workers=1,
                             thread_pool=True)
    assert loader.stats.settings == LoaderSettings(
        producers=1, auto_producers=True, prefetch=2, num_workers=1, thread_pool=True,
        per_sample=True, batch_size=8)
    d = run(loader)
    assert d.bottleneck == "workers", d
    assert d.evidence["worker_wait_share"] > 0.5
    cores = d.evidence["cores"]
    assert count(d.advice, "num_workers") == min(d.evidence["workers_needed"], cores) > 1 \
        or cores == 1


@pytest.mark.mxnet
def test_a_slow_training_step_with_fast_data_is_training_bound():
    d = run(gs.StreamLoader(gs.FunctionSource(range(5), arrays), batch_size=8), step_s=0.01)
    assert (d.bottleneck, d.advice) == ("none", TRAINING), d
    assert d.evidence["wait_share"] < 0.1
    assert math.isclose(d.evidence["batches"], 40)


@pytest.mark.mxnet
def test_the_wait_for_shards_is_part_of_the_stall():
    def last_is_slow(key):
        time.sleep(0.2 if key == 3 else 0.0)
        return arrays(key)[:16]

    with gs.StreamLoader(gs.FunctionSource(range(4), last_is_slow), batch_size=16,
                         producers=1, prefetch=1) as loader:
        for _ in loader:
            pass
    epoch, = loader.stats.epochs
    assert epoch.stall_s >= 0.2
    assert epoch.shard_wait_s <= epoch.stall_s
