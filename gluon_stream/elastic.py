"""Elastic resume: the states N ranks saved at one step, merged into one that M ranks load.

:func:`merge_states` joins the ranks' positions into a description of what none of them trained
yet in the interrupted epoch (see :mod:`gluon_stream._stages.keys`); every new rank loads
the same merged state with ``load_state_dict`` and reads its stride of that remainder, then the
next epochs as a job of its world size reads them. Only the saved states and the new world size
decide what each rank reads: no rank needs another's, nothing is communicated. With
``samples_per_epoch`` what is left of each old rank's epoch, and where a fresh job's next epoch
starts, are found by the shards' sizes (counted by producing a shard where none is known).
"""
from __future__ import annotations

import json
import warnings
from typing import Any, Callable, Iterator, Mapping, Sequence

from ._stages.batching import Position, Segment
from ._stages.keys import Remainder
from ._stages.resolve import resolve
from ._stages.state import STATE_VERSION, LoaderState, checksum, unit_lengths, verify
from .errors import InvalidState
from .stream import ShardStream

__all__ = ["FIXED_SETTINGS", "load_any", "load_merged", "merge_states", "remainder_fields"]

#: Settings an elastic resume keeps (the world size, ``batch_size`` and ``num_workers`` may
#: change; the deal of the shards follows the world size).
FIXED_SETTINGS = ("seed", "shuffle", "last_batch", "shuffle_window", "even_batches",
                  "samples_per_epoch", "context_rows")  # context_rows: saved only where set
def merge_states(states: Sequence[Mapping[str, Any]], *,
                 synchronous: bool | None = None) -> dict:
    """One state that any rank of any world size loads, from the states of all ranks of a job
    saved at the same step (``loader.state_dict()`` on every rank, in any order).

    In a synchronous job every rank has delivered as many batches at a step, so ranks whose
    states stand at other positions are states of different steps (a rank's file left from an
    earlier checkpoint): refused where the job is known to be synchronous (``synchronous=True``;
    ``even_batches``; or None, the default, where the states say so: saved by loaders whose
    ranks came from a ``dist_sync`` kvstore or Horovod), else a warning naming the ranks and
    their positions (``synchronous=False``: the ranks train independently, nothing compared).

    Loaded with ``load_state_dict`` by each rank of the new job (built with the same arguments,
    but any ``num_parts``/``part_index``, ``batch_size`` and ``num_workers``), the interrupted
    epoch goes on with exactly the samples no old rank trained, each once, dealt to the new
    ranks by the usual even rules; the epochs after it are those a fresh job of the new size
    reads. The merged state is JSON-serialisable and checksummed like a rank's own.

    Raises:
        InvalidState: a state is not a rank's state or was edited; a rank's state is missing
            or given twice; the states were saved at different steps (different epochs; or,
            in a synchronous job, after different batch counts: the ranks and positions are
            named) or with other settings (the field is named); a state saved with
            ``shuffle_window > 1`` does
            not record the lengths of the mixed units it read part of (``unit_lengths``: an
            older gluon_stream's), or records lengths its shards no longer have (when the new
            ranks read them).

    Example:
        >>> merged = merge_states([state_0, state_1])  # doctest: +SKIP
        >>> loader.load_state_dict(merged)              # on each of the new ranks # doctest: +SKIP
    """
    by_rank = _checked_states(states)
    first = by_rank[0]["settings"]
    epoch = max(_epoch_of(s) for s in by_rank)
    prior = _prior(by_rank)
    ranks = [_rank_spec(state, rank, epoch, first) for rank, state in enumerate(by_rank)]
    _check_steps(by_rank, first, synchronous)  # here: its warning names merge_states' caller
    left = any(not r["end"] or r["carry"] for r in ranks)
    spec = _remainder_spec(by_rank, first, epoch, prior, ranks) if left else None
    # every rank stood at the next epoch's start (its pass ended: do_checkpoint, the docs' loop
    # over range(state["epoch"], ...)): so does the merge, or a resumed pass would be empty
    started = not left and all(_epoch_of(s) != s["epoch"] for s in by_rank)
    out: dict = {"version": STATE_VERSION, "elastic": spec, "epoch": epoch + started,
                 "end": not left and not started,
                 "settings": {name: first.get(name) for name in FIXED_SETTINGS if name in first}}
    out["digest"] = checksum(out)
    return out


