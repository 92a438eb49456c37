"""context_rows: a shard's transform sees the last raw rows of the keys before it, in key order.

The promise: the key list yields exactly the windows one long series would (the concatenation
of every key's raw rows in key order), once each, whatever reads it: shuffles, a shuffle
window, ranks (each its own loader), a resume in a new loader, an elastic resume, windows
longer than a shard; and a ``context_break`` starts the series afresh.
"""
from __future__ import annotations

import collections
import json
import threading

import mxnet as mx
import numpy as np
import pytest

import gluon_stream as gs

pytestmark = pytest.mark.mxnet

SIZES = [5, 3, 0, 7, 2, 6, 4, 1, 8]  # rows per key: an empty key, keys smaller than windows


def series_source(sizes=SIZES, keys=None, npz=False, calls=None, **kw):
    """Key ``i`` holds rows ``starts[i] .. starts[i] + sizes[i] - 1`` of one series (its
    values are their positions in it); ``npz``: a second array, the values times -1."""
    keys = list(range(len(sizes))) if keys is None else keys
    starts = dict(zip(keys, np.cumsum([0] + list(sizes))[:-1].tolist()))
    size = dict(zip(keys, sizes))

    def fn(key):
        if calls is not None:
            with calls[1]:
                calls[0][key] += 1
        rows = np.arange(starts[key], starts[key] + size[key], dtype=np.int64)
        return {"v": rows, "neg": -rows} if npz else rows
    return gs.FunctionSource(keys, fn, **kw)


def windows_of(steps):
    """The transform: every window of ``steps`` rows of the raw input, one sample each."""
    def transform(raw):
        values = raw[0] if isinstance(raw, tuple) else raw
        if isinstance(raw, tuple):  # npz: both arrays were given context alike
            assert (raw[1] == -values).all()
        if len(values) < steps:
            return np.zeros((0, steps), np.int64)
        return np.ascontiguousarray(np.lib.stride_tricks.sliding_window_view(values, steps))
    return transform


def series_windows(segments, steps):
    """The windows one long series (or one per segment of it) yields, as a sorted list."""
    out = []
    for rows in segments:
        rows = np.asarray(rows, dtype=np.int64)
        if len(rows) >= steps:
            out += [tuple(w) for w in np.lib.stride_tricks.sliding_window_view(rows, steps)
                    .tolist()]
    return sorted(out)


def rows_of(batch):
    first = batch[0] if isinstance(batch, (list, tuple)) else batch
    return [tuple(r) for r in first.asnumpy().astype(np.int64).tolist()]


def loader_for(steps, **kw):
    kw.setdefault("batch_size", 3)
    source = kw.pop("source", None) or series_source()
    return gs.StreamLoader(source, transform=windows_of(steps), context_rows=steps - 1, **kw)


@pytest.mark.parametrize("steps", [1, 2, 4, 9, 20])  # 9 and 20: longer than any shard
@pytest.mark.parametrize("shuffle,window", [(False, 1), (True, 1), (True, 3)])
def test_the_key_list_yields_the_windows_of_one_long_series(steps, shuffle, window):
    total = sum(SIZES)
    want = series_windows([range(total)], steps)
    for epoch in range(2):
        with loader_for(steps, shuffle=shuffle, shuffle_window=window, seed=5) as loader:
            loader.set_epoch(epoch)
            got = sorted(r for b in loader for r in rows_of(b))
        assert got == want, f"epoch {epoch}"
    assert len(want) == total - steps + 1  # none lost at the keys' boundaries


def test_without_context_the_boundaries_lose_windows():
    """The figure the example reports: what context recovers, here one key's worth each."""
    steps = 4
    with gs.StreamLoader(series_source(), batch_size=3, transform=windows_of(steps)) as loader:
        alone = sum(len(rows_of(b)) for b in loader)
    with loader_for(steps) as loader:
        spanned = sum(len(rows_of(b)) for b in loader)
    assert spanned == sum(SIZES) - steps + 1
    assert alone == sum(max(0, n - steps + 1) for n in SIZES) < spanned


