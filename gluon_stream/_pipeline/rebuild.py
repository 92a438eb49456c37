"""A resumed position's data: the units a state's segments name (a carry, a batch to
repeat), produced again in the calling thread exactly as the producers made them."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from .._mx import arrays as mx_arrays
from .._mx.padding import pad_rows
from .._utils.random import batch_seed
from ..errors import InvalidState
from .batching import Segment, WindowMixer
from .contracts import BatchPath
from .feed import Carry, MixedData, UnitSources
from .state import check_segment_key

if TYPE_CHECKING:
    from .provenance import ProvenanceTracker
    from .settings import PassSettings
    from .stream import ShardStream

__all__ = ["Rebuild"]


class Rebuild:
    """Produces again the units of a state's segments.

    Args:
        stream: Whose keys and producer make them.
        path: The batch path (its ``prepare``, ``cut`` and ``mix``).
        window: ``shuffle_window``.
        rows_before: ``deal='balanced'``: the rows before a shard position, as the state
            records them.
        origins: provenance=True: told of the units made again.
    """

    def __init__(self, stream: ShardStream, path: BatchPath, window: int,
                 rows_before: Callable[[int], int], origins: ProvenanceTracker | None) -> None:
        self.stream, self.path, self.window = stream, path, window
        self.rows_before, self.origins = rows_before, origins

    def carry(self, segments: Sequence[Segment],
                       skipped: Sequence[tuple[int, int]]) -> Carry:
        carry = Carry()
        carry.sources.origins = self.origins  # provenance: the carried units' origins too
        for seg, chunk in zip(segments, self.chunks(segments, skipped, carry.sources)):
            carry.add(seg, chunk)
        return carry

    def batch(self, segments: Sequence[Segment], number: int, epoch: int,
              skipped: Sequence[tuple[int, int]], carry: Carry | None,
              settings: PassSettings) -> Any:
        """Batch ``number`` of ``epoch`` (``segments``), made again: the batch even_batches
        repeats, after a resume while repeating it; padded to a batch, placed on ``ctx``."""
        chunks = self.chunks(segments, skipped, carry.sources if carry is not None else None)
        if self.origins is not None:
            self.origins.delivered(segments, settings.batch_size - sum(s.size for s in segments))
        data = self.path.join(chunks, batch_seed(self.stream.seed, epoch, number))
        if settings.ctx is not None:
            data = mx_arrays.place(data, settings.ctx)
        return pad_rows(data, settings.batch_size)

    def chunks(self, segments: Sequence[Segment], skipped: Sequence[tuple[int, int]],
                 sources: UnitSources | None = None) -> list[tuple]:
        """The rows of ``segments``, cut from their units produced again (a resume); their
        samples' sources noted in ``sources``."""
        chunks = []
        for seg in segments:
            unit = self.unit(seg, skipped, sources)
            if seg.stop > len(unit):
                raise InvalidState(
                    f"the state holds rows {seg.start}..{seg.stop - 1} of {_unit_name(seg)} of "
                    f"epoch {seg.epoch}, which now holds only {len(unit)} samples: the data "
                    "changed since the state was saved; start the epoch afresh")
            chunks.append(self.path.cut(unit, seg))
        return chunks

    def unit(self, seg: Segment, skipped: Sequence[tuple[int, int]],
                    sources: UnitSources | None = None) -> Any:
        """Unit ``seg.unit`` of epoch ``seg.epoch``, produced again (its samples' sources
        noted in ``sources``)."""
        stream, window = self.stream, self.window
        keys = stream.dealer.epoch_keys(seg.epoch)[2]
        prepare = self.path.prepare
        if window == 1:
            key = keys[seg.unit] if keys is not None and seg.unit < len(keys) else seg.key
            shard = stream.producer.produce_now(key, seg.epoch, prepare, seg.unit,
                                       before=self.rows_before(seg.unit))
            if sources is not None:
                sources.shard(seg.epoch, seg.unit, shard)
            return shard
        first = WindowMixer.first_shard(seg.unit, window)
        if keys is None:  # an endless iterator: the unit's shards drawn again up to it
            named = stream.dealer.keys_between(seg.epoch, first, seg.unit + 1)
            check_segment_key(seg, named, first)
        else:
            named = keys[first:seg.unit + 1]
        mixer = WindowMixer(window, stream.seed, seg.epoch, first_unit=seg.unit)
        shards, units = {}, []
        for j, key in enumerate(named, first):
            if (seg.epoch, j) in skipped:  # failed before: an empty shard in the mix, as it was
                continue
            shards[j] = stream.producer.produce_now(key, seg.epoch, prepare, j,
                                           before=self.rows_before(j))
            units.extend(mixer.add(j, len(shards[j])))
        units.extend(mixer.finish())
        unit = next((u for u in units if u.index == seg.unit), None)
        if unit is None:
            raise InvalidState(f"the state holds samples of mixed unit {seg.unit} of epoch "
                               f"{seg.epoch}, which does not exist: the keys changed")
        used = {j: shards[j] for j in np.unique(unit.shards).tolist()}  # as the feed holds them
        newest = shards.get(seg.unit)
        mixed = MixedData(unit, used, newest.key if newest else None)
        if sources is not None:
            sources.mixed(seg.epoch, mixed)
        return self.path.mix(mixed)


def _unit_name(seg: Segment) -> str:
    return f"shard {seg.key!r}" if seg.key is not None else f"unit {seg.unit}"
