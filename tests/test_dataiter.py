"""StreamIter, for Module: shapes, names, padding, reset, fit, PrefetchingIter, aliasing."""
from __future__ import annotations

import logging

import mxnet as mx
import numpy as np
import pytest

import gluon_stream as gs
from _helpers import id_shards

pytestmark = pytest.mark.mxnet  # these tests use MXNet: warm its engine first

SIZES = [7, 10, 5]  # 22 samples: not multiples of the batch size, a shard smaller than one batch


def _loader(sizes=SIZES, **kwargs):
    kwargs.setdefault("batch_size", 4)
    return gs.StreamLoader(gs.FunctionSource(range(len(sizes)), id_shards(sizes)), **kwargs)


def _ids(arr) -> list:
    return [int(x) for x in arr.asnumpy()]


def _real_ids(batch) -> list:
    """The ids of a DataBatch without its padding."""
    return _ids(batch.data[0])[:batch.data[0].shape[0] - batch.pad]


def test_provide_data_and_label_describe_the_batches():
    with _loader() as loader:
        it = gs.StreamIter(loader, data_names=["ids"], label_names=["half"])
        (data,), (label,) = it.provide_data, it.provide_label
        assert (data.name, data.shape, data.dtype, data.layout) == ("ids", (4,), np.int64, "N")
        assert (label.name, label.shape, label.dtype) == ("half", (4,), np.float32)
        batch = it.next()
        assert [d.shape for d in batch.data] == [(4,)] and batch.data[0].dtype == np.int64
        assert batch.provide_data == it.provide_data and batch.provide_label == it.provide_label
        assert batch.pad == 0 and it.getpad() == 0
        assert it.getdata()[0] is batch.data[0] and it.getlabel()[0] is batch.label[0]
        it.close()


def test_layouts_by_rank_and_override():
    def fn(key):
        return np.zeros((6, 5, 3), np.float32), np.zeros((6, 2), np.float32)

    with gs.StreamLoader(gs.FunctionSource([0], fn), batch_size=3) as loader:
        it = gs.StreamIter(loader, label_names=["y"])
        assert [d.layout for d in it.provide_data + it.provide_label] == ["NTC", "NC"]
        it2 = gs.StreamIter(loader, label_names=["y"], layouts={"data": "NCW"})
        with pytest.raises(ValueError, match="layout"):
            gs.StreamIter(loader, layouts={"data": "CHW"})
        it.close()
        assert it2.provide_data[0].layout == "NCW"
        assert it2.provide_data[0].shape == (3, 5, 3)
        it2.close()


def test_first_batch_is_not_lost_and_every_sample_once_with_padding():
    """provide_data peeks at the first batch; it is then handed out first. The short last
    batch is padded to batch_size by repeating its own samples, and getpad() says how many."""
    with _loader() as loader:
        it = gs.StreamIter(loader, data_names=["ids"], label_names=["half"])
        assert it.provide_data[0].shape == (4,)
        seen, pads = [], []
        for batch in it:
            assert batch.data[0].shape == (4,)
            ids = _ids(batch.data[0])
            seen += ids[:4 - batch.pad]
            pads.append(batch.pad)
            np.testing.assert_allclose(batch.label[0].asnumpy(), np.array(ids) * 0.5)
        assert sorted(seen) == sorted(i for k, n in enumerate(SIZES)
                                      for i in range(1000 * k, 1000 * k + n))
        assert pads == [0] * 5 + [2]  # 22 = 5 * 4 + 2
        assert ids[2:] == ids[:2]  # the padding repeats the batch's own samples


def test_reset_starts_the_next_epoch_and_early_reset_is_free():
    with _loader(shuffle=True, seed=3) as loader:
        it = gs.StreamIter(loader, data_names=["ids"], label_names=["half"])
        it.reset()  # before any batch: keeps the pass (Module.fit/score call reset first)
        first = [_real_ids(b) for b in it]
        assert loader.stats.epochs[0].epoch == 0 and len(loader.stats.epochs) == 1
        assert it.iter_next() is False  # stays at the end until reset
        it.reset()
        second = [_real_ids(b) for b in it]
        assert [e.epoch for e in loader.stats.epochs] == [0, 1]
        assert first != second  # another epoch, another shuffle
        assert sorted(sum(first, [])) == sorted(sum(second, []))
        it.reset()
        it.next()
        it.reset()  # mid-epoch: the pass is cancelled, the next one starts fresh
        assert len([b for b in it]) == 6
        assert loader.stats.epochs[2].complete is False and loader.stats.epochs[3].complete


