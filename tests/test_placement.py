"""Batches on the device: ctx= places them on one context or splits them across several (as
split_and_load does), copied one batch ahead; shards_on_ctx copies whole shards instead. Tested
on CPU contexts (mx.cpu(0) and mx.cpu(1) are distinct contexts in MXNet)."""
from __future__ import annotations

import mxnet as mx
import numpy as np
import pytest

import gluon_stream as gs
from _helpers import all_ids, id_shards

pytestmark = pytest.mark.mxnet  # these tests use MXNet: warm its engine first

SIZES = [9, 6, 11]
SAMPLE = {"sample_transform": lambda ids, half: (ids, half)}


def loader(**kw):
    kw.setdefault("batch_size", 4)
    return gs.StreamLoader(gs.FunctionSource(range(len(SIZES)), id_shards(SIZES)), shuffle=True,
                           seed=2, **kw)


def values(batches):
    return [[a.asnumpy().tolist() for a in b] for b in batches]


@pytest.mark.parametrize("options", [{}, SAMPLE, dict(SAMPLE, num_workers=2),
                                     {"shards_on_ctx": True}])
def test_batches_arrive_on_the_asked_context_with_the_same_values(options):
    with loader() as plain:
        reference = values(plain)
    with loader(ctx=mx.cpu(1), **options) as ld:
        batches = list(ld)
    assert {str(a.context) for b in batches for a in b} == {"cpu(1)"}
    assert values(batches) == reference


@pytest.mark.parametrize("options", [{}, dict(SAMPLE, num_workers=2)])
def test_a_list_of_contexts_splits_every_array_like_split_and_load(options):
    contexts = [mx.cpu(0), mx.cpu(1)]
    with loader() as plain:
        reference = [[mx.gluon.utils.split_and_load(a, contexts, even_split=False) for a in b]
                     for b in plain]
    with loader(ctx=contexts, **options) as ld:
        batches = list(ld)
    assert len(batches) == len(reference)
    for got, want in zip(batches, reference):
        for parts, expected in zip(got, want):
            assert [str(p.context) for p in parts] == [str(e.context) for e in expected]
            assert [p.asnumpy().tolist() for p in parts] == [e.asnumpy().tolist()
                                                           for e in expected]
    flat = [int(i) for b in batches for part in b[0] for i in part.asnumpy()]
    assert sorted(flat) == all_ids(SIZES)


def test_the_next_batch_is_copied_before_the_current_one_is_handed_out(monkeypatch):
    import gluon_stream._mx as mx_arrays

    events = []
    real = mx_arrays.place

    def place(data, ctx):
        events.append(("copy", int(data[0].asnumpy()[0])))
        return real(data, ctx)

    monkeypatch.setattr(mx_arrays, "place", place)
    src = gs.FunctionSource([0], lambda k: np.arange(16, dtype=np.int64))
    with gs.StreamLoader(src, batch_size=4, ctx=mx.cpu(1)) as ld:
        for batch in ld:
            events.append(("loop", int(batch.asnumpy()[0])))
    # within a shard the next batch is ready: its copy starts before this one reaches the loop
    assert events == [("copy", 0), ("copy", 4), ("loop", 0), ("copy", 8), ("loop", 4),
                      ("copy", 12), ("loop", 8), ("loop", 12)]


def test_bad_placements_are_refused():
    with pytest.raises(TypeError, match="ctx must be an MXNet context"):
        loader(ctx="gpu0")
    with pytest.raises(ValueError, match="shards_on_ctx=True copies whole shards to one ctx"):
        loader(ctx=[mx.cpu(0), mx.cpu(1)], shards_on_ctx=True)
    with pytest.raises(ValueError, match="shards_on_ctx"):
        loader(ctx=mx.cpu(1), shards_on_ctx=True, **SAMPLE)
    with loader(ctx=[mx.cpu(0), mx.cpu(1)]) as ld, pytest.raises(ValueError, match="one ctx"):
        gs.StreamIter(ld)


def test_stream_iter_passes_one_context_through_to_module_batches():
    with loader(ctx=mx.cpu(1)) as ld:
        it = gs.StreamIter(ld, data_names=["ids"], label_names=["half"])
        contexts = {str(a.context) for batch in it for a in batch.data + batch.label}
        it.close()
    assert contexts == {"cpu(1)"}


@pytest.mark.parametrize("ctx", [mx.cpu(0), mx.cpu(1), mx.cpu_pinned(0)])
def test_slice_rows_is_a_view_with_the_rows_getitem_gives(ctx):
    """The slice path's batches are cut with one C call, not NDArray.__getitem__ (which reads
    the shape three times): the same rows, the same context, memory shared as a view."""
    from gluon_stream._mx import slice_rows
    base = mx.nd.array(np.arange(60, dtype=np.float32).reshape(10, 3, 2), ctx=ctx)
    for start, stop in [(0, 10), (3, 7), (9, 10), (4, 4)]:
        view = slice_rows(base, start, stop)
        assert view.context == ctx and view.shape == base[start:stop].shape
        np.testing.assert_array_equal(view.asnumpy(), base.asnumpy()[start:stop])
    view = slice_rows(base, 2, 5)
    view[:] = -1  # a view: writing through it writes the base's rows
    assert (base.asnumpy()[2:5] == -1).all() and (base.asnumpy()[5:] >= 0).all()
    rows = np.arange(12).reshape(6, 2)
    cut = slice_rows(rows, 1, 3)  # numpy: sliced as usual, a view
    assert np.shares_memory(cut, rows) and cut.tolist() == [[2, 3], [4, 5]]
    with pytest.raises(mx.base.MXNetError):
        slice_rows(base, 8, 11)  # past the end: MXNet refuses, as __getitem__ would


