"""The remainder a merged state describes: each old rank's takes, grouped into pieces.

:func:`gluon_stream.merge_states` joins the old ranks' positions into a spec; :func:`resolve`
cuts what each rank has left (:mod:`~gluon_stream._pipeline.quotas` with ``samples_per_epoch``,
:mod:`~gluon_stream._pipeline.window_cuts` with a shuffle window) into a
:class:`~gluon_stream._pipeline.remainder.Remainder`.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping

from ..errors import InvalidState
from .keys import part_endless
from .quotas import KeysOf, Quotas, SizeOf
from .remainder import Drawn, Mixed, Piece, Remainder, Take, remainder_deal
from .sizes import stride_of
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
    epoch, parts, deal = spec["epoch"], spec["parts"], spec["deal"]
    quota = spec.get("samples_per_epoch")
    endless = bool(spec.get("endless")) and quota is None
    if endless and (drawn is None or drawn.epoch != epoch):
        if endless_of is None:
            raise InvalidState("the state was saved reading endless keys: this loader's keys "
                               "are a list (field 'keys'); build it with the same keys")
        drawn = Drawn(epoch, endless_of(epoch))
    prior = resolve(spec["prior"], keys_of, endless_of, drawn, size_of) \
        if spec.get("prior") else None
    full_of: dict[tuple, int] = {}  # samples_per_epoch: (epoch, key) -> the shard's samples
    own = Quotas(spec, keys_of, endless_of, size_of, full_of) if quota is not None else None
    # which stride of each of its pieces a rank read (saved with its state: see stride_of)
    turns = spec["prior"].get("turns") if prior is not None else None
    if deal == "balanced" and prior is not None and not spec["prior"].get("turned"):
        turns = None  # saved before balanced strides turned across pieces: read equal ones
    # the prior's balanced pieces (and tail) turned where no rank counted them ahead too, by
    # the rows before them the producers learned (the ranks' rows_before); a piece none of
    # them reached: each its own stride, which together are all its rows
    learned = prior is not None and bool(spec["prior"].get("learned"))
    # deal='balanced': the rows before the shards the ranks stood in, which turn their strides
    # (a shard none of them reached: every rank's own stride, which together are all its rows)
    before = {int(u): int(n) for saved in spec["ranks"]
              for u, n in saved.get("rows_before", ())}
    lists: dict[tuple[int, int], list] = {}
    tail_start = 0
    tail_at: int | None = None  # an endless remainder read before: where its tail keys start
    if endless:  # each old rank's keys as far as any rank got, then the tail
        assert drawn is not None
        same = prior if prior is not None and prior.epoch == epoch else None
        base = list(same.pieces) if same is not None else []
        tail_at = len(base) if same is not None else None
        start = same.tail_start if same is not None else 0
        need = max([u - len(base) + 1 for saved in spec["ranks"]
                    for u in _units_named(saved, epoch)] + [0])
        tail_start = start + (need * parts if deal == "shards" and parts > 1 else need)
        if any(saved["end"] for saved in spec["ranks"]):  # a rank saw the iterator end: the
            tail_start = drawn.upto_end()  # other ranks' keys are all drawn, none after them
        drawn_keys = drawn.upto(tail_start)[start:]
        for rank in range(parts):
            lists[(epoch, rank)] = base + list(part_endless(drawn_keys, parts, rank, deal))

    def units(e: int, rank: int) -> list:
        if prior is not None and e == prior.epoch and not endless:
            return list(prior.pieces)
        if (e, rank) not in lists:
            if endless:
                raise InvalidState(f"field 'last_batch': the state of rank {rank} holds "
                                   f"samples epoch {e} of an endless key iterator rolled over "
                                   f"into epoch {epoch}: two epochs of an iterator are not "
                                   "drawn again; resume on the same number of ranks")
            lists[(e, rank)] = list(keys_of(e, parts, rank, deal))
        return lists[(e, rank)]

    def take(e: int, unit: int, rank: int, start: int, stop: int | None,
             expect: int | None = None, mixed: Mixed | None = None) -> tuple[tuple, Take]:
        found = units(e, rank)
        if unit >= len(found):
            raise InvalidState(f"the state of rank {rank} refers to shard {unit} of epoch {e}, "
                               f"which has {len(found)}: the keys changed since it was saved")
        item = found[unit]
        if isinstance(item, Piece) and prior is not None and prior.sizes is not None:
            full_of[(item.epoch, item.key)] = prior.sizes[unit]
        if isinstance(item, Piece):
            read_before = turns[unit] if turns else None
            read = remainder_deal(deal, read_before)
            if learned and deal == "balanced" and read_before is None:
                read_before, read = before.get(unit), "strides"
            return (item.epoch, item.key), Take(item, parts,
                                                stride_of(rank, parts, read, read_before),
                                                read, start, stop, expect, mixed)
        if deal == "balanced" and parts > 1 and e == epoch and tail_at is not None \
                and unit >= tail_at and not learned:  # the tail read before: equal strides
            return (e, item), Take(None, parts, rank, "samples", start, stop, expect, mixed)
        if deal == "balanced" and parts > 1:
            return (e, item), Take(None, parts, stride_of(rank, parts, deal, before.get(unit)),
                                   "strides", start, stop, expect, mixed)
        return (e, item), Take(None, parts, rank, deal, start, stop, expect, mixed)

    window = int(spec.get("window", 1))

    per_rank: list[list[tuple[tuple, Take]]] = []
    for rank, saved in enumerate(spec["ranks"]):
        if own is not None and "pass" in saved:  # read its own stream: the rest of its quota
            per_rank.append(own.takes(saved, rank))
            continue
        check_rank_keys(saved, [p.key if isinstance(p, Piece) else p
                                for p in units(epoch, rank)], epoch, rank)
        if window > 1:
            per_rank.append(WindowCuts(saved, rank, epoch, window, spec["seed"], units,
                                        take).takes())
            continue
        takes = [take(e, u, rank, a, b) for e, u, a, b in saved["carry"]]
        if not saved["end"] and saved["unit"] > len(units(epoch, rank)):
            raise InvalidState(f"the state of rank {rank} stands at shard {saved['unit']} of "
                               f"epoch {epoch}, which has {len(units(epoch, rank))}: the keys "
                               "changed since it was saved")
        if not saved["end"] and saved["unit"] < len(units(epoch, rank)):  # else: all read
            takes.append(take(epoch, saved["unit"], rank, saved["offset"], None))
            takes += [take(epoch, j, rank, 0, None)
                      for j in range(saved["unit"] + 1, len(units(epoch, rank)))]
        per_rank.append(takes)
    grouped: dict[tuple, list[Take]] = {}  # the order of first appearance, ranks in turn
    for i in range(max((len(t) for t in per_rank), default=0)):
        for takes in per_rank:
            if i < len(takes):
                grouped.setdefault(takes[i][0], []).append(takes[i][1])
    pieces = tuple(Piece(e, key, tuple(t)) for (e, key), t in grouped.items())
    sizes = None
    if own is not None:
        assert size_of is not None  # Quotas refused a spec without it
        sizes = tuple(full_of[p.epoch, p.key] if (p.epoch, p.key) in full_of
                      else size_of(p.key, p.epoch) for p in pieces)
    return Remainder(epoch, pieces, spec, drawn if endless else None, tail_start, sizes)


def _units_named(saved: Mapping[str, Any], epoch: int) -> list:
    """The positions of ``epoch`` a rank's saved position refers to."""
    return [u for e, u, _, _ in saved["carry"] if e == epoch] + \
        ([] if saved["end"] else [saved["unit"]])
