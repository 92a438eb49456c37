"""Rank sharding: disjoint parts that cover each epoch once, equal batch counts, 'auto' ranks."""
from __future__ import annotations

import json
import subprocess
import sys
import time
import types

import numpy as np
import pytest

import gluon_stream as gs
from _helpers import all_ids, batch_ids, id_shards
from gluon_stream._stages.keys import resolve_parts

pytestmark = pytest.mark.mxnet  # these tests use MXNet: warm its engine first

SIZES = [7, 2, 0, 9, 5, 6, 11, 3, 1, 8]  # awkward sizes, one empty shard


def part_batches(num_parts, part, epoch=0, **kw):
    src = gs.FunctionSource(range(len(SIZES)), id_shards(SIZES))
    kw.setdefault("shard_sizes", dict(enumerate(SIZES)))
    with gs.StreamLoader(src, batch_size=4, num_parts=num_parts, part_index=part, seed=3,
                         **kw) as loader:
        loader.set_epoch(epoch)
        return [batch_ids(b) for b in loader]


@pytest.mark.parametrize("num_parts", [2, 3, 4])
@pytest.mark.parametrize("shuffle", [False, True])
def test_parts_are_disjoint_and_cover_every_sample_once(num_parts, shuffle):
    for epoch in (0, 1):
        parts = [[i for b in part_batches(num_parts, r, epoch, shuffle=shuffle) for i in b]
                 for r in range(num_parts)]
        flat = [i for p in parts for i in p]
        assert len(flat) == len(set(flat)) == sum(SIZES)


