"""A rank's state left from an earlier step is not merged silently (issue 35).

In a synchronous job (``dist_sync``, Horovod) the ranks step together: at a checkpoint every
rank still in the epoch has delivered as many batches. ``merge_states`` of a rank's state from
an earlier step (a file an earlier checkpoint left, a rank that failed to write its new one)
would train that rank's samples between the two steps again. With ``even_batches`` the counts
were always compared; without, states saved by a loader whose ranks came from a synchronous
kvstore record it (``job``) and are compared, ``synchronous=True`` asks for the comparison,
and where it cannot be told a warning names the ranks and their positions.
"""
from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest

import gluon_stream as gs

pytestmark = pytest.mark.mxnet


@dataclasses.dataclass
class SyncKV:
    """What a loader reads of ``mx.kv.create('dist_sync')`` (a real one needs a scheduler and a
    server: ``tests/test_elastic_kvstore.py`` checks the field in a real job)."""

    rank: int
    num_workers: int
    type: str = "dist_sync"


def states_after(stops: list[int], kvstore: bool = False, **kw) -> list[dict]:
    """Rank r's state after ``stops[r]`` batches of epoch 0 (each rank its own loader)."""
    out = []
    for rank, stop in enumerate(stops):
        ranks = {"num_parts": "auto", "part_index": "auto",
                 "kvstore": SyncKV(rank, len(stops))} if kvstore else \
            {"num_parts": len(stops), "part_index": rank}
        with gs.StreamLoader(gs.FunctionSource(range(6), lambda k: np.arange(20.0) + 100 * k),
                             batch_size=4, shuffle=True, seed=0, **ranks, **kw) as loader:
            batches = iter(loader)
            for _ in range(stop):
                next(batches)
            out.append(loader.state_dict())
    return out


def test_a_synchronous_jobs_stale_state_is_refused_naming_the_ranks():
    """States saved by a dist_sync job record it: rank 1's file of an earlier step (2 batches,
    rank 0 after 5) is refused, naming both ranks and every rank's position."""
    states = states_after([5, 2], kvstore=True)
    assert {s["job"] for s in states} == {"dist_sync"}
    with pytest.raises(gs.InvalidState, match=r"rank 0's state is after 5 batch\(es\) of epoch 0, "
                       r"rank 1's after 2 .*rank 1: 2 batch\(es\) of epoch 0.*dist_sync.*"
                       r"rank 1's may be a file left from an earlier checkpoint"):
        gs.merge_states(states)
    gs.merge_states(states_after([3, 3], kvstore=True))  # one step: merged


def test_synchronous_true_refuses_and_unknown_warns():
    """Ranks given by number: nothing says the job is synchronous. A state of another step
    warns (naming the ranks and positions) and merges; ``synchronous=True`` refuses it;
    ``synchronous=False`` (ranks that train independently) merges without a word."""
    states = states_after([4, 4, 1])
    with pytest.warns(RuntimeWarning, match=r"rank 2: 1 batch\(es\) of epoch 0.*"
                      "synchronous=True"):
        gs.merge_states(states)
    with pytest.raises(gs.InvalidState, match=r"rank 0's state is after 4.*rank 2's after 1.*"
                       "a synchronous job"):
        gs.merge_states(states, synchronous=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gs.merge_states(states, synchronous=False)
        gs.merge_states(states_after([4, 4, 4]))


def test_a_rank_whose_epoch_ran_out_may_be_behind():
    """Without even_batches a rank dealt fewer samples ends its pass first: its state at the
    end of the epoch, after fewer batches than a rank still in it, is no stale file, and
    merges without a word (a synchronous job's states too)."""
    sizes = [40, 4, 36, 8]

    def shard(key):
        return np.arange(sizes[key]) + 100.0 * key

    def loader(rank):
        return gs.StreamLoader(gs.FunctionSource(range(4), shard), batch_size=4, seed=0,
                               num_parts="auto", part_index="auto", kvstore=SyncKV(rank, 2),
                               shard_sizes=dict(enumerate(sizes)))

    lens = []
    for rank in range(2):
        with loader(rank) as ld:
            lens.append(len(ld))
    short = int(np.argmin(lens))
    assert lens[short] + 1 < lens[1 - short], lens
    states = {}
    for rank, stop in ((short, lens[short]), (1 - short, lens[short] + 1)):
        with loader(rank) as ld:
            batches = iter(ld)
            for _ in range(stop):
                next(batches)
            states[rank] = ld.state_dict()
    assert states[short]["end"] and not states[1 - short]["end"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gs.merge_states([states[0], states[1]])
