"""Ranks agree in every topology, or all refuse alike (issue 24, section 3).

A synchronous job hangs when one rank raises or yields fewer batches while the others go on.
Each case below builds every rank's loader as its own process would (a new source each) and
checks that every rank yields the same count, with ``'pad'`` covering every sample once among
the real rows; the rank-agreement property over random topologies lives in
``test_reference_model.py``.
"""
from __future__ import annotations

import numpy as np
import pytest

import gluon_stream as gs
from _helpers import all_ids, batch_ids, id_shards

pytestmark = pytest.mark.mxnet


def run_rank(sizes, rank, parts, *, keys=None, epochs=1, **kw):
    """[(ids, pad), ...] per epoch of one rank, its loader held as users hold it: unnamed in
    the ``for`` when it is one epoch, no ``with``."""
    src = gs.FunctionSource(list(range(len(sizes))) if keys is None else keys,
                            id_shards(sizes))
    loader = gs.StreamLoader(src, num_parts=parts, part_index=rank, seed=3, **kw)
    out = []
    for _ in range(epochs):
        out.append([(batch_ids(b), loader.pad) for b in loader])
    loader.close()
    return out


def check_pad(sizes, parts, **kw):
    ranks = [run_rank(sizes, r, parts, batch_size=4, even_batches="pad", **kw)[0]
             for r in range(parts)]
    counts = [len(batches) for batches in ranks]
    assert len(set(counts)) == 1, f"batches per rank {counts}"
    real = sorted(i for batches in ranks for ids, pad in batches for i in ids[:len(ids) - pad])
    assert real == all_ids(sizes)
    assert all(len(ids) == 4 for batches in ranks for ids, _ in batches)
    return counts[0]


@pytest.mark.parametrize("known", [True, False], ids=["sizes-known", "sizes-unknown"])
def test_pad_with_a_rank_dealt_no_sample(known):
    """Two held-out dates on three ranks: the rank dealt nothing pads as the others do."""
    sizes = [5, 3]
    kw = {"shard_sizes": dict(enumerate(sizes))} if known else {}
    # dealt whole: 5 samples on one rank (2 batches); by stride: 3/3/2 (1 batch)
    assert check_pad(sizes, 3, **kw) == (2 if known else 1)


def test_pad_with_a_zero_sample_shard_dealt_alone():
    sizes = [0, 6, 2, 7]
    for parts in (2, 3, 4):
        check_pad(sizes, parts, shard_sizes=dict(enumerate(sizes)))


def test_pad_with_fewer_samples_than_ranks():
    """Unknown sizes, strides: 3 samples on 4 ranks leave a rank with no row of its own."""
    assert check_pad([3], 4) == 1


@pytest.mark.parametrize("even", [False, True, "pad"])
def test_samples_per_epoch_with_fewer_keys_than_ranks(even):
    """3 keys, 4 ranks: every rank reads samples_per_epoch samples per epoch, as promised."""
    sizes = [9, 7, 8]
    kw = {"last_batch": "discard"} if even is True else {}
    ranks = [run_rank(sizes, r, 4, epochs=2, batch_size=4, samples_per_epoch=6,
                      even_batches=even, **kw) for r in range(4)]
    for epoch in range(2):
        counts = [len(r[epoch]) for r in ranks]
        assert counts == [counts[0]] * 4 and counts[0] >= 1, counts
        real = [len(ids) - pad for r in ranks for ids, pad in r[epoch]]
        want = 6 // 4 * 4 if even is True else 6
        assert sum(real) == 4 * want, real


def test_even_batches_with_sizes_known_and_fewer_shards_than_ranks():
    """Sizes known, 2 shards on 3 ranks: not 0 batches everywhere, but full batches on every
    rank (strides of every shard)."""
    sizes = [13, 11]
    ranks = [run_rank(sizes, r, 3, batch_size=3, even_batches=True,
                      shard_sizes=dict(enumerate(sizes)))[0] for r in range(3)]
    counts = [len(b) for b in ranks]
    assert len(set(counts)) == 1 and counts[0] == 2, counts
    seen = [i for batches in ranks for ids, _ in batches for i in ids]
    assert len(seen) == len(set(seen))  # no sample twice


def test_len_agrees_with_what_every_rank_yields_when_a_rank_is_dealt_nothing():
    sizes = [5, 3]
    for rank in range(3):
        src = gs.FunctionSource(range(2), id_shards(sizes))
        loader = gs.StreamLoader(src, batch_size=4, num_parts=3, part_index=rank, seed=0,
                                 even_batches="pad", shard_sizes=dict(enumerate(sizes)))
        assert len(loader) == len(list(loader)) == 2
        loader.close()


def test_stream_iter_keeps_all_padding_batches():
    """StreamIter yields every batch the loader yields, all-padding ones included (pad ==
    batch_size), so ranks run the same number of steps under a distributed Module."""
    sizes = [7, 2, 0, 9]
    counts = []
    for rank in range(3):
        src = gs.FunctionSource(range(4), lambda k: (
            np.arange(sizes[k], dtype=np.float32).reshape(-1, 1) + 100 * k,
            np.zeros(sizes[k], dtype=np.float32)))
        it = gs.StreamIter(gs.StreamLoader(src, batch_size=4, num_parts=3, part_index=rank,
                                           seed=0, even_batches="pad",
                                           shard_sizes=dict(enumerate(sizes))))
        pads = [b.pad for b in it]
        counts.append(len(pads))
        it.loader.close()
    assert len(set(counts)) == 1, counts
