"""Equal counts across ranks (``even_batches``): which planned batches a part delivers, its
last batch repeated (or padded) up to the count every part yields, and a batch borrowed for a
part that has none of its own."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _mx as mx_arrays
from .._mx.padding import pad_rows
from .._utils.random import batch_seed
from ..errors import StreamError
from .batching import Batch, MixedUnit, Position, Segment
from .contracts import BatchPath
from .feed import MixedData
from .state import LoaderState

if TYPE_CHECKING:
    from .produce import KeyPass, ShardStream
    from .provenance import ProvenanceTracker
    from .settings import PassSettings

__all__ = ["EvenBatches", "borrow_batch"]

logger = logging.getLogger(__name__)


class EvenBatches:
    """even_batches on one part, and its position (the last batch, to repeat).

    ``True``: only full batches and, with a ``limit`` (shards dealt to the parts, sizes known),
    exactly ``limit`` of them; a part that runs short (skipped shards, shards smaller than
    declared) repeats its last full batch. ``'pad'``: every batch, the short last one padded to
    ``batch_size``, then the last batch repeated as padding up to ``limit`` (None: the largest
    part's count, known once the epoch's shards are seen: ``lead`` counts its samples).
    """

    def __init__(self, batch_size: int, limit: int | None, start: LoaderState,
                 pad: bool = False, counted: bool = True) -> None:
        self.batch_size = batch_size
        self.limit = limit
        self.pad = pad
        self.counted = counted  # False with samples_per_epoch: every part reads as many
        kept = limit is not None or pad
        self.repeat: tuple[Segment, ...] = start.repeat if kept else ()
        self.repeat_number = start.repeat_number
        self.repeat_data: Any = None  # the repeated batch's data, once known
        self.lead = start.lead  # samples of the largest part in the shards before the run's

    def admits(self, batch: Batch) -> bool:
        """Whether a planned batch is delivered: a short one only with padding."""
        return self.pad or batch.size == self.batch_size

    def padding(self, batch: Batch) -> int:
        """Rows of padding a planned batch gets."""
        return self.batch_size - batch.size if self.pad else 0

    def reached(self, delivered: int) -> bool:
        return self.limit is not None and delivered >= self.limit

    def count(self, lead: int) -> int | None:
        """The batches every part yields, given the largest part's samples (``'pad'``)."""
        if self.limit is not None or not self.pad or not self.counted:
            return self.limit
        return -(-lead // self.batch_size)

    def after(self, after: Position, delivered: int, ends: bool) -> Position:
        """Where the epoch stands after ``delivered`` batches, the last one planned to stop
        at ``after``: ended once the count is reached, not yet with ``'pad'`` where more may
        follow (``ends``: a position past the units ends the epoch, not with
        samples_per_epoch)."""
        if self.reached(delivered):
            return after.ended()
        return Position(after.epoch, after.unit) if after.end and ends else after

    def delivered(self, batch: Batch, data: Any, number: int) -> None:
        if self.limit is not None or self.pad:  # kept only to repeat it; it pins its shard
            self.repeat, self.repeat_number, self.repeat_data = batch.segments, number, data


def borrow_batch(stream: ShardStream, path: BatchPath, settings: PassSettings, run: KeyPass,
             count: int, origins: ProvenanceTracker | None) -> Any:
    """A batch for a part that has none of its own to repeat (it was dealt no sample, or
    its shards failed) while the others yield ``count``: the first ``batch_size`` rows
    (cycled) of the first shard of the epoch's key list that holds any, read whole. With
    ``'pad'`` all its rows are padding; with ``True`` it keeps the step count, as a
    repeat does. The same on every resume (a state records no borrowed segment)."""
    bs = settings.batch_size
    keys, finite = stream.source.keys_for_epoch(run.epoch)
    tried = []
    for key in (keys if finite else ()):
        if stream.sizes.full_size(key, run.epoch) == 0:
            continue
        try:
            shard = stream.producer.produce_now(key, run.epoch, path.prepare, whole=True)
        except Exception as exc:  # a failing shard (on_error='skip'): the next one
            if stream.error_policy.verdict(exc, stream.error_policy.retries) != "skip":
                raise
            tried.append(f"{key!r}: {type(exc).__name__}")
            continue
        if len(shard):
            rows = min(bs, len(shard))
            unit: Any = shard  # or the mixed unit a mixing path gathers from it
            if settings.window > 1:  # the path gathers a mixed unit from its shards
                mixed = MixedUnit(0, np.zeros(rows, np.int64), np.arange(rows), ())
                unit = path.mix(MixedData(mixed, {0: shard}, key))
            seg = Segment(run.epoch, 0, 0, rows, key)
            data = path.join([path.cut(unit, seg)],
                                  batch_seed(stream.seed, run.epoch, count))
            if settings.ctx is not None:
                data = mx_arrays.place(data, settings.ctx)
            if origins is not None:
                origins.borrowed(shard, rows, bs)
            logger.info("epoch %d: part %d of %d has no batch of its own; it yields %d "
                        "batch(es) of rows of shard %r (even_batches=%r) to keep the "
                        "ranks' step counts equal", run.epoch, stream.part_index,
                        stream.num_parts, count, key, settings.even)
            return pad_rows(data, bs)
    raise StreamError(
        f"part {stream.part_index} of {stream.num_parts} has no batch to give in epoch "
        f"{run.epoch} while the others yield {count}, and no shard of the epoch holds a "
        f"sample to pad with ({run.skipped} shard(s) skipped here"
        f"{'; failed: ' + ', '.join(tried) if tried else ''}): the declared sizes "
        "(shard_sizes=) say there are samples the shards do not hold; see the warnings above")
