"""Gluon's numpy interface (``npx.set_np()``): every path hands out ``mx.np.ndarray``, as
Gluon's DataLoader does, and numpy-mode code (a Gluon net, d2l-style training functions)
runs on a StreamLoader unchanged. Legacy mode stays as it was.

``npx.set_np()`` is per-thread state of MXNet 1.9.1 that outlives a test: each test that turns
it on turns it off in a ``finally`` (the ``numpy_mode`` fixture), so the next test in the same
pytest-xdist worker starts in legacy mode."""
from __future__ import annotations

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon, init, npx
from mxnet.gluon.data.vision import transforms

import gluon_stream as gs

pytestmark = pytest.mark.mxnet  # these tests use MXNet: warm its engine first

CLASSES = 3
ROWS = 24


def patterns(key):
    """Separable 1x4x4 images (the class lights one row of pixels) and int32 labels."""
    rng = np.random.default_rng(key)
    labels = rng.integers(0, CLASSES, ROWS)
    images = rng.normal(0, 0.1, (ROWS, 1, 4, 4)).astype(np.float32)
    images[np.arange(ROWS), 0, labels, :] += 1.0
    return images, labels.astype(np.int32)


def pictures(key):
    """uint8 HWC images, as a decoder gives them, for Gluon's vision transforms."""
    images, labels = patterns(key)
    return (images.transpose(0, 2, 3, 1) * 200).clip(0, 255).astype(np.uint8), labels


@pytest.fixture
def numpy_mode():
    """Gluon's numpy semantics on for the test, off after it whatever happens."""
    npx.set_np()
    try:
        yield
    finally:
        npx.reset_np()


def _net(contexts):
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(16, activation="relu"), gluon.nn.Dense(CLASSES))
    net.initialize(init.Xavier(), ctx=contexts)
    return net


def _np_stack(samples):
    """A batchify_fn written for numpy mode: it stacks with mx.np operators."""
    images, labels = zip(*samples)
    return mx.np.stack([mx.np.array(i) for i in images]), mx.np.array(np.array(labels))


def _flip(image, label):
    """A sample_transform that only numpy-mode arrays pass (an mx.np operator; axis=-1 fails
    in MXNet 1.9.1 whatever the input)."""
    return mx.np.flip(image, axis=2), label


PATHS = {
    "slices": ({}, patterns),
    "shuffle_window": ({"shuffle": True, "seed": 0, "shuffle_window": 2}, patterns),
    "ctx": ({"ctx": mx.cpu(0)}, patterns),
    "ctx_list": ({"ctx": [mx.cpu(0), mx.cpu(1)]}, patterns),
    "shards_on_ctx": ({"ctx": mx.cpu(0), "shards_on_ctx": True}, patterns),
    "pad": ({"even_batches": "pad", "num_parts": 2, "part_index": 1, "batch_size": 10},
            patterns),
    "batchify_fn": ({"batchify_fn": _np_stack}, patterns),
    "inline": ({"sample_transform": _flip, "sample_format": "ndarray"}, patterns),
    "threads": ({"sample_transform": _flip, "sample_format": "ndarray", "num_workers": 2,
                 "thread_pool": True}, patterns),
    "processes": ({"sample_transform": _flip, "sample_format": "ndarray", "num_workers": 2},
                  patterns),
    "processes_numpy_rows": ({"sample_transform": lambda x, y: (x * 2, y), "num_workers": 2},
                             patterns),
    "gluon_transforms_threads": ({"sample_transform": lambda x, y: (transforms.ToTensor()(x), y),
                                  "num_workers": 2, "thread_pool": True}, pictures),
    "gluon_transforms_processes": ({"sample_transform":
                                    lambda x, y: (transforms.ToTensor()(x), y),
                                    "num_workers": 2}, pictures),
}


def _arrays(batch):
    """Every array of a batch, lists of split parts flattened."""
    out = []
    for field in batch:
        out.extend(field if isinstance(field, list) else [field])
    return out


@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_numpy_mode_gluon_net_trains_on_every_path(numpy_mode, path):
    kwargs, fn = PATHS[path]
    kwargs = dict(kwargs)
    batch_size = kwargs.pop("batch_size", 8)
    contexts = kwargs["ctx"] if isinstance(kwargs.get("ctx"), list) else [mx.cpu(0)]
    net = _net(contexts)
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    src = gs.FunctionSource(range(3), fn, cache_dir=None)
    batches = 0
    with gs.StreamLoader(src, batch_size=batch_size, **kwargs) as loader:
        for _epoch in range(2):
            for batch in loader:
                assert all(isinstance(a, mx.np.ndarray) for a in _arrays(batch)), \
                    [type(a) for a in _arrays(batch)]
                images, labels = batch
                images = images if isinstance(images, list) else [images]
                labels = labels if isinstance(labels, list) else [labels]
                with autograd.record():
                    losses = [loss_fn(net(x.as_in_ctx(c)), y.as_in_ctx(c))
                              for c, x, y in zip(contexts, images, labels)]
                for loss in losses:
                    loss.backward()
                trainer.step(sum(int(x.shape[0]) for x in images))
                batches += 1
    assert batches > 0


def test_legacy_mode_is_unchanged():
    for kwargs in ({}, {"sample_transform": _identity, "num_workers": 2, "thread_pool": True},
                   {"sample_transform": _identity, "num_workers": 2}):
        src = gs.FunctionSource(range(2), patterns, cache_dir=None)
        with gs.StreamLoader(src, batch_size=8, **kwargs) as loader:
            for batch in loader:
                assert all(type(a) is mx.nd.NDArray for a in batch)


