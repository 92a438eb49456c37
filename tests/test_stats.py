"""Stats: numbers against known spans, summary/to_dict, timeline plot, Chrome trace, progress, logs."""
from __future__ import annotations

import io
import json
import logging
import time

import numpy as np
import pytest

import gluon_stream as gs
from gluon_stream.stats import EpochRecord, ProgressBar, ShardRecord, Stats


@pytest.fixture(scope="module", autouse=True)
def _warm_matplotlib(tmp_path_factory):
    """matplotlib opens its font files lazily and keeps them open: not a leak of ours."""
    known_stats().plot(tmp_path_factory.mktemp("warm") / "warm.png")


class FakeClock:
    """A clock only the test moves (reads from any thread are safe)."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def known_stats() -> Stats:
    """Two producers and the training loop with hand-written spans (origin 100.0)."""
    stats = Stats(clock=FakeClock())
    for lane, name, a, b in [("gluon_stream-producer_0", "generate", 100.0, 102.0),
                             ("gluon_stream-producer_0", "load", 102.0, 102.5),
                             ("gluon_stream-producer_0", "transform", 102.5, 103.0),
                             ("gluon_stream-producer_1", "generate", 100.0, 103.5),
                             ("gluon_stream-producer_1", "load", 103.5, 103.5),
                             ("gluon_stream-producer_1", "transform", 103.5, 104.0),
                             ("train", "wait", 100.0, 103.0),
                             ("train", "busy", 103.0, 105.0),
                             ("train", "wait", 105.0, 105.5),
                             ("train", "busy", 105.5, 107.5)]:
        stats.add_span(lane, name, a, b)
    stats.add_shard(ShardRecord("a", 0, 10, False, 2.0, 0.5, 0.5, "gluon_stream-producer_0"))
    stats.add_shard(ShardRecord("b", 0, 6, True, 3.5, 0.0, 0.5, "gluon_stream-producer_1"))
    stats.epochs.append(EpochRecord(0, batches=2, samples=16, wall_s=7.5, stall_s=3.5,
                                    first_batch_s=3.0, rotation_s=[0.002], peak_prefetch=2,
                                    complete=True))
    return stats


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


def test_progress_bar_shows_rate_waiting_share_and_shards_ahead():
    out = io.StringIO()
    bar = ProgressBar(3, total=4, file=out)
    bar.update(EpochRecord(3, batches=1, samples=32, wall_s=2.0, stall_s=0.5), ahead=2)
    assert bar.postfix == {"samples/s": "16", "waiting": "25%", "ahead": 2}
    bar.close(EpochRecord(3, batches=4, samples=128, wall_s=4.0, stall_s=2.0))
    assert bar.postfix == {"samples/s": "32", "waiting": "50%", "ahead": 0}
    text = out.getvalue()
    assert "epoch 3" in text and "waiting=50%" in text and "samples/s=32" in text


def test_loader_progress_true_draws_a_bar_per_epoch(capsys):
    with gs.StreamLoader(gs.FunctionSource(range(2), lambda k: np.ones((8, 2))), batch_size=4,
                         progress=True) as loader:
        for epoch in range(2):
            loader.set_epoch(epoch)
            assert sum(1 for _ in loader) == 4
    err = capsys.readouterr().err
    assert "epoch 0" in err and "epoch 1" in err and "waiting=" in err and "ahead=" in err


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


def test_docstring_examples_run():
    import doctest

    from gluon_stream import cli, stats

    for module in (stats, cli):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0 and result.attempted > 0, module.__name__


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
