"""``len(loader)`` after a resume is the epoch's count from its start, as a fresh job of this
size has it, whether the state was saved by this world size or merged from another (issue 35).

Gluon's ``len(DataLoader)`` is an epoch's batch count; a learning-rate schedule or a progress
total sized by it must not change because a state was loaded. Before, a same-size resume kept
the epoch's count while an elastic resume gave the batches left in the interrupted epoch.
"""
from __future__ import annotations

import json

import pytest

import gluon_stream as gs
from _helpers import batch_ids, id_shards

pytestmark = pytest.mark.mxnet

SIZES = [13, 7, 22, 9, 16, 11, 5, 18]


def make(ranks: int, rank: int, batch_size: int = 4, **kw) -> gs.StreamLoader:
    kw.setdefault("shard_sizes", dict(enumerate(SIZES)))
    return gs.StreamLoader(gs.FunctionSource(list(range(len(SIZES))), id_shards(SIZES)),
                           batch_size=batch_size, num_parts=ranks, part_index=rank, seed=2,
                           shuffle=True, **kw)


def fresh_len(ranks: int, rank: int, epoch: int, batch_size: int, **kw) -> int:
    with make(ranks, rank, batch_size, **kw) as ld:
        ld.set_epoch(epoch)
        return len(ld)


def saved(ranks: int, stop: int, **kw) -> list[dict]:
    """Every rank's state after ``stop`` batches of epoch 0."""
    states = []
    for rank in range(ranks):
        with make(ranks, rank, **kw) as ld:
            batches = iter(ld)
            for _ in range(stop):
                next(batches)
            states.append(json.loads(json.dumps(ld.state_dict())))
    return states


KINDS = {"even": {"even_batches": True}, "keep": {},
         "samples_per_epoch": {"samples_per_epoch": 30, "even_batches": True}}


@pytest.mark.parametrize("kind", list(KINDS))
def test_same_size_resume_len_is_the_epochs_count(kind):
    kw = KINDS[kind]
    for rank, state in enumerate(saved(2, 3, **kw)):
        with make(2, rank, **kw) as ld:
            ld.load_state_dict(state)
            count = len(ld)
            assert count == fresh_len(2, rank, 0, 4, **kw)
            rest = [batch_ids(b) for b in ld]
            assert len(rest) == count - 3


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("old,new", [(2, 3), (3, 1)])
def test_elastic_resume_len_is_a_fresh_jobs_count(kind, old, new):
    """The merged state on ``new`` ranks (batch size 5): len() is the count a fresh job of
    ``new`` ranks has for the interrupted epoch, the same as before the state was loaded, and
    the pass yields the rest; the next epoch's len() is what that pass yields."""
    kw = KINDS[kind]
    merged = gs.merge_states(saved(old, 2, **kw))
    for rank in range(new):
        with make(new, rank, 5, **kw) as ld:
            before = len(ld)
            ld.load_state_dict(merged)
            assert len(ld) == before == fresh_len(new, rank, 0, 5, **kw)
            assert [batch_ids(b) for b in ld]  # the rest of epoch 0
            ld.set_epoch(1)
            assert len(ld) == len(list(ld))