def _identity(x, y):
    return x, y


def test_the_mode_is_the_iterating_threads_at_each_batch():
    """A loader built in legacy mode yields mx.np once the loop turns numpy mode on, and
    legacy arrays again once it turns it off, as Gluon's DataLoader does."""
    src = gs.FunctionSource(range(2), patterns, cache_dir=None)
    with gs.StreamLoader(src, batch_size=8, sample_transform=_identity, num_workers=1) as loader:
        batches = iter(loader)
        assert type(next(batches)[0]) is mx.nd.NDArray
        with mx.util.np_shape(True), mx.util.np_array(True):
            assert isinstance(next(batches)[0], mx.np.ndarray)
        assert type(next(batches)[0]) is mx.nd.NDArray
        batches.close()


def test_workers_forked_in_numpy_mode_follow_a_loop_in_legacy_mode():
    """Worker processes forked while numpy mode was on keep it (fork copies the thread's
    state); a batch asked for from a legacy loop is still made in legacy mode there."""
    def kind(x, y):
        return x, np.float32(mx.util.is_np_array())

    src = gs.FunctionSource(range(1), patterns, cache_dir=None)
    npx.set_np()
    try:
        loader = gs.StreamLoader(src, batch_size=8, sample_transform=kind, num_workers=1)
    finally:
        npx.reset_np()
    with loader:
        for _, made_in_numpy_mode in loader:
            assert type(made_in_numpy_mode) is mx.nd.NDArray
            assert made_in_numpy_mode.asnumpy().tolist() == [0.0] * 8


def test_numpy_batches_are_views_not_copies(numpy_mode):
    """Slices of the shard, handed out as mx.np arrays over the same memory: no copy per batch."""
    src = gs.FunctionSource(range(1), lambda k: np.arange(16.0, dtype=np.float32), cache_dir=None)
    with gs.StreamLoader(src, batch_size=4) as loader:
        first, second = list(loader)[:2]
        assert isinstance(first, mx.np.ndarray)
        pointers = [_data_pointer(a) for a in (first, second)]
        assert pointers[1] - pointers[0] == 4 * 4  # consecutive rows of one buffer


def _data_pointer(array):
    import ctypes

    from mxnet.base import _LIB, check_call
    pointer = ctypes.c_void_p()
    check_call(_LIB.MXNDArrayGetData(array.handle, ctypes.byref(pointer)))
    return pointer.value


def test_stream_iter_keeps_legacy_ndarrays_for_module(numpy_mode):
    """The Module API binds legacy executors only (as mx.io.NDArrayIter, StreamIter gives legacy
    NDArrays in numpy mode too)."""
    src = gs.FunctionSource(range(2), patterns, cache_dir=None)
    with gs.StreamLoader(src, batch_size=8) as loader:
        it = gs.StreamIter(loader, label_names=("softmax_label",))
        batch = it.next()
        assert type(batch.data[0]) is mx.nd.NDArray and type(batch.label[0]) is mx.nd.NDArray
        assert it.provide_data[0].shape == (8, 1, 4, 4)
        it.close()


# -- d2l-style code, written as Dive into Deep Learning (MXNet edition) writes it --------------
def accuracy(y_hat, y):
    """Number of correct predictions (d2l.accuracy)."""
    if len(y_hat.shape) > 1 and y_hat.shape[1] > 1:
        y_hat = y_hat.argmax(axis=1)
    cmp = y_hat.astype(y.dtype) == y
    return float(cmp.astype(y.dtype).sum())


def evaluate_accuracy_gpu(net, data_iter, device=None):
    """Accuracy over a dataset (d2l.evaluate_accuracy_gpu)."""
    if not device:
        device = list(net.collect_params().values())[0].list_ctx()[0]
    correct, total = 0.0, 0
    for X, y in data_iter:
        X, y = X.as_in_ctx(device), y.as_in_ctx(device)
        correct, total = correct + accuracy(net(X), y), total + y.size
    return correct / total


def train_ch6(net, train_iter, test_iter, num_epochs, lr, device):
    """d2l.train_ch6, its plotting left out."""
    net.initialize(force_reinit=True, ctx=device, init=init.Xavier())
    loss = gluon.loss.SoftmaxCrossEntropyLoss()
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": lr})
    num_batches = len(train_iter)
    seen = 0
    for _epoch in range(num_epochs):
        batches = 0  # this epoch's, counted: an epoch of no batch must fail the assert
        for X, y in train_iter:
            X, y = X.as_in_ctx(device), y.as_in_ctx(device)
            with autograd.record():
                y_hat = net(X)
                batch_loss = loss(y_hat, y)
            batch_loss.backward()
            trainer.step(X.shape[0])
            seen += 1
            batches += 1
        assert batches == num_batches
    return evaluate_accuracy_gpu(net, test_iter), seen


def test_d2l_style_training_runs_unchanged(numpy_mode):
    device = mx.cpu()
    net = gluon.nn.Sequential()
    net.add(gluon.nn.Dense(16, activation="relu"), gluon.nn.Dense(CLASSES))
    train = gs.StreamLoader(gs.FunctionSource(range(4), patterns, cache_dir=None), batch_size=8,
                            shuffle=True, seed=0, shard_sizes=ROWS)
    test = gs.StreamLoader(gs.FunctionSource(range(10, 12), patterns, cache_dir=None),
                           batch_size=8, shard_sizes=ROWS)
    with train, test:
        test_acc, seen = train_ch6(net, train, test, num_epochs=4, lr=0.5, device=device)
    assert seen == 4 * 4 * ROWS // 8
    assert test_acc > 0.9