def _checked_states(states: Any) -> list:
    """The ranks' states in rank order: a list of plain rank states (not merged ones), each
    verified, every rank of one job once, all saved with the same :data:`FIXED_SETTINGS`."""
    if isinstance(states, (Mapping, str, bytes)) or not isinstance(states, Sequence) \
            or not states:
        got = "an empty list" if isinstance(states, Sequence) and not states \
            else type(states).__name__
        raise InvalidState(f"merge_states takes the list of every rank's state, got {got}")
    for index, state in enumerate(states):
        if isinstance(state, Mapping) and "elastic" in state:
            raise InvalidState(f"state {index} is a merged state: merge the states the ranks "
                               "saved after loading it")
    by_rank = _by_rank([verify(s, ("version", "digest", "settings", "epoch", "end", "unit",
                                   "offset", "batches", "carry")) for s in states])
    first = by_rank[0]["settings"]
    for rank, state in enumerate(by_rank):
        for name in FIXED_SETTINGS:
            if state["settings"].get(name) != first.get(name):
                raise InvalidState(
                    f"field {name!r}: rank {rank}'s state was saved with {name}="
                    f"{state['settings'].get(name)!r}, rank 0's with {first.get(name)!r}: not "
                    "states of one job")
    return by_rank


def _remainder_spec(by_rank: list, first: Mapping[str, Any], epoch: int, prior: Any,
                    ranks: list) -> dict:
    """The merged state's ``elastic`` field: what no old rank trained yet in ``epoch`` (each
    rank's position in ``ranks``), as :mod:`gluon_stream._stages.keys` reads it."""
    spec = {"epoch": epoch, "parts": len(by_rank), "deal": first.get("deal", "shards"),
            "prior": prior, "ranks": ranks}
    # deal='balanced': the pieces' strides turn by the rows left before them, learned as they
    # are made where no rank counts them ahead
    spec["learned"] = True
    if first.get("samples_per_epoch") is not None:  # each rank's quota
        spec["samples_per_epoch"] = first["samples_per_epoch"]
    if first.get("shuffle_window", 1) != 1:  # the mixed units to cut
        spec.update(window=first["shuffle_window"], seed=first.get("seed"))
    fixed = first.get("samples_per_epoch") is not None  # a remainder's pieces: a key list
    if any("keys" not in s for s in by_rank if not (fixed and _reading(s))):  # an endless
        spec["endless"] = True  # iterator
    return spec


def load_merged(state: Mapping[str, Any], settings: Mapping[str, Any],
                keys_of: Callable[[int, int, int, str], Sequence[Any]],
                endless_of: Callable[[int], Iterator[Any]] | None = None,
                size_of: Callable[[Any, int], int] | None = None
                ) -> tuple[LoaderState, Remainder | None]:
    """Where a loader with ``settings`` starts from a merged state, and the remainder it reads
    in place of the interrupted epoch's keys (``keys_of(epoch, parts, part, deal)``: the shard
    order a rank of the old job read; ``endless_of(epoch)``: an endless iterator's keys, drawn
    anew from its beginning; ``size_of(key, epoch)``: a shard's samples, with
    ``samples_per_epoch``)."""
    verify(state, ("version", "digest", "elastic", "epoch", "end", "settings"))
    saved = state["settings"]
    for name in FIXED_SETTINGS:
        if saved.get(name) != settings.get(name):
            raise InvalidState(
                f"field {name!r}: the merged state was saved with {name}={saved.get(name)!r}, "
                f"this loader has {settings.get(name)!r}; an elastic resume may change only the "
                "number of ranks, batch_size and num_workers: build the loader as before")
    epoch = state["epoch"]
    fixed = saved.get("samples_per_epoch") is not None
    if state["elastic"] is None:  # every rank ended the epoch: the next starts afresh
        # samples_per_epoch: where a fresh job of this world size starts it in the stream
        return LoaderState(Position(epoch, end=bool(state["end"])),
                           loader_epoch=epoch if fixed else None, fresh=fixed), None
    remainder = resolve(state["elastic"], keys_of, endless_of, size_of=size_of)
    return LoaderState(Position(epoch), loader_epoch=epoch if fixed else None), remainder


def load_any(state: Any, settings: Mapping[str, Any], stream: ShardStream,
             decode: Callable[[], LoaderState]) -> LoaderState:
    """Where a loader starts from ``state``: a merged state, a state saved while reading a
    remainder (installed on ``stream`` for it), or a rank's plain state (``decode`` decodes
    those). A refused state leaves the stream's remainder as it was."""
    def dealt(epoch: int, parts: int, part: int, deal: str) -> list:
        return stream.dealer.dealt_keys(epoch, parts, part, deal, settings["seed"])

    before = stream.dealer.remainder
    try:
        if isinstance(state, Mapping) and "elastic" in state:
            start, remainder = load_merged(state, settings, dealt, stream.dealer.endless_keys,
                                           stream.producer.counted_size)
            stream.set_remainder(remainder)
            return start
        if isinstance(state, Mapping) and "remainder" in state:
            verify(state)
            stream.set_remainder(resolve(state["remainder"], dealt, stream.dealer.endless_keys,
                                         size_of=stream.producer.counted_size))
        else:
            stream.set_remainder(None)
        return decode()
    except BaseException:
        stream.set_remainder(before)
        raise


