"""The bench command end to end on a tiny workload, and the fast path's batches (issue 4).

Behaviour only: no timing assertions (the figures depend on the machine).
"""
from __future__ import annotations

import json
import subprocess

import mxnet as mx
import numpy as np
import pytest

import gluon_stream as gs
from _helpers import id_shards
from gluon_stream.cli import main
from gluon_stream.tools import bench, generator

pytestmark = pytest.mark.mxnet  # these tests use MXNet: warm its engine first

SIZES = [10, 7, 3, 0, 12, 5]  # leftovers at every boundary, an empty shard, one under a batch
BS = 4
PIPELINE_FIGURES = {"wall_s", "x_ideal", "x_wave_bound", "first_batch_s", "stall_s", "stall_pct",
                    "rotation_ms", "peak_rss_mb", "batches", "speedup_vs_dataloader_per_shard",
                    "rounds"}


MANY_EPOCHS = ("stragglers", "window-epochs")  # tested apart, on smaller settings than the CLI's


def test_bench_runs_end_to_end_and_json_has_every_contender_and_figure(tmp_path, capsys):
    out = tmp_path / "bench.json"
    # tuning: tested apart, in test_tuning.py
    scenarios = ",".join(s for s in bench.SCENARIOS if s not in MANY_EPOCHS + ("tuning",))
    status = main(["bench", "--rounds", "1", "--shards", "2", "--rows", "150", "--step-ms", "0",
                   "--delay", "0", "--throughput-samples", "300", "--throughput-batch-size", "64",
                   "--memory-rows", "200", "--memory-epochs", "2", "--persample-images", "40",
                   "--one-row-keys", "40", "--growth-keys", "50", "--growth-shards", "10",
                   "--growth-ranks", "2", "--growth-epochs", "1,2",
                   "--no-warmup", "--scenarios", scenarios,
                   "--json", str(out)])
    assert status == 0
    printed = capsys.readouterr().out
    results = json.loads(out.read_text())
    for scenario in bench.PIPELINE_SCENARIOS:
        res = results[scenario]
        assert scenario in printed
        assert set(res["contenders"]) == set(bench.PIPELINE_CONTENDERS)
        assert res["ideal"]["wall_s"] > 0 and res["ideal"]["wave_bound_s"] > 0
        assert set(res["components"]) == {"generate_s", "load_s", "transform_s"}
        for name, figures in res["contenders"].items():
            assert PIPELINE_FIGURES <= set(figures), name
            # per-shard loaders drop each shard's leftover; StreamLoader carries it over
            assert figures["batches"] == (5 if name.startswith("gluon_stream") else 4), name
            assert figures["wall_s"] > 0 and figures["x_ideal"] > 0, name
            if name in ("naive", "dataloader-per-shard"):
                assert figures["rotation_ms"] is not None, name
            # StreamLoader times only boundaries whose shard was ready: with no training step
            # the loop may wait at every one, and then there is no rotation to show
            assert figures["rotation_ms"] is None or figures["rotation_ms"] >= 0, name
    for shape in bench.THROUGHPUT_SHAPES:
        contenders = results["throughput"][shape]["contenders"]
        assert set(contenders) == set(bench.THROUGHPUT_CONTENDERS)
        assert all(c["samples_per_s"] > 0 and c["vs_ndarrayiter"] > 0
                   for c in contenders.values())
    per = results["per-sample"]
    assert set(per["in_memory"]) == set(bench.PERSAMPLE_CONTENDERS)
    assert all(c["samples_per_s"] > 0 and c["x_two_core_limit"] > 0
               and set(c["cpu_ms_per_batch"]) == {"loop", "workers"}
               for c in per["in_memory"].values())
    assert per["in_memory"]["gluon_stream-nw2"]["cpu_ms_per_batch"]["workers"] > 0
    assert per["in_memory"]["gluon_stream-nw2"]["cpu_x_two_core_limit"] > 0
    assert per["in_memory"]["gluon_stream-nw0"]["cpu_x_two_core_limit"] is None
    assert set(per["streaming"]["contenders"]) == {"dataloader-per-shard", "gluon_stream"}
    assert per["streaming"]["ideal_s"] > 0
    assert per["rotation"]["step_ms"] > 0 and per["rotation"]["boundaries"] >= 1
    assert set(results["placement"]["ms_per_batch"]) == {"as_in_context in the loop", "ctx="}
    assert set(results["mixing"]["distinct_shards_per_batch"]) == {"1", "2", "4", "8"}
    assert "per-sample" in printed and "placement" in printed and "shuffle_window" in printed
    memory = results["memory"]
    assert {"baseline_mb", "peak_over_baseline_mb", "bound_mb", "rss_slope_mb_per_epoch",
            "rss_per_epoch_mb", "overhead_mb", "peak_over_import_baseline_mb"} <= set(memory)
    assert len(memory["rss_per_epoch_mb"]) == 2
    assert memory["function_source"]["rows"] == 51 and memory["function_source"]["bound_mb"] > 0
    features = results["features"]
    assert set(features["contenders"]) == {"plain", "2 parts", "2 parts, even_batches='pad'",
                                           "samples_per_epoch", "MixSource 3:1"}
    assert all(c["samples_per_s"] > 0 and c["x_against"] > 0
               for c in features["contenders"].values())
    assert features["state_save_ms"] > 0 and features["diagnose_ms"] > 0
    assert "even_batches='pad'" in printed and "stats.diagnose()" in printed
    assert set(results["timeseries"]["contenders"]) == {"alone", "context", "alone, cache_dir",
                                                        "context, cache_dir"}
    assert results["targets"] and all({"target", "value", "limit", "met"} <= set(t)
                                      for t in results["targets"])
    one_row = results["one-row"]
    assert one_row["check"]["every_key_once"] and one_row["keys"] == 40
    assert results["growth"]["keys"]["50"]["len"] == 2 and set(results["growth"]["epochs"]) == {
        "1", "2"}
    assert "one-row shards" in printed and "growth:" in printed
    assert "one-row: the loader's own work per shard, us" in {t["target"]
                                                             for t in results["targets"]}
    ref = results["reference"]  # the machine's speed today, for comparing runs across days
    assert ref["images_per_s"] > 0 and ref["images_per_cpu_s"] >= ref["images_per_s"] * 0.9
    assert printed.startswith("reference rate") and f"{ref['images_per_s']:.0f} images/s" in printed


