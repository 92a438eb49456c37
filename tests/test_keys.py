"""Shard keys: hostile keys are refused before any process starts; ordinary ones pass."""
from __future__ import annotations

import datetime
import os

import pytest

import gluon_stream as gs
from fake_generator import command, read_lines
from fake_generator import command_source as source
from fake_generator import generator_runs as runs
from gluon_stream.sources.base import validate_key

HOSTILE_KEYS = ["a;touch X", "$(id)", "../../x", "a/b", "", "a\0b", "-rf", "k" * 300,
                ".hidden", "a b", "x\ny", "..", "`id`"]


@pytest.mark.parametrize("key", HOSTILE_KEYS)
def test_hostile_keys_are_refused_before_any_process_starts(tmp_path, key, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = set(os.listdir(tmp_path))
    src = source(tmp_path, "ok", keys=["good", key])
    with src:
        with pytest.raises(gs.UnsafeKey, match=r"shard key .* is not allowed"):
            src.keys_for_epoch(0)  # the whole epoch is refused up front
        with pytest.raises(gs.UnsafeKey, match=r"not allowed"):
            src.produce(key, 0)
        with pytest.raises(gs.UnsafeKey, match=r"not allowed"), \
                gs.ShardStream(src) as stream:
            list(stream)
    assert runs(tmp_path) == []  # no generator ever ran, not even for the good key
    assert set(os.listdir(tmp_path)) == before | {"cache"}
    assert os.listdir(tmp_path / "cache") == []


def test_ordinary_keys_pass():
    for key in ["2024-01-01", 17, datetime.date(2024, 1, 2), "user@host", "a.b_c-d", "x=1,y=2"]:
        assert validate_key(key) == str(key)


@pytest.mark.mxnet
def test_hostile_keys_fail_the_loader_before_any_process_starts(tmp_path):
    src = gs.CommandSource(["ok-key", "a;touch X"], command("ok", workdir=tmp_path),
                           cache_dir=tmp_path / "cache")
    with gs.StreamLoader(src, batch_size=4) as loader:
        with pytest.raises(gs.UnsafeKey, match=r"'a;touch X' is not allowed"):
            list(loader)
    assert read_lines(tmp_path / "count") == []
