"""How many batches a pass yields: ``len(loader)``, the progress bar's total and even_batches'
limit, from the declared or known shard sizes (never by producing shards)."""
from __future__ import annotations

from typing import Any, Iterator, Protocol

from ..errors import SizeUnknown
from ..sources import Source
from .batching import LastBatch, Position
from .ranks import even_count
from .remainder import Remainder
from .sizes import ShardSizes
from .stream import ShardStream

__all__ = ["BatchCounts"]


class Dealt(Protocol):
    """What :class:`BatchCounts` reads of a stream's keys stage."""

    remainder: Remainder | None

    def epoch_keys(self, epoch: int, part_index: int | None = None
                   ) -> tuple[Iterator[Any], bool, list | None]: ...


class Counted(Protocol):
    """What :class:`BatchCounts` reads of a stream."""

    sizes: ShardSizes
    num_parts: int
    deal: str
    source: Source
    transform: Any

    @property
    def dealer(self) -> Dealt: ...


class BatchCounts:
    """Batch counts of one loader's epochs (its stream, batch size and batch rules)."""

    def __init__(self, stream: Counted, batch_size: int, last_batch: LastBatch,
                 even_batches: bool | str, samples_per_epoch: int | None) -> None:
        self.stream = stream
        self.batch_size = batch_size
        self.last_batch = last_batch
        self.even_batches = even_batches
        self.samples_per_epoch = samples_per_epoch

    def fresh_len(self, epoch: int, start: Position) -> int:
        """``len(loader)``: batches of ``epoch`` from its start as a fresh job of this size
        yields them (``start``: where the next pass starts; its carry counts at the epoch's
        start); :class:`~gluon_stream.SizeUnknown` where the sizes are not known."""
        fresh = start.epoch == epoch and start.unit == start.offset == 0
        count = self.batches(epoch, start.carried if fresh else 0, fresh=True)
        if count is None:
            raise SizeUnknown(f"len(StreamLoader) is unknown for epoch {epoch}: "
                              f"{self.unknown_reason(epoch)}")
        return count

    def batches(self, epoch: int, carried: int = 0, fresh: bool = False) -> int | None:
        """Batches epoch ``epoch`` yields from its start (``carried``: samples rolled over);
        None where the sizes are not known. ``fresh``: as a fresh job of this size counts the
        epoch (``len()``), not the rest an elastic resume reads in its place."""
        if fresh and self._resumed(epoch):
            return self._fresh().batches(epoch, carried)
        bs = self.batch_size
        if self._fixed(epoch):  # rolled over: what the epochs before left
            n = self.samples_per_epoch
            assert n is not None
            full, rest = divmod(n + (epoch * n % bs if self.last_batch == "rollover" else 0), bs)
            keeps = self.even_batches == "pad" or (self.last_batch == "keep"
                                                   and not self.even_batches)
            return full + (1 if rest and keeps else 0)
        if self.even_batches:
            limit = self.even_limit(epoch)
            if limit is not None or self.even_batches == "pad":
                return limit
        total = self.stream.sizes.epoch_size(epoch)
        if total is None:
            return None
        full, rest = divmod(total + carried, bs)
        return full + (1 if rest and self.last_batch == "keep" and not self.even_batches else 0)

    def even_limit(self, epoch: int) -> int | None:
        """With even_batches, the batch count every part yields in ``epoch``: the smallest
        part's full batches, by the declared or known sizes. None where the parts hold equal
        counts by construction (``deal='samples'``, or one part): every full batch.

        With ``'pad'``: the largest part's batches, the last one short; None where that is
        only known once the epoch's shards are seen (``deal='strides'``, or one part).
        ``deal='balanced'`` without the sizes: None, the pass stops where every part can no
        longer fill a batch (see :meth:`~gluon_stream._pipeline.run.KeyPass.reaches`)."""
        stream = self.stream
        if self._fixed(epoch):  # every part reads as many samples
            return None
        if self.even_batches == "pad":
            sizes = stream.sizes.part_sizes(epoch)
            return None if sizes is None else even_count("pad", sizes, self.batch_size)
        if not self.even_batches or stream.deal == "samples" or stream.num_parts == 1:
            return None
        sizes = stream.sizes.part_sizes(epoch)
        if sizes is None and stream.deal == "balanced":
            return None
        if sizes is None:
            raise SizeUnknown(
                f"even_batches=True needs every shard's size for epoch {epoch} on every rank: "
                f"{self.unknown_reason(epoch)}")
        return even_count(True, sizes, self.batch_size)

    def _resumed(self, epoch: int) -> bool:
        """Whether ``epoch`` reads an elastic resume's remainder in place of its keys."""
        remainder = self.stream.dealer.remainder
        return remainder is not None and remainder.epoch == epoch

    def _fresh(self) -> "BatchCounts":
        """These counts as a fresh job of this size has them: its keys, no remainder."""
        assert isinstance(self.stream, ShardStream)  # a remainder is only ever a stream's
        return BatchCounts(_FreshStream(self.stream), self.batch_size, self.last_batch,
                           self.even_batches, self.samples_per_epoch)

    def _fixed(self, epoch: int) -> bool:
        """Whether ``epoch`` reads ``samples_per_epoch`` samples: not the rest of an epoch an
        elastic resume reads (its pieces, counted as an epoch of keys is)."""
        remainder = self.stream.dealer.remainder
        return self.samples_per_epoch is not None and not (
            remainder is not None and remainder.fixed and remainder.epoch == epoch)

    def unknown_reason(self, epoch: int) -> str:
        """Why an epoch's samples cannot be counted without producing it, and the fix."""
        stream = self.stream
        _, finite, keys = stream.dealer.epoch_keys(epoch)
        if not finite or keys is None:
            return ("the keys are an endless iterator, so the epoch has no known end (iterate "
                    "with a fixed number of steps instead)")
        unknown = [k for k in keys if stream.sizes.shard_size(k, epoch) is None]
        why = [stream.source.unknown_size_reason()]
        if stream.transform is not None:
            why.insert(0, "a transform may change the sample counts of the files")
        return (f"the sizes of {len(unknown)} of {len(keys)} shards (e.g. {unknown[0]!r}) are not "
                f"known without producing them ({'; '.join(why)}). "
                "Pass shard_sizes= (a dict, fn(key), or one int for every shard), fill the cache "
                "ahead with gluon-stream generate, or read existing files with FileSource; sizes "
                "of shards seen in an earlier pass are reused when the data cannot change")


class _FreshStream:
    """What :class:`BatchCounts` reads of a stream, as a fresh job of its size has it: the
    epoch's own keys and sizes, an elastic resume's remainder aside (sizes seen are shared)."""

    remainder: Remainder | None = None

    def __init__(self, stream: ShardStream) -> None:
        self._stream = stream
        self.num_parts, self.deal = stream.num_parts, stream.deal
        self.source, self.transform = stream.source, stream.transform
        self.sizes = stream.sizes.without_remainder(self.epoch_keys)
        self.dealer: Dealt = self  # its own keys, without the remainder

    def epoch_keys(self, epoch: int, part_index: int | None = None
                   ) -> tuple[Iterator[Any], bool, list | None]:
        stream = self._stream
        _, finite = stream.source.keys_for_epoch(epoch)
        if not finite:
            return iter(()), False, None
        part = stream.part_index if part_index is None else part_index
        keys = stream.dealer.dealt_keys(epoch, stream.num_parts, part, stream.deal)
        return iter(keys), True, keys
