"""MetricsExporter: what loader.stats measures goes to TensorBoard (read back from the event
files) and to a callback, every N batches, per rank."""
from __future__ import annotations

import struct
import sys
from pathlib import Path

import numpy as np
import pytest

import gluon_stream as gs
from gluon_stream.records import EpochRecord, ShardRecord, TuningRecord


def read_events(logdir: Path) -> list:
    """Every Event in a directory's TensorBoard event files (TFRecord framing: length, its
    CRC, the serialised Event, its CRC)."""
    event_pb2 = pytest.importorskip("tensorboardX.proto.event_pb2")
    events = []
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        at = 0
        while at < len(data):
            (length,) = struct.unpack_from("<Q", data, at)
            at += 12  # the length and its CRC
            events.append(event_pb2.Event.FromString(data[at:at + length]))
            at += length + 4  # the event and its CRC
    return events


def scalars(logdir: Path) -> dict:
    """``{tag: [(step, value), ...]}`` of every scalar written into ``logdir``."""
    out: dict = {}
    for event in read_events(logdir):
        for value in event.summary.value:
            if value.HasField("simple_value"):
                out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


def shards(key):
    return np.arange(20.0, dtype=np.float32) + 100 * key


def test_a_loaders_metrics_reach_tensorboard_every_n_batches(tmp_path):
    pytest.importorskip("tensorboardX")
    src = gs.FunctionSource(range(3), shards, cache_dir=None)
    with gs.StreamLoader(src, batch_size=4) as loader, \
            gs.MetricsExporter(loader, every=5, tensorboard=tmp_path) as metrics:
        taken = 0
        for _ in loader:  # 15 batches
            metrics.step()
            taken += 1
    assert taken == 15
    written = scalars(tmp_path / "rank0")
    assert [step for step, _ in written["gluon_stream/samples"]] == [5, 10, 15]
    assert sum(v for _, v in written["gluon_stream/samples"]) == 60
    assert sum(v for _, v in written["gluon_stream/batches"]) == 15
    assert sum(v for _, v in written["gluon_stream/shards"]) == 3
    for tag in ("stall_share", "samples_per_s", "generate_s", "load_s", "transform_s",
                "wall_s"):
        assert len(written[f"gluon_stream/{tag}"]) == 3, tag
    assert all(0.0 <= v <= 1.0 for _, v in written["gluon_stream/stall_share"])
    assert all(v > 0 for _, v in written["gluon_stream/samples_per_s"])


def test_intervals_stall_and_tuning_from_the_stats():
    """Differences between exports, read from the records a loader fills: the stall share and
    rate of the batches in between, mean shard timings, the tuner's new changes."""
    now = [0.0]
    stats = gs.Stats(clock=lambda: now[0])
    seen = []
    exporter = gs.MetricsExporter(stats, every=2, callback=seen.append, rank=3)
    epoch = stats.new_epoch(0)
    _took(epoch, batches=2, samples=8, stall=1.0)
    now[0] = 4.0
    stats.add_shard(ShardRecord(0, 0, samples=8, generate_s=2.0, load_s=0.5))
    stats.add_shard(ShardRecord(1, 0, samples=8, generate_s=4.0, load_s=0.5))
    stats.add_tuning(TuningRecord(1.0, 0, "prefetch", 2, 3, "the loop waited"))
    exporter.step()
    exporter.step()
    _took(epoch, batches=2, samples=8, stall=0.0)
    now[0] = 6.0
    exporter.step(2)
    exporter.close()
    first, second = seen
    assert (first.rank, first.step, first.batches, first.samples) == (3, 2, 2, 8)
    assert first.stall_share == pytest.approx(0.25) and first.samples_per_s == pytest.approx(2)
    assert (first.shards, first.generate_s, first.load_s) == (2, 3.0, 0.5)
    assert [(t.setting, t.new) for t in first.tuning] == [("prefetch", 3)]
    assert first.scalars()["gluon_stream/tuning/prefetch"] == 3.0
    assert (second.step, second.batches, second.stall_share, second.shards) == (4, 2, 0.0, 0)
    assert second.samples_per_s == pytest.approx(4) and second.tuning == ()


def _took(record: EpochRecord, batches: int, samples: int, stall: float) -> None:
    record.batches += batches
    record.samples += samples
    record.stall_s += stall


def test_each_rank_exports_its_own(tmp_path):
    pytest.importorskip("tensorboardX")
    for rank in range(2):
        src = gs.FunctionSource(range(4), shards, cache_dir=None)
        calls = []
        with gs.StreamLoader(src, batch_size=5, num_parts=2, part_index=rank) as loader, \
                gs.MetricsExporter(loader, every=2, callback=calls.append,
                                   tensorboard=tmp_path) as metrics:
            for _ in loader:
                metrics.step()
        assert [m.rank for m in calls] == [rank] * 4  # 8 batches of this rank's 2 shards
        assert sum(m.samples for m in calls) == 40
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]
    for rank in range(2):
        assert [s for s, _ in scalars(tmp_path / f"rank{rank}")["gluon_stream/samples"]] \
            == [2, 4, 6, 8]


def test_a_writer_of_ones_own_is_used_and_left_open():
    class Writer:
        def __init__(self):
            self.scalars, self.flushed, self.closed = [], 0, False

        def add_scalar(self, tag, value, step):
            self.scalars.append((tag, step))

        def flush(self):
            self.flushed += 1

        def close(self):
            self.closed = True

    writer = Writer()
    with gs.MetricsExporter(gs.Stats(), every=1, tensorboard=writer) as metrics:
        metrics.step()
    assert ("gluon_stream/stall_share", 1) in writer.scalars
    assert writer.flushed == 1 and not writer.closed


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="every"):
        gs.MetricsExporter(gs.Stats(), every=0)
    with pytest.raises(TypeError, match="tensorboard"):
        gs.MetricsExporter(gs.Stats(), tensorboard=3)


def test_without_tensorboardx_a_log_directory_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # import fails as if not installed
    with pytest.raises(ImportError, match=r"gluon_stream\[tensorboard\]"):
        gs.MetricsExporter(gs.Stats(), tensorboard=tmp_path)
