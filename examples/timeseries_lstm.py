"""Train a Gluon LSTM on time-series shards generated per date by an external program.

The motivating case of gluon_stream: for each date a generator program (here the built-in
``gluon_stream.tools.generator``, standing in for your C++ tool) writes a raw ``(rows, num_inputs)``
``.npy`` file. A transform, run in a background thread, cuts it into sliding windows
``(n, time_steps, num_inputs)`` and three labels (the next value of inputs 0 and 1, and
whether input 0 goes up). With ``context_rows=time_steps`` (the default here) the transform of a
date also receives the last ``time_steps`` rows of the dates before it, so windows span the
dates' boundaries: the dates yield exactly the windows one long series would (each epoch says how
many it gained), and a window may be longer than a date (``--time-steps`` above ``--rows``). A
gap in the dates starts the series afresh (``context_break``). An LSTM with one output per label
trains on the batches while the next dates are generated. Each epoch ends with an exact
validation pass over two held-out dates: ``even_batches='pad'`` gives every rank the same number
of full batches, and ``loader.pad`` says how many rows at the end of a batch are padding, so
each sample counts once.
With ``provenance=True`` the loader names each window's date and row, and each epoch prints
the window with the largest loss (where to look when the loss spikes).

    python examples/timeseries_lstm.py                 # 8 dates, 2 epochs
    python examples/timeseries_lstm.py --tiny          # seconds, for CI
"""
from __future__ import annotations

import argparse
import datetime
import tempfile
import time
from typing import Sequence

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import gluon_stream as gs
from gluon_stream.tools.generator import generator_command


def make_samples(raw: np.ndarray, time_steps: int):
    """Windows ``(n, time_steps, num_inputs)`` and three labels, from one raw shard (with
    ``context_rows=time_steps``, the rows before it first: a window, and its label, for each of
    the date's own rows)."""
    n = len(raw) - time_steps
    if n <= 0:  # fewer rows than a window and its label (a first date shorter than a window)
        return (np.zeros((0, time_steps, raw.shape[1]), raw.dtype),
                *(np.zeros(0, np.float32) for _ in range(3)))
    windows = np.lib.stride_tricks.sliding_window_view(raw[:-1], time_steps, axis=0)
    windows = np.ascontiguousarray(windows.transpose(0, 2, 1))[:n]
    nxt = raw[time_steps:]
    up = (nxt[:, 0] > raw[time_steps - 1:-1, 0]).astype(np.float32)
    return windows, np.ascontiguousarray(nxt[:, 0]), np.ascontiguousarray(nxt[:, 1]), up


class ThreeHeadLSTM(gluon.HybridBlock):
    """An LSTM over the window, then a Dense layer with one output per label."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.lstm = gluon.rnn.LSTM(hidden, layout="NTC")
        self.heads = gluon.nn.Dense(3)

    def hybrid_forward(self, F, x):
        out = self.lstm(x)  # (batch, time, hidden)
        last = F.squeeze(F.slice_axis(out, axis=1, begin=-1, end=None), axis=1)
        return self.heads(last)  # (batch, 3): next0, next1, up-logit


def worst_window(loader: gs.StreamLoader, loss: mx.nd.NDArray, worst: tuple | None
                 ) -> tuple | None:
    """(loss, date, window, epoch) of the largest per-sample loss so far: the window's date and
    its row in that date's windows, from ``loader.last_provenance`` (``provenance=True``)."""
    values = loss.asnumpy()
    i = int(values.argmax())
    if worst is not None and values[i] <= worst[0]:
        return worst
    origin = loader.last_provenance
    return float(values[i]), origin.keys[i], int(origin.rows[i]), int(origin.epochs[i])


def date_gap(previous: str, date: str) -> bool:
    """``context_break``: a series starts afresh after a missing date (no window spans it)."""
    days = (datetime.date.fromisoformat(date) - datetime.date.fromisoformat(previous)).days
    return days != 1


