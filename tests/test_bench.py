"""The bench command end to end on a tiny workload, and the fast path's batches (issue 4).

Behaviour only: no timing assertions (the figures depend on the machine).
"""
from __future__ import annotations

import json

import mxnet as mx
import pytest

import gluon_stream as gs
from _helpers import id_shards
from gluon_stream.tools import bench
from gluon_stream.cli import main

pytestmark = pytest.mark.mxnet  # these tests use MXNet: warm its engine first

SIZES = [10, 7, 3, 0, 12, 5]  # leftovers at every boundary, an empty shard, one under a batch
BS = 4
PIPELINE_FIGURES = {"wall_s", "x_ideal", "x_wave_bound", "first_batch_s", "stall_s", "stall_pct",
                    "rotation_ms", "peak_rss_mb", "batches", "speedup_vs_dataloader_per_shard",
                    "rounds"}


def test_bench_runs_end_to_end_and_json_has_every_contender_and_figure(tmp_path, capsys):
    out = tmp_path / "bench.json"
    status = main(["bench", "--rounds", "1", "--shards", "2", "--rows", "150", "--step-ms", "0",
                   "--delay", "0", "--throughput-samples", "300", "--throughput-batch-size", "64",
                   "--memory-rows", "200", "--memory-epochs", "2", "--persample-images", "40",
                   "--no-warmup",
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
    assert all(c["samples_per_s"] > 0 for c in per["in_memory"].values())
    assert set(per["streaming"]["contenders"]) == {"dataloader-per-shard", "gluon_stream"}
    assert per["streaming"]["ideal_s"] > 0
    assert per["rotation"]["step_ms"] > 0 and per["rotation"]["boundaries"] >= 1
    assert set(results["placement"]["ms_per_batch"]) == {"as_in_context in the loop", "ctx="}
    assert set(results["mixing"]["distinct_shards_per_batch"]) == {"1", "2", "4", "8"}
    assert "per-sample" in printed and "placement" in printed and "shuffle_window" in printed
    memory = results["memory"]
    assert {"baseline_mb", "peak_over_baseline_mb", "bound_mb", "rss_slope_mb_per_epoch",
            "rss_per_epoch_mb"} <= set(memory)
    assert len(memory["rss_per_epoch_mb"]) == 2
    assert results["targets"] and all({"target", "value", "limit", "met"} <= set(t)
                                      for t in results["targets"])


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
