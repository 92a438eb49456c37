"""Where each sample of a batch came from (``StreamLoader(provenance=True)``).

A sample's origin is its shard's key, its row in that shard's raw output (the row of the
transform's output, before any shuffle or rank took its part), and the epoch the shard was made
for. The planned batch already names its samples as segments of units (see
:mod:`~gluon_stream._stages.batching`); a unit's read order to raw rows is the shard's row
order (:class:`ShardOrigin`, kept on the :class:`~gluon_stream.Shard` where it is made) or, for
a shuffle window's mixed unit, each sample's shard and row in that shard's read order. So the
whole cost is a few dictionary lookups per batch; the arrays are built only when
:attr:`ProvenanceTracker.last` is read. Without ``provenance=True`` none of this runs.

Example:
    >>> import numpy as np
    >>> from gluon_stream import FunctionSource, StreamLoader
    >>> src = FunctionSource(range(2), lambda k: np.arange(3.0) + 10 * k)
    >>> with StreamLoader(src, batch_size=4, provenance=True) as loader:
    ...     for batch in loader:
    ...         print(loader.last_provenance.samples())
    [(0, 0, 0), (0, 1, 0), (0, 2, 0), (1, 0, 0)]
    [(1, 1, 0), (1, 2, 0)]
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence, Union

import numpy as np

from .batching import MixedUnit, Position, Segment
from .produce import Shard, ShardOrigin

__all__ = ["Provenance", "ProvenanceTracker"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Provenance:
    """The origin of every row of one batch, in the batch's row order.

    Attributes:
        keys: Each row's shard key.
        rows: Each row's index in its shard's raw output (the transform's output, before the
            shuffle and before ranks took their part), int64.
        epochs: The epoch each row's shard was made for (what the source and transform were
            called with), int64.
        padding: True where the row is padding: rows ``even_batches='pad'`` added to a short
            batch (copies of the batch's first rows), and every row of a batch that
            ``even_batches`` repeats (or borrows) to keep the ranks' step counts equal.
            Keys and rows still name the data of a padding row (a copy of a real one).

    The arrays are read-only.
    """

    keys: tuple
    rows: np.ndarray
    epochs: np.ndarray
    padding: np.ndarray

    def __len__(self) -> int:
        return len(self.keys)

    def samples(self, padding: bool = False) -> list[tuple[Any, int, int]]:
        """``(key, row, epoch)`` of each row, padding rows left out unless ``padding``."""
        keep = np.ones(len(self), bool) if padding else ~self.padding
        return [(self.keys[i], int(self.rows[i]), int(self.epochs[i]))
                for i in np.flatnonzero(keep).tolist()]


class _MixedOrigin:
    """A shuffle window's unit: each sample's shard position and row in its read order, traced
    back for the whole unit the first time a batch of it is read (then sliced per batch)."""

    def __init__(self, shards: np.ndarray, rows: np.ndarray,
                 origins: dict[int, ShardOrigin]) -> None:
        self.shards, self.rows, self.origins = shards, rows, origins
        self._traced: tuple[list, np.ndarray, np.ndarray, np.ndarray] | None = None

    def traced(self) -> tuple[list, np.ndarray, np.ndarray, np.ndarray]:
        """(keys by index, each sample's key index, raw row, epoch)."""
        if self._traced is None:
            positions = sorted(self.origins)
            which = np.searchsorted(np.asarray(positions, np.int64), self.shards)
            rows = np.empty(len(self.shards), np.int64)
            epochs = np.empty(len(self.shards), np.int64)
            for i, j in enumerate(positions):
                m = which == i
                rows[m] = self.origins[j].raw_rows(self.rows[m])
                epochs[m] = self.origins[j].epoch
            self._traced = ([self.origins[j].key for j in positions], which, rows, epochs)
        return self._traced


_Origin = Union[ShardOrigin, _MixedOrigin]
_UNKNOWN = ShardOrigin(None, -1, np.zeros(0, np.int64))


@dataclass(frozen=True)
class _Pending:
    """The last batch's segments with their units' origins; built into a record when read."""

    parts: tuple[tuple[Any, _Origin], ...]  # (segment, its unit's origin)
    pad: int = 0  # rows of padding after the real ones
    repeated: bool = False  # every row is padding


class ProvenanceTracker:
    """The origin of every unit a batch may still read, and of the last batch yielded.

    Units are registered as they are handed out or rebuilt for a resume (``shard``,
    ``mixed``) and let go of with the same rule as the sources a mix counts
    (``forget_before``); a delivered batch notes its segments' origins (``delivered``).
    """

    def __init__(self) -> None:
        self._units: dict[tuple[int, int], _Origin] = {}
        self._last: _Pending | None = None
        self._built: Provenance | None = None

    # -- units --------------------------------------------------------------------------
    def shard(self, epoch: int, unit: int, shard: Shard) -> None:
        self._units[(epoch, unit)] = _origin_of(shard)

    def mixed(self, epoch: int, unit: MixedUnit, shards: dict[int, Shard]) -> None:
        """A shuffle window's unit, and the shards it reads by their position in the epoch."""
        origins = {j: _origin_of(s) for j, s in shards.items()}
        self._units[(epoch, unit.index)] = _MixedOrigin(unit.shards, unit.rows, origins)

    def forget_before(self, position: Position) -> None:
        """No batch reads units before ``position``'s unit or its carried segments any more."""
        first = min([(position.epoch, position.unit)]
                    + [(s.epoch, s.unit) for s in position.carry])
        for unit in [u for u in self._units if u < first]:
            del self._units[unit]

    # -- batches ------------------------------------------------------------------------
    def delivered(self, segments: Sequence[Segment], pad: int = 0) -> None:
        """A batch of ``segments`` was yielded, ``pad`` rows of padding after them."""
        units = self._units
        self._set(_Pending(tuple((s, units.get((s.epoch, s.unit), _UNKNOWN))
                                 for s in segments), pad))

    def repeated(self) -> None:
        """The last batch is yielded again, all of it padding (``even_batches``)."""
        if self._last is not None:
            last = self._last
            self._set(_Pending(last.parts, last.pad, True))

    def borrowed(self, shard: Shard, rows: int, batch_size: int) -> None:
        """A batch of another shard's first ``rows`` rows cycled to ``batch_size``, all of it
        padding (a part with no batch of its own to repeat)."""
        segment = Segment(shard.epoch, -1, 0, rows, shard.key)
        self._set(_Pending(((segment, _origin_of(shard)),), batch_size - rows, True))

    def _set(self, pending: _Pending) -> None:
        self._last, self._built = pending, None

    @property
    def last(self) -> Provenance | None:
        """The record of the last batch yielded (None before the first)."""
        if self._built is None and self._last is not None:
            self._built = _build(self._last)
        return self._built


def _origin_of(shard: Shard) -> ShardOrigin:
    origin = shard.origin
    return origin if origin is not None else ShardOrigin(shard.key, shard.epoch)


def _build(pending: _Pending) -> Provenance:
    keys: list = []
    rows, epochs = [], []
    for seg, origin in pending.parts:
        k, r, e = _segment(seg, origin)
        keys.extend(k)
        rows.append(r)
        epochs.append(e)
    n = len(keys)
    row = rows[0] if len(rows) == 1 else np.concatenate(rows) if rows else np.zeros(0, np.int64)
    epoch = epochs[0] if len(epochs) == 1 else \
        np.concatenate(epochs) if epochs else np.zeros(0, np.int64)
    padding = np.zeros(n, bool)
    if pending.pad and n:
        cycle = np.arange(n + pending.pad) % n  # as pad_rows repeats the batch's rows
        keys = [keys[i] for i in cycle.tolist()]
        row, epoch = row[cycle], epoch[cycle]
        padding = np.arange(len(cycle)) >= n
    if pending.repeated:
        padding = np.ones(len(keys), bool)
    for array in (row, epoch, padding):  # views of what later records read too
        array.flags.writeable = False
    return Provenance(tuple(keys), row, epoch, padding)


def _segment(seg: Any, origin: _Origin) -> tuple[list, np.ndarray, np.ndarray]:
    n = seg.stop - seg.start
    if origin is _UNKNOWN:  # never registered: an internal gap, said once per batch read
        logger.warning("provenance: unit %d of epoch %d (key %r) was not recorded; its rows "
                       "read as -1", seg.unit, seg.epoch, seg.key)
        return [seg.key] * n, np.full(n, -1, np.int64), np.full(n, seg.epoch, np.int64)
    if isinstance(origin, ShardOrigin):
        return ([origin.key] * n, origin.raw_rows(slice(seg.start, seg.stop)),
                np.full(n, origin.epoch, np.int64))
    keys, which, rows, epochs = origin.traced()
    part = slice(seg.start, seg.stop)
    return [keys[i] for i in which[part].tolist()], rows[part], epochs[part]
