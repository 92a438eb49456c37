"""MixSource: counts by largest remainder, an even interleave, keys as a pure function of
(seed, epoch), cache namespaces, per-source stats, and exact resume through the loader."""
from __future__ import annotations

import json
import os
import warnings
from fractions import Fraction

import numpy as np
import pytest

import gluon_stream as gs
from _helpers import batch_ids, epoch_batch_ids
from fake_generator import command, shard_values
from gluon_stream.sources.mix import cycled, interleave, largest_remainder
from gluon_stream.stats import ShardRecord, Stats


def ids_fn(base, sizes):
    """A FunctionSource fn: shard k holds ids base + 1000*k .. (and a float copy)."""
    def fn(key):
        ids = np.arange(sizes[key], dtype=np.int64) + base + 1000 * key
        return ids, ids.astype(np.float32)
    return fn


A_SIZES = [5, 7, 3, 6]                       # 4 keys: fewer than its share over 3 epochs
B_SIZES = [4 + k % 3 for k in range(10)]     # 10 keys: more than its share per epoch


def two_sources(cache_dir=None):
    return {"a": gs.FunctionSource(range(len(A_SIZES)), ids_fn(0, A_SIZES), cache_dir=cache_dir),
            "b": gs.FunctionSource(range(len(B_SIZES)), ids_fn(100_000, B_SIZES),
                                   cache_dir=cache_dir)}


def mix(weights=None, shards_per_epoch=6, seed=5, **kw):
    return gs.MixSource(two_sources(**kw), weights=weights or {"a": 1, "b": 2},
                        shards_per_epoch=shards_per_epoch, seed=seed)


def keys(source, epoch):
    found, finite = source.keys_for_epoch(epoch)
    assert finite
    return list(found)


# -- counts --------------------------------------------------------------------------------------

def test_counts_are_largest_remainders_with_ties_to_the_first_name():
    assert largest_remainder({"a": 3, "b": 1}, 10) == {"a": 8, "b": 2}  # 7.5, 2.5: tie -> a
    assert largest_remainder({"b": 1, "a": 1}, 3) == {"b": 1, "a": 2}
    assert largest_remainder({"x": 1, "y": 1, "z": 1}, 4) == {"x": 2, "y": 1, "z": 1}
    assert largest_remainder({"a": 5, "b": 3, "c": 2}, 7) == {"a": 4, "b": 2, "c": 1}  # 3.5 2.1 1.4
    rng = np.random.default_rng(0)
    for _ in range(300):
        weights = {f"s{i}": Fraction(int(rng.integers(1, 50)), int(rng.integers(1, 9)))
                   for i in range(int(rng.integers(1, 6)))}
        total = int(rng.integers(1, 200))
        counts = largest_remainder(weights, total)
        assert sum(counts.values()) == total
        whole = sum(weights.values())
        assert all(abs(counts[n] - total * w / whole) < 1 for n, w in weights.items())


def test_float_weights_count_as_the_decimals_written():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 0.7 : 0.3 of 10 is exact: no warning
        src = mix(weights={"a": 0.7, "b": 0.3}, shards_per_epoch=10)
    assert src.counts == {"a": 7, "b": 3}


@pytest.mark.parametrize("a, b", [(np.float32(0.7), 0.3), (np.float16(0.7), np.float32(0.3)),
                                  (np.float64(0.7), np.float32(0.3))],
                         ids=["float32", "float16", "float64"])
