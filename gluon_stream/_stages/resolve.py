"""The remainder a merged state describes: each old rank's takes, grouped into pieces.

:func:`gluon_stream.merge_states` joins the old ranks' positions into a spec; :func:`resolve`
cuts what each rank has left (:mod:`~gluon_stream._stages.quotas` with ``samples_per_epoch``,
:mod:`~gluon_stream._stages.window_cuts` with a shuffle window) into a
:class:`~gluon_stream._stages.keys.Remainder`.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping

from ..errors import InvalidState
from .keys import Drawn, Mixed, Piece, Remainder, Take, part_endless, remainder_deal, stride_of
from .quotas import KeysOf, Quotas, SizeOf
from .state import check_rank_keys
from .window_cuts import WindowCuts

__all__ = ["resolve"]


def resolve(spec: Mapping[str, Any], keys_of: KeysOf,
            endless_of: Callable[[int], Iterator[Any]] | None = None,
            drawn: Drawn | None = None, size_of: SizeOf | None = None) -> Remainder:
    """The remainder a merged state's ``spec`` describes, its shards named by ``keys_of``
    (endless keys: by ``endless_of(epoch)``, the iterator drawn anew from its beginning).

    With ``samples_per_epoch`` (``spec["samples_per_epoch"]``) an old rank that read its own
    stream leaves the rest of its epoch's quota: its stream from its position for as many
    samples as its epoch had still to read, cut where the shards' sizes (``size_of``, every
    rank alike) say; the remainder records those sizes.

    Raises:
        InvalidState: an old rank's keys are not those its state was saved with, or a
            position lies outside them.
    """
    epoch, quota = spec["epoch"], spec.get("samples_per_epoch")
    endless = bool(spec.get("endless")) and quota is None
    if endless:
        drawn = _drawn_of(epoch, endless_of, drawn)
    prior = resolve(spec["prior"], keys_of, endless_of, drawn, size_of) \
        if spec.get("prior") else None
    full_of: dict[tuple, int] = {}  # samples_per_epoch: (epoch, key) -> the shard's samples
    own = Quotas(spec, keys_of, endless_of, size_of, full_of) if quota is not None else None
    ranks = _OldRanks(spec, keys_of, prior, full_of, drawn if endless else None)
    window = int(spec.get("window", 1))
    # an old rank that read its own stream (samples_per_epoch): the rest of its quota
    per_rank = [own.takes(saved, rank) if own is not None and "pass" in saved
                else ranks.takes(saved, rank, window) for rank, saved in enumerate(spec["ranks"])]
    pieces = _grouped(per_rank)
    sizes = None
    if own is not None:
        assert size_of is not None  # Quotas refused a spec without it
        sizes = tuple(full_of[p.epoch, p.key] if (p.epoch, p.key) in full_of
                      else size_of(p.key, p.epoch) for p in pieces)
    return Remainder(epoch, pieces, spec, drawn if endless else None, ranks.tail_start, sizes)


def _drawn_of(epoch: int, endless_of: Callable[[int], Iterator[Any]] | None,
              drawn: Drawn | None) -> Drawn:
    """Endless keys: the iterator of ``epoch``, ``drawn`` if it is that epoch's, else drawn
    anew from ``endless_of``."""
    if drawn is not None and drawn.epoch == epoch:
        return drawn
    if endless_of is None:
        raise InvalidState("the state was saved reading endless keys: this loader's keys "
                           "are a list (field 'keys'); build it with the same keys")
    return Drawn(epoch, endless_of(epoch))


class _OldRanks:
    """The old ranks' units of each epoch (shards, or the prior remainder's pieces) and the
    takes of them: the rows each old rank left of a unit, keyed by the unit's shard.

    ``drawn`` (endless keys): the iterator each old rank's keys are drawn from, as far as any
    rank got; the keys after them are the remainder's tail (from :attr:`tail_start`).
    """

    def __init__(self, spec: Mapping[str, Any], keys_of: KeysOf, prior: Remainder | None,
                 full_of: dict[tuple, int], drawn: Drawn | None) -> None:
        self.spec, self.keys_of, self.prior, self.full_of = spec, keys_of, prior, full_of
        self.epoch, self.parts, self.deal = spec["epoch"], spec["parts"], spec["deal"]
        self.endless = drawn is not None
        # which stride of each of its pieces a rank read (saved with its state: see stride_of)
        self.turns = spec["prior"].get("turns") if prior is not None else None
        if self.deal == "balanced" and prior is not None and not spec["prior"].get("turned"):
            self.turns = None  # saved before balanced strides turned across pieces: equal ones
        # the prior's balanced pieces (and tail) turned where no rank counted them ahead too, by
        # the rows before them the producers learned (the ranks' rows_before); a piece none of
        # them reached: each its own stride, which together are all its rows
        self.learned = prior is not None and bool(spec["prior"].get("learned"))
        # deal='balanced': the rows before the shards the ranks stood in, which turn their
        # strides (a shard none of them reached: every rank's own stride, which together are
        # all its rows)
        self.before = {int(u): int(n) for saved in spec["ranks"]
                       for u, n in saved.get("rows_before", ())}
        self.lists: dict[tuple[int, int], list] = {}
        self.tail_at: int | None = None  # an endless remainder read before: its tail's start
        self.tail_start = self._draw(drawn) if drawn is not None else 0

    def _draw(self, drawn: Drawn) -> int:
        """Each old rank's endless keys as far as any rank got (after the pieces of a prior
        remainder of the same epoch); where the tail starts in the iterator."""
        epoch, parts, deal, prior = self.epoch, self.parts, self.deal, self.prior
        same = prior if prior is not None and prior.epoch == epoch else None
        base = list(same.pieces) if same is not None else []
        self.tail_at = len(base) if same is not None else None
        start = same.tail_start if same is not None else 0
        need = max([u - len(base) + 1 for saved in self.spec["ranks"]
                    for u in _units_named(saved, epoch)] + [0])
        tail_start = start + (need * parts if deal == "shards" and parts > 1 else need)
        if any(saved["end"] for saved in self.spec["ranks"]):  # a rank saw the iterator end:
            tail_start = drawn.upto_end()  # the other ranks' keys are all drawn, none after
        drawn_keys = drawn.upto(tail_start)[start:]
        for rank in range(parts):
            self.lists[(epoch, rank)] = base + list(part_endless(drawn_keys, parts, rank, deal))
        return tail_start

    def units(self, e: int, rank: int) -> list:
        """Old rank ``rank``'s units of epoch ``e``: its shards' keys, or the prior's pieces."""
        prior = self.prior
        if prior is not None and e == prior.epoch and not self.endless:
            return list(prior.pieces)
        if (e, rank) not in self.lists:
            if self.endless:
                raise InvalidState(f"field 'last_batch': the state of rank {rank} holds "
                                   f"samples epoch {e} of an endless key iterator rolled over "
                                   f"into epoch {self.epoch}: two epochs of an iterator are "
                                   "not drawn again; resume on the same number of ranks")
            self.lists[(e, rank)] = list(self.keys_of(e, self.parts, rank, self.deal))
        return self.lists[(e, rank)]

    def take(self, e: int, unit: int, rank: int, start: int, stop: int | None,
             expect: int | None = None, mixed: Mixed | None = None) -> tuple[tuple, Take]:
        """Rows ``start .. stop`` of what old rank ``rank`` read of unit ``unit`` of epoch
        ``e``, with the unit's shard (its epoch and key)."""
        found, parts, deal, prior = self.units(e, rank), self.parts, self.deal, self.prior
        if unit >= len(found):
            raise InvalidState(f"the state of rank {rank} refers to shard {unit} of epoch {e}, "
                               f"which has {len(found)}: the keys changed since it was saved")
        item = found[unit]
        if isinstance(item, Piece) and prior is not None and prior.sizes is not None:
            self.full_of[(item.epoch, item.key)] = prior.sizes[unit]
        if isinstance(item, Piece):
            read_before = self.turns[unit] if self.turns else None
            read = remainder_deal(deal, read_before)
            if self.learned and deal == "balanced" and read_before is None:
                read_before, read = self.before.get(unit), "strides"
            return (item.epoch, item.key), Take(item, parts,
                                                stride_of(rank, parts, read, read_before),
                                                read, start, stop, expect, mixed)
        if deal == "balanced" and parts > 1 and e == self.epoch and self.tail_at is not None \
                and unit >= self.tail_at and not self.learned:  # the tail read before: equal
            return (e, item), Take(None, parts, rank, "samples", start, stop, expect, mixed)
        if deal == "balanced" and parts > 1:
            return (e, item), Take(None, parts, stride_of(rank, parts, deal, self.before.get(unit)),
                                   "strides", start, stop, expect, mixed)
        return (e, item), Take(None, parts, rank, deal, start, stop, expect, mixed)

    def takes(self, saved: Mapping[str, Any], rank: int, window: int) -> list[tuple[tuple, Take]]:
        """Old rank ``rank``'s takes in order (its state ``saved``, a shuffle window of
        ``window``): its carry, the rest of the shard it stood in, the shards after it."""
        epoch = self.epoch
        check_rank_keys(saved, [p.key if isinstance(p, Piece) else p
                                for p in self.units(epoch, rank)], epoch, rank)
        if window > 1:
            return WindowCuts(saved, rank, epoch, window, self.spec["seed"], self.units,
                              self.take).takes()
        takes = [self.take(e, u, rank, a, b) for e, u, a, b in saved["carry"]]
        count = len(self.units(epoch, rank))
        if not saved["end"] and saved["unit"] > count:
            raise InvalidState(f"the state of rank {rank} stands at shard {saved['unit']} of "
                               f"epoch {epoch}, which has {count}: the keys "
                               "changed since it was saved")
        if not saved["end"] and saved["unit"] < count:  # else: all read
            takes.append(self.take(epoch, saved["unit"], rank, saved["offset"], None))
            takes += [self.take(epoch, j, rank, 0, None) for j in range(saved["unit"] + 1, count)]
        return takes


def _grouped(per_rank: list[list[tuple[tuple, Take]]]) -> tuple[Piece, ...]:
    """The old ranks' takes grouped by shard into pieces, in the order of first appearance
    (the ranks' first takes in turn, then their second, ...)."""
    grouped: dict[tuple, list[Take]] = {}
    for i in range(max((len(t) for t in per_rank), default=0)):
        for takes in per_rank:
            if i < len(takes):
                grouped.setdefault(takes[i][0], []).append(takes[i][1])
    return tuple(Piece(e, key, tuple(t)) for (e, key), t in grouped.items())


def _units_named(saved: Mapping[str, Any], epoch: int) -> list:
    """The positions of ``epoch`` a rank's saved position refers to."""
    return [u for e, u, _, _ in saved["carry"] if e == epoch] + \
        ([] if saved["end"] else [saved["unit"]])
