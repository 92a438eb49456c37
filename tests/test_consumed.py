"""A shard copied into its NDArray gives its own memory back as it goes, when the loader owns it
(gluon_stream._mx.consumed): read from a file by the loader, or handed over by
``FunctionSource(fresh_arrays=True)``; what user code returns is never touched otherwise."""
from __future__ import annotations

import sys

import mxnet as mx
import numpy as np
import pytest

import gluon_stream as gs
import gluon_stream._mx as mx_arrays
from gluon_stream._mx import consumed

pytestmark = [pytest.mark.mxnet,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="consumed on Linux")]

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
    assert consumed.consumable(arrays[0])
    out = mx_arrays.to_ndarray(arrays[0], ctx, rows, consume=True)
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
    out = mx_arrays.to_ndarray(arrays[0], mx.cpu(), rows, consume=True)
    np.testing.assert_array_equal(out.asnumpy(), expected)
    np.testing.assert_array_equal(arrays[0], before)


def test_only_owning_writable_contiguous_large_arrays_are_consumable():
    """consumable: what can be given back page by page (who owns it is the stream's say)."""
    assert consumed.consumable(fresh(4))
    assert not consumed.consumable(fresh(4)[::2])  # a view: its base owns the memory
    assert not consumed.consumable(np.zeros(100, np.float32))  # too small to matter
    read_only = fresh(5)
    read_only.flags.writeable = False
    assert not consumed.consumable(read_only)
    assert not consumed.consumable(np.asfortranarray(fresh(6)))
    assert not consumed.consumable(mx.nd.zeros((ROWS,) + SHAPE))


@pytest.mark.parametrize("path", ["slices", "worker processes"])
@pytest.mark.parametrize("keep", [False, True])
def test_through_the_loader_batches_are_exact_and_held_arrays_untouched(keep, path,
                                                                         monkeypatch):
    """A FunctionSource that hands fresh arrays over (``fresh_arrays=True``: consumed) and one
    that returns arrays it keeps (the default: never consumed) give exact batches, on the slice path
    (copied into NDArrays) and the per-sample path (copied into shared memory); the kept arrays read
    as they were made, every epoch."""
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
    with gs.StreamLoader(gs.FunctionSource(range(3), fn, fresh_arrays=not keep),
                         batch_size=500, shuffle=True, seed=7, **options) as loader:
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
    rank its own loader over a new FunctionSource that hands fresh arrays over, held as users
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
        for data, label in gs.StreamLoader(gs.FunctionSource(range(2), fn, fresh_arrays=True),
                                           batch_size=100,
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


def _weakly_shared():
    """A FunctionSource function that shares each pair of keys' data through a
    ``WeakValueDictionary`` (sharing without pinning): key 2k+1 returns key 2k's data array
    if it is still alive (it waits for key 2k's call to return first), with labels that name
    their rows."""
    import threading
    import weakref
    shared: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
    made = {k: threading.Event() for k in range(64)}

    def fn(key):
        if key % 2:
            made[key // 2].wait(10)
        data = shared.get(key // 2)
        if data is None:
            data = fresh(100 + key // 2)
            shared[key // 2] = data
        made[key // 2].set()
        return data, np.arange(ROWS, dtype=np.float32) + 1e4 * key

    return fn


@pytest.mark.parametrize("shape", ["slices", "worker processes", "rank strides"])
def test_arrays_a_function_shares_through_weak_references_are_never_consumed(shape):
    """Weak references are invisible to reference counts: the loader consumes only arrays it
    owns, so a function that shares arrays through a WeakValueDictionary gets exact batches
    (it got batches of zeros when the copy inferred ownership from a reference count)."""
    options: dict = {"slices": {}, "worker processes": {
        "sample_transform": lambda d, lab: (d, lab), "num_workers": 2},
        "rank strides": {"num_parts": 3, "part_index": 1, "even_batches": True}}[shape]
    keys = 8
    made = {s: fresh(100 + s) for s in range(keys // 2)}
    checked = 0
    for data, label in gs.StreamLoader(gs.FunctionSource(range(keys), _weakly_shared()),
                                       batch_size=500, prefetch=3, producers=2,
                                       **options):
        k, row = np.divmod(label.asnumpy().astype(np.int64), 10 ** 4)
        np.testing.assert_array_equal(
            data.asnumpy(), np.stack([made[int(s) // 2][int(r)] for s, r in zip(k, row)]))
        checked += len(row)
    assert checked == (keys * ROWS if shape != "rank strides" else keys * ROWS // 3)


@pytest.mark.parametrize("how", ["cache", "file", "file mmap", "transform", "function"])
def test_arrays_the_loader_read_itself_are_consumed_and_no_others(how, tmp_path, monkeypatch):
    """Ownership is carried from where the arrays are made: a shard read back from a
    cache_dir or a FileSource file is the loader's own and consumed by its copy; a
    memory-mapped file, a transform's output and a plain FunctionSource's result are not."""
    calls = []
    real = mx_arrays.consume_into
    monkeypatch.setattr(mx_arrays, "consume_into",
                        lambda out, array, order: calls.append(array.shape) or real(out, array,
                                                                                   order))
    data = {k: fresh(30 + k) for k in range(2)}
    options: dict = {}
    if how == "cache":
        source = gs.FunctionSource(range(2), lambda k: data[k].copy(), cache_dir=tmp_path)
    elif how == "function":
        source = gs.FunctionSource(range(2), lambda k: data[k].copy())
    else:
        for k in range(2):
            gs.write_shard(str(tmp_path / f"{k}.npy"), data[k])
        source = gs.FileSource(str(tmp_path), mmap=how == "file mmap")
        if how == "transform":
            options["transform"] = lambda a: a
    rows = []
    for batch in gs.StreamLoader(source, batch_size=1000, **options):
        rows.append(batch.asnumpy())
    np.testing.assert_array_equal(np.concatenate(rows), np.concatenate([data[0], data[1]]))
    assert (len(calls) >= 2) if how in ("cache", "file") else not calls  # (and the next epoch)
