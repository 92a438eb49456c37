"""A loader's position as plain data: round trips, a checksum against edits, every field
checked, and the keys it names checked against the keys now. Pure Python: no MXNet."""
from __future__ import annotations

import json

import pytest

from gluon_stream._stages.batching import Position, Segment
from gluon_stream._stages.state import (
    STATE_VERSION,
    LoaderState,
    _checksum,
    decode_state,
    encode_state,
    keys_digest,
)
from gluon_stream.errors import InvalidState

SETTINGS = {"seed": 3, "shuffle": True, "batch_size": 4, "num_parts": 1, "part_index": 0,
            "deal": "shards", "shuffle_window": 1}
KEYS = ["2024-01-01", "2024-01-02", "2024-01-03", "2024-01-04"]


def keys_of(epoch):
    return KEYS


def resigned(state: dict, **change) -> dict:
    """``state`` with fields changed and its checksum made again: what the checks after the
    checksum must catch on their own (a state from a buggy writer, not a hand edit)."""
    out = {k: v for k, v in state.items() if k != "digest"}
    out.update(change)
    out["digest"] = _checksum(out)
    return out


def test_a_state_round_trips_through_json():
    state = LoaderState(Position(2, 2, 3, (Segment(1, 3, 1, 3, "2024-01-04"),)), 9,
                        skipped=((2, 1),),
                        repeat=(Segment(2, 1, 0, 4, "2024-01-02"),), repeat_number=5)
    saved = json.loads(json.dumps(encode_state(state, SETTINGS, KEYS)))
    assert saved["version"] == STATE_VERSION and saved["keys"]["next"] == "2024-01-03"
    assert decode_state(saved, SETTINGS, 4, keys_of) == state


def test_the_end_of_an_epoch_is_a_position():
    state = LoaderState(Position(1, 4, 0, (Segment(1, 3, 2, 3, "2024-01-04"),), end=True), 6)
    decoded = decode_state(encode_state(state, SETTINGS, KEYS), SETTINGS, 4, keys_of)
    assert decoded.position.end and decoded.epoch == 1
    assert decoded.position.next_epoch() == Position(2, 0, 0, decoded.position.carry)


@pytest.mark.parametrize("field, value", [
    ("epoch", 1), ("unit", 3), ("offset", 2), ("batches", 2), ("end", True),
    ("skipped", [[0, 1]]), ("carry", []), ("settings", dict(SETTINGS, seed=4)),
    ("keys", {"count": 2, "digest": "0", "next": None}), ("version", STATE_VERSION),
])
def test_any_edit_breaks_the_checksum(field, value):
    state = encode_state(LoaderState(Position(0, 1, 1, (Segment(0, 0, 2, 3, KEYS[0]),)), 3),
                         SETTINGS, KEYS)
    edited = dict(state, **{field: value})
    if edited == state:
        return
    with pytest.raises(InvalidState, match="do not match its checksum"):
        decode_state(edited, SETTINGS, 4, keys_of)
    del edited["digest"]
    with pytest.raises(InvalidState, match=r"missing \['digest'\]"):
        decode_state(edited, SETTINGS, 4, keys_of)


@pytest.mark.parametrize("change, match", [
    ({"unit": -1}, r"'unit' must be an integer >= 0"),
    ({"offset": 1.5}, r"'offset' must be an integer >= 0"),
    ({"batches": "7"}, r"'batches' must be an integer >= 0"),
    ({"end": 1}, r"'end' must be true or false"),
    ({"carry": [{"epoch": 0, "unit": 0, "start": 0}]}, r"carry\[0\]' must have"),
    ({"carry": [{"epoch": 0, "unit": 0, "start": 2, "stop": 2}]}, "holds no samples"),
    ({"carry": [{"epoch": 0, "unit": 0, "start": 0, "stop": 9}]}, "a batch or more"),
    ({"skipped": [3]}, r"'skipped' must be a list of \[epoch, shard position\]"),
    ({"skipped": [[5, 1]]}, r"'skipped' names an epoch after"),
    ({"repeat": {"batch": 0, "segments": []}}, r"'repeat' is not a full batch"),
    ({"settings": dict(SETTINGS, seed=4)}, r"other settings .*'seed': \(4, 3\)"),
    ({"epoch": 10 ** 30, "unit": 10 ** 30}, r"keys of epoch"),
])
def test_every_field_is_checked_beyond_the_checksum(change, match):
    state = encode_state(LoaderState(Position(0, 1, 1), 1), SETTINGS, KEYS)
    with pytest.raises(InvalidState, match=match):
        decode_state(resigned(state, **change), SETTINGS, 4, keys_of)


def test_values_json_cannot_hold_are_refused_not_raised_raw():
    state = encode_state(LoaderState(Position(0, 1, 1), 1), SETTINGS, KEYS)
    for value in (float("nan"), object(), {1, 2}):
        with pytest.raises(InvalidState, match="JSON cannot hold"):
            decode_state(dict(state, offset=value), SETTINGS, 4, keys_of)


def test_another_version_is_named():
    state = encode_state(LoaderState(Position(0)), SETTINGS, KEYS)
    with pytest.raises(InvalidState, match=r"'version' is 2; this gluon_stream reads version 3"):
        decode_state(dict(state, version=2), SETTINGS, 4, keys_of)


def test_a_changed_key_list_or_carried_key_is_refused():
    state = encode_state(LoaderState(Position(0, 2, 1), 3), SETTINGS, KEYS)
    changed = KEYS[:1] + ["2024-02-02"] + KEYS[2:]
    with pytest.raises(InvalidState, match=r"keys of epoch 0 changed.*'2024-01-03'"):
        decode_state(state, SETTINGS, 4, lambda epoch: changed)
    assert decode_state(state, SETTINGS, 4, lambda epoch: KEYS[:3] + ["later"])  # after it
    carried = encode_state(LoaderState(Position(1, 0, 0, (Segment(0, 1, 2, 3, "2024-01-02"),))),
                           SETTINGS, KEYS)
    with pytest.raises(InvalidState, match=r"came from shard 1 = '2024-01-02'"):
        decode_state(carried, SETTINGS, 4, lambda epoch: changed)


def test_endless_keys_carry_no_digest_and_are_not_checked():
    state = encode_state(LoaderState(Position(0, 5, 0), 2), SETTINGS, None)
    assert "keys" not in state
    assert decode_state(state, SETTINGS, 4, lambda epoch: None) == LoaderState(Position(0, 5), 2)


def test_not_a_state_at_all():
    with pytest.raises(InvalidState, match="a dict is expected"):
        decode_state([1, 2], SETTINGS, 4, keys_of)
    with pytest.raises(InvalidState, match=r"missing \['batches', 'carry'"):
        decode_state({"version": STATE_VERSION, "epoch": 0, "unit": 0, "offset": 0},
                     SETTINGS, 4, keys_of)


def test_the_digest_depends_on_order_and_type():
    assert keys_digest([1, 2]) != keys_digest([2, 1])
    assert keys_digest([1]) != keys_digest(["1"])