def test_several_labels_map_to_several_label_names():
    def fn(key):
        x = np.random.default_rng(key).standard_normal((9, 4, 2)).astype(np.float32)
        return x, x[:, -1, 0], x[:, -1, 1], (x[:, -1, 0] > 0).astype(np.float32)

    with gs.StreamLoader(gs.FunctionSource(range(2), fn), batch_size=3) as loader:
        it = gs.StreamIter(loader, label_names=["next0", "next1", "up"])
        assert [d.name for d in it.provide_label] == ["next0", "next1", "up"]
        assert [d.shape for d in it.provide_label] == [(3,)] * 3
        for batch in it:
            x, (a, b, up) = batch.data[0].asnumpy(), [lb.asnumpy() for lb in batch.label]
            np.testing.assert_array_equal(a, x[:, -1, 0])
            np.testing.assert_array_equal(b, x[:, -1, 1])
            np.testing.assert_array_equal(up, (x[:, -1, 0] > 0))
        with pytest.raises(ValueError, match="4 arrays but data_names"):
            _ = gs.StreamIter(loader, label_names=["only_one"]).provide_data  # peeks, raises


def test_bad_arguments_are_named():
    with _loader() as loader:
        with pytest.raises(TypeError, match="StreamLoader"):
            gs.StreamIter([1, 2, 3])
        with pytest.raises(ValueError, match="distinct"):
            gs.StreamIter(loader, data_names=["x"], label_names=["x"])
        with pytest.raises(ValueError, match="at least one"):
            gs.StreamIter(loader, data_names=[])
        with pytest.raises(RuntimeError, match="iter_next"):
            gs.StreamIter(loader).getdata()


def test_batches_handed_out_are_never_overwritten():
    """The PrefetchingIter complaint: keep every batch, move on through shards and epochs,
    then check each still holds what it held when handed out (and all are distinct)."""
    with _loader(sizes=[9, 6, 11, 8]) as loader:
        it = gs.StreamIter(loader, data_names=["ids"], label_names=["half"])
        kept = []
        for _ in range(2):
            for batch in it:
                kept.append((batch, batch.data[0].asnumpy().copy(),
                             batch.label[0].asnumpy().copy()))
            it.reset()
        assert len(kept) == 2 * 9
        for batch, ids, half in kept:
            np.testing.assert_array_equal(batch.data[0].asnumpy(), ids)
            np.testing.assert_array_equal(batch.label[0].asnumpy(), half)
        first_epoch = [int(i) for _, ids, _ in kept[:8] for i in ids]
        assert len(set(first_epoch)) == 32  # 8 full batches of distinct samples


def stop_prefetching(pf) -> None:
    """End a PrefetchingIter's thread. Only its ``__del__`` does (``del`` never frees it), and
    calling that while the thread is fetching loses the wake-up (the thread clears the event
    after its fetch): wait for the fetch in flight first."""
    assert all(ready.wait(60) for ready in pf.data_ready), "PrefetchingIter's thread died"
    pf.__del__()


def _drain(pf) -> list:
    """Iterate a PrefetchingIter, failing (not hanging) if its thread died: MXNet's thread
    catches only StopIteration, and its consumer then waits forever."""
    batches = []
    while True:
        assert all(ready.wait(60) for ready in pf.data_ready), \
            "PrefetchingIter's thread died; its exception is reported above"
        try:
            batches.append(pf.next())
        except StopIteration:
            return batches


def test_prefetching_iter_works_from_the_first_use_and_keeps_batches_intact():
    with _loader(sizes=[9, 6, 11, 8]) as loader:
        it = gs.StreamIter(loader, data_names=["ids"], label_names=["half"])
        pf = mx.io.PrefetchingIter(it)
        try:
            assert pf.provide_data[0].shape == (4,)
            kept = []
            for epoch in range(2):
                batches = _drain(pf)
                assert len(batches) == 9, f"epoch {epoch}"
                kept += [(b, b.data[0].asnumpy().copy()) for b in batches]
                pf.reset()
            for batch, ids in kept:
                np.testing.assert_array_equal(batch.data[0].asnumpy(), ids)
            ids = sorted(int(i) for b, _ in kept[:9] for i in b.data[0].asnumpy()[:4 - b.pad])
            assert ids == sorted(1000 * k + i for k, n in enumerate([9, 6, 11, 8])
                                 for i in range(n))
        finally:
            stop_prefetching(pf)
            it.close()