def remainder_fields(stream: ShardStream, epoch: int, loader_epoch: int | None = None
                     ) -> dict | None:
    """What a state saved in ``epoch`` (the loader's: ``loader_epoch``) holds of the
    remainder ``stream`` reads (None: none it needs): its spec, and the stride each piece gave
    this rank (a merge needs them). With ``samples_per_epoch`` only a state in the remainder
    needs it: the next epoch is read from the stream, not after the remainder."""
    remainder = stream.dealer.remainder
    if remainder is None or epoch > remainder.epoch + 1:
        return None
    if remainder.fixed and (loader_epoch != remainder.epoch or epoch != remainder.epoch):
        return None
    turns = [stream.sizes.rows_before(remainder.epoch, k) for k in range(len(remainder.pieces))]
    # turned: 'balanced' pieces are read by turning strides where ``turns`` holds a number
    # (an older state's numbers were not used so: its pieces were cut to equal strides)
    return {"remainder": dict(remainder.spec, turns=turns, turned=True)}


def _by_rank(states: list) -> list:
    """The states in rank order: each rank once, every rank of the job."""
    parts = states[0]["settings"].get("num_parts")
    found: dict[int, Mapping[str, Any]] = {}
    for state in states:
        settings = state["settings"]
        rank = settings.get("part_index")
        if settings.get("num_parts") != parts:
            raise InvalidState(f"rank {rank}'s state was saved by a job of "
                               f"{settings.get('num_parts')} ranks, another's by one of {parts}: "
                               "not states of one job")
        if rank in found:
            raise InvalidState(f"rank {rank}'s state is given twice: give each rank's state once")
        found[rank] = state
    missing = [r for r in range(parts) if r not in found]
    if missing:
        raise InvalidState(f"the state of rank {missing[0]} of {parts} is missing (missing: "
                           f"{missing}): every rank's state is needed, or its samples would be "
                           "skipped")
    return [found[r] for r in range(parts)]


def _epoch_of(state: Mapping[str, Any]) -> int:
    """The epoch a rank's state stands in; a state at an epoch's very start counts as the end
    of the one before (with what it rolled over), but for one at the start of the remainder it
    reads (it is in that epoch). With ``samples_per_epoch`` an epoch starts where the one
    before stopped in the stream: at its start the state has read no sample of it."""
    if "taken" in state:  # samples_per_epoch
        at_start = not state["taken"] and not state["end"] and not state["batches"]
    else:
        at_start = not state["end"] and not state["unit"] and not state["offset"] \
            and not state["batches"]
    return state["epoch"] - 1 if at_start and state["epoch"] > 0 and not _reading(state) \
        else state["epoch"]


def _reading(state: Mapping[str, Any]) -> bool:
    """Whether a rank's state stands in the remainder it reads (not in the epoch after it)."""
    remainder = state.get("remainder")
    return isinstance(remainder, Mapping) and remainder.get("epoch") == state["epoch"]


def _rank_spec(state: Mapping[str, Any], rank: int, epoch: int,
               first: Mapping[str, Any]) -> dict:
    carry = [[s["epoch"], s["unit"], s["start"], s["stop"]] for s in state["carry"]]
    fixed = first.get("samples_per_epoch") is not None
    # samples_per_epoch: a state at the next epoch's start adds nothing (see below)
    if first.get("shuffle_window", 1) != 1 and not (fixed and state["epoch"] != epoch):
        _check_unit_lengths(state, rank, first["shuffle_window"])
    if state["epoch"] != epoch:
        if _epoch_of(state) != epoch:
            raise InvalidState(
                f"rank {rank}'s state is in epoch {state['epoch']}, another's in epoch {epoch}: "
                "states from different steps; save every rank's state at the same step")
        # samples_per_epoch: what it rolled over is left out (as a short batch is): after a
        # remainder they are samples of a fresh job's epoch before, not of this one
        out = {"end": True, "unit": 0, "offset": 0, "carry": [] if fixed else carry,
               "keys": None}
    else:
        out = {"end": state["end"], "unit": state["unit"], "offset": state["offset"],
               "carry": carry, "keys": state.get("keys")}
        if state.get("rows_before"):  # deal='balanced': which stride of each shard it takes
            out["rows_before"] = state["rows_before"]
    if fixed and not _reading(state):  # its own stream: where, and its epoch's samples read
        out.update({"pass": state["pass"], "taken": state["taken"]})
    if state.get("unit_lengths"):  # shuffle_window > 1: how its mixed units are cut
        out["unit_lengths"] = state["unit_lengths"]
    return out