def test_assignment_is_deterministic_and_reshuffled_each_epoch():
    def shards_of(part, epoch):
        return sorted({i // 1000 for b in part_batches(3, part, epoch) for i in b})
    assert shards_of(0, 0) == shards_of(0, 0)
    assert [shards_of(r, 0) for r in range(3)] != [shards_of(r, 1) for r in range(3)]


@pytest.mark.parametrize("num_parts", [2, 3, 4])
def test_even_batches_gives_every_part_the_same_number_of_full_batches(num_parts):
    for epoch in (0, 1, 2):
        parts = [part_batches(num_parts, r, epoch, even_batches=True) for r in range(num_parts)]
        counts = {len(p) for p in parts}
        assert len(counts) == 1 and counts.pop() > 0
        assert all(len(b) == 4 for p in parts for b in p)
        flat = [i for p in parts for b in p for i in b]
        assert len(flat) == len(set(flat))  # truncation drops, never duplicates


@pytest.mark.parametrize("num_parts", [2, 3])
@pytest.mark.parametrize("options", [{}, {"shuffle": True}, {"shuffle": True, "shuffle_window": 3},
                                     {"sample_transform": lambda ids, half: (ids, half)}])
def test_even_batches_without_any_size_known(num_parts, options):
    """On-demand shards (a FunctionSource, no cache): every rank produces every shard and takes
    its stride of each one's samples, the strides going on from shard to shard: equal counts,
    disjoint, losing fewer than num_parts samples in all and a batch per rank at most."""
    def part(rank, epoch):
        src = gs.FunctionSource(range(len(SIZES)), id_shards(SIZES))
        with gs.StreamLoader(src, batch_size=4, num_parts=num_parts, part_index=rank, seed=3,
                             even_batches=True, **options) as ld:
            assert ld.stream.deal == "balanced"
            ld.set_epoch(epoch)
            return [batch_ids(b) for b in ld]

    for epoch in (0, 1):
        parts = [part(r, epoch) for r in range(num_parts)]
        assert len({len(p) for p in parts}) == 1  # the same number of batches ...
        assert all(len(b) == 4 for p in parts for b in p)  # ... all full
        flat = [i for p in parts for b in p for i in b]
        assert len(flat) == len(set(flat))  # disjoint
        # ranks hold sum // num_parts samples (and one more), each keeps all but its short tail
        assert len(flat) >= sum(SIZES) - (num_parts - 1) - num_parts * 3
        assert set(flat) <= {1000 * k + i for k, n in enumerate(SIZES) for i in range(n)}

    assert part(0, 0) == part(0, 0)  # deterministic
    if options.get("shuffle"):
        assert part(0, 0) != part(0, 1)  # and another order each epoch


@pytest.mark.parametrize("rank", [0, 1])
def test_even_batches_without_sizes_resume_exactly_at_every_batch(rank):
    def make():
        src = gs.FunctionSource(range(len(SIZES)), id_shards(SIZES))
        return gs.StreamLoader(src, batch_size=4, num_parts=2, part_index=rank, seed=3,
                               shuffle=True, even_batches=True)

    with make() as loader:
        reference = [batch_ids(b) for b in loader]
    for cut in range(1, len(reference)):
        with make() as first:
            head = [batch_ids(b) for _, b in zip(range(cut), first)]
            state = first.state_dict()
        with make() as second:
            second.load_state_dict(state)
            assert second.stream.deal == "balanced"
            assert head + [batch_ids(b) for b in second] == reference, f"cut at {cut}"


def test_even_batches_refuses_what_it_cannot_keep_equal():
    src = gs.FunctionSource(range(4), id_shards([3] * 4))
    with pytest.raises(ValueError, match="rollover"):
        gs.StreamLoader(src, batch_size=2, even_batches=True, last_batch="rollover")
    with pytest.raises(ValueError, match="on_error='skip' cannot keep every rank's batch count"):
        gs.StreamLoader(src, batch_size=2, num_parts=2, part_index=0, even_batches=True,
                        on_error="skip")


def test_even_batches_with_known_sizes_and_a_skipped_shard_keeps_the_counts_equal(caplog):
    """A rank whose shard failed repeats its last batch rather than make the others wait."""
    def part(rank):
        def fn(key):
            if key == 3 and rank == 0:  # fails on this rank only
                raise RuntimeError("upstream data missing")
            return id_shards(SIZES)(key)

        src = gs.FunctionSource(range(len(SIZES)), fn)
        with gs.StreamLoader(src, batch_size=4, num_parts=2, part_index=rank, seed=3,
                             even_batches=True, on_error="skip",
                             shard_sizes=dict(enumerate(SIZES))) as ld:
            return [batch_ids(b) for b in ld]

    with caplog.at_level("WARNING", logger="gluon_stream"):
        counts = [len(part(r)) for r in range(2)]
    assert counts[0] == counts[1] > 0
    if any("short of the" in r.getMessage() for r in caplog.records):
        assert "repeating its last batch" in caplog.text


def test_even_batches_from_file_headers(tmp_path):
    paths = []
    for k, n in enumerate(SIZES):
        paths.append(str(tmp_path / f"s{k}.npy"))
        np.save(paths[-1], np.arange(n) + 1000 * k)
    counts = set()
    for r in range(3):
        with gs.StreamLoader(gs.FileSource(paths), batch_size=4, num_parts=3, part_index=r,
                             even_batches=True) as loader:
            counts.add(sum(1 for _ in loader))
    assert len(counts) == 1


def test_resolve_parts_sources_and_errors():
    assert resolve_parts(4, 2) == (4, 2)
    assert resolve_parts("auto", "auto", environ={"RANK": "1", "WORLD_SIZE": "3"}) == (3, 1)
    kv = types.SimpleNamespace(rank=2, num_workers=4)
    assert resolve_parts("auto", "auto", kvstore=kv, environ={}) == (4, 2)
    with pytest.raises(ValueError, match="disagree"):
        resolve_parts("auto", "auto", kvstore=kv, environ={"RANK": "1", "WORLD_SIZE": "4"})
    with pytest.raises(ValueError, match="found no rank"):
        resolve_parts("auto", "auto", environ={})
    with pytest.raises(ValueError, match="both"):
        resolve_parts("auto", 0)
    with pytest.raises(ValueError, match="part_index"):
        resolve_parts(2, 2)
    with pytest.raises(ValueError, match="seed"):
        gs.StreamLoader(gs.FunctionSource(range(2), id_shards([2, 2])), batch_size=2,
                        shuffle=True, num_parts=2, part_index=0)


def test_resume_within_a_part():
    def make():
        src = gs.FunctionSource(range(len(SIZES)), id_shards(SIZES))
        return gs.StreamLoader(src, batch_size=4, num_parts=2, part_index=1, seed=5,
                               shuffle=True)
    with make() as loader:
        reference = [batch_ids(b) for b in loader]
    with make() as first:
        head = []
        for b in first:
            head.append(batch_ids(b))
            if len(head) == 3:
                break
        state = first.state_dict()
    with make() as second:
        second.load_state_dict(state)
        assert head + [batch_ids(b) for b in second] == reference


WORKER = """
import json, sys
import gluon_stream as gs
sys.path.insert(0, {tests!r})
from _helpers import id_shards, batch_ids
sizes = {sizes!r}
src = gs.FunctionSource(range(len(sizes)), id_shards(sizes), cache_dir={cache!r})
known = dict(shard_sizes=dict(enumerate(sizes))) if {known!r} else dict(shuffle_window=3)
with gs.StreamLoader(src, batch_size=4, num_parts="auto", part_index="auto", seed=1,
                     shuffle=True, even_batches=True, **known) as ld:
    print(json.dumps([batch_ids(b) for b in ld]))
"""


def run_ranks(worker: str, ranks: int, timeout: float, **fields) -> list:
    """Run ``worker`` (formatted with ``fields`` and ``tests``, this folder) as ``ranks`` real
    processes at once, rank and world size in the environment; what each printed, as JSON."""
    import os
    code = worker.format(tests=os.path.dirname(__file__), **fields)
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(ranks)))
             for r in range(ranks)]
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, err
        outs.append(json.loads(out))
    return outs