def test_numpy_float_weights_count_as_written_too(a, b):
    """np.float32(0.7) took 7/3 but warned 'pass a multiple of 999999988079071': its binary
    value was read, not the 0.7 the user wrote."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        src = mix(weights={"a": a, "b": b}, shards_per_epoch=10)
    assert src.counts == {"a": 7, "b": 3}
    with pytest.warns(UserWarning, match=r"multiple of 10 for exact"):
        mix(weights={"a": a, "b": b}, shards_per_epoch=9)
    with pytest.raises(TypeError, match=r"weights\['a'\] must be a number above 0"):
        mix(weights={"a": np.bool_(True), "b": b})


def test_inexact_counts_warn_with_the_counts_taken_and_the_fix():
    with pytest.warns(UserWarning, match=r"a 2, b 3 shards every epoch .* 1.67, 3.33.* "
                                         r"multiple of 3"):
        src = mix(weights={"a": 1, "b": 2}, shards_per_epoch=5)
    assert src.counts == {"a": 2, "b": 3}
    assert len(keys(src, 0)) == 5


# -- order and keys ------------------------------------------------------------------------------

def test_the_interleave_spreads_every_source_evenly_over_the_epoch():
    """In any first n shards a source's count is within 1 + (k - 2) * share of share * n."""
    rng = np.random.default_rng(1)
    for trial in range(400):
        k = int(rng.integers(2, 7))
        counts = {f"s{i}": int(rng.integers(1, 25)) for i in range(k)}
        total = sum(counts.values())
        order = interleave(counts, np.random.default_rng(trial))
        assert sorted(order) == sorted(n for n, c in counts.items() for _ in range(c))
        for name, count in counts.items():
            seen = np.cumsum([x == name for x in order])
            share = count / total
            gap = np.abs(seen - share * np.arange(1, total + 1)).max()
            assert gap < 1 + (k - 2) * share, (counts, name, order)


def test_an_epochs_keys_are_a_pure_function_of_seed_and_epoch():
    first, second = mix(), mix()
    assert keys(first, 7) == keys(second, 7)  # no earlier epoch needed, any call order
    assert [keys(first, e) for e in (3, 0, 3)] == [keys(second, 3), keys(second, 0),
                                                   keys(second, 3)]
    assert keys(first, 0) != keys(first, 1)
    assert keys(mix(seed=6), 0) != keys(first, 0)
    for epoch in range(5):
        found = keys(first, epoch)
        assert [n for n, _ in found].count("a") == 2 and len(found) == 6


def test_a_small_source_cycles_in_fresh_shuffles_and_a_large_one_continues():
    src = mix(weights={"a": 5, "b": 2}, shards_per_epoch=7)  # a: 5 of 4 keys, b: 2 of 10
    seq = {name: [k for e in range(10) for n, k in keys(src, e) if n == name] for name in "ab"}
    passes = [seq["a"][i:i + 4] for i in range(0, 48, 4)]  # 50 keys: 12 full passes
    assert all(sorted(p) == [0, 1, 2, 3] for p in passes)  # every key once per pass
    assert len({tuple(p) for p in passes}) > 1  # passes in fresh orders
    assert sorted(seq["b"][:10]) == list(range(10)) == sorted(seq["b"][10:])
    assert seq["b"][:10] != seq["b"][10:]

    def order(p):
        return np.random.default_rng(p).permutation(4)
    endless = ["wxyz"[i] for p in range(3) for i in order(p)]
    assert cycled("wxyz", 3, 6, order) == endless[3:9]


def test_callable_keys_give_each_epoch_its_own_keys():
    weekly = gs.FunctionSource(lambda epoch: [f"{epoch}-{d}" for d in range(3)], lambda k: [1.0])
    src = gs.MixSource({"w": weekly, "b": two_sources()["b"]}, shards_per_epoch=4, seed=0)
    for epoch in range(4):
        assert {k for n, k in keys(src, epoch) if n == "w"} <= {f"{epoch}-{d}" for d in range(3)}


def test_endless_keys_are_refused_at_construction_and_at_a_later_epoch():
    endless = gs.FunctionSource(iter(range(10 ** 9)), lambda k: [1.0])
    with pytest.raises(TypeError, match=r"source 'e' are an endless iterator.*a list"):
        gs.MixSource({"e": endless, "b": two_sources()["b"]}, shards_per_epoch=2)
    late = gs.FunctionSource(lambda e: iter([1, 2]) if e else [1, 2], lambda k: [1.0])
    src = gs.MixSource({"late": late}, shards_per_epoch=1)
    with pytest.raises(TypeError, match="endless"):
        src.keys_for_epoch(1)


# -- validation ----------------------------------------------------------------------------------

def one():
    return gs.FunctionSource([0], lambda k: [1.0])