def _check_unit_lengths(state: Mapping[str, Any], rank: int, window: int) -> None:
    """A rank's state with a shuffle window records the lengths of every mixed unit it read
    part of: what is left of their shards is cut by them."""
    epoch = state.get("pass", state["epoch"])  # samples_per_epoch: the pass over the keys
    lengths = unit_lengths(state.get("unit_lengths", []), window, epoch)
    carry = tuple(Segment(s["epoch"], s["unit"], s["start"], s["stop"]) for s in state["carry"])
    read = Position(epoch, state["unit"], state["offset"], carry,
                    bool(state["end"])).units_read()
    missing = sorted(read - set(lengths))
    if missing:
        raise InvalidState(
            f"field 'unit_lengths': rank {rank}'s state does not record the lengths of the "
            f"shards of mixed unit {missing[0][1]} of epoch {missing[0][0]}, which it read part "
            "of (saved by an older gluon_stream?): save it again with this one, or resume on "
            "the same number of ranks")


def _check_steps(states: list, first: Mapping[str, Any], synchronous: bool | None) -> None:
    """Where the ranks step together, positions that differ mean a state of another step.

    With even_batches every rank has delivered as many batches, its pass over or not. In a
    synchronous job (``synchronous=True``, or states saved by one: their ``job``) the ranks
    still in the epoch have delivered as many, and a rank whose pass is over no more than they.
    Where that cannot be told (``synchronous=None``, no ``job``) the same test warns: the ranks
    may train at their own pace, or a state is stale."""
    steps = [(s["epoch"], s["batches"]) for s in states]
    if first.get("even_batches"):
        odd = _odd_step(steps, {r: b for r, (_, b) in enumerate(steps)}, {})
        why: str | None = "even_batches: every rank delivers as many"
    elif synchronous is False:
        return
    else:
        odd = _odd_step(steps, {r: s["batches"] for r, s in enumerate(states)
                                if not s["end"] and _epoch_of(s) == s["epoch"]},
                        {r: s["batches"] for r, s in enumerate(states) if s["end"]})
        jobs = sorted({str(s["job"]) for s in states if s.get("job")})
        why = ("a synchronous job: the ranks step together" if synchronous else
               f"saved by a {' / '.join(jobs)} job: the ranks step together" if jobs else None)
    if odd is None:
        return
    behind, ahead = odd
    where = ", ".join(f"rank {r}: {b} batch(es) of epoch {e}{' (ended)' if s['end'] else ''}"
                      for r, ((e, b), s) in enumerate(zip(steps, states)))
    if why is not None:
        raise InvalidState(
            f"rank {ahead}'s state is after {steps[ahead][1]} batch(es) of epoch "
            f"{steps[ahead][0]}, rank {behind}'s after {steps[behind][1]} of epoch "
            f"{steps[behind][0]} ({where}): states from different steps ({why}); rank "
            f"{behind}'s may be a file left from an earlier checkpoint. Save every rank's state "
            "at the same step")
    warnings.warn(
        f"merge_states: the ranks' states stand at different positions ({where}). In a "
        "synchronous job (dist_sync, Horovod) the ranks step together, so a state of "
        f"rank {behind} or {ahead} is from another step (a rank's file left from an earlier "
        "checkpoint) and merging it would repeat or skip samples: pass synchronous=True to "
        "refuse such states, or synchronous=False if the ranks train independently",
        RuntimeWarning, stacklevel=3)


def _odd_step(steps: list, going: Mapping[int, int], ended: Mapping[int, int]
              ) -> tuple[int, int] | None:
    """(behind, ahead): two ranks whose positions cannot be of one step of a job whose ranks
    step together (``going``: the batches of those still in the epoch; ``ended``: of those
    whose pass is over, which may have run out earlier), or None."""
    if going and len(set(going.values())) > 1:
        return min(going, key=going.__getitem__), max(going, key=going.__getitem__)
    if going and ended and max(ended.values()) > min(going.values()):
        return min(going, key=going.__getitem__), max(ended, key=ended.__getitem__)
    if len({e for e, _ in steps}) > 1 and not ended and len(going) == len(steps):
        return min(range(len(steps)), key=steps.__getitem__), \
            max(range(len(steps)), key=steps.__getitem__)
    return None


def _prior(states: list) -> Any:
    """The remainder the ranks were reading (a resize during an elastic resume), the same in
    every state that holds one."""
    specs = [(rank, s["remainder"]) for rank, s in enumerate(states) if "remainder" in s]
    if not specs:
        return None
    text = json.dumps(specs[0][1], sort_keys=True)
    for rank, spec in specs:
        if json.dumps(spec, sort_keys=True) != text:
            raise InvalidState(f"rank {rank}'s state reads another remainder than rank "
                               f"{specs[0][0]}'s: states of different resumes")
    return specs[0][1]
