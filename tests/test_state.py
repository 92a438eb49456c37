"""A loader's position as plain data: round trips, every field checked, and the keys it names
checked against the keys now. Pure Python: no MXNet."""
from __future__ import annotations

import json

import pytest

from gluon_stream.batching import Position, Segment
from gluon_stream.errors import InvalidState
from gluon_stream.state import STATE_VERSION, decode_state, encode_state, keys_digest

SETTINGS = {"seed": 3, "shuffle": True, "batch_size": 4, "num_parts": 1, "part_index": 0,
            "deal": "shards", "shuffle_window": 1}
KEYS = ["2024-01-01", "2024-01-02", "2024-01-03", "2024-01-04"]


def keys_of(epoch):
    return KEYS


def test_a_state_round_trips_through_json():
    position = Position(2, 2, 3, (Segment(1, 3, 5, 7, "2024-01-04"),))
    state = json.loads(json.dumps(encode_state(position, 9, SETTINGS, KEYS)))
    assert state["version"] == STATE_VERSION and state["keys"]["next"] == "2024-01-03"
    assert decode_state(state, SETTINGS, 4, keys_of) == (position, 9)


def test_a_changed_key_list_or_carried_key_is_refused():
    state = encode_state(Position(0, 2, 1), 3, SETTINGS, KEYS)
    changed = KEYS[:1] + ["2024-02-02"] + KEYS[2:]
    with pytest.raises(InvalidState, match=r"keys of epoch 0 changed.*'2024-01-03'"):
        decode_state(state, SETTINGS, 4, lambda epoch: changed)
    assert decode_state(state, SETTINGS, 4, lambda epoch: KEYS[:3] + ["later"])  # after it
    carried = encode_state(Position(1, 0, 0, (Segment(0, 1, 2, 3, "2024-01-02"),)), 0, SETTINGS,
                           KEYS)
    with pytest.raises(InvalidState, match=r"carried samples came from shard 1 = '2024-01-02'"):
        decode_state(carried, SETTINGS, 4, lambda epoch: changed)


def test_endless_keys_carry_no_digest_and_are_not_checked():
    state = encode_state(Position(0, 5, 0), 2, SETTINGS, None)
    assert "keys" not in state
    assert decode_state(state, SETTINGS, 4, lambda epoch: None) == (Position(0, 5, 0), 2)


@pytest.mark.parametrize("change, match", [
    ({"shard": -1}, r"'shard' must be an integer >= 0"),
    ({"offset": 1.5}, r"'offset' must be an integer >= 0"),
    ({"batches": "7"}, r"'batches' must be an integer >= 0"),
    ({"carry": [{"epoch": 0, "index": 0, "start": 0}]}, r"carry\[0\]' must have"),
    ({"carry": [{"epoch": 0, "index": 0, "start": 2, "end": 2}]}, "holds no samples"),
    ({"seed": 4}, r"other settings .*'seed': \(4, 3\)"),
    ({"version": 1}, r"'version' is 1"),
])
def test_every_field_is_checked(change, match):
    state = dict(encode_state(Position(0, 1, 1), 1, SETTINGS, KEYS), **change)
    with pytest.raises(InvalidState, match=match):
        decode_state(state, SETTINGS, 4, keys_of)


def test_not_a_state_at_all():
    with pytest.raises(InvalidState, match="a dict is expected"):
        decode_state([1, 2], SETTINGS, 4, keys_of)
    with pytest.raises(InvalidState, match=r"missing \['batches', 'carry'"):
        decode_state({"version": STATE_VERSION, "epoch": 0, "shard": 0, "offset": 0},
                     SETTINGS, 4, keys_of)


def test_the_digest_depends_on_order_and_type():
    assert keys_digest([1, 2]) != keys_digest([2, 1])
    assert keys_digest([1]) != keys_digest(["1"])
