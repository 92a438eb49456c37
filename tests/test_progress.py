"""Progress bars: samples/s, the share of time waiting and the shards ahead, one bar per epoch."""
from __future__ import annotations

import io

import numpy as np
import pytest

import gluon_stream as gs
from gluon_stream._utils.progress import ProgressBar
from gluon_stream.stats import EpochRecord


def test_progress_bar_shows_rate_waiting_share_and_shards_ahead():
    out = io.StringIO()
    bar = ProgressBar(3, total=4, file=out)
    bar.update(EpochRecord(3, batches=1, samples=32, wall_s=2.0, stall_s=0.5), ahead=2)
    assert bar.postfix == {"samples/s": "16", "waiting": "25%", "ahead": 2}
    bar.close(EpochRecord(3, batches=4, samples=128, wall_s=4.0, stall_s=2.0))
    assert bar.postfix == {"samples/s": "32", "waiting": "50%", "ahead": 0}
    text = out.getvalue()
    assert "epoch 3" in text and "waiting=50%" in text and "samples/s=32" in text


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def run_epoch(bar: ProgressBar, batches: int) -> None:
    for i in range(1, batches + 1):
        bar.update(EpochRecord(0, batches=i, samples=32 * i, wall_s=0.5 * i, stall_s=0.1), 1)
    bar.close(EpochRecord(0, batches=batches, samples=32 * batches, wall_s=0.5 * batches,
                          stall_s=0.1))


def test_into_a_log_file_the_bar_is_one_line_per_epoch_not_redraws():
    log = io.StringIO()
    run_epoch(ProgressBar(0, total=50, file=log), 50)
    assert "\r" not in log.getvalue()
    line, = log.getvalue().splitlines()
    assert line.startswith("epoch 0: 100%") and "50/50" in line
    assert "samples/s=64" in line and "waiting=0%" in line and "ahead=0" in line


def test_on_a_terminal_or_when_forced_the_bar_redraws_in_place():
    for out, live in ((Terminal(), None), (io.StringIO(), True)):
        run_epoch(ProgressBar(0, total=3, file=out, live=live), 3)
        assert out.getvalue().count("\r") >= 2 and "3/3" in out.getvalue()
    hidden = io.StringIO()
    run_epoch(ProgressBar(0, total=3, file=hidden, disable=None), 3)
    assert hidden.getvalue() == ""  # tqdm's disable=None: nothing where no one watches


def test_no_rate_over_the_first_milliseconds_of_an_epoch():
    bar = ProgressBar(0, total=10, file=io.StringIO())
    bar.update(EpochRecord(0, batches=1, samples=128, wall_s=0.0012, stall_s=0.0012), ahead=2)
    assert bar.postfix == {"ahead": 2}  # not samples/s=106,667 and waiting=100%
    bar.close(EpochRecord(0, batches=1, samples=128, wall_s=0.0012, stall_s=0.0012))
    assert bar.postfix["samples/s"] == "106,667"  # a finished epoch's figures are what they are


@pytest.mark.mxnet
def test_loader_progress_true_draws_a_bar_per_epoch(capsys):
    with gs.StreamLoader(gs.FunctionSource(range(2), lambda k: np.ones((8, 2))), batch_size=4,
                         progress=True) as loader:
        for epoch in range(2):
            loader.set_epoch(epoch)
            assert sum(1 for _ in loader) == 4
    err = capsys.readouterr().err
    assert "epoch 0" in err and "epoch 1" in err and "waiting=" in err and "ahead=" in err
    assert "\r" not in err and len(err.splitlines()) == 2  # captured: not a terminal