def test_the_slice_path_cuts_batches_without_ndarray_getitem(monkeypatch):
    """Keeps the loop's per-batch cost down: every batch of a shard is cut by slice_rows."""
    calls = []
    getitem = mx.nd.NDArray.__getitem__

    def counted(self, key):
        calls.append(key)
        return getitem(self, key)

    source = gs.FunctionSource(range(3), lambda k: np.arange(40, dtype=np.float32) + 100 * k)
    with gs.StreamLoader(source, batch_size=8) as loader:
        monkeypatch.setattr(mx.nd.NDArray, "__getitem__", counted)
        values = [batch.asnumpy() for batch in loader]
    assert len(values) == 15 and sorted(np.concatenate(values).tolist()) == sorted(
        float(v + 100 * k) for k in range(3) for v in range(40))
    assert not calls


@pytest.mark.parametrize("ctx", [mx.cpu(0), mx.cpu_pinned(0)])
@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.uint8, np.bool_])
def test_a_shard_is_gathered_in_its_order_straight_into_its_ndarray(ctx, dtype, monkeypatch):
    """A contiguous shard's rows in a shuffled order (a permutation, or a rank's subset) are
    gathered into the NDArray's memory in one pass: the rows order gives, in order, with no
    chunk copied in between; a strided view (sliding windows) still goes by chunks."""
    import gluon_stream._mx as mx_arrays
    raw = (np.arange(7 * 3 * 2).reshape(7, 3, 2) % 5).astype(dtype)
    chunked = []
    real_chunks = mx_arrays.row_chunks
    monkeypatch.setattr(mx_arrays, "row_chunks",
                        lambda *a, **k: chunked.append(1) or real_chunks(*a, **k))
    for order in [np.array([3, 0, 6, 1, 5, 2, 4]), np.array([5, 1, 2]), np.array([], np.int64)]:
        out = mx_arrays.to_ndarray(raw, ctx, order)
        assert out.context == ctx and out.dtype == raw.dtype and out.shape == raw[order].shape
        np.testing.assert_array_equal(out.asnumpy(), raw[order])
    assert not chunked
    with pytest.raises(IndexError):  # an order out of range is refused, not clipped
        mx_arrays.to_ndarray(raw, ctx, np.array([0, 7]))
    with pytest.raises(IndexError):
        mx_arrays.to_ndarray(raw, ctx, np.array([-9, 1]))
    chunked.clear()
    windows = np.lib.stride_tricks.sliding_window_view((np.arange(20) % 3).astype(dtype), 4)
    np.testing.assert_array_equal(
        mx_arrays.to_ndarray(windows, ctx, np.array([9, 0, 4])).asnumpy(), windows[[9, 0, 4]])
    assert chunked


def test_the_loops_thread_reads_no_ndarray_shape_dtype_or_context_at_shard_boundaries(
        monkeypatch):
    """Each such read is a C call that lets go of the GIL and may wait for it behind a busy
    producer: a shard's rows and schema are taken where it is made, and its last batch is
    copied by one operator call. The batches are the same as before: each a copy or a view of
    the shard's rows, every row once."""
    import threading
    loop = threading.get_ident()
    reads = []
    for name in ("shape", "dtype", "context"):
        real = getattr(mx.nd.NDArray, name)
        monkeypatch.setattr(mx.nd.NDArray, name, property(
            lambda self, real=real, name=name: (
                reads.append(name) if threading.get_ident() == loop else None,
                real.fget(self))[1]))
    source = gs.FunctionSource(range(6), lambda k: (np.arange(32, dtype=np.float32) + 100 * k,
                                                    np.full(32, k, dtype=np.int64)))
    # held as users hold it: the loader referred to by its iterator alone
    iterator = iter(gs.StreamLoader(source, batch_size=8, shuffle=True, seed=3))
    first = next(iterator)
    reads.clear()  # what the first batch costs once (the stream's schema, MXNet's warm-up)
    batches = [first] + list(iterator)
    assert not reads
    values = np.concatenate([b[0].asnumpy() for b in batches])
    assert sorted(values.tolist()) == sorted(float(v + 100 * k) for k in range(6)
                                             for v in range(32))
    for data, label in batches:  # rows of one shard, the label its key
        assert ((data.asnumpy() // 100) == label.asnumpy()).all()
        assert data.context == mx.cpu() and data.dtype == np.float32