def validate(net: gluon.Block, source: gs.Source, args: argparse.Namespace,
             context: int) -> tuple[float, int]:
    """Exact mean squared error of the next-value heads on ``source``'s dates. On several
    ranks add ``num_parts='auto', part_index='auto'`` (read from the kvstore or the launcher):
    every rank then runs as many batches, and summing ``err`` and ``count`` over the ranks
    counts each sample once."""
    err, count = 0.0, 0
    with gs.StreamLoader(source, batch_size=args.batch_size, even_batches="pad",
                         transform=lambda raw: make_samples(raw, args.time_steps),
                         context_rows=context) as val:  # the held-out dates as one series
        for x, next0, next1, _ in val:
            real = x.shape[0] - val.pad  # the rows after these are padding
            out = net(x)[:real]
            err += float((((out[:, 0] - next0[:real]) ** 2).sum()
                          + ((out[:, 1] - next1[:real]) ** 2).sum()).asscalar())
            count += real
    return err / max(2 * count, 1), count


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dates", type=int, default=8,
                        help="dates (shards) per epoch (default: 8)")
    parser.add_argument("--rows", type=int, default=3000,
                        help="raw rows per date (default: 3000)")
    parser.add_argument("--inputs", type=int, default=8, help="input columns (default: 8)")
    parser.add_argument("--time-steps", type=int, default=24,
                        help="window length; with context it may exceed --rows (default: 24)")
    parser.add_argument("--no-context", action="store_true",
                        help="window each date alone (the windows across dates are lost)")
    parser.add_argument("--hidden", type=int, default=32, help="LSTM units (default: 32)")
    parser.add_argument("--epochs", type=int, default=2, help="epochs (default: 2)")
    parser.add_argument("--batch-size", type=int, default=128,
                        help="windows per batch (default: 128)")
    parser.add_argument("--delay", type=float, default=0.2,
                        help="seconds the generator sleeps per date (default: 0.2)")
    parser.add_argument("--tiny", action="store_true",
                        help="3 dates of 150 rows, no delay: seconds (CI)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.dates, args.rows, args.inputs, args.time_steps = 3, 150, 3, 8
        args.hidden, args.batch_size, args.delay = 8, 32, 0.0

    first = datetime.date(2024, 1, 1)
    days = [(first + datetime.timedelta(days=i)).isoformat() for i in range(args.dates + 2)]
    dates, held_out = days[:-2], days[-2:]
    net = ThreeHeadLSTM(args.hidden)
    net.initialize(mx.init.Xavier())
    trainer = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": 3e-3})
    l2, bce = gluon.loss.L2Loss(), gluon.loss.SigmoidBinaryCrossEntropyLoss()

    with tempfile.TemporaryDirectory(prefix="timeseries_lstm_") as cache_dir:
        command = generator_command(args.rows, args.inputs, args.delay)
        source = gs.CommandSource(dates, command, cache_dir=cache_dir, timeout=120, retries=1)
        context = 0 if args.no_context else args.time_steps  # a window and its label's rows
        alone = len(dates) * max(0, args.rows - args.time_steps)  # each date windowed alone
        with gs.StreamLoader(source, batch_size=args.batch_size, shuffle=True, seed=0,
                             transform=lambda raw: make_samples(raw, args.time_steps),
                             context_rows=context, context_break=date_gap if context else None,
                             last_batch="rollover", prefetch=2, producers=2,
                             provenance=True) as loader:
            for epoch in range(args.epochs):
                loader.set_epoch(epoch)
                t0, total, seen = time.perf_counter(), 0.0, 0
                worst = None  # the window with the largest loss (provenance)
                for x, next0, next1, up in loader:
                    with autograd.record():
                        out = net(x)
                        loss = (l2(out[:, 0], next0) + l2(out[:, 1], next1)
                                + bce(out[:, 2], up))
                    loss.backward()
                    trainer.step(x.shape[0])
                    total += float(loss.sum().asscalar())
                    seen += x.shape[0]
                    worst = worst_window(loader, loss, worst)
                wall = time.perf_counter() - t0
                mse, count = validate(net, gs.CommandSource(held_out, command, cache_dir=cache_dir,
                                                            timeout=120, retries=1), args,
                                      context)
                made = sum(r.samples for r in loader.stats.shards if r.epoch == epoch)
                print(f"epoch {epoch}: {made} windows made ({made - alone:+d} against each date "
                      f"windowed alone), {seen} trained, loss {total / max(seen, 1):.4f}, "
                      f"{seen / wall:,.0f} samples/s; validation MSE {mse:.4f} over {count}")
                if worst is not None:
                    print(f"  largest loss {worst[0]:.3f}: date {worst[1]}, window {worst[2]} "
                          f"(made for epoch {worst[3]})")
            print(loader.stats.summary())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