@pytest.mark.parametrize("known", [True, False], ids=["sizes-known", "sizes-unknown"])
def test_ranks_as_real_processes(tmp_path, known):
    """Three ranks as real processes on one shared cache_dir; with sizes unknown every rank
    produces every shard (each generated once, through the cache's per-key lock)."""
    outs = run_ranks(WORKER, 3, 120, sizes=SIZES, known=known, cache=str(tmp_path / "cache"))
    assert len({len(o) for o in outs}) == 1
    flat = [i for o in outs for b in o for i in b]
    assert len(flat) == len(set(flat))
    if known:
        assert len(flat) >= sum(SIZES) - 3 * 4 * 2
    else:  # at most num_parts - 1 samples lost per shard, and the same batch sizes everywhere
        assert len(flat) >= sum(SIZES) - 2 * len(SIZES) - 3 * 3
        assert len({tuple(len(b) for b in o) for o in outs}) == 1


# -- equal batch counts across ranks, whatever happens (issue 17, item 5) ---------------------
def counts_and_len(num_parts, epochs=3, **kw):
    """Per rank and epoch: (len() before the pass, batches yielded)."""
    out = []
    for rank in range(num_parts):
        src = gs.FunctionSource(range(len(SIZES)), id_shards(SIZES))
        with gs.StreamLoader(src, batch_size=4, num_parts=num_parts, part_index=rank, seed=3,
                             shuffle=True, even_batches=True, **kw) as loader:
            row = []
            for epoch in range(epochs):
                loader.set_epoch(epoch)
                try:
                    expected = len(loader)
                except TypeError:  # sizes unknown before the first pass
                    expected = None
                row.append((expected, len(list(loader))))
            out.append(row)
    return out


@pytest.mark.parametrize("kw", [{"shard_sizes": dict(enumerate(SIZES))}, {}],
                            ids=["sizes-known", "sizes-unknown"])
def test_len_is_what_every_rank_yields(kw):
    table = counts_and_len(2, **kw)
    for epoch in range(3):
        pairs = {row[epoch] for row in table}
        assert len(pairs) == 1  # the same len() and the same count on every rank ...
        expected, got = pairs.pop()
        assert expected == got or (expected is None and epoch == 0 and not kw), epoch
        # ... and len() is what is yielded (known from the first pass on without sizes)


def test_lying_shard_sizes_keep_the_ranks_equal_every_epoch(caplog):
    """shard_sizes=5 for shards of 0..11 samples: every epoch counts with the declared sizes,
    never with the sizes a rank saw, so the ranks stay equal (a rank left short repeats)."""
    table = counts_and_len(2, shard_sizes=5)
    for epoch in range(3):
        assert len({row[epoch] for row in table}) == 1
    assert "shard_sizes declares 5" in caplog.text


