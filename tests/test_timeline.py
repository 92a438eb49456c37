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
