"""Training metrics out of ``loader.stats``: to TensorBoard, or to any callback, every N batches.

What every data loader's user ends up hand-coding (how long the loop waited for data, how fast
samples arrive) is already measured by :class:`~gluon_stream.Stats`. A
:class:`MetricsExporter` reads it every ``every`` batches of this rank and sends one
:class:`Metrics` record of the batches since the last one: to a callback (W&B, MLflow, a log
line), and/or as scalars to TensorBoard (through ``tensorboardX``: ``pip install
'gluon_stream[tensorboard]'``, or any writer with ``add_scalar(tag, value, step)``). It reads
the stats only: nothing in the loader changes, and nothing here imports MXNet.
"""
from __future__ import annotations

import logging
import os
import weakref
from dataclasses import asdict, dataclass
from typing import Any, Callable, Protocol

from ._utils import validate as _validate
from ._utils.closing import Closing
from .records import EpochRecord, TuningRecord
from .stats import Stats

__all__ = ["Metrics", "MetricsExporter", "ScalarWriter"]

logger = logging.getLogger(__name__)

TENSORBOARD_HINT = "pip install 'gluon_stream[tensorboard]' (tensorboardX)"
PREFIX = "gluon_stream"


class ScalarWriter(Protocol):
    """What a TensorBoard writer offers: ``tensorboardX.SummaryWriter`` and
    ``torch.utils.tensorboard.SummaryWriter`` both do."""

    def add_scalar(self, tag: str, scalar_value: float, global_step: int | None = None
                   ) -> Any: ...

    def flush(self) -> Any: ...


@dataclass(frozen=True)
class Metrics:
    """What the loader measured over the batches since the last export, on one rank.

    Attributes:
        rank: This rank's part (``part_index``; 0 on a single process).
        step: Batches this rank's loop took since the exporter was made (TensorBoard's step).
        epoch: The epoch of the latest batch.
        batches: Batches in this interval.
        samples: Samples in this interval.
        wall_s: Seconds since the last export (or since the exporter was made), on the
            stats' clock.
        stall_share: Share of ``wall_s`` the loop waited for data (0: never waited; time
            between epochs counts as time not waited).
        samples_per_s: ``samples / wall_s``.
        shards: Shards produced in this interval (cache hits included).
        generate_s, load_s, transform_s: Mean seconds per shard produced in this interval
            (0.0 when none was).
        tuning: The changes ``memory_budget``'s tuner made in this interval.
    """

    rank: int
    step: int
    epoch: int
    batches: int
    samples: int
    wall_s: float
    stall_share: float
    samples_per_s: float
    shards: int
    generate_s: float
    load_s: float
    transform_s: float
    tuning: tuple[TuningRecord, ...] = ()

    def scalars(self) -> dict[str, float]:
        """The numbers as TensorBoard tags (``gluon_stream/stall_share``, ...), tuning changes
        as ``gluon_stream/tuning/<setting>`` (the setting's new value)."""
        skip = {"rank", "step", "tuning"}
        out = {f"{PREFIX}/{k}": float(v) for k, v in asdict(self).items() if k not in skip}
        for change in self.tuning:
            out[f"{PREFIX}/tuning/{change.setting}"] = float(change.new)
        return out