def test_deal_balanced_yields_only_full_batches():
    for rank in range(3):
        src = gs.FunctionSource(range(len(SIZES)), id_shards(SIZES))
        with gs.StreamLoader(src, batch_size=4, num_parts=3, part_index=rank, seed=3,
                             even_batches=True) as loader:
            assert loader.stream.deal == "balanced"
            assert all(len(b) == 4 for b in (batch_ids(x) for x in loader))


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_a_state_taken_while_a_short_rank_repeats_resumes_exactly(rank):
    """even_batches + shard_sizes + a skipped shard: states saved after the rank's last real
    batch and while it repeats it resume the repeats, as the uninterrupted run gave them."""
    def fn(key):
        if key == 3:
            raise ValueError("shard 3 fails")
        return id_shards(SIZES)(key)

    def make():
        return gs.StreamLoader(gs.FunctionSource(range(len(SIZES)), fn), batch_size=4,
                               num_parts=3, part_index=rank, seed=3, even_batches=True,
                               shard_sizes=dict(enumerate(SIZES)), on_error="skip")

    with make() as loader:
        reference = [batch_ids(b) for b in loader]
    for k in range(1, len(reference) + 1):
        with make() as first:
            batches = iter(first)
            head = [batch_ids(next(batches)) for _ in range(k)]
            state = json.loads(json.dumps(first.state_dict()))
        with make() as second:
            second.load_state_dict(state)
            assert head + [batch_ids(b) for b in second] == reference, k


def test_a_cache_filled_ahead_by_generate_counts_as_sizes_known(tmp_path):
    """gluon-stream generate records the sizes it filled the cache with: every rank then deals
    shards (each loads only its own) with equal counts and len(); shards cached by a job that
    is already running do not count, so ranks starting at different times decide alike."""
    import shlex

    from fake_generator import command
    from gluon_stream.cli import main

    keys = [f"k{i}" for i in range(9)]
    argv = command("ok", rows=7)
    cache = tmp_path / "cache"
    assert main(["generate", "--command", shlex.join(argv), "--keys", *keys,
                 "--cache-dir", str(cache), "--no-progress"]) == 0

    def rank(r, cache_dir):
        src = gs.CommandSource(keys, argv, cache_dir=cache_dir)
        with gs.StreamLoader(src, batch_size=4, num_parts=3, part_index=r, seed=1,
                             shuffle=True, even_batches=True) as loader:
            expected = len(loader)
            batches = list(loader)
            loaded = {record.key for record in loader.stats.shards}
            return loader.stream.deal, expected, len(batches), loaded

    results = [rank(r, cache) for r in range(3)]
    assert {deal for deal, *_ in results} == {"shards"}
    assert len({(expected, got) for _, expected, got, _ in results}) == 1
    assert all(expected == got for _, expected, got, _ in results)
    loaded = [keys_loaded for *_, keys_loaded in results]
    assert all(len(k) == 3 for k in loaded) and set().union(*loaded) == set(keys)  # its own

    # a cache some process filled while running (no record): sizes unknown on every rank
    other = tmp_path / "other"
    src = gs.CommandSource(keys, argv, cache_dir=other)
    with gs.StreamLoader(src, batch_size=4) as loader:
        list(loader)
    assert [rank(r, other)[0] for r in range(3)] == ["balanced"] * 3