@pytest.mark.parametrize("make, error, match", [
    (lambda: gs.MixSource({}, shards_per_epoch=1), ValueError, "sources is empty"),
    (lambda: gs.MixSource([one()], shards_per_epoch=1), TypeError, "sources must be a dict"),
    (lambda: gs.MixSource({"a": one()}, weights={"a": 1, "c": 2}, shards_per_epoch=1),
     ValueError, r"weights name \['c'\] that are not sources"),
    (lambda: gs.MixSource({"a": one(), "b": one()}, weights={"a": 1}, shards_per_epoch=2),
     ValueError, r"no weight for \['b'\]"),
    (lambda: gs.MixSource({"a": one()}, weights={"a": 0}, shards_per_epoch=1),
     ValueError, r"weights\['a'\] must be a number above 0, got 0"),
    (lambda: gs.MixSource({"a": one()}, weights={"a": -1.5}, shards_per_epoch=1),
     ValueError, "above 0, got -1.5"),
    (lambda: gs.MixSource({"a": one()}, weights={"a": float("nan")}, shards_per_epoch=1),
     ValueError, "finite number above 0, got nan"),
    (lambda: gs.MixSource({"a": one()}, weights={"a": float("inf")}, shards_per_epoch=1),
     ValueError, "finite number above 0, got inf"),
    (lambda: gs.MixSource({"a": one()}, weights={"a": True}, shards_per_epoch=1),
     TypeError, "number above 0, got True"),
    (lambda: gs.MixSource({"a": one()}, weights={"a": "3"}, shards_per_epoch=1),
     TypeError, "number above 0, got '3'"),
    (lambda: gs.MixSource({"a": one()}, shards_per_epoch=0), ValueError, "shards_per_epoch"),
    (lambda: gs.MixSource({"a": one()}, shards_per_epoch=2.0), ValueError, "shards_per_epoch"),
    (lambda: gs.MixSource({"a": one(), "b": one()}, shards_per_epoch=1), ValueError,
     r"shards_per_epoch=1 leaves source 'b' without a shard .* shards_per_epoch=2 or more"),
    (lambda: gs.MixSource({"a": one(), "b": one()}, weights={"a": 99, "b": 1},
                          shards_per_epoch=10), ValueError,
     r"leaves source 'b' .* asks for 0.1\).* shards_per_epoch=51 or more"),
    (lambda: gs.MixSource({"a": [0, 1]}, shards_per_epoch=1), TypeError,
     "'a' must be a Source .* got list"),
    (lambda: gs.MixSource({"a": gs.MixSource({"x": one()}, shards_per_epoch=1)},
                          shards_per_epoch=1), TypeError, "'a' is a MixSource"),
    (lambda: gs.MixSource({1: one()}, shards_per_epoch=1), TypeError, "names must be str"),
    (lambda: gs.MixSource({"a+b": one()}, shards_per_epoch=1), ValueError, r"contains '\+'"),
    (lambda: gs.MixSource({"a/b": one()}, shards_per_epoch=1), ValueError,
     "cannot name cache files"),
    (lambda: gs.MixSource({"a": gs.FunctionSource([], lambda k: [1.0])}, shards_per_epoch=1),
     ValueError, "source 'a' has no keys for epoch 0"),
])
def test_bad_arguments_raise_typed_errors_naming_them(make, error, match):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # inexact counts: not what is tested
        with pytest.raises(error, match=match):
            make()


def test_one_source_object_under_two_names_is_refused():
    shared = one()
    with pytest.raises(ValueError, match="'a' and 'b' are the same source object"):
        gs.MixSource({"a": shared, "b": shared}, shards_per_epoch=2)


def test_a_source_that_runs_out_of_keys_later_names_the_epoch():
    src = gs.MixSource({"a": gs.FunctionSource(lambda e: [] if e == 2 else [e], lambda k: [1.0])},
                       shards_per_epoch=1)
    assert keys(src, 1) == [("a", 1)]
    with pytest.raises(ValueError, match="source 'a' has no keys for epoch 2"):
        src.keys_for_epoch(2)