class MetricsExporter(Closing):
    """Send what ``loader.stats`` measures to TensorBoard and/or a callback every ``every`` batches.

    Call :meth:`step` once per batch in the training loop. Every ``every`` calls (and at
    :meth:`close`, for the batches left) it builds a :class:`Metrics` of the batches since the
    last export and sends it on. Run one per rank: each reads its own loader's stats, tagged
    with its rank.

    Args:
        loader: A :class:`~gluon_stream.StreamLoader` (or a :class:`~gluon_stream.Stats`).
        every: Batches between exports.
        callback: Called with each :class:`Metrics` (e.g. ``lambda m: wandb.log(m.scalars(),
            step=m.step)``).
        tensorboard: A log directory (a ``tensorboardX.SummaryWriter`` writes into
            ``<dir>/rank<r>`` and is closed with the exporter), or a writer of your own with
            ``add_scalar`` (flushed at each export, closed by you).
        rank: This rank's number (default: the loader's ``part_index``, or 0).

    Example:
        >>> seen = []
        >>> stats = Stats()
        >>> with MetricsExporter(stats, every=2, callback=seen.append) as metrics:
        ...     for batch in range(5):
        ...         _ = metrics.step()  # once per batch
        >>> [m.step for m in seen]
        [2, 4, 5]
    """

    def __init__(self, loader: Any, *, every: int = 100,
                 callback: Callable[[Metrics], Any] | None = None,
                 tensorboard: str | os.PathLike | ScalarWriter | None = None,
                 rank: int | None = None) -> None:
        self.every = _validate.integer("every", every, minimum=1)
        _validate.callable_or_none("callback", callback)
        self.stats: Stats = loader if isinstance(loader, Stats) else loader.stats
        stream = getattr(loader, "stream", None)
        self.rank = rank if rank is not None else int(getattr(stream, "part_index", 0) or 0)
        self.callback = callback
        self.writer, owned = _writer(tensorboard, self.rank)
        self.step_count = 0
        self._exported = 0  # step of the last export
        self._reading = _Reading(self.stats)
        self._closed = False
        self._finalizer = weakref.finalize(self, _close_writer, self.writer if owned else None)

    def step(self, batches: int = 1) -> Metrics | None:
        """Count ``batches`` the loop took; export when ``every`` have passed since the last
        export. Returns what was exported, or None."""
        self.step_count += batches
        if self.step_count - self._exported >= self.every:
            return self.export()
        return None

    def export(self) -> Metrics:
        """Build and send the :class:`Metrics` of the batches since the last export, now."""
        metrics = self._reading.take(self.rank, self.step_count)
        self._exported = self.step_count
        if self.writer is not None:
            for tag, value in metrics.scalars().items():
                self.writer.add_scalar(tag, value, metrics.step)
            add_text = getattr(self.writer, "add_text", None)
            if add_text is not None:  # the tuner's reasons, as text beside its scalars
                for change in metrics.tuning:
                    add_text(f"{PREFIX}/tuning", f"{change.setting}: {change.old} -> "
                                                 f"{change.new} ({change.reason})", metrics.step)
            self.writer.flush()
        if self.callback is not None:
            self.callback(metrics)
        return metrics

    def close(self) -> None:
        """Export the batches since the last export (if any), then close a writer made here;
        idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.step_count > self._exported:
                self.export()
        finally:
            self._finalizer()


class _Reading:
    """Differences of the stats between two exports: per epoch record (the loop's batches,
    samples and waits), over the totals of every shard produced, and on the stats' clock."""

    def __init__(self, stats: Stats) -> None:
        self.stats = stats
        self._time = stats.clock()
        self._epochs: dict[int, tuple[int, int, float]] = {}
        self._shards = self._shard_totals()
        self._tuning = len(stats.tuning)
        self._last_tuning = stats.tuning[-1] if stats.tuning else None
        for record in list(stats.epochs):
            self._epochs[id(record)] = _loop(record)

    def _shard_totals(self) -> tuple[int, float, float, float]:
        totals = self.stats.totals_produced
        return (totals.produced, totals.generate_s, totals.load_s, totals.transform_s)

    def take(self, rank: int, step: int) -> Metrics:
        batches = samples = 0
        stall = 0.0
        epoch = 0
        seen: dict[int, tuple[int, int, float]] = {}
        for record in list(self.stats.epochs):
            now = _loop(record)
            before = self._epochs.get(id(record), (0, 0, 0.0))
            seen[id(record)] = now
            batches += now[0] - before[0]
            samples += now[1] - before[1]
            stall += now[2] - before[2]
            if now[0] > before[0]:
                epoch = record.epoch
        self._epochs = seen
        time_now = self.stats.clock()
        wall, self._time = max(0.0, time_now - self._time), time_now
        shards = self._shard_totals()
        made = shards[0] - self._shards[0]
        means = [(shards[i] - self._shards[i]) / made if made else 0.0 for i in (1, 2, 3)]
        self._shards = shards
        return Metrics(rank=rank, step=step, epoch=epoch, batches=batches, samples=samples,
                       wall_s=wall, stall_share=min(1.0, stall / wall) if wall > 0 else 0.0,
                       samples_per_s=samples / wall if wall > 0 else 0.0, shards=made,
                       generate_s=means[0], load_s=means[1], transform_s=means[2],
                       tuning=self._new_tuning())

    def _new_tuning(self) -> tuple[TuningRecord, ...]:
        """The tuner's records after the last one exported (the deque keeps the latest)."""
        records = list(self.stats.tuning)
        start = 0
        if self._last_tuning is not None:
            for i in range(len(records) - 1, -1, -1):
                if records[i] is self._last_tuning:
                    start = i + 1
                    break
        if records:
            self._last_tuning = records[-1]
        return tuple(records[start:])


def _loop(record: EpochRecord) -> tuple[int, int, float]:
    return record.batches, record.samples, record.stall_s


def _writer(tensorboard: Any, rank: int) -> tuple[Any, bool]:
    """(the writer, whether it was made here) for ``tensorboard=``."""
    if tensorboard is None:
        return None, False
    if hasattr(tensorboard, "add_scalar"):
        return tensorboard, False
    if not isinstance(tensorboard, (str, os.PathLike)):
        raise TypeError(f"tensorboard must be a log directory or a writer with add_scalar(), "
                        f"got {type(tensorboard).__name__}")
    try:
        from tensorboardX import SummaryWriter
    except ImportError as exc:
        raise ImportError(f"tensorboard={os.fspath(tensorboard)!r} writes with tensorboardX: "
                          f"{TENSORBOARD_HINT}, or pass a writer of your own") from exc
    logdir = os.path.join(os.fspath(tensorboard), f"rank{rank}")
    logger.info("writing loader metrics for TensorBoard into %s", logdir)
    return SummaryWriter(logdir), True


def _close_writer(writer: Any) -> None:
    if writer is not None:
        writer.close()