@pytest.mark.parametrize("even", [False, True, "pad"])
@pytest.mark.parametrize("parts", [2, 3])
def test_every_rank_reads_the_same_windows_of_its_keys(parts, even):
    """Each rank its own loader: together they hold every window of the series once (every
    rank reads a key's windows alike, from whichever previous keys it did not read)."""
    steps = 6
    want = series_windows([range(sum(SIZES))], steps)
    got = []
    counts = []
    for rank in range(parts):
        with loader_for(steps, shuffle=True, seed=2, num_parts=parts, part_index=rank,
                        even_batches=even) as loader:
            rows = []
            batches = 0
            for b in loader:
                real = len(rows_of(b)) - loader.pad
                rows += rows_of(b)[:real]
                batches += 1
            got += rows
            counts.append(batches)
    if even:
        assert len(set(counts)) == 1, counts
    if even is True:  # full batches only: a few windows left out, none twice
        assert not [w for w, c in collections.Counter(got).items() if c > 1]
        assert set(got) <= set(want)
        assert len(want) - len(got) < parts * 3 + parts
    else:
        assert sorted(got) == want


@pytest.mark.parametrize("npz", [False, True])
def test_a_resume_in_a_new_loader_reads_the_rest_of_the_windows(npz):
    steps = 10  # longer than any shard
    want = series_windows([range(sum(SIZES))], steps)
    whole = []
    with loader_for(steps, source=series_source(npz=npz), shuffle=True, seed=1,
                    shuffle_window=2) as loader:
        whole = [rows_of(b) for b in loader]
    for cut in (1, len(whole) // 2, len(whole) - 1):
        with loader_for(steps, source=series_source(npz=npz), shuffle=True, seed=1,
                        shuffle_window=2) as loader:
            it = iter(loader)
            head = [rows_of(next(it)) for _ in range(cut)]
            state = json.loads(json.dumps(loader.state_dict()))
            it.close()
        with loader_for(steps, source=series_source(npz=npz), shuffle=True, seed=1,
                        shuffle_window=2) as loader:
            loader.load_state_dict(state)
            tail = [rows_of(b) for b in loader]
        assert head + tail == whole, f"cut {cut}"
    assert sorted(r for b in whole for r in b) == want


def test_an_elastic_resume_from_two_ranks_to_three_reads_every_window_once():
    steps = 5
    want = series_windows([range(sum(SIZES))], steps)
    got, states = [], []
    for rank in range(2):
        with loader_for(steps, shuffle=True, seed=3, num_parts=2, part_index=rank) as loader:
            it = iter(loader)
            got += [r for _ in range(2) for r in rows_of(next(it))]
            states.append(loader.state_dict())
            it.close()
    merged = gs.merge_states(states)
    for rank in range(3):
        with loader_for(steps, shuffle=True, seed=3, num_parts=3, part_index=rank,
                        batch_size=2) as loader:
            loader.load_state_dict(merged)
            got += [r for b in loader for r in rows_of(b)]
    assert sorted(got) == want


def test_a_context_break_starts_the_series_afresh():
    """Dates with a gap: no window spans the gap, every window within a run of dates once."""
    keys = [1, 2, 3, 7, 8, 12]
    sizes = [4, 2, 5, 3, 6, 3]
    seen = []

    def gap(prev, key):
        seen.append((prev, key))
        return key - prev != 1

    steps = 4
    with gs.StreamLoader(series_source(sizes, keys), batch_size=2, shuffle=True, seed=0,
                         transform=windows_of(steps), context_rows=steps - 1,
                         context_break=gap) as loader:
        got = sorted(r for b in loader for r in rows_of(b))
    starts = np.cumsum([0] + sizes)
    runs = [range(starts[0], starts[3]), range(starts[3], starts[5]), range(starts[5], starts[6])]
    assert got == series_windows(runs, steps)
    assert (3, 7) in seen and (8, 12) in seen


def test_len_even_batches_and_samples_per_epoch_hold_with_context():
    steps = 3
    total = sum(SIZES) - steps + 1
    sizes = {}  # each key's windows with context: its own rows (the first key: fewer)
    before = 0
    for key, n in enumerate(SIZES):
        sizes[key] = max(0, min(before, steps - 1) + n - steps + 1)
        before += n
    assert sum(sizes.values()) == total
    with loader_for(steps, shard_sizes=sizes, shuffle=True, seed=4) as loader:
        assert len(loader) == -(-total // 3) == sum(1 for _ in loader)
    with loader_for(steps, samples_per_epoch=7, shuffle=True, seed=4) as loader:
        got = []
        for epoch in range(6):
            loader.set_epoch(epoch)
            got += [r for b in loader for r in rows_of(b)]
    assert len(got) == 42
    want = series_windows([range(sum(SIZES))], steps)
    assert sorted(got[:total]) == want  # the first pass over the keys: every window once


def test_per_sample_workers_see_the_same_windows():
    steps = 4
    want = series_windows([range(sum(SIZES))], steps)
    with loader_for(steps, batchify_fn=mx.gluon.data.dataloader.default_batchify_fn,
                    num_workers=2, thread_pool=True, shuffle=True, seed=9) as loader:
        got = sorted(r for b in loader for r in rows_of(b))
    assert got == want


def test_with_a_cache_the_previous_keys_are_cache_hits(tmp_path):
    """A producer reads the previous keys' shards from the cache_dir: each key's function
    runs once; without one it runs again for every key that needs its rows."""
    steps = 12  # spans two or three previous keys
    calls = (collections.Counter(), threading.Lock())
    with loader_for(steps, source=series_source(calls=calls, cache_dir=tmp_path)) as loader:
        cached = sorted(r for b in loader for r in rows_of(b))
    assert max(calls[0].values()) == 1
    calls[0].clear()
    with loader_for(steps, source=series_source(calls=calls)) as loader:
        fresh = sorted(r for b in loader for r in rows_of(b))
    assert cached == fresh == series_windows([range(sum(SIZES))], steps)
    assert sum(calls[0].values()) > len(SIZES)


def test_the_memory_budget_admits_the_context_before_it_is_allocated():
    steps = 8
    want = series_windows([range(sum(SIZES))], steps)
    with loader_for(steps, memory_budget="64MiB", prefetch=2) as loader:
        got = sorted(r for b in loader for r in rows_of(b))
        gate = loader.stream.gate
        assert gate.largest["context"] >= (steps - 1) * 8  # context rows of int64, admitted
        assert gate.peak <= gate.budget and not gate.over
    assert got == want


def test_a_budget_that_cannot_hold_the_context_says_so():
    rows = 20_000
    source = gs.FunctionSource(range(3), lambda k: np.full(rows, k, dtype=np.float64))
    with gs.StreamLoader(source, batch_size=4, transform=lambda raw: raw[-10:],
                         context_rows=rows, memory_budget=3 * rows * 8) as loader:
        with pytest.raises(gs.MemoryBudgetTooSmall, match="context rows"):
            list(loader)


def test_context_needs_a_transform_and_a_key_list():
    with pytest.raises(ValueError, match="pass transform=fn"):
        gs.StreamLoader(series_source(), batch_size=2, context_rows=3)
    with pytest.raises(gs.ContextUnavailable, match="endless iterator"):
        gs.StreamLoader(gs.FunctionSource(iter(range(5)), lambda k: np.arange(3.0)),
                        batch_size=2, transform=lambda r: r, context_rows=3,
                        samples_per_epoch=4)
    with pytest.raises(ValueError, match="context_rows must"):
        gs.StreamLoader(series_source(), batch_size=2, transform=lambda r: r, context_rows=-1)
    with pytest.raises(ValueError, match="needs context_rows"):
        gs.StreamLoader(series_source(), batch_size=2, transform=lambda r: r,
                        context_break=lambda a, b: False)
    with gs.ShardStream(series_source()) as stream:  # the stream owns it
        with pytest.raises(ValueError, match="context_rows"):
            gs.StreamLoader(stream, batch_size=2, context_rows=3)


def test_a_key_listed_twice_is_refused():
    source = gs.FunctionSource([0, 1, 0], lambda k: np.arange(3.0))
    with gs.StreamLoader(source, batch_size=2, transform=lambda r: r, context_rows=2) as loader:
        with pytest.raises(gs.ContextUnavailable, match="listed twice"):
            list(loader)


def test_a_failing_previous_key_fails_the_key_that_needs_it():
    """A key whose context cannot be read fails (named), and on_error='skip' skips it: its
    windows would otherwise differ with what failed where."""
    def fn(key):
        if key == 2:
            raise RuntimeError("no data for key 2")
        return np.arange(10 * key, 10 * key + 4, dtype=np.int64)

    source = gs.FunctionSource(list(range(5)), fn)
    with gs.StreamLoader(source, batch_size=2, transform=windows_of(3),
                         context_rows=2) as loader:
        with pytest.raises(gs.StreamError, match="no data for key 2"):
            list(loader)
    source = gs.FunctionSource(list(range(5)), fn)
    with gs.StreamLoader(source, batch_size=2, transform=windows_of(3), context_rows=2,
                         on_error="skip") as loader:
        got = sorted(r for b in loader for r in rows_of(b))
    # keys 2 (failing) and 3 (its context is key 2's) are skipped; key 4 reads key 3's rows
    assert got == series_windows([[0, 1, 2, 3, 10, 11, 12, 13], [32, 33, 40, 41, 42, 43]], 3)
    with gs.ShardStream(gs.FunctionSource(list(range(5)), fn), transform=lambda r: r,
                        context_rows=2) as stream:
        with pytest.raises(gs.ShardError, match=r"shard 3 .* needs shard 2, which failed"):
            stream.producer.produce_now(3, 0)


def test_the_break_rule_is_asked_only_as_far_back_as_the_rows_need():
    """A key's context reads back only the keys it needs: a long key list costs each key a
    few calls, not one per key before it."""
    calls = []

    def never(prev, key):
        calls.append((prev, key))
        return False

    keys = 200
    with gs.StreamLoader(series_source([2] * keys), batch_size=50, transform=windows_of(4),
                         context_rows=3, context_break=never) as loader:
        got = sorted(r for b in loader for r in rows_of(b))
    assert got == series_windows([range(2 * keys)], 4)
    assert len(calls) <= 2 * keys and all(key == prev + 1 for prev, key in calls)


def test_a_state_saved_with_other_context_rows_is_refused():
    """Another context_rows makes other samples of the same keys: the resume would repeat or
    skip some. (A state saved without context loads as before.)"""
    with loader_for(4, shuffle=True, seed=1) as loader:
        it = iter(loader)
        next(it)
        state = loader.state_dict()
        it.close()
    with gs.StreamLoader(series_source(), batch_size=3, transform=windows_of(4),
                         context_rows=5, shuffle=True, seed=1) as other:
        with pytest.raises(gs.InvalidState, match="context_rows"):
            other.load_state_dict(state)
    with gs.StreamLoader(series_source(), batch_size=3, transform=windows_of(4),
                         shuffle=True, seed=1) as plain:
        it = iter(plain)
        next(it)
        saved = plain.state_dict()
        it.close()
    with loader_for(4, shuffle=True, seed=1) as loader:
        with pytest.raises(gs.InvalidState, match="context_rows"):
            loader.load_state_dict(saved)


def test_len_follows_a_key_list_that_changes_between_epochs():
    """keys(epoch) in another order each epoch: a key's context, so its count of samples,
    changes with it; len() counts each epoch's, not the sizes seen in the last one."""
    sizes = [4, 1, 6, 2]

    def keys(epoch):
        return [(k + epoch) % 4 for k in range(4)]

    def fn(key):
        return np.arange(sizes[key], dtype=np.int64) + 100 * key

    def runs(epoch):  # the series break where the keys wrap round (3 -> 0)
        order = keys(epoch)
        cut = order.index(0)
        return [order[:cut], order[cut:]]

    with gs.StreamLoader(gs.FunctionSource(keys, fn), batch_size=1, transform=windows_of(3),
                         context_rows=2, context_break=lambda a, b: b != a + 1) as loader:
        want = [sum(max(0, sum(sizes[k] for k in run) - 2) for run in runs(epoch))
                for epoch in range(4)]
        assert want[0] != want[1]
        for epoch in range(3):
            loader.set_epoch(epoch)
            assert sum(1 for _ in loader) == want[epoch], f"epoch {epoch}"
        for epoch in range(3):  # counted from the sizes seen in that epoch
            loader.set_epoch(epoch)
            assert len(loader) == want[epoch], f"len() of epoch {epoch}"
        loader.set_epoch(3)  # not from another epoch's: unknown until seen, or declared
        with pytest.raises(gs.SizeUnknown):
            len(loader)



def test_a_state_saved_with_context_is_refused_by_a_loader_without_it():
    """The samples a state's position counts were made with context: a loader without it
    would read them otherwise (the same key yields other samples), so it refuses the state,
    plain or merged from the ranks, naming the setting."""
    def make(part, parts=2, context=True):
        extra = {"context_rows": 2} if context else {}
        return gs.StreamLoader(gs.FunctionSource(range(4), lambda k: np.arange(5.0) + 10 * k),
                               batch_size=2, transform=lambda raw: raw[2:] + raw[:-2],
                               num_parts=parts, part_index=part, seed=0, **extra)

    states = []
    for part in range(2):
        with make(part) as rank:
            next(iter(rank))
            states.append(rank.state_dict())
    merged = gs.merge_states(states)
    with make(0, context=False) as plain:
        with pytest.raises(gs.InvalidState, match="context_rows"):
            plain.load_state_dict(states[0])
    with make(0, parts=1, context=False) as resized:
        with pytest.raises(gs.InvalidState, match="context_rows"):
            resized.load_state_dict(merged)
    with make(0, parts=1) as resized:  # with the same context it resumes
        resized.load_state_dict(merged)


_RANK_SCRIPT = r"""
import json, sys
import numpy as np
import gluon_stream as gs

cache, part, parts, phase, state_path, out_path = sys.argv[1:7]
part, parts = int(part), int(parts)
sizes = %r
starts = np.cumsum([0] + sizes)[:-1].tolist()

def fn(key):  # a new source object in every process: key k holds its rows of one series
    return np.arange(starts[key], starts[key] + sizes[key], dtype=np.int64)

def windows(raw):
    if len(raw) < 4:
        return np.zeros((0, 4), np.int64)
    return np.ascontiguousarray(np.lib.stride_tricks.sliding_window_view(raw, 4))

loader = gs.StreamLoader(gs.FunctionSource(range(len(sizes)), fn, cache_dir=cache),
                         batch_size=2, transform=windows, context_rows=3, shuffle=True,
                         seed=5, num_parts=parts, part_index=part)
rows = []
if phase == "first":  # half an epoch, then the state, as a job killed mid-epoch leaves it
    batches = iter(loader)
    for _ in range(2):
        rows += next(batches).asnumpy().astype(np.int64).tolist()
    json.dump(loader.state_dict(), open(state_path, "w"))
else:  # a new process: the state loaded into a loader nothing else refers to
    loader.load_state_dict(json.load(open(state_path)))
    for batch in loader:
        rows += batch.asnumpy().astype(np.int64).tolist()
json.dump(rows, open(out_path, "w"))
"""


def test_ranks_in_their_own_processes_sharing_a_cache_resume_every_window_once(tmp_path):
    """Each of 3 ranks is its own process, all sharing one cache_dir (a rank reads another's
    shards as context); each stops mid-epoch, and a new process with new source objects
    resumes it: together the ranks read every window of the one series once."""
    import subprocess
    import sys

    sizes = [5, 3, 0, 7, 2, 6, 4, 1, 8]
    script = tmp_path / "rank.py"
    script.write_text(_RANK_SCRIPT % (sizes,))
    cache = tmp_path / "cache"
    rows = []
    for phase in ("first", "rest"):
        procs = [subprocess.Popen([sys.executable, str(script), str(cache), str(part), "3",
                                   phase, str(tmp_path / f"state{part}.json"),
                                   str(tmp_path / f"{phase}{part}.json")],
                                  stderr=subprocess.PIPE, text=True) for part in range(3)]
        for proc in procs:
            _, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err[-3000:]
        rows += [tuple(r) for part in range(3)
                 for r in json.load(open(tmp_path / f"{phase}{part}.json"))]
    assert sorted(rows) == series_windows([range(sum(sizes))], 4)
