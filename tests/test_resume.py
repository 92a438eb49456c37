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
    assert (saved["unit"], saved["offset"]) != (0, 0)
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
    assert state["keys"]["count"] == state["unit"] + 1
    # one key renamed: the epoch order of the others is kept, but the digest of every prefix
    # that reaches it differs (and the shuffled order moves, so the prefix does reach it)
    changed = gs.FunctionSource(lambda epoch: [10 * epoch + i for i in (1, 2, 3, 4, 5, 6)], fn)
    with gs.StreamLoader(changed, batch_size=4, shuffle=True, seed=7) as other:
        with pytest.raises(gs.InvalidState,
                           match=r"keys of epoch 0 changed since the state was saved"):
            other.load_state_dict(state)


@pytest.mark.parametrize("field, value", [
    ("unit", -1), ("unit", 10 ** 6), ("offset", "5"), ("offset", 3), ("batches", -7),
    ("epoch", True), ("epoch", 1), ("end", True), ("skipped", [[0, 1]]),
    ("carry", [{"epoch": 0, "unit": 0, "key": 3, "start": 0, "stop": 2}]), ("carry", "nowhere"),
])
def test_a_hand_edited_state_is_refused(field, value):
    with make() as loader:
        run(loader, stop_after=3)
        state = dict(loader.state_dict())
    state[field] = value
    with make() as other:
        with pytest.raises(gs.InvalidState, match=r"do not match its checksum"):
            other.load_state_dict(state)


def test_a_state_of_another_version_names_it():
    with make() as loader:
        state = dict(loader.state_dict(), version=2)
        with pytest.raises(gs.InvalidState, match=r"'version' is 2; this gluon_stream reads "
                                                   r"version 3"):
            loader.load_state_dict(state)


# -- the end of an epoch is a position (torchdata's StatefulDataLoader convention) ----------------
def even_source(size):
    """4 shards of ``size`` samples each, with ids."""
    import numpy as np
    return gs.FunctionSource(range(4), lambda k: np.arange(size, dtype=np.int64) + 1000 * k)


def at_end(batch_size, size, window=1, epochs=3):
    """(uninterrupted batches per epoch, a state taken after epoch 0's last batch, before the
    loop saw its end)."""
    def make_one():
        return gs.StreamLoader(even_source(size), batch_size=batch_size, shuffle=True, seed=5,
                               shuffle_window=window)
    with make_one() as loader:
        reference = [[batch_ids(b) for b in loader] for _ in range(epochs)]
    with make_one() as first:
        batches = iter(first)
        for _ in reference[0]:
            next(batches)
        state = json.loads(json.dumps(first.state_dict()))
    return make_one, reference, state


@pytest.mark.parametrize("window", [1, 2])
@pytest.mark.parametrize("batch_size, size", [(4, 4), (3, 4)], ids=["full-last", "short-last"])
def test_a_state_after_the_last_batch_says_end_of_epoch(batch_size, size, window, caplog):
    make_one, reference, state = at_end(batch_size, size, window)
    assert state["epoch"] == 0 and state["end"] is True
    flat = [b for epoch in reference[1:] for b in epoch]

    with make_one() as loader:  # (a): load, iterate the rest (nothing), then the next epochs
        loader.load_state_dict(state)
        rest = [batch_ids(b) for b in loader]
        assert rest == [] and loader.epoch == 1
        after = []
        for epoch in (1, 2):
            loader.set_epoch(epoch)
            after += [batch_ids(b) for b in loader]
        assert after == flat

    with make_one() as loader:  # (b), the README's loop: from the state's epoch on
        loader.load_state_dict(state)
        got = []
        for epoch in range(state["epoch"], 3):
            loader.set_epoch(epoch)
            got += [batch_ids(b) for b in loader]
        assert got == flat

    with make_one() as loader:  # the user's own counter says epoch 1 is next
        loader.load_state_dict(state)
        got = []
        for epoch in (1, 2):
            loader.set_epoch(epoch)
            got += [batch_ids(b) for b in loader]
        assert got == flat
    assert "no samples" not in caplog.text and "from its beginning" not in caplog.text


def test_a_state_after_the_loop_saw_the_end_says_the_next_epoch():
    make_one, reference, _ = at_end(3, 4)
    with make_one() as first:
        assert [batch_ids(b) for b in first] == reference[0]
        state = first.state_dict()
    assert state["epoch"] == 1 and state["end"] is False and state["batches"] == 0
    with make_one() as second:
        second.load_state_dict(state)
        assert [batch_ids(b) for b in second] == reference[1]


def test_module_fit_resumes_from_the_end_of_an_epoch():
    """StreamIter under Module.fit: begin at ``state['epoch'] + state['end']``."""
    import numpy as np

    def shard(k):
        ids = np.arange(4, dtype=np.float32) + 1000 * k
        return ids[:, None], ids

    def make_one():
        return gs.StreamLoader(gs.FunctionSource(range(4), shard), batch_size=4, shuffle=True,
                               seed=5)

    def fit(loader, begin, seen):
        net = mx.sym.LinearRegressionOutput(
            mx.sym.FullyConnected(mx.sym.Variable("data"), num_hidden=1),
            mx.sym.Variable("lin_label"), name="lin")
        it = gs.StreamIter(loader, label_names=["lin_label"])
        it.set_epoch(begin)
        mod = mx.mod.Module(net, label_names=["lin_label"], context=mx.cpu())
        mod.fit(it, begin_epoch=begin, num_epoch=3, optimizer="sgd",
                batch_end_callback=lambda p: seen.append(
                    [int(x) for x in p.locals["data_batch"].data[0].asnumpy().ravel()]))

    reference: list = []
    with make_one() as loader:
        fit(loader, 0, reference)
    with make_one() as first:
        batches = iter(first)
        for _ in range(len(reference) // 3):
            next(batches)
        state = json.loads(json.dumps(first.state_dict()))
    assert state["end"]
    resumed: list = []
    with make_one() as loader:
        loader.load_state_dict(state)
        fit(loader, state["epoch"] + state["end"], resumed)
    assert resumed == reference[len(reference) // 3:]
