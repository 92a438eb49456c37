"""A loader's position as plain data, for exact resume: encoded, checked, decoded.

A :class:`LoaderState` composes the positions of the stages that own them: the planner's
(:class:`~gluon_stream._stages.batching.Position`: the next unit and row, the samples carried, or
the end of the epoch), the run's (shards it skipped that a resume must skip again), and
even_batches' (the batch a part left short repeats). Encoded, it also holds enough to tell whether a
loader can continue from it: the settings that decide the batches, the keys at the positions it
refers to (a digest of the epoch's keys up to the next shard, and each carried segment's key), and a
checksum of all of it, so that a hand-edited or damaged state is refused with an
:class:`~gluon_stream.InvalidState` naming the problem, never resumed elsewhere.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from .._utils import validate as _validate
from ..errors import InvalidState
from .batching import Position, Segment, WindowMixer

__all__ = ["STATE_VERSION", "LoaderState", "UnitLengths", "check_rank_keys", "check_segment_key",
           "checksum", "decode_state", "encode_state", "keys_digest", "unit_lengths", "verify"]

STATE_VERSION = 3
_JSON_KEY = (str, int, float)
_FIELDS = {"version", "epoch", "end", "unit", "offset", "batches", "carry", "skipped",
           "settings", "digest"}  # and, where they apply: "repeat", "lead", "keys", "drawn",
#                         "rows_before", "unit_lengths"

#: ``((epoch, unit, (samples of each of the unit's shards, ...)), ...)``: see
#: :attr:`LoaderState.unit_lengths`.
UnitLengths = tuple[tuple[int, int, tuple[int, ...]], ...]
#: ``epoch_keys(epoch)``: an epoch's shard order for this part (None: an endless iterator).
EpochKeys = Callable[[int], "Sequence[Any] | None"]
#: ``key_at(epoch, i)``: an endless iterator's key ``i`` in pass ``epoch``, drawn up to it, as
#: ``(key, None)`` or ``(None, why there is none)``; None where keys are not drawn again.
KeyAt = Callable[[int, int], "tuple[Any, str | None] | None"]


@dataclass(frozen=True)
class LoaderState:
    """Where a loader stands between batches, as its stages hold it.

    Attributes:
        position: The planner's position (see :class:`~gluon_stream._stages.batching.Position`).
        delivered: Batches of the epoch delivered so far (they number the next batches).
        skipped: Shards, as ``(epoch, position in the epoch)``, that failed with
            ``on_error='skip'`` and that a resume reads from or around (a shuffle window mixes
            them as empty shards): they stay skipped, without being produced again.
        repeat: even_batches: the last full batch delivered, repeated by a part that runs
            short of the batch count every part yields (empty before the first one).
        repeat_number: That batch's number in the epoch (its random augmentation).
        lead: even_batches='pad' without sizes known ahead: the largest part's samples in the
            shards before the position's, which the batch count every part yields needs.
        loader_epoch: ``samples_per_epoch``: the loader's epoch, while the position's epoch
            is the pass over the keys it reads (None: the two are one).
        rows_before: ``deal='balanced'``: ``(position, rows)`` for each shard of the epoch a
            resume reads again or starts from: the rows of the shards before it, which decide
            the strides a part takes of it (a resume does not read those shards again).
        unit_lengths: ``shuffle_window > 1``: ``(epoch, unit, lengths)`` for each mixed unit
            the position has read part of (its unit, or the one before it at a unit's start,
            and each carried segment's): this part's samples of each of the unit's
            ``shuffle_window`` shards (:attr:`~gluon_stream._stages.batching.MixedUnit.lengths`),
            which decide which rows of each shard the unit's positions hold. An elastic resume
            (:func:`gluon_stream.merge_states`) cuts what is left of those shards by them; a
            resume on the same world size rebuilds the units from the shards instead.
        fresh: ``samples_per_epoch`` after an elastic resume (a merged state): the position
            is no place in this part's stream; the epoch (the next one, where it says its
            epoch ended) starts where a fresh job of this world size starts it, counted when
            it is needed (:meth:`~gluon_stream._stages.epoch.PassStarts.fresh_start`).
    """

    position: Position
    delivered: int = 0
    skipped: tuple[tuple[int, int], ...] = ()
    repeat: tuple[Segment, ...] = ()
    repeat_number: int = 0
    lead: int = 0
    loader_epoch: int | None = None
    rows_before: tuple[tuple[int, int], ...] = ()
    unit_lengths: UnitLengths = ()
    fresh: bool = False

    @property
    def epoch(self) -> int:
        """The loader's epoch."""
        return self.position.epoch if self.loader_epoch is None else self.loader_epoch


