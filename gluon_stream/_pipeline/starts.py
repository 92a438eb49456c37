"""Where each pass of a loader starts: a loaded state, or where the last pass left the stream.

Without ``samples_per_epoch`` a pass is the stream's epoch, from its start (with what the last
pass rolled over). With it, the loader's epochs are cut from the stream: epoch ``e`` starts
where epoch ``e - 1`` stopped, so its start is known only once that epoch was read (or a state
saved in it loaded). After an elastic resume the epoch after the remainder starts where a fresh
job of the new world size starts it: after ``e * samples_per_epoch`` samples of this part's
stream, counted from the shards' sizes (:meth:`PassStarts.fresh_start`).
"""
from __future__ import annotations

import logging

from ..errors import InvalidState
from .batching import Position, Segment
from .epoch import LoaderEpoch
from .feed import Carry
from .quotas import PartStream, endless_drawn
from .run import KeyPass
from .state import LoaderState
from .stream import ShardStream

__all__ = ["PassStarts"]

logger = logging.getLogger(__name__)


class PassStarts:
    """A loader's epochs and the position each pass starts from."""

    def __init__(self, stream: ShardStream, samples_per_epoch: int | None,
                 batch_size: int = 1, last_batch: str = "keep", window: int = 1) -> None:
        self.stream = stream
        self.samples_per_epoch = samples_per_epoch
        self.batch_size, self.last_batch, self.window = batch_size, last_batch, window
        self._fresh: tuple[int, LoaderState] | None = None  # the last fresh_start counted
        self._epoch = 0  # samples_per_epoch: the loader's epoch (the stream's is its key pass)
        self.loaded: LoaderState | None = None  # a state loaded for the next pass
        self.last: LoaderEpoch | None = None  # the pass in progress, or the last one

    @property
    def epoch(self) -> int:
        """The epoch the next pass produces."""
        return self.stream.epoch if self.samples_per_epoch is None else self._epoch

    def set_epoch(self, epoch: int) -> None:
        if self.samples_per_epoch is None:
            self.stream.set_epoch(epoch)
        else:
            self._epoch = epoch

    def load(self, state: LoaderState) -> None:
        """The next pass starts at ``state`` (checked already)."""
        self.loaded, self.last = state, None
        self.set_epoch(state.epoch)

    def begin(self) -> tuple[LoaderState, Carry | None, KeyPass | None]:
        """(start, carry, handover) of a new pass: the carry and the run the last pass left,
        where the new one goes on from them."""
        start = self.next()
        self.loaded = None
        remainder = self.stream.dealer.remainder
        if remainder is not None and remainder.fixed and start.epoch != remainder.epoch:
            self.stream.set_remainder(None)  # its epoch is over: the next ones read the stream
        if start.position.end and self.samples_per_epoch is None:
            self.stream.set_epoch(start.epoch + 1)  # the rest of an ended epoch: nothing
        self._epoch = start.epoch + 1  # samples_per_epoch: without set_epoch, the next one
        last = self.last if self.last is not None and self.last.finished else None
        carry = last.carry if last is not None and start.position.carry and \
            last.state.position.carry == start.position.carry else None
        handover = last.handover if last is not None and start.loader_epoch is not None \
            else None
        return start, carry, handover

    def current(self) -> LoaderState:
        """Where the stream stands between batches (what a state saves)."""
        last = self.last
        if self.loaded is not None or last is None or last.finished:
            return self.next()
        return last.state

    def next(self, warn: bool = True) -> LoaderState:
        """Where the next pass starts: a loaded state, or the stream's epoch with what the last
        pass rolled over."""
        if self.samples_per_epoch is not None:
            return self._in_stream()
        epoch, loaded, last = self.stream.epoch, self.loaded, self.last
        if loaded is not None:
            if loaded.epoch == epoch:
                return loaded
            if loaded.position.end and loaded.epoch + 1 == epoch:  # the next epoch, as it said
                return LoaderState(loaded.position.next_epoch(), skipped=loaded.skipped,
                                   unit_lengths=loaded.unit_lengths)
            if warn:
                logger.warning("state loaded for epoch %d, but epoch %d starts: iterating it "
                               "from its beginning", loaded.epoch, epoch)
            return LoaderState(Position(epoch))
        if last is not None and last.finished:
            return LoaderState(Position(epoch, carry=last.state.position.carry),
                               skipped=last.state.skipped,
                               unit_lengths=last.state.unit_lengths)
        return LoaderState(Position(epoch))

    def _in_stream(self) -> LoaderState:
        """samples_per_epoch: where the loader's epoch starts in the stream: where the one
        before it stopped (as it ended, or as far as the loop took it)."""
        epoch, loaded, last = self._epoch, self.loaded, self.last
        before = loaded if loaded is not None else last.state if last is not None else None
        if before is not None and before.epoch == epoch and loaded is not None:
            return self.fresh_start(epoch) if loaded.fresh and not loaded.position.end \
                else loaded
        remainder = self.stream.dealer.remainder
        if before is not None and before.epoch + 1 == epoch and (before.fresh or (
                remainder is not None and remainder.fixed and before.epoch == remainder.epoch)):
            return self.fresh_start(epoch)  # after an elastic resume's remainder
        if before is not None and before.epoch + 1 == epoch:
            p = before.position
            return LoaderState(Position(p.epoch, p.unit, p.offset, p.carry),
                               skipped=before.skipped, loader_epoch=epoch,
                               unit_lengths=before.unit_lengths)
        if before is None and epoch == 0:
            return LoaderState(Position(0), loader_epoch=0)
        raise InvalidState(
            f"samples_per_epoch={self.samples_per_epoch}: epoch {epoch} starts where epoch "
            f"{epoch - 1} stopped in the stream, which this loader has not reached: iterate the "
            "epochs in order, or load the state saved in the epoch before")

    def fresh_start(self, epoch: int) -> LoaderState:
        """samples_per_epoch: where a fresh job of this world size starts ``epoch`` in this
        part's stream: after ``epoch * samples_per_epoch`` of its samples, with the samples
        its epoch before rolled over (``last_batch='rollover'``). The same on every run from
        the same state: the walk counts the part's shards up to there by their sizes, known
        ahead (``shard_sizes=``, the source's, a cache filled ahead) or seen, else counted by
        producing each shard once (a cache hit with a ``cache_dir``)."""
        if self._fresh is not None and self._fresh[0] == epoch:
            return self._fresh[1]
        assert self.samples_per_epoch is not None
        stream = self.stream
        endless = not stream.source.keys_for_epoch(0)[1]
        dealer = stream.dealer
        part = PartStream(stream.num_parts, stream.part_index, stream.deal, dealer.dealt_keys,
                          stream.producer.counted_size,
                          endless_drawn(dealer.endless_keys) if endless else None, self.window)
        stretches, at = part.walk(0, 0, 0, epoch * self.samples_per_epoch)
        carried = epoch * self.samples_per_epoch % self.batch_size \
            if self.last_batch == "rollover" else 0
        carry: list[Segment] = []
        for s in reversed(stretches):  # the last samples before it, in order
            if not carried:
                break
            n = min(carried, s.stop - s.start)
            carry.insert(0, Segment(s.epoch, s.unit, s.stop - n, s.stop, s.key))
            carried -= n
        logger.debug("epoch %d starts at shard %d of pass %d, row %d (a fresh job's start on "
                      "part %d of %d, after %d shard(s) counted)", epoch, at.unit, at.epoch,
                      at.offset, stream.part_index, stream.num_parts, len(stretches))
        position = Position(at.epoch, at.unit, at.offset, tuple(carry))
        lengths = [] if self.window == 1 else [  # the mixed units a state there names
            (e, u, shards) for e, u in sorted(position.units_read())
            if (shards := part.lengths(e, u)) is not None]
        start = LoaderState(position, loader_epoch=epoch, unit_lengths=tuple(lengths))
        self._fresh = (epoch, start)
        return start
