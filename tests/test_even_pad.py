"""even_batches='pad': exact distributed evaluation. Every rank yields the same number of
batches of batch_size rows; the real rows of all ranks hold every sample once; ``loader.pad``
(and StreamIter's DataBatch.pad) says how many rows at a batch's end are padding."""
from __future__ import annotations

import json

import mxnet as mx
import numpy as np
import pytest

import gluon_stream as gs
from _helpers import all_ids, batch_ids, id_shards

pytestmark = pytest.mark.mxnet

SIZES = [7, 2, 0, 9, 5, 6, 11, 3, 1, 8]
BATCH = 4


def padding_at_the_end(pads):
    """0 for the real batches, then at most one partly padded one, then whole padding."""
    real = [p for p in pads if p == 0]
    rest = pads[len(real):]
    return pads[:len(real)] == real and all(0 < p for p in rest[:1]) \
        and all(p == BATCH for p in rest[1:])


def rank_batches(rank, parts, epoch=0, **kw):
    """(len() before the pass, [(ids, pad), ...]) of one rank."""
    src = gs.FunctionSource(range(len(SIZES)), id_shards(SIZES))
    with gs.StreamLoader(src, batch_size=BATCH, num_parts=parts, part_index=rank, seed=3,
                         even_batches="pad", **kw) as loader:
        loader.set_epoch(epoch)
        try:
            expected = len(loader)
        except TypeError:
            expected = None
        return expected, [(batch_ids(b), loader.pad) for b in loader]


@pytest.mark.parametrize("parts", [2, 3])
@pytest.mark.parametrize("kw", [{"shard_sizes": dict(enumerate(SIZES))}, {},
                                {"shuffle": True, "shuffle_window": 2,
                                 "shard_sizes": dict(enumerate(SIZES))},
                                {"batchify_fn": mx.gluon.data.dataloader.default_batchify_fn}],
                         ids=["sizes-known", "sizes-unknown", "window", "per-sample"])
def test_every_sample_once_in_equal_counts_of_full_batches(parts, kw):
    for epoch in (0, 1):
        ranks = [rank_batches(r, parts, epoch, **kw) for r in range(parts)]
        counts = {len(batches) for _, batches in ranks}
        assert len(counts) == 1  # the same number of batches on every rank
        real = []
        for expected, batches in ranks:
            assert all(len(ids) == BATCH for ids, _ in batches)  # all of batch_size rows
            assert expected in (None, len(batches))
            assert padding_at_the_end([pad for _, pad in batches])
            real += [i for ids, pad in batches for i in ids[:BATCH - pad]]
        assert sorted(real) == all_ids(SIZES)  # every sample exactly once among real rows
    if "shard_sizes" in kw:  # len() is known ahead, the same everywhere
        assert all(expected is not None for expected, _ in ranks)


def test_padding_repeats_the_batchs_own_rows_then_the_last_batch():
    _, batches = rank_batches(1, 3, shard_sizes=dict(enumerate(SIZES)))
    pads = [pad for _, pad in batches]
    assert pads[-1] == BATCH or pads[-1] < BATCH
    for ids, pad in batches:
        if 0 < pad < BATCH:  # a short last batch: its rows, then its rows again
            n = BATCH - pad
            assert ids == [ids[i % n] for i in range(BATCH)]


def test_a_state_taken_anywhere_resumes_the_padding_exactly():
    def make(rank):
        src = gs.FunctionSource(range(len(SIZES)), id_shards(SIZES))
        return gs.StreamLoader(src, batch_size=BATCH, num_parts=3, part_index=rank, seed=3,
                               even_batches="pad")
    for rank in range(3):
        with make(rank) as loader:
            reference = [(batch_ids(b), loader.pad) for b in loader]
        for k in range(1, len(reference) + 1):
            with make(rank) as first:
                batches = iter(first)
                head = [(batch_ids(next(batches)), first.pad) for _ in range(k)]
                state = json.loads(json.dumps(first.state_dict()))
            with make(rank) as second:
                second.load_state_dict(state)
                assert head + [(batch_ids(b), second.pad) for b in second] == reference, k


def test_stream_iter_marks_the_padding_and_predict_keeps_only_real_rows():
    """DataBatch.pad is the loader's pad, so Module.predict trims the padding: the ranks'
    predictions hold every sample once. (MXNet's Module.score does not read DataBatch.pad: it
    counts padding rows, with NDArrayIter as here.)"""
    def shard(key):
        ids = np.arange(SIZES[key], dtype=np.float32) + 1000 * key
        return ids[:, None], ids

    net = mx.sym.LinearRegressionOutput(mx.sym.Variable("data") * 1.0,
                                        mx.sym.Variable("lin_label"), name="lin")
    predicted = []
    for rank in range(3):
        with gs.StreamLoader(gs.FunctionSource(range(len(SIZES)), shard), batch_size=BATCH,
                             num_parts=3, part_index=rank, seed=3, even_batches="pad") as loader:
            # Module.predict on one rank: without the batches that are all padding
            it = gs.StreamIter(loader, label_names=["lin_label"], padding_batches=False)
            pads = [b.pad for b in it]
            assert padding_at_the_end(pads)
            mod = mx.mod.Module(net, label_names=["lin_label"], context=mx.cpu())
            mod.bind(it.provide_data, it.provide_label, for_training=False)
            mod.init_params()
            out = mod.predict(it).asnumpy().ravel()
            predicted += [int(x) for x in out]
    assert sorted(predicted) == all_ids(SIZES)


def test_pad_refuses_what_would_drop_or_carry_samples():
    src = gs.FunctionSource(range(3), id_shards([4, 4, 4]))
    for last_batch in ("discard", "rollover"):
        with pytest.raises(ValueError, match="even_batches='pad' yields every sample once"):
            gs.StreamLoader(src, batch_size=4, even_batches="pad", last_batch=last_batch)
    with pytest.raises(ValueError, match="even_batches must be True, False or 'pad'"):
        gs.StreamLoader(src, batch_size=4, even_batches="yes")
