"""A small built-in shard generator, run as a real external process by the demo and the bench.

It stands in for a user's C++ program: given a key (a date), it optionally sleeps (the
cost of producing data), then writes a deterministic raw time series of shape
``(rows, num_inputs)`` float32 to ``--out``::

    python -m gluon_stream.tools.generator --key 2024-01-01 --out shard.npy --rows 5000 --delay 0.2

``--delay-factor KEY:FACTOR`` makes one key sleep ``FACTOR`` times ``--delay`` (a straggler: a
date whose data takes longer to produce); ``--epoch`` makes the series differ per epoch (data
produced anew every epoch, e.g. augmented, as ``{epoch}`` in a CommandSource's command does).

:func:`make_windows` is the matching transform: sliding windows ``(n, time_steps, num_inputs)``
plus labels, the time-series case gluon_stream was built for.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import zlib
from typing import Mapping, Sequence

import numpy as np

__all__ = ["generate", "generator_command", "make_windows"]


def generate(key: str, rows: int, num_inputs: int, epoch: int | None = None) -> np.ndarray:
    """The deterministic raw series for ``key`` (and ``epoch``, if given): a noisy sum of sines
    per input column."""
    seed = zlib.crc32(key.encode("utf-8"))
    rng = np.random.default_rng(seed if epoch is None else [seed, epoch])
    t = np.arange(rows, dtype=np.float32)[:, None]
    freq = rng.uniform(0.01, 0.2, size=(1, num_inputs)).astype(np.float32)
    phase = rng.uniform(0, 2 * np.pi, size=(1, num_inputs)).astype(np.float32)
    noise = rng.standard_normal((rows, num_inputs), dtype=np.float32) * np.float32(0.1)
    return np.sin(t * freq + phase) + noise


def make_windows(raw: np.ndarray, time_steps: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """Sliding windows ``(n, time_steps, num_inputs)`` and the next value of column 0 as label.

    Both are read-only views of ``raw`` (no copy): the loader's one copy of the shard into its
    NDArray reads them a few MB at a time, so no whole-shard temporary is made (a transform
    that returns ``np.ascontiguousarray(...)`` holds the shard twice while it is copied).
    """
    n = len(raw) - time_steps
    if n <= 0:
        return (np.empty((0, time_steps, raw.shape[1]), raw.dtype), np.empty((0,), raw.dtype))
    windows = np.lib.stride_tricks.sliding_window_view(raw[:-1], time_steps, axis=0)
    return windows.transpose(0, 2, 1), raw[time_steps:, 0]


def generator_command(rows: int, num_inputs: int, delay: float = 0.0, *,
                      delay_factors: Mapping[str, float] | None = None,
                      per_epoch: bool = False) -> list[str]:
    """The argv of this generator for a :class:`~gluon_stream.CommandSource`.

    ``delay_factors``: ``{key: factor}``, keys that sleep ``factor * delay`` (stragglers).
    ``per_epoch``: the series differs per epoch (``{epoch}`` in the argv: the source makes and
    caches shards per epoch). The script runs by path, not ``-m``, so the child never imports
    MXNet (a second of start-up).
    """
    argv = [sys.executable, os.path.abspath(__file__), "--key", "{key}", "--out", "{path}",
            "--rows", str(rows), "--inputs", str(num_inputs), "--delay", str(delay)]
    for key, factor in (delay_factors or {}).items():
        argv += ["--delay-factor", f"{key}:{float(factor)!r}"]
    if per_epoch:
        argv += ["--epoch", "{epoch}"]
    return argv


def _delay_factor(text: str) -> tuple[str, float]:
    key, sep, factor = text.rpartition(":")
    try:
        value = float(factor)
    except ValueError:
        value = -1.0
    if not sep or value < 0:
        raise argparse.ArgumentTypeError(f"expected KEY:FACTOR with FACTOR >= 0, got {text!r}")
    return key, value


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gluon_stream.tools.generator",
                                     description="Write one deterministic raw shard (.npy).")
    parser.add_argument("--key", required=True, help="shard key, e.g. a date")
    parser.add_argument("--out", required=True, help="path of the .npy file to write")
    parser.add_argument("--rows", type=int, default=2000, help="time steps in the raw series")
    parser.add_argument("--inputs", type=int, default=8, help="input columns")
    parser.add_argument("--delay", type=float, default=0.0, help="seconds to sleep first")
    parser.add_argument("--delay-factor", type=_delay_factor, action="append", default=[],
                        metavar="KEY:FACTOR",
                        help="key KEY sleeps FACTOR times --delay (repeatable)")
    parser.add_argument("--epoch", type=int, default=None,
                        help="make the series of this epoch (default: the same every epoch)")
    args = parser.parse_args(argv)
    delay = args.delay * dict(args.delay_factor).get(args.key, 1.0)
    if delay > 0:
        time.sleep(delay)
    with open(args.out, "wb") as fp:
        np.save(fp, generate(args.key, args.rows, args.inputs, args.epoch))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
