"""provenance=True: every batch says where each of its rows came from (key, raw row, epoch,
padding), checked against the data itself: each sample's value is ``key * 1000 + raw row``, so
a batch's values are what its provenance names, through shuffles, shuffle windows, rollover,
'pad', repeats, ranks with each deal, per-sample workers and resumes."""
from __future__ import annotations

import json

import numpy as np
import pytest

import gluon_stream as gs

pytestmark = pytest.mark.mxnet  # these tests use MXNet: warm its engine first

SIZES = [13, 0, 9, 17, 5, 11, 8, 14]  # awkward sizes, an empty shard, one under a batch
BS = 4


def values(key):
    return np.arange(SIZES[key], dtype=np.float64) + 1000 * key


def source(sizes=None):
    if sizes is None:
        return gs.FunctionSource(range(len(SIZES)), values)
    return gs.FunctionSource(range(len(sizes)),
                             lambda k: np.arange(sizes[k], dtype=np.float64) + 1000 * k)


def loader(src=None, **kw):
    kw.setdefault("batch_size", BS)
    return gs.StreamLoader(src if src is not None else source(), provenance=True, **kw)


def checked_epoch(ld, epoch):
    """Iterate one epoch; check every batch against its provenance. Returns each batch's
    provenance."""
    records = []
    for batch in ld:
        data = batch.asnumpy().ravel()
        prov = ld.last_provenance
        assert isinstance(prov, gs.Provenance) and len(prov) == len(data)
        expected = np.array([1000 * k for k in prov.keys]) + prov.rows
        np.testing.assert_array_equal(data, expected)
        assert int(prov.padding.sum()) == ld.pad or prov.padding.all()  # a repeat
        records.append(prov)
    return records


def real(records):
    return [s for p in records for s in p.samples()]


def every_sample(sizes=SIZES):
    return sorted((k, r) for k, n in enumerate(sizes) for r in range(n))


@pytest.mark.parametrize("window", [1, 3])
def test_each_row_names_its_key_row_and_epoch_through_shuffles(window):
    with loader(shuffle=True, seed=5, shuffle_window=window) as ld:
        for epoch in range(2):
            ld.set_epoch(epoch)
            records = checked_epoch(ld, epoch)
            samples = real(records)
            assert sorted((k, r) for k, r, _ in samples) == every_sample()
            assert {e for _, _, e in samples} == {epoch}
            assert not any(p.padding.any() for p in records)
            # shuffled: raw rows are not read in order
            assert [r for _, r, _ in samples] != sorted(r for _, r, _ in samples)


def test_rollover_names_the_epoch_the_carried_rows_were_made_for():
    total = sum(SIZES)  # 77: 1 sample rolls over from epoch 0 into epoch 1's first batch
    with loader(shuffle=True, seed=2, last_batch="rollover") as ld:
        first = real(checked_epoch(ld, 0))
        ld.set_epoch(1)
        second = checked_epoch(ld, 1)
    carried = total % BS
    assert len(first) == total - carried
    opening = second[0].samples()
    assert [e for _, _, e in opening] == [0] * carried + [1] * (BS - carried)
    rolled = {(k, r) for k, r, _ in opening[:carried]}
    assert rolled.isdisjoint((k, r) for k, r, _ in first)
    assert sorted({(k, r) for k, r, _ in first} | rolled) == every_sample()


def test_pad_rows_and_padding_batches_are_marked():
    parts, seen, masks = 3, [], []
    for part in range(parts):
        with loader(num_parts=parts, part_index=part, even_batches="pad", seed=1) as ld:
            for _ in ld:
                masks.append((ld.pad, ld.last_provenance.padding.tolist()))
        with loader(num_parts=parts, part_index=part, even_batches="pad", seed=1) as ld:
            seen.extend(real(checked_epoch(ld, 0)))
    # padding is the batch's last ld.pad rows, and a batch all padding is marked so
    assert all(mask == [i >= BS - pad for i in range(BS)] for pad, mask in masks)
    assert {pad for pad, _ in masks} >= {0, 1, 2, BS}
    assert sorted((k, r) for k, r, _ in seen) == every_sample()  # every real row once


def test_a_part_with_no_shard_borrows_rows_marked_as_padding():
    sizes = [6, 5]
    batches = []
    for part in range(3):  # sizes known: two shards dealt whole to three parts
        with loader(source(sizes), num_parts=3, part_index=part, even_batches="pad",
                    shard_sizes=dict(enumerate(sizes)), seed=1) as ld:
            batches.append(checked_epoch(ld, 0))
    assert [len(b) for b in batches] == [2, 2, 2]
    assert all(p.padding.all() for p in batches[2])  # part 2 was dealt no shard
    assert sorted(s[:2] for b in batches for p in b for s in p.samples()) == \
        every_sample(sizes)