def keys_digest(keys: Sequence[Any]) -> str:
    """A short digest of a key list (its order counts)."""
    text = json.dumps([[type(k).__name__, str(k)] for k in keys], separators=(",", ":"))
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]


def _checksum(fields: Mapping[str, Any]) -> str:
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:20]


def _key(key: Any) -> Any:
    if key is None or (isinstance(key, _JSON_KEY) and not isinstance(key, bool)):
        return key
    return str(key)


def _segments(segments: Sequence[Segment]) -> list:
    return [{"epoch": s.epoch, "unit": s.unit, "start": s.start, "stop": s.stop,
             "key": _key(s.key)} for s in segments]


def encode_state(state: LoaderState, settings: Mapping[str, Any],
                 epoch_keys: Sequence[Any] | None, drawn: tuple[int, Any] | None = None,
                 extra: Mapping[str, Any] | None = None) -> dict:
    """The JSON-serialisable form of ``state``, checksummed.

    ``epoch_keys`` is the shard order of the position's epoch (its pass over the keys) for this
    part (None for endless key iterators). ``drawn``: an endless iterator's (position, key) at
    or before the state's shard, for a resume to check that its iterator gives the same keys.
    ``extra``: more fields (an elastic resume's remainder, read in place of an epoch's keys).
    """
    position = state.position
    out: dict = {"version": STATE_VERSION, "epoch": state.epoch, "end": position.end,
                 "unit": position.unit, "offset": position.offset, "batches": state.delivered,
                 "carry": _segments(position.carry),
                 "skipped": [[epoch, j] for epoch, j in sorted(state.skipped)],
                 "settings": dict(settings)}
    if state.repeat:
        out["repeat"] = {"batch": state.repeat_number, "segments": _segments(state.repeat)}
    if state.lead:
        out["lead"] = state.lead
    if state.rows_before:
        out["rows_before"] = [[unit, rows] for unit, rows in state.rows_before]
    if state.unit_lengths:
        out["unit_lengths"] = [[epoch, unit, list(lengths)]
                               for epoch, unit, lengths in state.unit_lengths]
    if state.loader_epoch is not None:  # samples_per_epoch
        out["pass"], out["taken"] = position.epoch, position.taken
    if epoch_keys is not None:
        seen = list(epoch_keys[:position.unit + 1])
        out["keys"] = {"count": len(seen), "digest": keys_digest(seen),
                       "next": _key(seen[position.unit]) if position.unit < len(seen) else None}
    elif drawn is not None:
        out["drawn"] = {"position": drawn[0], "key": _key(drawn[1])}
    out.update(extra or {})
    out["digest"] = _checksum(out)
    return out


def checksum(fields: Mapping[str, Any]) -> str:
    """The checksum a state's ``digest`` holds, of its other fields."""
    return _checksum(fields)


def verify(state: Any, fields: Sequence[str] = ("version", "digest")) -> Mapping[str, Any]:
    """``state`` if it is a dict of this version holding ``fields`` whose checksum matches
    (a state edited or damaged after it was saved is refused)."""
    if not isinstance(state, Mapping):
        raise InvalidState(f"not a StreamLoader state: a dict is expected, got "
                           f"{type(state).__name__}")
    if "version" in state and state["version"] != STATE_VERSION:
        raise InvalidState(f"state field 'version' is {state['version']!r}; this gluon_stream "
                           f"reads version {STATE_VERSION} (save the state again with it)")
    missing = set(fields) - set(state)
    if missing:
        raise InvalidState(f"not a StreamLoader state: missing {sorted(missing)}")
    _check_checksum(state)
    return state


