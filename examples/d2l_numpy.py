"""Gluon's numpy API, as *Dive into Deep Learning* (MXNet edition) writes it, on streamed shards.

The book's code starts with ``npx.set_np()``: blocks then take ``mx.np.ndarray`` and its
training functions call ``X.as_in_ctx(device)``, ``len(train_iter)`` and an accuracy over a
test iterator. A ``StreamLoader`` is a drop-in for ``gluon.data.DataLoader`` there: under
``set_np()`` it hands out ``mx.np.ndarray``. The functions below are the book's
``train_ch6``/``evaluate_accuracy_gpu`` (plotting left out), unchanged but for the loaders;
the data are 1x16x16 images made per shard (each class lights one band), per-sample
augmentation runs in worker processes with Gluon's numpy-mode transforms.

    python examples/d2l_numpy.py            # 6 training shards of 256 images, 5 epochs
    python examples/d2l_numpy.py --tiny     # seconds, for CI
"""
from __future__ import annotations

import argparse
import time
from typing import Sequence

import numpy as np
from mxnet import autograd, gluon, init, npx
from mxnet.gluon.data.vision import transforms

import gluon_stream as gs

npx.set_np()

CLASSES = 4
SIZE = 16


def make_images(key: int, count: int):
    """``count`` uint8 HWC images whose class lights one horizontal band, and int32 labels."""
    rng = np.random.default_rng(key)
    labels = rng.integers(0, CLASSES, count)
    images = rng.normal(60, 25, (count, SIZE, SIZE, 1))
    band = SIZE // CLASSES
    for c in range(CLASSES):
        images[labels == c, c * band:(c + 1) * band] += 120
    return np.clip(images, 0, 255).astype(np.uint8), labels.astype(np.int32)


def accuracy(y_hat, y):
    """Number of correct predictions (d2l.accuracy)."""
    if len(y_hat.shape) > 1 and y_hat.shape[1] > 1:
        y_hat = y_hat.argmax(axis=1)
    cmp = y_hat.astype(y.dtype) == y
    return float(cmp.astype(y.dtype).sum())


def evaluate_accuracy_gpu(net, data_iter, device=None):
    """Accuracy of a model over a dataset (d2l.evaluate_accuracy_gpu)."""
    if not device:
        device = list(net.collect_params().values())[0].list_ctx()[0]
    correct, total = 0.0, 0
    for X, y in data_iter:
        X, y = X.as_in_ctx(device), y.as_in_ctx(device)
        correct += accuracy(net(X), y)
        total += y.size
    return correct / total


def train_ch6(net, train_iter, test_iter, num_epochs, lr, device):
    """d2l.train_ch6, printing instead of plotting."""
    net.initialize(force_reinit=True, ctx=device, init=init.Xavier())
    loss = gluon.loss.SoftmaxCrossEntropyLoss()
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": lr})
    num_batches = len(train_iter)
    for epoch in range(num_epochs):
        train_iter.set_epoch(epoch)  # a StreamLoader's shuffle follows the epoch
        start, loss_sum, correct, seen = time.perf_counter(), 0.0, 0.0, 0
        batches = 0
        for X, y in train_iter:
            X, y = X.as_in_ctx(device), y.as_in_ctx(device)
            with autograd.record():
                y_hat = net(X)
                batch_loss = loss(y_hat, y)
            batch_loss.backward()
            trainer.step(X.shape[0])
            batches += 1
            loss_sum += float(batch_loss.sum())
            correct += accuracy(y_hat, y)
            seen += X.shape[0]
        test_acc = evaluate_accuracy_gpu(net, test_iter)
        print(f"epoch {epoch}: {batches} of {num_batches} batches, loss {loss_sum / seen:.3f}, "
              f"train acc {correct / seen:.3f}, test acc {test_acc:.3f}, "
              f"{seen / (time.perf_counter() - start):,.0f} examples/s")
    return test_acc


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=6, help="training shards (default: 6)")
    parser.add_argument("--images", type=int, default=256, help="images per shard")
    parser.add_argument("--epochs", type=int, default=5, help="epochs (default: 5)")
    parser.add_argument("--batch-size", type=int, default=64, help="default: 64")
    parser.add_argument("--tiny", action="store_true",
                        help="3 shards of 64 images, 3 epochs, batches of 16: seconds (CI)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.shards, args.images, args.epochs, args.batch_size = 3, 64, 3, 16

    augment = transforms.Compose([transforms.RandomFlipLeftRight(), transforms.ToTensor()])
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(6, kernel_size=3, padding=1, activation="relu"),
            gluon.nn.MaxPool2D(pool_size=2, strides=2),
            gluon.nn.Dense(32, activation="relu"), gluon.nn.Dense(CLASSES))
    train = gs.FunctionSource(range(args.shards), lambda k: make_images(k, args.images),
                              cache_dir=None)
    test = gs.FunctionSource(range(1000, 1002), lambda k: make_images(k, args.images),
                             cache_dir=None)
    with gs.StreamLoader(train, batch_size=args.batch_size, shuffle=True, seed=0,
                         shard_sizes=args.images, num_workers=2, sample_format="ndarray",
                         sample_transform=lambda x, y: (augment(x), y)) as train_iter, \
            gs.StreamLoader(test, batch_size=args.batch_size, shard_sizes=args.images,
                            transform=as_tensors) as test_iter:
        test_acc = train_ch6(net, train_iter, test_iter, args.epochs, lr=0.3,
                             device=npx.cpu())
        X, y = next(iter(test_iter))
    print(f"batches: {type(X).__module__}.{type(X).__name__} {X.shape}, "
          f"final test acc {test_acc:.3f}")
    return 0


def as_tensors(arrays):
    """A whole test shard as ``ToTensor`` makes each image (CHW, float32 in [0, 1]), in numpy,
    once per shard in a producer thread: the test batches are then slices, no per-sample work."""
    images, labels = arrays
    return images.transpose(0, 3, 1, 2).astype(np.float32) / 255.0, labels


if __name__ == "__main__":
    raise SystemExit(main())
