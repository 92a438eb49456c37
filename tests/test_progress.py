"""Progress bars: samples/s, the share of time waiting and the shards ahead, one bar per epoch."""
from __future__ import annotations

import io

import numpy as np
import pytest

import gluon_stream as gs
from gluon_stream.progress import ProgressBar
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


@pytest.mark.mxnet
def test_loader_progress_true_draws_a_bar_per_epoch(capsys):
    with gs.StreamLoader(gs.FunctionSource(range(2), lambda k: np.ones((8, 2))), batch_size=4,
                         progress=True) as loader:
        for epoch in range(2):
            loader.set_epoch(epoch)
            assert sum(1 for _ in loader) == 4
    err = capsys.readouterr().err
    assert "epoch 0" in err and "epoch 1" in err and "waiting=" in err and "ahead=" in err
