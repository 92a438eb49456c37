"""Train a GluonCV model-zoo network on image shards generated on demand.

Each shard is a batch of synthetic images (``uint8`` arrays in HWC layout, as decoders and
cameras produce them) with integer labels, made by a Python function per key and cached as
``.npz``. Per sample, GluonCV's image transforms (random flip) and Gluon's
``ToTensor``/``Normalize`` run in the loader's DataLoader; a ``cifar_resnet20_v1`` from the
GluonCV model zoo (``pretrained=False``: nothing is downloaded) trains for an epoch.

    python examples/gluoncv_classification.py            # 8 shards of 256 images
    python examples/gluoncv_classification.py --tiny     # seconds, for CI

Needs GluonCV: pip install 'gluon_stream[examples]'.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from typing import Sequence

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon
from mxnet.gluon.data.vision import transforms

import gluon_stream as gs

NUM_CLASSES = 4
MEAN, STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)


def make_images(key: int, count: int, size: int):
    """``count`` HWC uint8 images whose class sets the dominant colour, plus labels."""
    rng = np.random.default_rng(key)
    labels = rng.integers(0, NUM_CLASSES, count)
    palette = np.array([[200, 40, 40], [40, 200, 40], [40, 40, 200], [200, 200, 40]], np.float32)
    images = palette[labels][:, None, None, :] + rng.normal(0, 40, (count, size, size, 3))
    return {"image": np.clip(images, 0, 255).astype(np.uint8),
            "label": labels.astype(np.float32)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, default=8, help="shards per epoch (default: 8)")
    parser.add_argument("--images", type=int, default=256,
                        help="images per shard (default: 256)")
    parser.add_argument("--size", type=int, default=32,
                        help="image height and width in pixels (default: 32)")
    parser.add_argument("--batch-size", type=int, default=64,
                        help="images per batch (default: 64)")
    parser.add_argument("--epochs", type=int, default=1, help="epochs (default: 1)")
    parser.add_argument("--tiny", action="store_true",
                        help="2 shards of 24 images, batches of 8: seconds (CI)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.shards, args.images, args.batch_size = 2, 24, 8
    try:
        from gluoncv import model_zoo
        from gluoncv.data.transforms import image as gcv_image
    except ImportError as exc:
        raise SystemExit(f"this example needs GluonCV ({exc}): "
                         "pip install 'gluon_stream[examples]'") from None

    to_tensor = transforms.Compose([transforms.ToTensor(), transforms.Normalize(MEAN, STD)])

    def train_transform(image: np.ndarray, label: np.float32):
        img = gcv_image.random_flip(mx.nd.array(image, dtype="uint8"), px=0.5)[0]
        return to_tensor(img), label

    net = model_zoo.get_model("cifar_resnet20_v1", classes=NUM_CLASSES, pretrained=False)
    net.initialize(mx.init.Xavier())
    net.hybridize()
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.05,
                                                          "momentum": 0.9})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    metric = mx.metric.Accuracy()

    with tempfile.TemporaryDirectory(prefix="gluoncv_example_") as cache_dir:
        source = gs.FunctionSource(range(args.shards),
                                   lambda k: make_images(k, args.images, args.size),
                                   cache_dir=cache_dir)
        with gs.StreamLoader(source, batch_size=args.batch_size, shuffle=True, seed=0,
                             sample_transform=train_transform, last_batch="discard",
                             prefetch=2) as loader:
            for epoch in range(args.epochs):
                loader.set_epoch(epoch)
                metric.reset()
                t0, seen = time.perf_counter(), 0
                for data, label in loader:
                    with autograd.record():
                        out = net(data)
                        loss = loss_fn(out, label)
                    loss.backward()
                    trainer.step(data.shape[0])
                    metric.update(label, out)
                    seen += data.shape[0]
                name, acc = metric.get()
                print(f"epoch {epoch}: {seen} images, train {name} {acc:.3f}, "
                      f"{seen / (time.perf_counter() - t0):,.0f} images/s")
            print(loader.stats.summary())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