def test_the_reference_rate_runs_a_fixed_workload_and_leaves_numpy_random_alone():
    from gluon_stream.tools.bench.reference import reference_rate

    np.random.seed(7)
    expected = np.random.rand()
    np.random.seed(7)
    ref = reference_rate(images=20, repeats=3)
    assert np.random.rand() == expected  # the augmentation's draws did not move the user's state
    assert ref["repeats"] == 3 and "20 32x32x3 images" in ref["workload"]
    assert ref["images_per_s"] > 0 and 0 < ref["cpu_share"] <= 1.5


def test_bench_rejects_an_unknown_scenario(capsys):
    assert main(["bench", "--scenarios", "warp-speed"]) == 2
    assert "warp-speed" in capsys.readouterr().err


def _epochs(last_batch: str, epochs: int = 2, **options) -> list[list[tuple]]:
    """Per epoch, every batch as (ids, values) from a shuffled multi-shard stream."""
    source = gs.FunctionSource(range(len(SIZES)), id_shards(SIZES))
    out = []
    with gs.StreamLoader(source, batch_size=BS, shuffle=True, seed=11, last_batch=last_batch,
                         **options) as loader:
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            out.append([(batch[0].asnumpy().tolist(), batch[1].asnumpy().tolist())
                        for batch in loader])
    return out


@pytest.mark.parametrize("last_batch,num_workers", [("keep", 0), ("rollover", 2)])
def test_fast_path_yields_exactly_the_dataloader_batches(last_batch, num_workers):
    fast = _epochs(last_batch)
    plain = _epochs(last_batch, batchify_fn=mx.gluon.data.dataloader.default_batchify_fn,
                    num_workers=num_workers)
    assert fast == plain
    assert fast[0] != fast[1]  # shuffled differently per epoch
    every_id = sorted(1000 * k + i for k, n in enumerate(SIZES) for i in range(n))
    if last_batch == "keep":  # each epoch: every sample exactly once
        assert all(sorted(i for ids, _ in epoch for i in ids) == every_id for epoch in fast)
    else:  # epoch 0's leftover opens epoch 1; only epoch 1's own leftover is held back
        first = [i for ids, _ in fast[0] for i in ids]
        assert len(first) == len(set(first)) and len(first) % BS == 0
    # leftovers crossed shard boundaries: only an epoch's last batch may be short
    assert all(len(ids) == BS for epoch in fast for ids, _ in epoch[:-1])