def decode_state(state: Any, settings: Mapping[str, Any], batch_size: int,
                 epoch_keys: EpochKeys, key_at: KeyAt | None = None) -> LoaderState:
    """Check ``state`` against this loader and return it decoded.

    Raises:
        InvalidState: the state is not one of a StreamLoader of this version, it was edited
            or damaged (its checksum), it was saved with other settings, a field is out of
            range, or the keys it refers to changed (or, from an endless iterator, cannot be
            drawn again up to where it resumes).
    """
    verify(state, sorted(_FIELDS))
    saved = state["settings"]
    differ = {k: (saved.get(k), v) for k, v in settings.items()
              if not isinstance(saved, Mapping) or saved.get(k) != v}
    if isinstance(saved, Mapping):  # a setting saved only where set (context_rows), unset here
        differ.update({k: (v, None) for k, v in saved.items() if k not in settings and v})
    if differ:
        raise InvalidState(f"state was saved by a loader with other settings "
                           f"(saved, this one): {differ}; build the loader as before")
    loader_epoch = None
    epoch = _int(state, "epoch")
    if settings.get("samples_per_epoch") is not None:  # the position is in a pass over the keys
        loader_epoch, epoch = epoch, _int(state, "pass")
    position = Position(epoch, _int(state, "unit"), _int(state, "offset"),
                        _carry(state["carry"], epoch, batch_size), _bool(state, "end"),
                        _int(state, "taken") if loader_epoch is not None else 0)
    delivered = _int(state, "batches")
    skipped = _positions(state["skipped"], epoch)
    repeat: tuple[Segment, ...] = ()
    number = 0
    if state.get("repeat") is not None:
        repeat, number = _repeat(state["repeat"], epoch, batch_size, delivered,
                                 settings.get("even_batches") == "pad")
    lead = _int(state, "lead") if "lead" in state else 0
    rows_before = _pairs(state.get("rows_before", []), "rows_before", "shard position, rows")
    lengths = unit_lengths(state.get("unit_lengths", []), settings.get("shuffle_window", 1), epoch)
    keys = epoch_keys(epoch)
    _check_keys(state, epoch, position.unit, keys)
    for segment in position.carry + repeat:
        check_segment_key(segment, epoch_keys(segment.epoch) if segment.epoch != epoch else keys)
    if keys is None and key_at is not None:
        window = settings.get("shuffle_window", 1)
        first = min([WindowMixer.first_shard(s.unit, window) for s in position.carry + repeat
                     if s.epoch == epoch] + [WindowMixer.first_shard(position.unit, window)])
        _check_drawn(state, epoch, position.unit, key_at, first)
    return LoaderState(position, delivered, skipped, repeat, number, lead, loader_epoch,
                       rows_before, tuple((e, u, n) for (e, u), n in lengths.items()))


def unit_lengths(values: Any, window: Any, epoch: int) -> dict[tuple[int, int], tuple[int, ...]]:
    """State field ``unit_lengths`` checked (see :attr:`LoaderState.unit_lengths`):
    ``{(epoch, unit): lengths}``, each unit once, of an epoch up to ``epoch``, ``window``
    lengths each, none of a shard before the epoch's first."""
    field = "unit_lengths"
    if not isinstance(values, (list, tuple)) or not all(
            isinstance(v, (list, tuple)) and len(v) == 3 and isinstance(v[2], (list, tuple))
            for v in values):
        raise InvalidState(f"state field {field!r} must be a list of [epoch, unit, [samples "
                           f"of each shard]], got {values!r}")
    if values and (not isinstance(window, int) or isinstance(window, bool) or window < 2):
        raise InvalidState(f"state field {field!r} is only saved with shuffle_window > 1, "
                           f"this state's is {window!r}")
    out: dict[tuple[int, int], tuple[int, ...]] = {}
    for e, u, lengths in values:
        key = (_int({field: e}, field), _int({field: u}, field))
        if key in out or key[0] > epoch:
            raise InvalidState(f"state field {field!r} names unit {key[1]} of epoch {key[0]} "
                               f"{'twice' if key in out else f'after the state epoch {epoch}'}")
        if len(lengths) != window:
            raise InvalidState(f"state field {field!r} holds {len(lengths)} lengths for unit "
                               f"{key[1]} of epoch {key[0]}, not one per shard of the window "
                               f"(shuffle_window={window})")
        counts = tuple(_int({field: n}, field) for n in lengths)
        if any(counts[:max(0, window - 1 - key[1])]):
            raise InvalidState(f"state field {field!r} gives samples to a shard before the "
                               f"first of epoch {key[0]} (unit {key[1]}: {list(counts)})")
        out[key] = counts
    return out


