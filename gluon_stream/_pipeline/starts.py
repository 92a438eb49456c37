"""Where each pass of a loader starts: a loaded state, or where the last pass left the stream.

Without ``samples_per_epoch`` a pass is the stream's epoch, from its start (with what the last
pass rolled over). With it, the loader's epochs are cut from the stream: epoch ``e`` starts
where epoch ``e - 1`` stopped, so its start is known only once that epoch was read (or a state
saved in it loaded).
"""
from __future__ import annotations

import logging

from .batching import Position
from .epoch import EpochPass
from .feed import Carry
from .state import LoaderState
from ..errors import InvalidState
from ..stream import EpochRun, ShardStream

__all__ = ["PassStarts"]

logger = logging.getLogger(__name__)


class PassStarts:
    """A loader's epochs and the position each pass starts from."""

    def __init__(self, stream: ShardStream, samples_per_epoch: int | None) -> None:
        self.stream = stream
        self.samples_per_epoch = samples_per_epoch
        self._epoch = 0  # samples_per_epoch: the loader's epoch (the stream's is its key pass)
        self.loaded: LoaderState | None = None  # a state loaded for the next pass
        self.last: EpochPass | None = None  # the pass in progress, or the last one

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

    def begin(self) -> tuple[LoaderState, Carry | None, EpochRun | None]:
        """(start, carry, handover) of a new pass: the carry and the run the last pass left,
        where the new one goes on from them."""
        start = self.next()
        self.loaded = None
        if start.position.end and self.samples_per_epoch is None:
            self.stream.set_epoch(start.epoch + 1)  # the rest of an ended epoch: nothing
        self._epoch = start.epoch + 1  # samples_per_epoch: without set_epoch, the next one
        last = self.last if self.last is not None and self.last.finished else None
        carry = last.carry if last is not None and start.position.carry and \
            last.state.position.carry == start.position.carry else None
        handover = last.handover if last is not None and start.stream_epoch is not None \
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
            return loaded
        if before is not None and before.epoch + 1 == epoch:
            p = before.position
            return LoaderState(Position(p.epoch, p.unit, p.offset, p.carry),
                               skipped=before.skipped, stream_epoch=epoch,
                               unit_lengths=before.unit_lengths)
        if before is None and epoch == 0:
            return LoaderState(Position(0), stream_epoch=0)
        raise InvalidState(
            f"samples_per_epoch={self.samples_per_epoch}: epoch {epoch} starts where epoch "
            f"{epoch - 1} stopped in the stream, which this loader has not reached: iterate the "
            "epochs in order, or load the state saved in the epoch before")