def test_a_repeated_batch_is_all_padding():
    # even_batches=True, sizes declared larger than a shard holds: a part runs short and
    # repeats its last full batch
    declared = {k: n for k, n in enumerate(SIZES)}
    declared[3] = 40
    with loader(num_parts=2, part_index=0, even_batches=True, shard_sizes=declared,
                seed=3) as ld0, loader(num_parts=2, part_index=1, even_batches=True,
                                       shard_sizes=declared, seed=3) as ld1:
        records = checked_epoch(ld0, 0) + checked_epoch(ld1, 0)
    repeated = [p for p in records if p.padding.all()]
    assert repeated, "no part repeated a batch"
    assert all(len(p.samples()) == 0 and len(p.samples(padding=True)) == BS for p in repeated)


@pytest.mark.parametrize("deal", ["shards", "samples", "strides", "turns", "balanced"])
def test_each_rank_names_its_own_rows_for_every_deal(deal):
    parts, seen = 3, []
    for part in range(parts):
        stream = gs.ShardStream(source(), num_parts=parts, part_index=part, deal=deal,
                                shuffle=True, seed=4)
        with loader(stream, last_batch="keep") as ld:
            seen.extend(real(checked_epoch(ld, 0)))
        stream.close()
    pairs = [(k, r) for k, r, _ in seen]
    assert len(pairs) == len(set(pairs))  # no row on two ranks
    if deal != "samples":  # equal strides leave each shard's last rows % parts out
        assert sorted(pairs) == every_sample()


@pytest.mark.parametrize("window", [1, 2])
def test_per_sample_workers(window):
    with loader(shuffle=True, seed=7, shuffle_window=window, num_workers=2,
                sample_transform=lambda x: x) as ld:
        assert sorted((k, r) for k, r, _ in real(checked_epoch(ld, 0))) == every_sample()


@pytest.mark.parametrize("window", [1, 3])
@pytest.mark.parametrize("cut", [1, 5, 9])
def test_a_resumed_loader_names_the_rest(window, cut):
    kw = dict(shuffle=True, seed=9, shuffle_window=window, last_batch="rollover")
    with loader(**kw) as ld:
        whole = [p.samples() for p in checked_epoch(ld, 0)]
    with loader(**kw) as ld:
        head = []
        for _ in ld:
            head.append(ld.last_provenance.samples())
            if len(head) == cut:
                break
        state = json.loads(json.dumps(ld.state_dict()))  # as saved to a file
    with loader(**kw) as resumed:
        resumed.load_state_dict(state)
        rest = [p.samples() for p in checked_epoch(resumed, 0)]
    assert head + rest == whole


def test_a_resume_in_the_next_epoch_names_the_rolled_over_rows():
    kw = dict(shuffle=True, seed=9, last_batch="rollover")
    with loader(**kw) as ld:
        list(ld)
        state = ld.state_dict()  # epoch 1, with epoch 0's last sample carried
        ld.set_epoch(1)
        expected = [p.samples() for p in checked_epoch(ld, 1)]
    with loader(**kw) as resumed:
        resumed.load_state_dict(state)
        got = [p.samples() for p in checked_epoch(resumed, 1)]
    assert got == expected and got[0][0][2] == 0


def test_samples_per_epoch_across_passes():
    with loader(shuffle=True, seed=1, samples_per_epoch=30) as ld:
        seen = []
        for epoch in range(3):
            ld.set_epoch(epoch)
            seen.extend(real(checked_epoch(ld, epoch)))
    assert len(seen) == 90
    passes = {e for _, _, e in seen}
    assert passes == {0, 1}  # 90 samples: the second pass over the 77 rows


def test_off_by_default_and_asking_says_how():
    with gs.StreamLoader(source(), BS) as ld:
        next(iter(ld))
        with pytest.raises(ValueError, match="provenance=True"):
            _ = ld.last_provenance
        assert not ld.stream.producer.keep_origins
    with pytest.raises(TypeError, match="provenance"):
        gs.StreamLoader(source(), BS, provenance="yes")


def test_placed_batches_and_skipped_shards():
    import mxnet as mx

    def failing(key):
        if key == 3:
            raise RuntimeError("no data for key 3")
        return values(key)

    with loader(gs.FunctionSource(range(len(SIZES)), failing), shuffle=True, seed=6,
                ctx=mx.cpu(0), on_error="skip") as ld:
        samples = real(checked_epoch(ld, 0))
    assert sorted((k, r) for k, r, _ in samples) == [(k, r) for k, r in every_sample() if k != 3]
