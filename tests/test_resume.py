"""Exact mid-epoch resume: stop after k batches, resume in a new loader, compare with one run."""
from __future__ import annotations

import json

import mxnet as mx
import pytest

import gluon_stream as gs
from _helpers import batch_ids, epoch_batch_ids

pytestmark = pytest.mark.mxnet  # these tests use MXNet: warm its engine first

SIZES = {k: n for k, n in zip(range(100), [7, 2, 0, 9, 5, 6] * 17)}
EPOCHS = 3
DATALOADER = {"batchify_fn": mx.gluon.data.dataloader.default_batchify_fn}


def fn(key):
    import numpy as np
    ids = np.arange(SIZES[key], dtype=np.int64) + 1000 * key
    return ids, ids.astype(np.float32)


def make(**kw):
    # each epoch has its own keys (so ids tell epochs apart) in a shuffled order
    src = gs.FunctionSource(lambda epoch: [10 * epoch + i for i in range(6)], fn)
    return gs.StreamLoader(src, batch_size=4, shuffle=True, seed=7, **kw)


def run(loader, start_epoch=0, stop_after=None):
    return epoch_batch_ids(loader, EPOCHS, start_epoch, stop_after)


@pytest.mark.parametrize("path", ["vectorised", "dataloader"])
@pytest.mark.parametrize("last_batch", ["keep", "rollover"])
def test_resume_after_every_batch_gives_the_uninterrupted_sequence(path, last_batch):
    kw = dict(last_batch=last_batch, **(DATALOADER if path == "dataloader" else {}))
    with make(**kw) as loader:
        reference = run(loader)
    assert len(reference) > 20
    for k in range(1, len(reference) + 1):
        with make(**kw) as first:
            head = run(first, stop_after=k)
            state = json.loads(json.dumps(first.state_dict()))  # JSON round trip
        with make(**kw) as second:
            second.load_state_dict(state)
            tail = run(second, start_epoch=state["epoch"])
        assert head + tail == reference, f"resume after {k} batches (state {state})"


def test_state_after_a_finished_epoch_resumes_at_the_next():
    with make(last_batch="rollover") as loader:
        reference = run(loader)
    with make(last_batch="rollover") as first:
        first.set_epoch(0)
        head = [batch_ids(b) for b in first]
        state = first.state_dict()
    assert state["epoch"] == 1 and state["carry"]  # the rollover travels in the state
    with make(last_batch="rollover") as second:
        second.load_state_dict(state)
        assert head + run(second, start_epoch=1) == reference


def test_state_from_other_settings_is_refused():
    with make() as loader:
        state = loader.state_dict()
    src = gs.FunctionSource(range(3), fn)
    with gs.StreamLoader(src, batch_size=4, shuffle=True, seed=8) as other:
        with pytest.raises(ValueError, match="seed"):
            other.load_state_dict(state)
        with pytest.raises(ValueError, match="missing"):
            other.load_state_dict({"epoch": 0})


def test_resume_example_continues_where_the_checkpoint_stopped(tmp_path, capsys):
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(__file__), "..", "examples", "resume_training.py")
    spec = importlib.util.spec_from_file_location("resume_training", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--workdir", str(tmp_path / "full")]) == 0
    total = int(capsys.readouterr().out.split("trained ")[1].split()[0])
    assert example.main(["--workdir", str(tmp_path / "ck"), "--stop-after", "7"]) == 0
    assert example.main(["--workdir", str(tmp_path / "ck")]) == 0
    out = capsys.readouterr().out
    assert "resumed at epoch 0, batch 7" in out
    assert f"trained {total - 7} batches" in out


def test_a_state_taken_after_loading_and_before_the_first_batch_is_the_loaded_one():
    """A second preemption while the first shard is still being made must not replay."""
    with make() as first:
        run(first, stop_after=5)
        saved = first.state_dict()
    assert (saved["shard"], saved["offset"]) != (0, 0)
    with make() as second:
        second.load_state_dict(saved)
        assert second.state_dict() == saved  # before iterating
        it = iter(second)
        assert second.state_dict() == saved  # iterating, before the first batch
        del it
    with make() as third:  # and the re-saved state resumes exactly
        third.load_state_dict(saved)
        again = third.state_dict()
    with make() as reference:
        full = run(reference)
    with make() as fourth:
        fourth.load_state_dict(again)
        assert run(fourth, start_epoch=saved["epoch"]) == full[5:]


def test_a_changed_key_list_is_refused_instead_of_repeating_samples():
    with make() as loader:
        run(loader, stop_after=7)
        state = loader.state_dict()
    assert state["keys"]["count"] == state["shard"] + 1
    # one key renamed: the epoch order of the others is kept, but the digest of every prefix
    # that reaches it differs (and the shuffled order moves, so the prefix does reach it)
    changed = gs.FunctionSource(lambda epoch: [10 * epoch + i for i in (1, 2, 3, 4, 5, 6)], fn)
    with gs.StreamLoader(changed, batch_size=4, shuffle=True, seed=7) as other:
        with pytest.raises(gs.InvalidState, match=r"keys of epoch 0 changed since the state was saved"):
            other.load_state_dict(state)


@pytest.mark.parametrize("field, value, match", [
    ("shard", -1, r"'shard' must be an integer >= 0"),
    ("offset", "5", r"'offset' must be an integer >= 0"),
    ("batches", -7, r"'batches' must be an integer >= 0"),
    ("epoch", True, r"'epoch' must be an integer >= 0"),
    ("carry", [{"epoch": 0, "index": 0, "key": 3, "start": 4, "end": 2}], r"carry\[0\].*no samples"),
    ("carry", [{"epoch": 9, "index": 0, "key": 3, "start": 0, "end": 2}], r"after the state's epoch"),
    ("carry", [{"epoch": 0, "index": 0, "key": 3, "start": 0, "end": 9}], r"a batch or more"),
    ("carry", "nowhere", r"'carry' must be a list"),
    ("version", 1, r"'version' is 1"),
])
def test_every_field_of_a_state_is_checked(field, value, match):
    with make() as loader:
        run(loader, stop_after=3)
        state = dict(loader.state_dict())
    state[field] = value
    with make() as other:
        with pytest.raises(ValueError, match=match):
            other.load_state_dict(state)
