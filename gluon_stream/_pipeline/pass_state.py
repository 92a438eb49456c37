"""Where a pass stands after each batch: its stages' positions composed into a
:class:`~gluon_stream._pipeline.state.LoaderState` (the planner's position, the batches
delivered, the shards skipped around it, even_batches' repeat and lead, ``deal='balanced'``'s
rows before the shards a resume reads, a shuffle window's unit lengths), so a state taken
between any two batches, the last one included, resumes exactly."""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from ..errors import InvalidState
from .batching import Position, WindowMixer
from .settings import PassSettings
from .state import LoaderState

if TYPE_CHECKING:
    from .even import EvenBatches
    from .run import KeyPass
    from .stream import ShardStream

__all__ = ["PassState"]


class PassState:
    """The state of a pass from ``start`` (:attr:`state`), composed by :meth:`advance`.

    It keeps what a state records beyond the stages' positions: the rows before the shards
    (``recorded``, ``deal='balanced'``), a window's unit lengths (``lengths``, shared with the
    window's feed), the shards' full sizes seen (``full_sizes``, even_batches='pad''s lead),
    and the run whose rows it reads (``run``, while one is on).
    """

    def __init__(self, stream: ShardStream, settings: PassSettings, start: LoaderState,
                 even: EvenBatches | None) -> None:
        self.stream, self.settings, self.start, self.even = stream, settings, start, even
        self.state = start
        self.recorded = dict(start.rows_before)  # deal='balanced': shard -> rows before it
        # shuffle_window > 1: (epoch, unit) -> its shards' lengths, of the units handed out
        # (and those the start state records) a state may refer to
        self.lengths = {(e, u): n for e, u, n in start.unit_lengths}
        self.full_sizes: dict[int, int] = {}  # shard position -> samples, for the lead
        self.run: KeyPass | None = None

    def advance(self, position: Position, delivered: int, skipped_at: Sequence[int],
                 units: int | None = None) -> None:
        """The pass stands at ``position`` after ``delivered`` batches: compose the state.

        ``units``: the epoch's count of units, where known: a position past all of them, with
        nothing left to deliver, is the end of the epoch (said so at once, not on the next
        pass).
        """
        settings = self.settings
        even = self.even
        tail_due = position.carry and settings.last_batch == "keep" and settings.even is not True
        # even_batches=True: a part short of the limit repeats its last batch after the units
        repeats_due = even is not None and even.limit is not None and delivered < even.limit
        if units is not None and not position.end and position.unit >= units \
                and not position.offset and not tail_due and not repeats_due:
            position = Position(position.epoch, position.unit, 0,
                                position.carry if settings.last_batch == "rollover" else (),
                                True)
        repeat = even.repeat if even is not None else ()
        number = even.repeat_number if even is not None else 0
        epoch, window = position.epoch, self.settings.window
        needed = [(s.epoch, s.unit) for s in position.carry + repeat]
        if not position.end:
            needed.append((epoch, position.unit))
        first: dict[int, int] = {}  # epoch -> the first shard a resume reads
        for e, unit in needed:
            first[e] = min(first.get(e, unit), WindowMixer.first_shard(unit, window))
        skipped = {(e, j) for e, j in self.start.skipped if j >= first.get(e, j + 1)}
        skipped |= {(epoch, j) for j in skipped_at if j >= first.get(epoch, j + 1)}
        # where a resume's run starts
        lead = 0 if position.end or even is None or not even.pad else \
            self.lead(WindowMixer.first_shard(position.unit, window))
        rows = self.rows_of(first[epoch], max(u for e, u in needed if e == epoch)) \
            if epoch in first else ()
        self.state = LoaderState(position, delivered, tuple(sorted(skipped)), repeat, number,
                                 lead, self.start.loader_epoch, rows, self.unit_lengths(position))

    def unit_lengths(self, position: Position) -> tuple:
        """``shuffle_window > 1``: the lengths of the mixed units ``position`` has read part of
        (see :attr:`LoaderState.unit_lengths`); those of units before them are let go of."""
        if self.settings.window == 1:
            return ()
        units = position.units_read()
        floor = min(units, default=(position.epoch, position.unit))
        for old in [u for u in self.lengths if u < floor]:
            del self.lengths[old]
        return tuple((e, u, self.lengths[(e, u)]) for e, u in sorted(units)
                     if (e, u) in self.lengths)

    def rows_of(self, first: int, last: int) -> tuple[tuple[int, int], ...]:
        """``deal='balanced'``: ``(position, rows before it)`` of the epoch's shards a resume
        reads again or starts from (``first .. last``; see :attr:`LoaderState.rows_before`),
        and of the shards before them that another rank, at the same step, may not have
        finished: those whose rows before them are within ``num_parts * (2 * batch_size +
        2)`` of the last one's (every rank at a step has read as many samples, give or take a
        batch, and holds ``rows // num_parts`` of the rows read or one more), so that a merge
        of every rank's state (:func:`gluon_stream.merge_states`) knows each shard's strides.
        () for other deals."""
        run = self.run
        if run is None or run.offsets is None:
            return ()

        def rows(unit: int) -> int | None:  # None: past the shards read (a window's units)
            found = run.rows_before(unit)
            return found if found is not None else self.recorded.get(unit)

        known = [(unit, n) for unit in range(first, last + 1) if (n := rows(unit)) is not None]
        if not known:
            return ()
        floor = known[-1][1] - self.stream.num_parts * (2 * self.settings.batch_size + 2)
        while first > 0 and (n := rows(first - 1)) is not None and n >= floor:
            first -= 1
            known.insert(0, (first, n))
        return tuple(known)

    def recorded_rows(self, unit: int) -> int:
        """``deal='balanced'``: the rows before position ``unit`` of the epoch, as the state
        this pass started from records them (0 at the epoch's start)."""
        recorded = self.recorded
        if unit in recorded or not unit or not self.stream.sizes.learns_rows(self.start.epoch):
            return recorded.get(unit, 0)
        raise InvalidState(
            f"the state resumes epoch {self.start.epoch} at shard {unit}, but does not record "
            "the rows of the shards before it, which decide the strides every rank takes "
            "(even_batches=True, sizes unknown): save it again with this gluon_stream")

    def lead(self, before: int) -> int:
        """even_batches='pad': the largest part's samples in the shards before position
        ``before`` (those a resume does not produce again)."""
        lead = self.even.lead if self.even is not None else 0
        share, epoch = self.stream.sizes.largest_share, self.start.position.epoch
        return lead + sum(share(epoch, j, n) for j, n in self.full_sizes.items() if j < before)