def test_module_fit_two_epochs_and_predict(caplog):
    rng = np.random.default_rng(0)
    w = rng.standard_normal(6).astype(np.float32)

    def fn(key):
        x = np.random.default_rng(key).standard_normal((40, 6)).astype(np.float32)
        return x, (x @ w > 0).astype(np.float32)

    data = mx.sym.Variable("data")
    net = mx.sym.FullyConnected(data, num_hidden=2, name="fc")
    net = mx.sym.SoftmaxOutput(net, name="softmax")
    with gs.StreamLoader(gs.FunctionSource(range(3), fn), batch_size=16, shuffle=True,
                         seed=0) as loader:
        it = gs.StreamIter(loader)
        mod = mx.mod.Module(net, data_names=["data"], label_names=["softmax_label"],
                            context=mx.cpu())
        metric = mx.metric.Accuracy()
        with caplog.at_level(logging.INFO):
            mod.fit(it, num_epoch=2, optimizer="adam",
                    optimizer_params={"learning_rate": 0.05}, eval_metric=metric,
                    initializer=mx.init.Xavier())
        assert [e.epoch for e in loader.stats.epochs] == [0, 1]
        assert all(e.complete and e.samples == 120 for e in loader.stats.epochs)
        assert any("Epoch[1]" in r.getMessage() for r in caplog.records)
        it.reset()
        out = mod.predict(it)
        assert out.shape == (120, 2)  # padding of the last batch removed by predict
        it.reset()
        (_, acc), = mod.score(it, "acc")
        assert acc > 0.6  # a linearly separable task: the model learned something
        it.close()


def test_docstring_example_runs():
    import doctest

    from gluon_stream import dataiter

    result = doctest.testmod(dataiter)
    assert result.failed == 0 and result.attempted > 0


def test_next_before_provide_data_on_a_one_batch_pass():
    """Module.score/predict call next() before provide_data: a one-batch pass must work."""
    src = gs.FunctionSource([0], lambda k: (np.ones((3, 2), np.float32), np.zeros(3, np.float32)))
    with gs.StreamLoader(src, batch_size=4) as loader:
        it = gs.StreamIter(loader)
        batch = it.next()
        assert batch.pad == 1 and batch.data[0].shape == (4, 2)
        assert [d.shape for d in it.provide_data] == [(4, 2)]
        with pytest.raises(StopIteration):
            it.next()
        it.close()


def test_module_fit_with_a_one_batch_validation_set_and_begin_epoch():
    data = mx.sym.Variable("data")
    net = mx.sym.SoftmaxOutput(mx.sym.FullyConnected(data, num_hidden=2, name="fc"),
                               name="softmax")

    def train_fn(key):
        x = np.random.default_rng(key).standard_normal((30, 4)).astype(np.float32)
        return x, (x[:, 0] > 0).astype(np.float32)

    train_src = gs.FunctionSource(lambda epoch: [10 * epoch, 10 * epoch + 1], train_fn)
    with gs.StreamLoader(train_src, batch_size=8, shuffle=True, seed=1) as train, \
            gs.StreamLoader(gs.FunctionSource([99], lambda k: tuple(a[:5] for a in train_fn(k))),
                            batch_size=8) as val:
        train_iter, val_iter = gs.StreamIter(train), gs.StreamIter(val)
        train_iter.set_epoch(5)  # what Module.fit(begin_epoch=5) needs
        mod = mx.mod.Module(net, context=mx.cpu())
        mod.fit(train_iter, eval_data=val_iter, begin_epoch=5, num_epoch=7, optimizer="sgd",
                initializer=mx.init.Xavier(), eval_metric="acc")
        assert [e.epoch for e in train.stats.epochs] == [5, 6]  # epoch 5's and 6's keys
        assert [e.samples for e in val.stats.epochs] == [5, 5]  # one short batch, each epoch
        train_iter.close()
        val_iter.close()


def test_bool_labels_are_padded_like_any_other():
    src = gs.FunctionSource([0], lambda k: (np.arange(6, dtype=np.float32), np.arange(6) % 2 == 0))
    with gs.StreamLoader(src, batch_size=4) as loader:
        it = gs.StreamIter(loader, label_names=["mask"])
        pads = []
        for batch in it:
            pads.append(batch.pad)
            assert batch.label[0].dtype == np.bool_ and batch.label[0].shape == (4,)
        assert pads == [0, 2]
        it.close()


def test_dict_keys_are_matched_to_data_and_label_names():
    def fn(key):  # the label first: positions would swap data and label
        x = np.arange(8, dtype=np.float32).reshape(4, 2) + 100 * key
        return {"softmax_label": x[:, 0] > 100, "data": x}

    with gs.StreamLoader(gs.FunctionSource(range(2), fn), batch_size=4) as loader:
        it = gs.StreamIter(loader)
        assert [d.shape for d in it.provide_data] == [(4, 2)]
        for batch in it:
            data, label = batch.data[0].asnumpy(), batch.label[0].asnumpy()
            np.testing.assert_array_equal(label, data[:, 0] > 100)
        assert loader.names == ("softmax_label", "data")
        it.close()


def test_npz_member_names_are_matched_too(tmp_path):
    np.savez(tmp_path / "s.npz", label=np.zeros(4, np.float32), data=np.ones((4, 3), np.float32))
    with gs.StreamLoader(gs.FileSource([str(tmp_path / "s.npz")]), batch_size=4) as loader:
        it = gs.StreamIter(loader, data_names=["data"], label_names=["label"])
        batch = it.next()
        assert batch.data[0].shape == (4, 3) and batch.label[0].shape == (4,)
        it.close()
