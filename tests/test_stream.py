"""ShardStream: shards in order with datasets, its settings, and skipping failed shards."""
from __future__ import annotations

import mxnet as mx
import numpy as np
import pytest

import gluon_stream as gs
from _helpers import batch_ids, id_shards

pytestmark = pytest.mark.mxnet  # these tests use MXNet: warm its engine first


def test_stream_settings_must_be_set_on_the_stream():
    stream = gs.ShardStream(gs.FunctionSource([0], id_shards([4])), shuffle=True, seed=0)
    with pytest.raises(ValueError, match="ShardStream"):
        gs.StreamLoader(stream, batch_size=2, shuffle=True)
    with gs.StreamLoader(stream, batch_size=2) as loader:
        assert sorted(i for b in loader for i in batch_ids(b)) == [0, 1, 2, 3]
    stream.close()


def test_shard_stream_yields_shards_in_order_with_datasets():
    with gs.ShardStream(gs.FunctionSource(range(4), id_shards([3, 0, 2, 5])), prefetch=1) as s:
        shards = list(s)
    assert [(sh.key, sh.index, len(sh)) for sh in shards] == [(0, 0, 3), (1, 1, 0), (2, 2, 2),
                                                             (3, 3, 5)]
    assert isinstance(shards[3].dataset, mx.gluon.data.ArrayDataset)
    assert shards[3].dataset[1][0] == 3001


def test_shard_stream_skip_yields_only_the_good_shards():
    def fn(key):
        if key in (1, 3):
            raise OSError(f"no data for {key}")
        return np.full((3, 2), key)

    with gs.ShardStream(gs.FunctionSource(range(5), fn), on_error="skip") as stream:
        shards = [(s.key, s.arrays[0][0, 0]) for s in stream]
        skipped = [(r.key, r.error) for r in stream.stats.shards if r.error]
    assert skipped == [(1, "ShardError: shard 1: fn(1) raised OSError: no data for 1"),
                       (3, "ShardError: shard 3: fn(3) raised OSError: no data for 3")]
    assert shards == [(0, 0), (2, 2), (4, 4)]