def _check_checksum(state: Mapping[str, Any]) -> None:
    fields = {k: v for k, v in state.items() if k != "digest"}
    try:
        expected = _checksum(fields)
    except (TypeError, ValueError) as exc:
        raise InvalidState(f"state holds a value JSON cannot hold ({exc}): not a state saved by "
                           "state_dict()") from None
    if state["digest"] != expected:
        raise InvalidState("the state's fields do not match its checksum ('digest'): it was "
                           "edited or damaged after state_dict() saved it. Resume from the state "
                           "as saved, or start the epoch afresh")


def _int(state: Mapping[str, Any], field: str, minimum: int = 0) -> int:
    if field not in state:
        raise InvalidState(f"not a state of this loader: field {field!r} is missing")
    try:
        return _validate.integer(f"state field {field!r}", state[field], minimum=minimum)
    except ValueError as exc:
        raise InvalidState(str(exc)) from None


def _bool(state: Mapping[str, Any], field: str) -> bool:
    if not isinstance(state[field], bool):
        raise InvalidState(f"state field {field!r} must be true or false, got {state[field]!r}")
    return state[field]


def _pairs(values: Any, field: str, what: str) -> tuple[tuple[int, int], ...]:
    """State field ``field``: a list of ``what`` pairs of ints >= 0."""
    if not isinstance(values, (list, tuple)) or not all(
            isinstance(v, (list, tuple)) and len(v) == 2 for v in values):
        raise InvalidState(f"state field {field!r} must be a list of [{what}], got {values!r}")
    return tuple((_int({field: a}, field), _int({field: b}, field)) for a, b in values)


def _positions(values: Any, epoch: int) -> tuple[tuple[int, int], ...]:
    out = _pairs(values, "skipped", "epoch, shard position")
    if any(e > epoch for e, _ in out):
        raise InvalidState(f"state field 'skipped' names an epoch after the state's {epoch}")
    return out


def _repeat(value: Any, epoch: int, batch_size: int, delivered: int, padded: bool
            ) -> tuple[tuple[Segment, ...], int]:
    if not isinstance(value, Mapping) or {"batch", "segments"} - set(value):
        raise InvalidState(f"state field 'repeat' must have batch and segments, got {value!r}")
    number = _int(value, "batch")
    segments = _segment_list(value["segments"], "repeat.segments", epoch)
    size = sum(s.size for s in segments)
    if not (size == batch_size or padded and 0 < size < batch_size) or number >= delivered:
        raise InvalidState(f"state field 'repeat' is not a full batch delivered before: "
                           f"{value!r} (batch_size={batch_size}, {delivered} delivered)")
    return segments, number


def _carry(segments: Any, epoch: int, batch_size: int) -> tuple[Segment, ...]:
    out = _segment_list(segments, "carry", epoch)
    carried = sum(s.size for s in out)
    if carried >= batch_size:
        raise InvalidState(f"state field 'carry' holds {carried} samples, a batch or more "
                           f"(batch_size={batch_size}): not a state of this loader")
    return out


def _segment_list(segments: Any, name: str, epoch: int) -> tuple[Segment, ...]:
    if not isinstance(segments, (list, tuple)):
        raise InvalidState(f"state field {name!r} must be a list of segments, got {segments!r}")
    out = []
    for i, seg in enumerate(segments):
        field = f"{name}[{i}]"
        if not isinstance(seg, Mapping) or {"epoch", "unit", "start", "stop"} - set(seg):
            raise InvalidState(f"state field {field!r} must have epoch, unit, key, start and "
                               f"stop, got {seg!r}")
        values = {name: _int(seg, name) for name in ("epoch", "unit", "start", "stop")}
        if values["epoch"] > epoch:
            raise InvalidState(f"state field '{field}.epoch' is {values['epoch']}, after the "
                               f"state's epoch {epoch}")
        if values["stop"] <= values["start"]:
            raise InvalidState(f"state field {field!r} holds no samples: start "
                               f"{values['start']}, stop {values['stop']}")
        out.append(Segment(values["epoch"], values["unit"], values["start"], values["stop"],
                           seg.get("key")))
    return tuple(out)


