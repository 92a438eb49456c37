"""gluon_stream in place of gluon.data.DataLoader or an mx.io iterator, in training code shaped
like GluonCV's CIFAR script and MXNet's Module examples (written here, on a few batches)."""
from __future__ import annotations

import logging

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon
from mxnet.gluon.data.vision import transforms

import gluon_stream as gs

pytestmark = pytest.mark.mxnet  # these tests use MXNet: warm its engine first

CLASSES = 4


def cifar_like(key):
    """32x32x3 uint8 images (class sets the colour) and float labels, as a decoder gives them."""
    rng = np.random.default_rng(key)
    labels = rng.integers(0, CLASSES, 24)
    palette = np.array([[200, 40, 40], [40, 200, 40], [40, 40, 200], [200, 200, 40]], np.float32)
    images = palette[labels][:, None, None, :] + rng.normal(0, 30, (24, 32, 32, 3))
    return np.clip(images, 0, 255).astype(np.uint8), labels.astype(np.float32)


def test_a_gluoncv_cifar_style_training_loop():
    gcv_transforms = pytest.importorskip("gluoncv.data.transforms")
    transform_train = transforms.Compose([
        gcv_transforms.RandomCrop(32, pad=4),  # calls x.asnumpy(): it needs NDArrays
        transforms.RandomFlipLeftRight(),
        transforms.ToTensor(),
        transforms.Normalize([0.4914, 0.4822, 0.4465], [0.2023, 0.1994, 0.2010])])
    contexts = [mx.cpu(0), mx.cpu(1)]
    batch_size, epochs = 8, 2

    src = gs.FunctionSource(range(3), cifar_like, cache_dir=None)
    train_data = gs.StreamLoader(src, batch_size=batch_size, shuffle=True, seed=0,
                                 last_batch="discard", num_workers=2,
                                 sample_transform=lambda image, label: (transform_train(image),
                                                                        label),
                                 shard_sizes=24)
    with train_data:
        num_batch = len(train_data)  # before the first pass: the LR schedule needs it
        assert num_batch == 3 * 24 // batch_size
        schedule = mx.lr_scheduler.CosineScheduler(max_update=epochs * num_batch, base_lr=0.1)
        net = gluon.nn.HybridSequential()
        net.add(gluon.nn.Conv2D(8, 3, padding=1, activation="relu"), gluon.nn.GlobalAvgPool2D(),
                gluon.nn.Dense(CLASSES))
        net.initialize(mx.init.Xavier(), ctx=contexts)
        net.hybridize()
        trainer = gluon.Trainer(net.collect_params(), "sgd", {"lr_scheduler": schedule,
                                                              "momentum": 0.9})
        loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
        metric = mx.metric.Accuracy()
        seen = []
        for epoch in range(epochs):
            train_data.set_epoch(epoch)
            metric.reset()
            count = 0
            for data, label in train_data:
                assert data.shape == (batch_size, 3, 32, 32) and data.dtype == np.float32
                parts = gluon.utils.split_and_load(data, ctx_list=contexts, batch_axis=0)
                labels = gluon.utils.split_and_load(label, ctx_list=contexts, batch_axis=0)
                with autograd.record():
                    outputs = [net(x) for x in parts]
                    losses = [loss_fn(o, y) for o, y in zip(outputs, labels)]
                for loss in losses:
                    loss.backward()
                trainer.step(batch_size)
                metric.update(labels, outputs)
                count += 1
            seen.append(count)
        assert seen == [num_batch] * epochs  # len() told the truth, every epoch
        assert trainer.learning_rate < 0.1  # the schedule moved, from len()
        assert 0.0 <= metric.get()[1] <= 1.0


def test_the_gluoncv_example_with_ctx_puts_batches_on_both_devices():
    contexts = [mx.cpu(0), mx.cpu(1)]
    to_tensor = transforms.Compose([transforms.ToTensor(), transforms.Normalize(0.5, 0.25)])
    with gs.StreamLoader(gs.FunctionSource(range(2), cifar_like), batch_size=8,
                         sample_transform=lambda im, lb: (to_tensor(im), lb), ctx=contexts,
                         last_batch="discard") as loader:
        for data, label in loader:
            assert [str(d.context) for d in data] == ["cpu(0)", "cpu(1)"]
            assert [d.shape[0] for d in data] == [4, 4] and len(label) == 2


def features(key, rows=60):
    rng = np.random.default_rng(key)
    weights = np.random.default_rng(7).standard_normal((10, 3))
    x = rng.standard_normal((rows, 10)).astype(np.float32)
    return x, (x @ weights).argmax(axis=1).astype(np.float32)


def test_a_module_example_style_fit_score_predict(caplog):
    data = mx.sym.Variable("data")
    net = mx.sym.FullyConnected(data, num_hidden=16, name="fc1")
    net = mx.sym.Activation(net, act_type="relu")
    net = mx.sym.FullyConnected(net, num_hidden=3, name="fc2")
    net = mx.sym.SoftmaxOutput(net, name="softmax")
    with gs.StreamLoader(gs.FunctionSource(range(4), features), batch_size=20, shuffle=True,
                         seed=3) as train, \
            gs.StreamLoader(gs.FunctionSource([100], lambda k: features(k, 30)),
                            batch_size=20) as val:
        train_iter, val_iter = gs.StreamIter(train), gs.StreamIter(val)
        mod = mx.mod.Module(net, context=mx.cpu())
        with caplog.at_level(logging.INFO):
            mod.fit(train_iter, eval_data=val_iter, optimizer="adam",
                    optimizer_params={"learning_rate": 0.02}, eval_metric="acc",
                    num_epoch=3, initializer=mx.init.Xavier(),
                    batch_end_callback=mx.callback.Speedometer(20, 2))
        assert any("Validation-accuracy" in r.getMessage() for r in caplog.records)
        assert [e.epoch for e in train.stats.epochs] == [0, 1, 2]
        (_, accuracy), = mod.score(val_iter, "acc")
        val_iter.reset()
        predictions = mod.predict(val_iter)
        assert predictions.shape == (30, 3)  # the padded last batch trimmed by predict
        assert accuracy > 0.4
        train_iter.close()
        val_iter.close()