def test_ideal_and_wave_bound():
    # generation-bound: 6 shards of 2 s on 2 producers, 0.1 s of steps per shard
    assert bench.ideal_time(1.0, 2.0, 0.0, 0.001, 600, 6, 2) == pytest.approx(6.0 + 0.1)
    assert bench.wave_bound(1.0, 2.0, 0.0, 0.001, 600, 6, 2) == pytest.approx(6.0 + 0.2)
    # an odd shard count leaves one shard in the last wave: both bounds agree
    assert bench.wave_bound(1.0, 2.0, 0.0, 0.001, 700, 7, 2) == pytest.approx(8.0 + 0.1)
    assert bench.ideal_time(1.0, 2.0, 0.0, 0.001, 700, 7, 2) == pytest.approx(8.0 + 0.1)
    # training-bound: the first shard plus every step
    assert bench.ideal_time(1.0, 0.1, 0.0, 0.01, 600, 6, 2) == pytest.approx(1.0 + 6.0)


def test_stragglers_and_window_epochs_run_end_to_end_on_tiny_settings():
    config = bench.BenchConfig(
        workload=bench.Workload(shards=2, rows=150, step_ms=0), scenarios=MANY_EPOCHS,
        rounds=1, delay=0.0, stragglers_dates=5, stragglers_batches=2, window_epochs=2,
        warmup=False)
    results = json.loads(json.dumps(bench.run_bench(config), default=str))
    strag = results["stragglers"]
    assert set(strag["contenders"]) == set(bench.STRAGGLER_CONTENDERS)
    assert strag["workload"]["shards"] == 5 and strag["workload"]["delay_factors"] == [
        ["s0004", 7.0]]  # every 5th date is a straggler
    for name, figures in strag["contenders"].items():
        # every date is 2 full batches: no leftovers, the same count for everyone
        assert figures["batches"] == 10 and figures["x_ideal"] > 0, name
    assert strag["ideal"]["wall_s"] > 0
    assert set(strag["stragglers"]) >= {"generate_s", "straggler_generate_s", "keeps_up"}
    windows = results["window-epochs"]
    assert windows["epochs"] == 2 and set(windows["scenarios"]) == set(bench.PIPELINE_SCENARIOS)
    for name, res in windows["scenarios"].items():
        assert set(res["contenders"]) == set(bench.WINDOW_EPOCHS_CONTENDERS), name
        assert res["workload"]["per_epoch"] and res["window_vs_1"] > 0, name
        # 2 epochs of 2 shards x 134 samples, batch 64, last_batch='keep': 5 batches each
        assert {c["batches"] for c in res["contenders"].values()} == {10}, name
    printed = bench.format_results(results)
    assert "stragglers:" in printed and "shuffle_window=4 against 1 over 2 epochs" in printed
    names = " ".join(t["target"] for t in results["targets"])
    assert "stragglers: gluon_stream x ideal" in names and "window-epochs balanced" in names


def test_every_stages_contender_takes_the_shards_in_the_stream_loaders_order(tmp_path):
    """The StreamLoader shuffles the shard order (shuffle=True): the other contenders take the
    shards in that same order, so a straggling date falls at the same place for everyone (the
    hand-built pipeline took them in key order and started on a quick date while the loader's
    first shard was a straggler)."""
    from gluon_stream.tools.bench.measure import Probe
    from gluon_stream.tools.bench.pipeline import _naive
    workload = bench.Workload(shards=7, rows=80, step_ms=0, seed=5)
    order = workload.shard_order()
    assert sorted(order) == workload.keys() and order != workload.keys()
    source = gs.FunctionSource(workload.keys(), lambda key: np.zeros(1))
    with gs.ShardStream(source, shuffle=True, seed=workload.seed) as stream:
        assert [shard.key for shard in stream] == order
    probe = Probe()
    for _ in _naive(workload, str(tmp_path), probe):
        pass
    assert [c["key"] for c in probe.components] == order