def _check_keys(state: Mapping[str, Any], epoch: int, unit: int, keys: Sequence[Any] | None
                ) -> None:
    saved = state.get("keys")
    if saved is None or keys is None:
        return
    if not isinstance(saved, Mapping) or {"count", "digest"} - set(saved):
        raise InvalidState(f"state field 'keys' must have count and digest, got {saved!r}")
    now = list(keys[:unit + 1])
    if len(now) != saved["count"] or keys_digest(now) != saved["digest"]:
        found = _key(now[unit]) if unit < len(now) else None
        raise InvalidState(
            f"the keys of epoch {epoch} changed since the state was saved: its first "
            f"{saved['count']} shard(s) (up to {saved.get('next')!r}, where it resumes) are not "
            f"the same now ({len(now)}, up to {found!r}); resuming would repeat or skip samples. "
            "Resume with the keys it was saved with, or start the epoch afresh")


def _check_drawn(state: Mapping[str, Any], epoch: int, unit: int, key_at: KeyAt,
                 first: int) -> None:
    """An endless iterator: its keys up to the state's shard are drawn again (a new process
    builds it from its beginning), and the one the state recorded must be the same; those
    from ``first`` on (a shuffle window's first shard, or a carried unit's) are read again."""
    drawn = state.get("drawn")
    if drawn is not None and (not isinstance(drawn, Mapping) or {"position", "key"} - set(drawn)):
        raise InvalidState(f"state field 'drawn' must have position and key, got {drawn!r}")
    index = _int(drawn, "position") if drawn is not None else unit
    if index > unit:
        raise InvalidState(f"state field 'drawn.position' is {index}, after the shard it resumes "
                           f"at ({unit})")
    where = (f"pass {epoch} over the keys at shard {index}"
             + (f" ({drawn['key']!r} when it was saved)" if drawn is not None else ""))
    for at in ([first] if first < index else []) + [index]:
        found = key_at(epoch, at)
        if found is None:
            return
        key, missing = found
        if missing is not None:
            again = "" if at == index else (f", reading its keys again from shard {at} (a "
                                            "shuffle window's first, or a carried unit's)")
            raise InvalidState(
                f"the state resumes {where}{again}, but this loader's key iterator cannot be "
                f"drawn up to it: {missing}. Load it into a new loader whose key iterator starts "
                "from its beginning, as the saved run's did")
    if drawn is not None and _key(key) != drawn["key"]:
        raise InvalidState(
            f"the state resumes {where}, but this loader's key iterator gives {_key(key)!r} "
            "there: it does not give the keys the saved run's did (build it from its beginning, "
            "as that run did); resuming would read other samples")


def check_segment_key(segment: Segment, keys: Sequence[Any] | None, first: int = 0) -> None:
    """The key a state recorded for ``segment`` is still the one at its position of
    ``keys`` (the epoch's keys from position ``first`` on); InvalidState naming both if not."""
    if keys is None or segment.key is None:
        return
    at = segment.unit - first
    found = _key(keys[at]) if 0 <= at < len(keys) else None
    if found != segment.key:
        raise InvalidState(
            f"the keys of epoch {segment.epoch} changed since the state was saved: samples "
            f"it holds came from shard {segment.unit} = {segment.key!r}, which is {found!r} now; "
            "resume with the keys the state was saved with")


def check_rank_keys(saved: Mapping[str, Any], keys: list, epoch: int, rank: int) -> None:
    """An old rank's saved keys (a digest of its first ones) are still ``keys``' first ones
    now; InvalidState naming the epoch and the rank if not."""
    digest = saved.get("keys")
    if digest is None:
        return
    now = keys[:digest["count"]]
    if len(now) != digest["count"] or keys_digest(now) != digest["digest"]:
        raise InvalidState(
            f"field 'keys': the keys of epoch {epoch} are not those rank {rank}'s state was "
            f"saved with (its first {digest['count']} shard(s) differ now); resuming would "
            "repeat or skip samples. Resume with the keys it was saved with")
