"""examples/estimator_checkpoint.py runs on tiny settings: preempted, resumed, and checked
against an uninterrupted run (the example raises SystemExit when the batches differ)."""
from __future__ import annotations

import sys

import numpy as np
import pytest

import gluon_stream as gs
from test_examples import example, run

pytestmark = pytest.mark.mxnet


def skip_while_estimator_refuses_stream_loaders() -> None:
    """Estimator.fit accepts only gluon DataLoaders; until a StreamLoader is one (the gap
    test_checkpoint.py::test_estimator_fit_takes_a_stream_loader shows), the example cannot run."""
    from mxnet import gluon

    with gs.StreamLoader(gs.FunctionSource([0], lambda k: np.zeros(2)), batch_size=1) as loader:
        if not isinstance(loader, gluon.data.DataLoader):
            pytest.xfail("StreamLoader is not a gluon.data.DataLoader: Estimator.fit refuses it")


@pytest.mark.parametrize("argv, saved", [([], 11), (["--batch-period", "4"], 12)])
def test_estimator_checkpoint_resumes_exactly(tmp_path, argv, saved):
    skip_while_estimator_refuses_stream_loaders()
    out = run([sys.executable, example("estimator_checkpoint.py"), "--tiny", *argv], tmp_path)
    assert "preempted after 14 batches" in out
    assert out.splitlines()[-1] == (f"resumed from the checkpoint after batch {saved}: the same "
                                    "33 batches as an uninterrupted run")
    assert not list(tmp_path.iterdir())  # its temporary directories are gone


def test_estimator_checkpoint_help(tmp_path):
    out = run([sys.executable, example("estimator_checkpoint.py"), "--help"], tmp_path)
    assert "--batch-period" in out and "StreamCheckpoint" in out
