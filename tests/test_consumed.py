"""A shard copied into its NDArray gives its own memory back as it goes, when no one else holds
it (gluon_stream._mx.consumed); an array anyone else holds is never touched."""
from __future__ import annotations

import sys

import mxnet as mx
import numpy as np
import pytest

import gluon_stream as gs
from gluon_stream._mx import arrays as mx_arrays
from gluon_stream._mx import consumed

pytestmark = [pytest.mark.mxnet,
              pytest.mark.skipif(not sys.platform.startswith("linux") or
                                 sys.version_info >= (3, 14), reason="consumed on Linux, <3.14")]

ROWS, SHAPE = 3000, (40, 16)  # 7.7 MB of float32: above CONSUME_MIN_BYTES


def fresh(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((ROWS,) + SHAPE, dtype=np.float32)


@pytest.mark.parametrize("ctx", [mx.cpu(0), mx.cpu_pinned(0)])
@pytest.mark.parametrize("order", ["none", "permutation", "subset"])
def test_a_consumed_array_is_copied_exactly_and_its_pages_given_back(ctx, order):
    """The copy holds the rows order gives, in order; the source reads as zeros after (its
    pages went back to the OS), all but a page at either end."""
    arrays = (fresh(1),)
    rows = {"none": None, "permutation": np.random.default_rng(2).permutation(ROWS),
            "subset": np.random.default_rng(3).permutation(ROWS)[:ROWS // 3]}[order]
    expected = arrays[0] if rows is None else arrays[0][rows]
    expected = expected.copy()
    alone = consumed.held_alone(arrays, 0)
    assert alone
    out = mx_arrays.to_ndarray(arrays[0], ctx, rows, consume=alone)
    assert out.context == ctx and out.dtype == np.float32
    np.testing.assert_array_equal(out.asnumpy(), expected)
    zero = float((arrays[0] == 0).mean())
    page_share = 2 * 4096 / arrays[0].nbytes
    assert zero >= 1 - page_share - 1e-9


def test_an_order_naming_a_row_twice_is_copied_as_usual():
    """Read in the array's own order a row goes to one place: an order that repeats a row is
    not consumed (the array is left whole) and the copy is still exact."""
    arrays = (fresh(8),)
    rows = np.array([5, 1, 5, 2999, 0, 1])
    expected = arrays[0][rows].copy()
    before = arrays[0].copy()
    out = mx_arrays.to_ndarray(arrays[0], mx.cpu(), rows, consume=consumed.held_alone(arrays, 0))
    np.testing.assert_array_equal(out.asnumpy(), expected)
    np.testing.assert_array_equal(arrays[0], before)


def test_only_an_array_nothing_else_holds_is_consumed():
    """held_alone: the tuple's own, owning, writable, contiguous, large arrays only."""
    big = fresh(4)
    assert not consumed.held_alone((big,), 0)  # ``big`` is held here too
    assert consumed.held_alone((fresh(4),), 0)
    assert not consumed.held_alone((fresh(4)[::2],), 0)  # a view: its base owns the memory
    assert not consumed.held_alone((np.zeros(100, np.float32),), 0)  # too small to matter
    read_only = fresh(5)
    read_only.flags.writeable = False
    assert not consumed.held_alone((read_only,), 0)
    del read_only
    assert not consumed.held_alone((np.asfortranarray(fresh(6)),), 0)
    assert not consumed.held_alone((mx.nd.zeros((ROWS,) + SHAPE),), 0)


@pytest.mark.parametrize("path", ["slices", "worker processes"])
@pytest.mark.parametrize("keep", [False, True])
def test_through_the_loader_batches_are_exact_and_held_arrays_untouched(keep, path,
                                                                         monkeypatch):
    """A FunctionSource that returns fresh arrays (consumed) and one that returns arrays it
    keeps (never consumed) give exact batches, on the slice path (copied into NDArrays) and
    the per-sample path (copied into shared memory); the kept arrays read as they were made,
    every epoch."""
    from gluon_stream._mx import shm
    calls = []
    module = mx_arrays if path == "slices" else shm
    real = module.consume_into
    monkeypatch.setattr(module, "consume_into",
                        lambda out, array, order: calls.append(array.shape) or real(out, array,
                                                                                   order))
    options = {} if path == "slices" else {"sample_transform": lambda d, lab: (d, lab),
                                           "num_workers": 1}
    kept = {k: (fresh(10 + k), np.arange(ROWS, dtype=np.float32) + 1e4 * k) for k in range(3)}
    snapshot = {k: (a.copy(), b.copy()) for k, (a, b) in kept.items()}

    def fn(key):
        data, label = kept[key]
        return (data, label) if keep else (data.copy(), label.copy())

    batches = []
    with gs.StreamLoader(gs.FunctionSource(range(3), fn), batch_size=500, shuffle=True,
                         seed=7, **options) as loader:
        for epoch in range(2):
            loader.set_epoch(epoch)
            batches.append([(d.asnumpy(), lab.asnumpy()) for d, lab in loader])
    # the data of 3 shards, 2 epochs (and of shards made ahead for the next); labels are small
    assert not calls if keep else len(calls) >= 6
    for k, (a, b) in kept.items():
        np.testing.assert_array_equal(a, snapshot[k][0])
        np.testing.assert_array_equal(b, snapshot[k][1])
    for epoch_batches in batches:
        labels = np.concatenate([lab for _, lab in epoch_batches])
        assert sorted(labels.tolist()) == sorted(
            float(v) for k in range(3) for v in snapshot[k][1])
        for data, label in epoch_batches:  # each row is the one its label names
            k, row = np.divmod(label.astype(np.int64), 10 ** 4)
            np.testing.assert_array_equal(
                data, np.stack([snapshot[int(s)][0][int(r)] for s, r in zip(k, row)]))


def test_more_ranks_than_shards_each_consuming_its_strides_read_every_row_once(monkeypatch):
    """3 ranks over 2 shards (``even_batches``: every rank takes balanced strides of every
    shard, a subset order, 2000 rows a rank here), each
    rank its own loader over a new FunctionSource that returns fresh arrays, held as users
    hold it (``for b in StreamLoader(...)``): every row once across the ranks, each row
    the one its label names."""
    made = {k: fresh(20 + k) for k in range(2)}
    orders = []
    real = mx_arrays.consume_into
    monkeypatch.setattr(mx_arrays, "consume_into",
                        lambda out, array, order: orders.append(len(order)) or real(out, array,
                                                                                   order))

    def fn(key):
        return made[key].copy(), np.arange(ROWS, dtype=np.float32) + 1e4 * key

    labels, checked = [], 0
    for rank in range(3):
        for data, label in gs.StreamLoader(gs.FunctionSource(range(2), fn), batch_size=100,
                                           shuffle=True, seed=5, num_parts=3, part_index=rank,
                                           even_batches=True):
            lab = label.asnumpy()
            labels.extend(lab.tolist())
            k, row = np.divmod(lab.astype(np.int64), 10 ** 4)
            np.testing.assert_array_equal(
                data.asnumpy(), np.stack([made[int(s)][int(r)] for s, r in zip(k, row)]))
            checked += len(lab)
    assert sorted(labels) == sorted(float(v + 1e4 * k) for k in range(2) for v in range(ROWS))
    assert checked == 2 * ROWS
    assert orders and all(n < ROWS for n in orders)  # consumed, each a rank's subset of rows
