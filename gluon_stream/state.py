"""A loader's position as plain data, for exact resume: encoded, checked field by field, decoded.

The state names where the epoch stands (:class:`~gluon_stream.batching.Position`: the next
shard and the row inside it, and the samples carried from earlier shards) and enough to tell
whether a loader can continue from it: the settings that decide the batches (seed, shuffle,
batch size, parts), and the keys at the positions it refers to (a digest of the epoch's keys
up to the next shard, and each carried segment's key). A state that does not fit is refused
with an InvalidState (a ValueError) naming the field, never silently resumed elsewhere.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping, Sequence

from . import _validate
from .batching import Position, Segment
from .errors import InvalidState

__all__ = ["STATE_VERSION", "decode_state", "encode_state", "keys_digest"]

STATE_VERSION = 2
_JSON_KEY = (str, int, float)


def keys_digest(keys: Sequence[Any]) -> str:
    """A short digest of a key list (its order counts)."""
    text = json.dumps([[type(k).__name__, str(k)] for k in keys], separators=(",", ":"))
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]


def _key(key: Any) -> Any:
    if key is None or (isinstance(key, _JSON_KEY) and not isinstance(key, bool)):
        return key
    return str(key)


def encode_state(position: Position, delivered: int, settings: Mapping[str, Any],
                 epoch_keys: Sequence[Any] | None) -> dict:
    """The JSON-serialisable state of ``position`` after ``delivered`` batches of its epoch.

    ``epoch_keys`` is the epoch's shard order for this part (None for endless key iterators).
    """
    state = {"version": STATE_VERSION, "epoch": position.epoch, "shard": position.unit,
             "offset": position.offset, "batches": delivered,
             "carry": [{"epoch": s.epoch, "index": s.unit, "key": _key(s.key),
                        "start": s.start, "end": s.stop} for s in position.carry]}
    if epoch_keys is not None:
        seen = list(epoch_keys[:position.unit + 1])
        state["keys"] = {"count": len(seen), "digest": keys_digest(seen),
                         "next": _key(seen[position.unit]) if position.unit < len(seen) else None}
    state.update(settings)
    return state


def _int(state: Mapping[str, Any], field: str, minimum: int = 0) -> int:
    try:
        return _validate.integer(f"state field {field!r}", state[field], minimum=minimum)
    except ValueError as exc:
        raise InvalidState(str(exc)) from None


def decode_state(state: Mapping[str, Any], settings: Mapping[str, Any], batch_size: int,
                 epoch_keys: Any) -> tuple[Position, int]:
    """Check ``state`` against this loader and return (position, batches delivered).

    ``settings`` must match the loader's; ``epoch_keys(epoch)`` gives the shard order of an
    epoch for this part (None when the keys are an endless iterator).
    """
    if not isinstance(state, Mapping):
        raise InvalidState(f"not a StreamLoader state: a dict is expected, got "
                           f"{type(state).__name__}")
    missing = {"version", "epoch", "shard", "offset", "batches", "carry"} - set(state)
    if missing:
        raise InvalidState(f"not a StreamLoader state: missing {sorted(missing)}")
    if state["version"] != STATE_VERSION:
        raise InvalidState(f"state field 'version' is {state['version']!r}; this gluon_stream "
                           f"reads version {STATE_VERSION}")
    differ = {k: (state.get(k), v) for k, v in settings.items() if state.get(k) != v}
    if differ:
        raise InvalidState(f"state was saved by a loader with other settings "
                           f"(saved, this one): {differ}; build the loader as before")
    epoch, unit, offset = _int(state, "epoch"), _int(state, "shard"), _int(state, "offset")
    delivered = _int(state, "batches")
    carry = _carry(state["carry"], epoch, batch_size)
    keys = epoch_keys(epoch)
    _check_keys(state, epoch, unit, keys)
    for segment in carry:
        _check_segment_key(segment, epoch_keys(segment.epoch) if segment.epoch != epoch else keys)
    return Position(epoch, unit, offset, carry), delivered


def _carry(segments: Any, epoch: int, batch_size: int) -> tuple[Segment, ...]:
    if not isinstance(segments, (list, tuple)):
        raise InvalidState(f"state field 'carry' must be a list of segments, got {segments!r}")
    out = []
    for i, seg in enumerate(segments):
        field = f"carry[{i}]"
        if not isinstance(seg, Mapping) or {"epoch", "index", "start", "end"} - set(seg):
            raise InvalidState(f"state field {field!r} must have epoch, index, key, start and end, "
                               f"got {seg!r}")
        values = {name: _int(seg, name) for name in ("epoch", "index", "start", "end")}
        if values["epoch"] > epoch:
            raise InvalidState(f"state field '{field}.epoch' is {values['epoch']}, after the "
                               f"state's epoch {epoch}")
        if values["end"] <= values["start"]:
            raise InvalidState(f"state field {field!r} holds no samples: start {values['start']}, "
                               f"end {values['end']}")
        out.append(Segment(values["epoch"], values["index"], values["start"], values["end"],
                           seg.get("key")))
    carried = sum(s.size for s in out)
    if carried >= batch_size:
        raise InvalidState(f"state field 'carry' holds {carried} samples, a batch or more "
                           f"(batch_size={batch_size}): not a state of this loader")
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


def _check_segment_key(segment: Segment, keys: Sequence[Any] | None) -> None:
    if keys is None or segment.key is None:
        return
    found = _key(keys[segment.unit]) if segment.unit < len(keys) else None
    if found != segment.key:
        raise InvalidState(
            f"the keys of epoch {segment.epoch} changed since the state was saved: carried "
            f"samples came from shard {segment.unit} = {segment.key!r}, which is {found!r} now; "
            "resume with the keys the state was saved with")
