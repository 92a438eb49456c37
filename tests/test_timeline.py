"""The timeline: a PNG with one lane per producer and one for the loop, and a Chrome trace that
holds the same spans, keyed by shard."""
from __future__ import annotations

import json

import numpy as np
import pytest

import gluon_stream as gs
from _helpers import known_stats

pytestmark = pytest.mark.usefixtures("warm_matplotlib")


def test_chrome_trace_holds_the_same_spans(tmp_path):
    stats = known_stats()
    path = stats.to_chrome_trace(tmp_path / "trace.json")
    trace = json.loads(open(path).read())
    events = trace["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert sorted(names.values()) == sorted(stats.lanes())
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == len(stats.spans)
    got = sorted((names[e["tid"]], e["name"], e["ts"], e["dur"]) for e in spans)
    want = sorted((s.lane, s.name, round(s.start * 1e6, 3), round((s.end - s.start) * 1e6, 3))
                  for s in stats.spans)
    assert got == want
    assert ("train", "busy", 3e6, 2e6) in got


def test_plot_draws_one_lane_per_producer_and_one_for_the_loop(tmp_path):
    import matplotlib.pyplot as plt

    open_before = plt.get_fignums()
    stats = known_stats()
    fig = stats.plot(tmp_path / "timeline.png")
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plt.get_fignums() == open_before  # saved without pyplot: nothing left open
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["producer_0", "producer_1", "train"]
    assert list(ax.get_yticks()) == [2, 1, 0]  # the training loop at the bottom
    # one bar group per (lane, phase) with non-empty spans: producer_1's load is empty
    assert len(ax.collections) == 3 + 2 + 2
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["generate", "load", "transform", "busy", "wait"]
    assert ax.get_title() == "training loop waited 3.50 s of 7.50 s (47%)"


def test_colours_can_be_told_apart():
    from gluon_stream._utils.timeline import COLORS

    rgb = {name: np.array([int(c[i:i + 2], 16) for i in (1, 3, 5)]) for name, c in COLORS.items()}
    names = sorted(rgb)
    closest = min((float(np.linalg.norm(rgb[a] - rgb[b])), a, b)
                  for i, a in enumerate(names) for b in names[i + 1:])
    assert closest[0] >= 100, closest  # transform and busy were two greens 62 apart


LONG_KEY = "shard-" + "0" * 80 + "42"


def two_epochs_stats():
    """Shards 'wide' and one with a long key on one producer, 'tiny' on the other; epoch 0 of
    2 batches from t=1, epoch 1 interrupted after 1 batch from t=12."""
    from gluon_stream.stats import EpochRecord, Stats

    stats = Stats(clock=lambda: 0.0)
    p0, p1 = "gluon_stream-producer_0", "gluon_stream-producer_1"
    shards = [(p0, "wide", 0.0), (p1, "tiny", 0.0), (p0, LONG_KEY, 5.0)]
    for lane, key, t in shards:  # generate 4 s, load 0.5 s, transform 0.5 s; tiny: 12.5 ms
        scale = 0.0025 if key == "tiny" else 1.0
        for name, a, b in [("generate", 0.0, 4.0), ("load", 4.0, 4.5), ("transform", 4.5, 5.0)]:
            stats.add_span(lane, name, t + a * scale, t + b * scale, key)
    for name, a, b in [("wait", 1.0, 5.0), ("busy", 5.0, 6.0), ("wait", 6.0, 6.5),
                       ("busy", 6.5, 7.0), ("wait", 12.0, 12.5), ("busy", 12.5, 13.0)]:
        stats.add_span("train", name, a, b)
    stats.epochs.append(EpochRecord(0, batches=2, samples=20, wall_s=6.0, complete=True))
    stats.epochs.append(EpochRecord(1, batches=1, samples=10, wall_s=1.0, complete=False))
    return stats


def test_plot_marks_epochs_and_labels_the_shards_it_has_room_for(tmp_path):
    fig = two_epochs_stats().plot(tmp_path / "t.png")
    ax = fig.axes[0]
    marks = [line.get_xdata()[0] for line in ax.lines if line.get_linestyle() == "--"]
    assert marks == [1.0, 12.0]
    texts = {t.get_text().strip(): t for t in ax.texts}
    assert {"epoch 0", "epoch 1*"} <= set(texts)
    assert "interrupted" in ax.get_xlabel()
    assert "wide" in texts and "tiny" not in texts  # 12.5 ms has no room for a key
    long, = (t for t in texts if t.endswith("42"))
    assert long.startswith("…") and LONG_KEY.endswith(long[1:]) and len(long) < len(LONG_KEY)
    assert texts["wide"].get_position() == (2.5, 2)  # centred on its shard, producer_0's lane


def test_epoch_marks_count_back_from_the_latest_spans():
    from gluon_stream._utils.timeline import epoch_starts
    from gluon_stream.stats import EpochRecord

    stats = two_epochs_stats()
    kept = [s for s in stats.span_list() if not (s.lane == "train" and s.start < 5.5)]
    # the first wait span was dropped: epoch 0 cannot be placed, epoch 1 still can
    assert epoch_starts(list(stats.epochs), kept) == [(12.0, "epoch 1*")]
    empty = [EpochRecord(0, batches=0), *stats.epochs]
    assert epoch_starts(empty, stats.span_list()) == [(1.0, "epoch 0"), (12.0, "epoch 1*")]


@pytest.mark.mxnet
def test_plot_of_a_real_run_and_into_given_axes(tmp_path):
    from matplotlib.figure import Figure

    with gs.StreamLoader(gs.FunctionSource(range(4), lambda k: np.ones((5, 2))),
                         batch_size=2, producers=2) as loader:
        for _ in loader:
            pass
        ax = Figure().subplots()
        assert loader.stats.plot(ax=ax, title="mine") is ax.figure
    assert ax.get_title() == "mine"
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels[-1] == "train" and all(lb.startswith("producer") for lb in labels[:-1])
    assert [t.get_text().strip() for t in ax.texts if t.get_text().strip().startswith("epoch")
            ] == ["epoch 0"]


@pytest.mark.mxnet
def test_producer_spans_carry_their_shard_key_into_the_trace(tmp_path):
    import numpy as np

    import gluon_stream as gs

    src = gs.FunctionSource(["a", "b"], lambda k: np.zeros((3, 2), np.float32))
    with gs.StreamLoader(src, batch_size=2) as loader:
        list(loader)
        path = loader.stats.to_chrome_trace(tmp_path / "t.json")
    events = json.loads(open(path).read())["traceEvents"]
    keyed = {(e["name"], e["args"]["key"]) for e in events if e["ph"] == "X" and "args" in e}
    assert {(phase, key) for phase in ("generate", "load", "transform")
            for key in "ab"} == keyed
    assert all("args" not in e for e in events if e.get("name") in ("busy", "wait"))
