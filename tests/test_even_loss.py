"""even_batches=True loses no more with sizes known than with sizes unknown (issue 35, item 5).

Every rank stops at the smallest part's count of full batches, so an epoch leaves out what the
ranks hold beyond that count. The promise: at most ``ranks * (batch_size - 1) + ranks - 1``
samples an epoch, in every topology, with ``len()`` exact, across a resume and an elastic
resume. Dealing whole shards could not keep it (a rank dealt one 5-row shard of 7 on 4 ranks
set every rank's count to 0), so with sizes known whole shards are dealt only where every deal
of them keeps within it, and balanced strides otherwise.

Each rank is its own loader over a new source, as each rank's process builds it; a few
topologies run every rank as a real process.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import gluon_stream as gs
from _helpers import batch_ids, id_shards

pytestmark = pytest.mark.mxnet


def bound(ranks: int, batch_size: int) -> int:
    return ranks * (batch_size - 1) + ranks - 1


def topologies(count: int = 20) -> list[tuple[int, list[int], int, int]]:
    """(ranks, shard sizes, batch_size, seed): 2-4 ranks, 6-14 shards of 5-90 rows, batches of
    4-8. The first is the one that gave every rank 0 batches: 4 ranks, 7 shards, batch 8, and
    seed 0 deals rank 3 the 5-row shard alone."""
    out = [(4, [40, 60, 70, 80, 85, 90, 5], 8, 0)]
    rng = np.random.default_rng(35)
    while len(out) < count:
        ranks, shards = int(rng.integers(2, 5)), int(rng.integers(6, 15))
        out.append((ranks, [int(n) for n in rng.integers(5, 91, shards)],
                    int(rng.integers(4, 9)), int(rng.integers(0, 100))))
    return out


TOPOLOGIES = topologies()


def rank_loader(ranks: int, rank: int, sizes: list[int], batch_size: int, seed: int,
                known: bool = True, **kw) -> gs.StreamLoader:
    """One rank's loader over a new source (as its own process would build it)."""
    if known:
        kw["shard_sizes"] = dict(enumerate(sizes))
    return gs.StreamLoader(gs.FunctionSource(list(range(len(sizes))), id_shards(sizes)),
                           batch_size=batch_size, num_parts=ranks, part_index=rank, seed=seed,
                           even_batches=kw.pop("even_batches", True), **kw)


def check_epoch(batches: list[list[list[int]]], sizes: list[int], batch_size: int,
                what: str) -> int:
    """Equal counts, full batches, no sample twice, at most the bound left out: the count."""
    ranks = len(batches)
    counts = [len(b) for b in batches]
    assert len(set(counts)) == 1, f"{what}: batches per rank {counts}"
    flat = [i for rank in batches for b in rank for i in b]
    assert all(len(b) == batch_size for rank in batches for b in rank), what
    assert len(flat) == len(set(flat)), f"{what}: a sample twice"
    left_out = sum(sizes) - len(flat)
    assert left_out <= bound(ranks, batch_size), \
        f"{what}: {left_out} of {sum(sizes)} samples left out, over {bound(ranks, batch_size)}"
    return counts[0]


@pytest.mark.parametrize("topology", TOPOLOGIES, ids=lambda t: f"{t[0]}r-{len(t[1])}s-b{t[2]}")
def test_sizes_known_leave_out_at_most_the_bound(topology):
    """Two epochs, each rank its own loader: equal counts, ``len()`` exact before each pass,
    no duplicates, and at most ``ranks * (batch_size - 1) + ranks - 1`` samples left out."""
    ranks, sizes, bs, seed = topology
    loaders = [rank_loader(ranks, r, sizes, bs, seed, shuffle=True) for r in range(ranks)]
    try:
        for epoch in range(2):
            lens = [len(ld) for ld in loaders]
            for ld in loaders:
                ld.set_epoch(epoch)
            got = [[batch_ids(b) for b in ld] for ld in loaders]
            count = check_epoch(got, sizes, bs, f"epoch {epoch}")
            assert lens == [count] * ranks, f"epoch {epoch}: len() {lens}, yielded {count}"
    finally:
        for ld in loaders:
            ld.close()


