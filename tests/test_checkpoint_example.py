"""examples/estimator_checkpoint.py runs on tiny settings: preempted, resumed, and checked
against an uninterrupted run (the example raises SystemExit when the batches differ)."""
from __future__ import annotations

import sys

import pytest

from test_examples import example, help_of, run

pytestmark = pytest.mark.mxnet


@pytest.mark.parametrize("argv, saved", [([], 11), (["--batch-period", "4"], 12)])
def test_estimator_checkpoint_resumes_exactly(tmp_path, argv, saved):
    out = run([sys.executable, example("estimator_checkpoint.py"), "--tiny", *argv], tmp_path)
    assert "preempted after 14 batches" in out
    assert out.splitlines()[-1] == (f"resumed from the checkpoint after batch {saved}: the same "
                                    "33 batches as an uninterrupted run")
    assert not list(tmp_path.iterdir())  # its temporary directories are gone


def test_estimator_checkpoint_help():
    out = help_of("estimator_checkpoint.py")
    assert "--batch-period" in out and "StreamCheckpoint" in out