def test_a_key_that_is_not_a_pair_of_the_mix_is_refused():
    src = mix()
    for bad in ["a", ("c", 1), ["a", 1]]:
        with pytest.raises(gs.UnsafeKey, match="not a \\(source name, key\\) pair"):
            src.produce(bad, 0)


# -- producing -----------------------------------------------------------------------------------

class EpochRecorder(gs.Source):
    """A source that records the epochs it was asked for."""

    def __init__(self, keys, per_epoch=False):
        super().__init__(keys)
        self.calls = []
        self._per_epoch = per_epoch

    @property
    def per_epoch(self):
        return self._per_epoch

    def produce(self, key, epoch, executor=None):
        self.calls.append((key, epoch))
        return gs.sources.RawShard(key, epoch, (np.zeros(2),))


def test_produce_delegates_with_the_epoch_and_tags_the_source():
    plain, yearly = EpochRecorder([1, 2]), EpochRecorder([1], per_epoch=True)
    src = gs.MixSource({"p": plain, "y": yearly}, shards_per_epoch=2)
    assert src.per_epoch
    assert not gs.MixSource({"p": EpochRecorder([1])}, shards_per_epoch=1).per_epoch
    raw = src.produce(("y", 1), epoch=3)
    assert (raw.key, raw.epoch, raw.source) == (("y", 1), 3, "y")
    assert yearly.calls == [(1, 3)] and plain.calls == []


def test_a_failing_shard_says_which_source_it_came_from():
    def broken(key):
        raise OSError("disk gone")
    src = gs.MixSource({"bad": gs.FunctionSource([1], broken)}, shards_per_epoch=1)
    with pytest.raises(gs.ShardError) as info:
        src.produce(("bad", 1), 0)
    assert "shard 1 of source 'bad' of a MixSource" in "\n".join(info.value.__notes__)


def test_closing_the_mix_closes_its_sources():
    src = mix()
    src.close()
    src.close()
    for inner in src.sources.values():
        with pytest.raises(gs.LoaderClosed):
            inner.produce(0, 0)


# -- the cache -----------------------------------------------------------------------------------

def test_sources_sharing_a_cache_dir_with_equal_keys_read_each_others_shards_alone(tmp_path):
    """The collision a mix prevents: two sources of one cache_dir, key 0 in both."""
    a, b = two_sources(cache_dir=tmp_path).values()
    first = a.produce(0, 0).arrays[0]
    second = b.produce(0, 0)
    assert second.cache_hit and (second.arrays[0] == first).all()  # b got a's shard
    a.close(), b.close()


def test_in_a_mix_sources_sharing_a_cache_dir_keep_their_own_shards(tmp_path):
    src = mix(cache_dir=tmp_path)
    a0, b0 = src.produce(("a", 0), 0), src.produce(("b", 0), 0)
    assert a0.arrays[0][0] == 0 and b0.arrays[0][0] == 100_000 and not b0.cache_hit
    assert sorted(os.listdir(tmp_path)) == ["a+0.npz", "b+0.npz"]
    again = mix(cache_dir=tmp_path)
    hit = again.produce(("b", 0), 0)
    assert hit.cache_hit and hit.arrays[0][0] == 100_000
    assert again.num_samples(("a", 0), 0) == A_SIZES[0]
    src.close(), again.close()


def test_command_sources_sharing_a_cache_dir_stay_apart_per_epoch(tmp_path):
    """Two programs with one key and one cache_dir, one of them per epoch ({epoch})."""
    cache = tmp_path / "cache"
    small = gs.CommandSource(["k1"], command(rows=3), cache_dir=cache)
    yearly = gs.CommandSource(["k1"], command(rows=5) + ["--started", str(tmp_path / "e{epoch}")],
                              cache_dir=cache)
    with gs.MixSource({"small": small, "yearly": yearly}, shards_per_epoch=2) as src:
        assert src.per_epoch and src.cached
        assert len(src.produce(("small", "k1"), 0).arrays[0]) == 3
        assert len(src.produce(("yearly", "k1"), 1).arrays[0]) == 5
        assert (src.produce(("yearly", "k1"), 1).arrays[0] == shard_values("k1", 5, 3)).all()
        path, hit, _ = src.ensure_file(("small", "k1"), 4)
        assert hit and os.path.basename(path) == "small+k1.npy"
    assert sorted(p for p in os.listdir(cache) if not p.startswith(".")) == [
        "small+k1.npy", "yearly+k1@e1.npy"]