@pytest.mark.parametrize("sizes, batch_size", [([23] * 9, 6), ([23, 5, 17, 1, 30, 8, 2, 11], 4)])
@pytest.mark.parametrize("shuffle", [False, True])
def test_even_batches_with_sizes_unknown_balances_the_strides(sizes, batch_size, shuffle):
    """Issue 24 §4's promise, each rank its own loader: with sizes unknown and
    even_batches=True, rank shares differ by one sample at most (every sample of the epoch is
    dealt once), equal counts of full batches, and a rank drops at most batch_size - 1 of its
    share. Today 9 shards of 23 rows keep 60 per rank with batch_size 6 (27 of 207 dropped:
    2 rows of every shard by the equal stride, then 3 per rank); balanced shares of 69 keep
    66 (9 dropped)."""
    ranks, total = 3, sum(sizes)
    kept = []
    for rank in range(ranks):
        src = gs.FunctionSource(range(len(sizes)), id_shards(sizes))
        loader = gs.StreamLoader(src, batch_size=batch_size, num_parts=ranks, part_index=rank,
                                 seed=3, shuffle=shuffle, even_batches=True)
        kept.append([batch_ids(b) for b in loader])
        loader.close()
    assert len({len(k) for k in kept}) == 1  # equal counts of full batches
    assert all(len(b) == batch_size for k in kept for b in k)
    flat = [i for k in kept for b in k for i in b]
    assert len(flat) == len(set(flat))  # never a sample twice
    # balanced shares hold total // ranks or one more (whichever rank gets the extra ones);
    # a rank keeps all but at most batch_size - 1 of its share
    for rank, batches in enumerate(kept):
        assert batch_size * len(batches) >= total // ranks - (batch_size - 1), rank


TURNS_WORKER = """
import json, sys
import gluon_stream as gs
sys.path.insert(0, {tests!r})
from _helpers import id_shards, batch_ids
src = gs.FunctionSource(range(3), id_shards({sizes!r}))
out = []
loader = gs.StreamLoader(src, batch_size=2, num_parts="auto", part_index="auto", seed=2,
                         shuffle=True, samples_per_epoch=4)
for epoch in range(3):
    loader.set_epoch(epoch)
    out.append([batch_ids(b) for b in loader])  # no with: the loader closes when dropped
print(json.dumps(out))
"""


@pytest.mark.timeout(180)
def test_samples_per_epoch_with_shards_smaller_than_the_ranks_reaches_every_rank():
    """Issue 24 §3: samples_per_epoch with fewer keys than ranks and every shard smaller than
    the rank count (3 dates of 1, 2 and 3 rows on 4 GPUs). Fixed strides gave rank 3 no row in
    any pass, so it raised after 16 passes while ranks 0-2 trained: a hung job. Turning
    strides reach every rank: each of 4 real processes reads 4 samples an epoch, 2 batches,
    every sample one of the shards'."""
    sizes = [1, 2, 3]
    outs = run_ranks(TURNS_WORKER, 4, 150, sizes=sizes)
    ids = set(all_ids(sizes))
    for rank, epochs in enumerate(outs):
        assert [len(e) for e in epochs] == [2, 2, 2], rank  # equal step counts every epoch
        assert all(len(b) == 2 and set(b) <= ids for e in epochs for b in e), rank
    # over 4 passes every rank reads every row position of every shard: the union is all rows
    assert {i for e in outs for ep in e for b in ep for i in b} == ids


@pytest.mark.timeout(120)
@pytest.mark.parametrize("producers", [1, 2])
def test_balanced_strides_with_a_shard_that_fails_once_and_is_retried(producers):
    """deal='balanced': a producer waits for the sizes of the shards before its own. A shard
    that fails once (on_error=('retry', 1)) is made again only when the loop reaches it, after
    the shards behind it already wait for its size: they give up (Deferred) and are made again
    after it, never holding the producers it needs. The batches are those of a run without
    the failure, on every rank."""
    sizes = [7, 5, 9, 4, 6]

    def batches(rank, fail):
        failed = set()

        def fn(key):
            if fail and key == 1 and key not in failed:
                time.sleep(0.1)  # the shards after it are made meanwhile, and wait for it
                failed.add(key)
                raise RuntimeError("a flaky generator")
            return id_shards(sizes)(key)

        with gs.StreamLoader(gs.FunctionSource(range(5), fn), batch_size=3, num_parts=2,
                             part_index=rank, seed=5, shuffle=True, even_batches=True,
                             producers=producers, on_error=("retry", 1)) as loader:
            assert loader.stream.deal == "balanced"
            return [batch_ids(b) for b in loader]

    clean = [batches(r, False) for r in range(2)]
    assert [batches(r, True) for r in range(2)] == clean
    assert len(clean[0]) == len(clean[1]) == 31 // 2 // 3  # 15 samples a rank: 5 batches