@pytest.mark.parametrize("topology", TOPOLOGIES[:8], ids=lambda t: f"{t[0]}r-{len(t[1])}s")
def test_sizes_unknown_leave_out_at_most_the_bound(topology):
    """The balanced strides (sizes unknown) keep the same bound."""
    ranks, sizes, bs, seed = topology
    got = []
    for rank in range(ranks):
        with rank_loader(ranks, rank, sizes, bs, seed, known=False) as ld:
            got.append([batch_ids(b) for b in ld])
    check_epoch(got, sizes, bs, "sizes unknown")


def test_whole_shards_kept_where_they_cost_nothing():
    """Equal shards, as many per rank: every deal of them keeps within the bound, so each rank
    reads only its own shards (a rank's batches come from its shards alone)."""
    sizes = [24] * 8
    got, deals = [], set()
    for rank in range(4):
        with rank_loader(4, rank, sizes, 5, 1) as ld:
            deals.add(ld.stream.deal)
            got.append([batch_ids(b) for b in ld])
    assert deals == {"shards"}
    check_epoch(got, sizes, 5, "equal shards")
    for rank in got:  # two whole shards per rank: ids of two keys only
        assert len({i // 1000 for b in rank for i in b}) == 2


@pytest.mark.parametrize("topology", TOPOLOGIES[:6], ids=lambda t: f"{t[0]}r-{len(t[1])}s")
def test_resumed_ranks_keep_the_bound_and_len(topology):
    """Each rank saves its state halfway through the epoch and resumes in a new loader:
    ``len()`` of the resumed loader is the epoch's whole count, and the batches after it are
    those an uninterrupted rank yields."""
    ranks, sizes, bs, seed = topology
    got = []
    for rank in range(ranks):
        with rank_loader(ranks, rank, sizes, bs, seed, shuffle=True) as whole:
            full = [batch_ids(b) for b in whole]
        with rank_loader(ranks, rank, sizes, bs, seed, shuffle=True) as first:
            batches = iter(first)
            head = [batch_ids(next(batches)) for _ in range(len(full) // 2)]
            state = first.state_dict()
        with rank_loader(ranks, rank, sizes, bs, seed, shuffle=True) as resumed:
            resumed.load_state_dict(json.loads(json.dumps(state)))
            assert len(resumed) == len(full)
            rest = [batch_ids(b) for b in resumed]
        assert head + rest == full, f"rank {rank}"
        got.append(full)
    check_epoch(got, sizes, bs, "resumed")


@pytest.mark.parametrize("known", [True, False], ids=["sizes-known", "sizes-unknown"])
@pytest.mark.parametrize("old,new", [(4, 3), (2, 3), (3, 1)])
@pytest.mark.parametrize("topology", TOPOLOGIES[:4], ids=lambda t: f"{len(t[1])}s")
def test_elastic_resume_keeps_the_bound(topology, old, new, known):
    """``old`` ranks train part of the epoch, ``new`` ranks (batch size one more) read the
    rest: equal counts on the new ranks, every sample at most once, and at most the new job's
    bound left out of the epoch, sizes known or not (unknown, the strides of the pieces left
    turn by the rows before each, learned as they are made; equal strides of each piece left
    out up to ``new - 1`` samples a piece more: 21 against 14)."""
    _, sizes, bs, seed = topology
    trained, states = [], []
    for rank in range(old):
        with rank_loader(old, rank, sizes, bs, seed, known, shuffle=True) as ld:
            batches = iter(ld)
            for _ in range(sum(sizes) // old // bs // 3):
                trained += batch_ids(next(batches))
            states.append(ld.state_dict())
    merged = gs.merge_states(states)
    rest = []
    for rank in range(new):
        with rank_loader(new, rank, sizes, bs + 1, seed, known, shuffle=True) as ld:
            ld.load_state_dict(merged)
            rest.append([batch_ids(b) for b in ld])
    counts = [len(r) for r in rest]
    assert len(set(counts)) == 1, f"batches per new rank {counts}"
    flat = trained + [i for r in rest for b in r for i in b]
    assert len(flat) == len(set(flat))
    left_out = sum(sizes) - len(flat)
    assert left_out <= bound(new, bs + 1), f"{left_out} samples left out"


def _train(ld: gs.StreamLoader, batches: int) -> list[int]:
    got, it = [], iter(ld)
    for _ in range(batches):
        got += batch_ids(next(it))
    return got


@pytest.mark.parametrize("known", [True, False], ids=["sizes-known", "sizes-unknown"])
@pytest.mark.parametrize("topology", TOPOLOGIES[1:4], ids=lambda t: f"{len(t[1])}s")
def test_resized_twice_keeps_the_bound(topology, known):
    """4 ranks train a third of the epoch; 3 ranks (batch one more) read part of the rest,
    each resuming its own state on the way (a same-size resume inside the pieces); 2 ranks
    read what is left of that: every sample at most once, equal counts, and at most the
    last job's bound left out (the second merge cuts the pieces by the strides the 3 ranks
    took of them, learned while they read them with sizes unknown)."""
    _, sizes, bs, seed = topology
    trained, states = [], []
    for rank in range(4):
        with rank_loader(4, rank, sizes, bs, seed, known, shuffle=True) as ld:
            trained += _train(ld, sum(sizes) // 4 // bs // 3)
            states.append(ld.state_dict())
    merged, states, counts = gs.merge_states(states), [], set()
    for rank in range(3):
        with rank_loader(3, rank, sizes, bs + 1, seed, known, shuffle=True) as ld:
            ld.load_state_dict(merged)
            trained += _train(ld, 2)
            state = json.loads(json.dumps(ld.state_dict()))
        with rank_loader(3, rank, sizes, bs + 1, seed, known, shuffle=True) as ld:
            ld.load_state_dict(state)  # a same-size resume of a state saved in the pieces
            trained += _train(ld, 1)
            states.append(ld.state_dict())
    merged = gs.merge_states(states)
    for rank in range(2):
        with rank_loader(2, rank, sizes, bs + 2, seed, known, shuffle=True) as ld:
            ld.load_state_dict(merged)
            rest = [batch_ids(b) for b in ld]
        counts.add(len(rest))
        trained += [i for b in rest for i in b]
    assert len(counts) == 1, counts
    assert len(trained) == len(set(trained)), "a sample trained twice"
    left_out = sum(sizes) - len(trained)
    assert left_out <= bound(2, bs + 2), f"{left_out} samples left out"


@pytest.mark.parametrize("topology", TOPOLOGIES[:8], ids=lambda t: f"{t[0]}r-{len(t[1])}s")
def test_pad_stays_exact(topology):
    """``even_batches='pad'`` with sizes known: equal counts, ``len()`` exact, every sample
    once among the real rows."""
    ranks, sizes, bs, seed = topology
    real, counts, lens = [], [], []
    for rank in range(ranks):
        with rank_loader(ranks, rank, sizes, bs, seed, even_batches="pad") as ld:
            lens.append(len(ld))
            n = 0
            for b in ld:
                ids = batch_ids(b)
                real += ids[:len(ids) - ld.pad]
                n += 1
            counts.append(n)
    assert len(set(counts)) == 1 and lens == counts
    assert sorted(real) == sorted(1000 * k + i for k, n in enumerate(sizes) for i in range(n))


WORKER = """
import json, sys
sys.path.insert(0, {tests!r})
import gluon_stream as gs
from _helpers import batch_ids, id_shards
sizes = {sizes!r}
with gs.StreamLoader(gs.FunctionSource(list(range(len(sizes))), id_shards(sizes)),
                     batch_size={bs}, num_parts={ranks}, part_index={rank}, seed={seed},
                     shuffle=True, even_batches=True, shard_sizes=dict(enumerate(sizes))) as ld:
    n = len(ld)
    print(json.dumps({{"len": n, "batches": [batch_ids(b) for b in ld]}}))
"""


@pytest.mark.parametrize("topology", [TOPOLOGIES[0], TOPOLOGIES[5]],
                         ids=lambda t: f"{t[0]}r-{len(t[1])}s-b{t[2]}")
def test_ranks_as_real_processes_keep_the_bound(topology):
    """Every rank a process of its own, started at once."""
    ranks, sizes, bs, seed = topology
    tests = os.path.dirname(os.path.abspath(__file__))
    procs = [subprocess.Popen(
        [sys.executable, "-c", WORKER.format(tests=tests, sizes=sizes, bs=bs, ranks=ranks,
                                             rank=rank, seed=seed)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(ranks)]
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
        outs.append(json.loads(out))
    count = check_epoch([o["batches"] for o in outs], sizes, bs, "processes")
    assert [o["len"] for o in outs] == [count] * ranks


@pytest.mark.parametrize("topology", [TOPOLOGIES[0], TOPOLOGIES[2]],
                         ids=lambda t: f"{t[0]}r-{len(t[1])}s-b{t[2]}")
def test_sizes_from_file_headers_keep_the_bound(tmp_path, topology):
    """Sizes the source knows (``.npy`` headers), nothing declared: the same bound and exact
    ``len()``."""
    ranks, sizes, bs, seed = topology
    paths = []
    for k, n in enumerate(sizes):
        paths.append(str(tmp_path / f"s{k:02d}.npy"))
        np.save(paths[-1], np.arange(n, dtype=np.int64) + 1000 * k)
    got, lens = [], []
    for rank in range(ranks):
        with gs.StreamLoader(gs.FileSource(paths), batch_size=bs, num_parts=ranks,
                             part_index=rank, seed=seed, even_batches=True) as ld:
            lens.append(len(ld))
            got.append([batch_ids(b) for b in ld])
    count = check_epoch(got, sizes, bs, "file headers")
    assert lens == [count] * ranks


def test_a_merge_of_an_older_gluon_stream_is_read_as_it_was():
    """A merged state without ``learned`` (written before the pieces' strides were learned,
    sizes unknown) is read by equal strides of each piece, as then, also across a same-size
    resume inside the pieces: every sample at most once, equal counts."""
    _, sizes, bs, seed = TOPOLOGIES[2]
    trained, states = [], []
    for rank in range(4):
        with rank_loader(4, rank, sizes, bs, seed, False, shuffle=True) as ld:
            trained += _train(ld, sum(sizes) // 4 // bs // 3)
            states.append(ld.state_dict())
    merged = gs.merge_states(states)
    merged["elastic"].pop("learned")
    merged["digest"] = gs._stages.state.checksum({k: v for k, v in merged.items()
                                                    if k != "digest"})
    counts = set()
    for rank in range(3):
        with rank_loader(3, rank, sizes, bs + 1, seed, False, shuffle=True) as ld:
            ld.load_state_dict(merged)
            assert not ld.stream.sizes.learns_rows(0)
            got = _train(ld, 2)
            state = json.loads(json.dumps(ld.state_dict()))
        with rank_loader(3, rank, sizes, bs + 1, seed, False, shuffle=True) as ld:
            ld.load_state_dict(state)
            rest = [batch_ids(b) for b in ld]
        counts.add(2 + len(rest))
        trained += got + [i for b in rest for i in b]
    assert len(counts) == 1, counts
    assert len(trained) == len(set(trained)), "a sample trained twice"