def test_a_namespace_is_checked_and_kept(tmp_path):
    src = gs.FunctionSource([0], lambda k: [1.0], cache_dir=tmp_path)
    with pytest.raises(gs.UnsafeKey, match=r"must not contain '\+'"):
        src.set_namespace("a+b")
    gs.MixSource({"a": src}, shards_per_epoch=1)
    assert src.namespace == "a" and src.cache_name(0, 0) == "a+0"
    with pytest.raises(ValueError, match="namespace 'a' already .* separate source for 'b'"):
        gs.MixSource({"b": src}, shards_per_epoch=1)


# -- stats ---------------------------------------------------------------------------------------

def test_stats_count_samples_per_source_and_the_summary_shows_a_line_each():
    stats = Stats()
    stats.add_shard(ShardRecord(("old", 1), 0, samples=30, source="old"))
    stats.add_shard(ShardRecord(("new", 1), 0, samples=10, source="new"))
    stats.add_shard(ShardRecord(("old", 2), 0, samples=20, source="old"))
    stats.add_shard(ShardRecord(("new", 2), 0, error="ShardError: boom"))
    assert stats.per_source() == {}  # produced, not yet received by the loop
    stats.add_delivered({"old": 4})
    stats.add_delivered({"old": 2, "new": 2})
    assert stats.per_source() == {"new": 2, "old": 6}
    lines = stats.summary().splitlines()
    assert lines[-2:] == ["source new: 1 shards, 10 samples (16.7%)",
                          "source old: 2 shards, 50 samples (83.3%)"]
    totals = json.loads(json.dumps(stats.to_dict()))["totals"]
    assert totals["source_samples"] == {"old": 50, "new": 10}
    alone = Stats()
    alone.add_shard(ShardRecord("k", 0, samples=3))
    assert alone.per_source() == {} and "source" not in alone.summary()


# -- through the loader --------------------------------------------------------------------------

@pytest.mark.mxnet
def test_a_loader_counts_each_sources_samples():
    src = mix()
    expected = {"a": 0, "b": 0}
    for epoch in range(3):
        for name, key in keys(src, epoch):
            expected[name] += (A_SIZES if name == "a" else B_SIZES)[key]
    with gs.StreamLoader(src, batch_size=4) as loader:
        got = epoch_batch_ids(loader, 3)
        assert loader.stats.per_source() == expected
        assert "source a: 6 shards" in loader.stats.summary()
    assert sum(map(len, got)) == sum(expected.values())


def received(batches) -> dict:
    """Samples per source in batches the loop received (b's ids are 100000 and up)."""
    out = {"a": 0, "b": 0}
    for ids in batches:
        for i in ids:
            out["b" if i >= 100_000 else "a"] += 1
    return {k: v for k, v in out.items() if v}


@pytest.mark.mxnet
@pytest.mark.parametrize("kw, stop_after", [
    ({}, 3),  # a loop that breaks: shards produced ahead were not received
    ({"samples_per_epoch": 11}, None),  # epochs stop inside a shard
    ({"shuffle": True, "seed": 2, "shuffle_window": 2}, 5),  # batches mix both sources
    ({"last_batch": "discard"}, None),  # the tail is dropped
    ({"batchify_fn": None, "num_workers": 1}, 4),  # per-sample work in a worker process
    ({"even_batches": True, "num_parts": 2, "part_index": 1}, None),
], ids=["break", "samples_per_epoch", "shuffle_window", "discard", "processes", "even"])
def test_per_source_counts_the_samples_the_loop_received(kw, stop_after):
    """per_source() counted the samples of every shard produced (the shard an epoch stops in,
    shards made ahead): 28/21 where the loop had 11/7."""
    if "batchify_fn" in kw:
        import mxnet as mx
        kw = dict(kw, batchify_fn=mx.gluon.data.dataloader.default_batchify_fn)
    with gs.StreamLoader(mix(), batch_size=4, prefetch=3, **kw) as loader:
        got = epoch_batch_ids(loader, 2, stop_after=stop_after)
        assert loader.stats.per_source() == received(got)
    assert received(got)


