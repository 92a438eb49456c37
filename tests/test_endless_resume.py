"""``samples_per_epoch`` over endless keys, resumed in a new process: the process builds its
key iterator anew, from its beginning, and a state taken anywhere (epoch 0, the middle of epoch
1, the start of epoch 2, ...) continues with exactly the batches of the uninterrupted run; a
state that cannot be resumed so is refused with InvalidState, naming why."""
from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import gluon_stream as gs
from _endless_resume_worker import KINDS, shard

pytestmark = pytest.mark.mxnet

WORKER = os.path.join(os.path.dirname(__file__), "_endless_resume_worker.py")


def worker(tmp_path, name, *args) -> dict:
    out = tmp_path / f"{name}.json"
    subprocess.run([sys.executable, WORKER, "--out", str(out), *args], check=True, timeout=240,
                   cwd=tmp_path)
    return json.loads(out.read_text())


def points(states: list) -> list:
    """States in epoch 0, in the middle of epoch 1, at the end of epoch 1 (before the loop saw
    it), at the start of epoch 2 (after), and in the middle of epoch 2 and 3."""
    def first(epoch, nth):
        return [s for s in states if s["epoch"] == epoch][nth]
    ends = [i for i, s in enumerate(states) if s["state"]["end"]]
    return [first(0, 3), first(1, 5), states[ends[1]], states[ends[1] + 1], first(2, 7),
            first(3, 2)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind, window", [(k, 1) for k in KINDS] + [("iterator", 2)])
def test_a_state_resumes_exactly_in_a_new_process_that_builds_its_keys_anew(tmp_path, kind,
                                                                            window):
    args = ["--keys", kind, "--window", str(window)]
    uninterrupted = worker(tmp_path, "uninterrupted", *args)
    batches = uninterrupted["batches"]
    chosen = points(uninterrupted["states"])
    assert [c["state"]["epoch"] for c in chosen] == [0, 1, 1, 2, 2, 3]
    assert any(c["state"]["pass" if kind == "callable_lists" else "unit"] > 0 for c in chosen)
    (tmp_path / "states.json").write_text(json.dumps([c["state"] for c in chosen]))
    resumed = worker(tmp_path, "resumed", *args, "--states", str(tmp_path / "states.json"))
    for point, got in zip(chosen, resumed["resumed"]):
        assert got == {"batches": batches[point["after"]:]}, point


def test_the_shard_each_state_resumes_in_is_not_the_first_one(tmp_path):
    """The bug this guards: a resumed pass read the iterator from its first key."""
    run = worker(tmp_path, "uninterrupted", "--keys", "iterator")
    state = [s for s in run["states"] if s["epoch"] == 2][0]["state"]
    assert state["unit"] > 20 and state["drawn"]["key"] == f"k{state['drawn']['position']}"


def endless_loader(keys):
    return gs.StreamLoader(gs.FunctionSource(keys, shard), batch_size=8, samples_per_epoch=100,
                           shuffle=True, seed=4)


def state_in_epoch_one():
    loader = endless_loader(f"k{i}" for i in itertools.count())
    for epoch in range(2):
        loader.set_epoch(epoch)
        for n, _ in enumerate(loader):
            if epoch == 1 and n == 4:
                state = loader.state_dict()
                loader.close()
                return state


@pytest.mark.parametrize("keys, cause", [
    (lambda: (f"k{i}" for i in itertools.count(3)), r"gives 'k\d+' there: it does not give"),
    (lambda: (f"k{i}" for i in range(5)), r"it ended after 5 key\(s\)"),
], ids=["another start", "too short"])
def test_an_iterator_that_does_not_give_the_saved_keys_is_refused(keys, cause):
    state = state_in_epoch_one()
    loader = endless_loader(keys())
    with pytest.raises(gs.InvalidState, match=r"resumes pass 0 over the keys at shard \d+ "
                                              r"\('k\d+' when it was saved\).*" + cause):
        loader.load_state_dict(state)
    loader.close()


def test_a_state_the_loaders_iterator_has_gone_past_is_refused_not_read_elsewhere():
    """The same loader cannot draw its iterator again: an old state is refused, naming why."""
    keys = (f"k{i}" for i in itertools.count())
    loader = endless_loader(keys)
    early = None
    for epoch in range(3):
        loader.set_epoch(epoch)
        for _batch in loader:
            early = early or loader.state_dict()
    with pytest.raises(gs.InvalidState, match=r"keys before position \d+ were let go .*new "
                                              r"loader whose key iterator starts"):
        loader.load_state_dict(early)
    loader.close()


def test_a_state_from_the_same_process_still_resumes_in_a_new_loader():
    state = state_in_epoch_one()
    loader = endless_loader(f"k{i}" for i in itertools.count())
    loader.load_state_dict(state)
    first = next(iter(loader))
    loader.close()
    reference = endless_loader(f"k{i}" for i in itertools.count())
    reference.set_epoch(0)
    list(reference)
    reference.set_epoch(1)
    expected = list(itertools.islice(iter(reference), 6))[5]
    reference.close()
    assert np.array_equal(first.asnumpy(), expected.asnumpy())


@pytest.mark.parametrize("part", [0, 1])
def test_each_rank_of_endless_keys_resumes_in_a_new_loader(part):
    """Ranks deal an endless iterator's keys by stride: a rank's resumed pass draws the
    iterator again up to its own position."""
    def make():
        return gs.StreamLoader(gs.FunctionSource((f"k{i}" for i in itertools.count()), shard),
                               batch_size=8, samples_per_epoch=60, num_parts=2, part_index=part,
                               even_batches=True)
    first = make()
    head, state = [], None
    for epoch in range(3):
        first.set_epoch(epoch)
        for batch in first:
            head.append(batch.asnumpy().tolist())
            if epoch == 1 and state is None and len(head) > 9:
                state, mark = first.state_dict(), len(head)
    first.close()
    resumed = make()
    resumed.load_state_dict(state)
    rest = []
    for epoch in range(resumed.epoch, 3):
        resumed.set_epoch(epoch)
        rest += [b.asnumpy().tolist() for b in resumed]
    resumed.close()
    assert state["unit"] > 5 and rest == head[mark:]
    assert {i // 100 % 2 for b in head for i in b} == {part}  # its stride of the keys