def test_the_cli_runs_the_new_scenarios_by_name(monkeypatch, tmp_path):
    seen = {}

    def fake(config):
        seen["config"] = config
        return {"targets": []}

    monkeypatch.setattr(bench, "run_bench", fake)
    assert main(["bench", "--scenarios", "stragglers,window-epochs"]) == 0
    assert list(seen["config"].scenarios) == ["stragglers", "window-epochs"]


def test_ideal_in_order_takes_dates_in_order_on_two_producers():
    # the straggler (3 s, ready at 4 s) holds one producer while the other makes date 4 (ready
    # at 2 s), which waits for the straggler's turn: 4 + 0.5 + 0.5
    assert bench.ideal_in_order([1.0, 1.0, 3.0, 1.0], [1, 1, 1, 1], 0.5) == pytest.approx(5.0)
    assert bench.ideal_in_order([1.0] * 4, [2] * 4, 1.0) == pytest.approx(1.0 + 8 * 1.0)


def test_the_generator_sleeps_longer_for_straggling_keys_and_varies_per_epoch(tmp_path):
    argv = generator.generator_command(20, 3, 0.01, delay_factors={"slow": 5.0}, per_epoch=True)
    assert argv[-4:] == ["--delay-factor", "slow:5.0", "--epoch", "{epoch}"]
    made = {}
    for key, epoch in [("slow", 0), ("slow", 1), ("fast", 0)]:
        path = tmp_path / f"{key}{epoch}.npy"
        subprocess.run([a.replace("{key}", key).replace("{path}", str(path))
                        .replace("{epoch}", str(epoch)) for a in argv], check=True)
        made[key, epoch] = np.load(path)
    np.testing.assert_array_equal(made["slow", 1], generator.generate("slow", 20, 3, 1))
    assert not np.array_equal(made["slow", 0], made["slow", 1])
    np.testing.assert_array_equal(generator.generate("fast", 20, 3),
                                  generator.generate("fast", 20, 3))  # no epoch: as before


def test_the_timeseries_scenario_measures_context_beside_shards_windowed_alone():
    from gluon_stream.tools.bench.timeseries import SHARDS, STEPS, run_timeseries_scenario

    out = run_timeseries_scenario(rounds=2, rows=40)
    got = out["contenders"]
    assert {name: (len(c["rounds"]), c["against"]) for name, c in got.items()} == {
        "alone": (2, "alone"), "context": (2, "alone"),
        "alone, cache_dir": (2, "alone, cache_dir"),
        "context, cache_dir": (2, "alone, cache_dir")}
    # context: the windows of one long series; alone: each shard's own
    assert got["context"]["windows"] == got["context, cache_dir"]["windows"] == SHARDS * 40 - STEPS
    assert got["alone"]["windows"] == SHARDS * (40 - STEPS)
    assert all(c["x_against"] > 0 and c["samples_per_s"] > 0 for c in got.values())


def test_the_features_scenario_runs_every_contender_each_round():
    from gluon_stream.tools.bench.features import run_features_scenario

    out = run_features_scenario(rounds=2, rows=130)
    assert {name: len(c["rounds"]) for name, c in out["contenders"].items()} == {
        "plain": 2, "2 parts": 2, "2 parts, even_batches='pad'": 2, "samples_per_epoch": 2,
        "MixSource 3:1": 2}