def test_per_source_of_a_shard_stream_counts_the_shards_its_loop_took():
    with gs.ShardStream(mix(), prefetch=3) as stream:
        taken = []
        for shard in stream:
            taken.append(shard.arrays[0].tolist())
            if len(taken) == 2:
                break
        assert stream.stats.per_source() == received(taken)


@pytest.mark.mxnet
@pytest.mark.parametrize("window", [1, 2])
def test_per_source_of_a_resumed_loader_counts_its_carried_samples_too(window):
    def make():
        return gs.StreamLoader(mix(), batch_size=5, shuffle=True, seed=3, shuffle_window=window,
                               last_batch="rollover")
    with make() as first:
        head = epoch_batch_ids(first, 1)
        state = first.state_dict()  # epoch 1, opened by the samples epoch 0 rolled over
    assert state["carry"]
    with make() as resumed:
        resumed.load_state_dict(state)
        rest = epoch_batch_ids(resumed, 2, start_epoch=1)
        assert resumed.stats.per_source() == received(rest)
    with make() as whole:
        assert epoch_batch_ids(whole, 2) == head + rest


@pytest.mark.mxnet
def test_a_shard_stream_takes_the_mix_and_generates_cached_shards_ahead(tmp_path):
    sources = two_sources()
    sources["a"] = gs.FunctionSource(range(4), ids_fn(0, A_SIZES), cache_dir=tmp_path)
    src = gs.MixSource(sources, weights={"a": 1, "b": 2}, shards_per_epoch=6, seed=5)
    with gs.ShardStream(src, prefetch=1) as stream:
        assert stream.generate_ahead > 0  # a caches: its shards may be made ahead
        got = [(shard.key, len(shard)) for shard in stream]
    assert [k for k, _ in got] == keys(src, 0)
    assert [n for _, n in got] == [(A_SIZES if s == "a" else B_SIZES)[k] for s, k in keys(src, 0)]


def loader(part_index=0, sized=False):
    sizes = (lambda key: (A_SIZES if key[0] == "a" else B_SIZES)[key[1]]) if sized else None
    return gs.StreamLoader(mix(), batch_size=2, shuffle=True, shuffle_window=2, seed=7,
                           num_parts=2, part_index=part_index, even_batches=True,
                           shard_sizes=sizes)


@pytest.mark.mxnet
@pytest.mark.parametrize("sized", [False, True], ids=["deal-samples", "deal-shards"])
def test_resume_after_every_batch_over_three_epochs_equals_the_uninterrupted_run(sized):
    """shuffle, shuffle_window=2, two disjoint ranks, even_batches: a state saved after any
    batch, resumed in a fresh loader, continues with exactly the batches of one run."""
    runs = []
    for part in range(2):
        with loader(part, sized) as one:
            reference = epoch_batch_ids(one, 3)
        runs.append(reference)
        for k in range(1, len(reference) + 1):
            with loader(part, sized) as first:
                head = epoch_batch_ids(first, 3, stop_after=k)
                state = json.loads(json.dumps(first.state_dict()))
            with loader(part, sized) as second:
                second.load_state_dict(state)
                tail = epoch_batch_ids(second, 3, start_epoch=state["epoch"])
            assert head + tail == reference, f"rank {part}, resumed after {k} batches"
    assert len(runs[0]) == len(runs[1]) >= 6  # even batches
    for epoch in range(3):
        per_rank = [_epoch_ids(part, sized, epoch) for part in range(2)]
        assert not per_rank[0] & per_rank[1]  # disjoint ranks


def _epoch_ids(part, sized, epoch):
    with loader(part, sized) as one:
        one.set_epoch(epoch)
        return {i for batch in one for i in batch_ids(batch)}