def test_the_one_row_scenario_counts_every_shard_and_sample_on_both_sides():
    """Issue 36's instrument: loader and plain loop over the same one-row shards, interleaved;
    the figures agree with each other (no timing thresholds)."""
    from gluon_stream.tools.bench.onerow import one_row_lines, run_one_row_scenario

    out = run_one_row_scenario(rounds=2, keys=70)
    assert out["check"] == {"keys_made": 70, "calls": out["check"]["calls"], "samples": 70,
                            "batches": 3, "every_key_once": True, "same_batches_as_plain": True}
    assert out["check"]["calls"] >= 70  # and those made ahead for the next epoch
    # every timed pass, loader and plain, delivered 70 samples in 3 batches (32, 32, 6)
    assert out["passes"] == [{"who": "loader", "batches": 3, "samples": 70},
                             {"who": "plain", "batches": 3, "samples": 70}]
    assert len(out["rounds"]["loader_s"]) == len(out["rounds"]["plain_s"]) == 2
    assert out["loader_shards_per_s"] * out["loader_us_per_shard"] == pytest.approx(1e6)
    assert out["plain_shards_per_s"] * out["plain_us_per_shard"] == pytest.approx(1e6)
    # two rounds: the median difference is the difference of the medians
    assert out["own_us_per_shard"] == pytest.approx(
        out["loader_us_per_shard"] - out["plain_us_per_shard"])
    assert out["x_plain"] > 0
    assert out["loader_cpu_us_per_shard"] > 0 and out["plain_cpu_us_per_shard"] > 0
    assert len(out["rounds"]["loader_cpu_s"]) == 2
    printed = "\n".join(one_row_lines(out))
    assert "70 keys of one row" in printed and f"{out['own_us_per_shard']:.1f} us" in printed


def test_the_growth_scenario_measures_every_size_of_every_part():
    from gluon_stream.tools.bench.growth import GrowthSizes, growth_lines, run_growth_scenario

    sizes = GrowthSizes(keys=(100, 1000), shards=(10, 40), ranks=(2, 8), epochs=(1, 3))
    out = json.loads(json.dumps(run_growth_scenario(2, sizes)))
    assert out["sizes"] == {"keys": [100, 1000], "shards": [10, 40], "ranks": [2, 8],
                            "epochs": [1, 3]}
    # shard_sizes=1 made len() known: ceil(keys / 32) batches
    assert {n: k["len"] for n, k in out["keys"].items()} == {"100": 4, "1000": 32}
    assert all(k["state_bytes"] > 0 and k["epoch_start_8_ranks_ms"] > 0
               for k in out["keys"].values())
    assert [s["keys"] for s in out["shards"].values()] == [10, 40]
    assert all(len(s["rounds"]["loader_s"]) == 2 for s in out["shards"].values())
    ranks = out["ranks"]
    assert set(ranks) == {"2", "8"}
    assert ranks["8"]["merged_bytes"] > ranks["2"]["merged_bytes"] > ranks["2"]["rank_state_bytes"]
    assert set(out["epochs"]) == {"1", "3"}
    assert all(e["state_bytes"] > 0 and e["epoch_ms"] > 0 for e in out["epochs"].values())
    printed = "\n".join(growth_lines(out))
    assert "shards/epoch" in printed and "merge ms" in printed and "1,000" in printed
    assert "CPU us/shard loader" in printed


def test_the_cli_passes_the_one_row_and_growth_sizes(monkeypatch, capsys):
    seen = {}

    def fake(config):
        seen["config"] = config
        return {"targets": []}

    monkeypatch.setattr(bench, "run_bench", fake)
    assert main(["bench", "--scenarios", "one-row,growth", "--one-row-keys", "50",
                 "--growth-keys", "10,20", "--growth-ranks", "4"]) == 0
    config = seen["config"]
    assert list(config.scenarios) == ["one-row", "growth"] and config.one_row_keys == 50
    assert config.growth == bench.GrowthSizes(keys=(10, 20), shards=(100, 1000, 10000),
                                              ranks=(4,), epochs=(1, 10, 100))
    assert main(["bench", "--growth-epochs", "1,0"]) == 2
    assert "--growth-epochs" in capsys.readouterr().err
def test_the_provenance_scenario_runs_every_contender_each_round():
    from gluon_stream.tools.bench.provenance import provenance_lines, run_provenance_scenario

    out = run_provenance_scenario(rounds=2, rows=70)
    assert {name: len(c["rounds"]) for name, c in out["contenders"].items()} == {
        f"window {w}, {how}": 2 for w in (1, 4) for how in ("off", "on", "on, read")}
    assert all(c["us_per_batch"] > 0 for c in out["contenders"].values())
    assert out["contenders"]["window 1, off"]["extra_us"] == 0
    assert any("us against off" in line for line in provenance_lines(out))
