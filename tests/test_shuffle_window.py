"""shuffle_window: batches that mix the samples of several consecutive shards, with every
sample once, the same batches on every path, deterministic orders, exact resume, per-rank
windows and a bounded number of shards held."""
from __future__ import annotations

import itertools
import json
import threading
import weakref

import numpy as np
import pytest

import gluon_stream as gs
from _helpers import all_ids, batch_ids, epoch_batch_ids, id_shards

pytestmark = pytest.mark.mxnet  # these tests use MXNet: warm its engine first

SIZES = [13, 0, 9, 17, 5, 11, 8, 14]  # awkward sizes, an empty shard, one under a batch
BS = 4
SAMPLE = {"sample_transform": lambda ids, half: (ids, half)}
PATHS = {"slices": {}, "inline": SAMPLE, "threads": dict(SAMPLE, num_workers=2, thread_pool=True),
         "processes": dict(SAMPLE, num_workers=2)}


def make(window, sizes=SIZES, seed=11, **kw):
    kw.setdefault("batch_size", BS)
    src = gs.FunctionSource(range(len(sizes)), id_shards(sizes))
    return gs.StreamLoader(src, shuffle=True, seed=seed, shuffle_window=window, **kw)


def epoch_batches(window, epoch=0, **kw):
    with make(window, **kw) as loader:
        loader.set_epoch(epoch)
        return [batch_ids(b) for b in loader]


def shards_per_batch(batches, batch_size):
    return [len({i // 1000 for i in b}) for b in batches if len(b) == batch_size]


@pytest.mark.parametrize("window", [2, 3, 5])
@pytest.mark.parametrize("last_batch", ["keep", "discard"])
def test_every_sample_once_and_full_batches(window, last_batch):
    batches = epoch_batches(window, last_batch=last_batch)
    flat = [i for b in batches for i in b]
    assert len(flat) == len(set(flat))
    if last_batch == "keep":
        assert sorted(flat) == all_ids(SIZES)
    else:
        assert len(flat) == sum(SIZES) // BS * BS and set(flat) < set(all_ids(SIZES))
    assert all(len(b) == BS for b in batches[:-1])


def test_batches_mix_more_shards_as_the_window_grows():
    mixing = {k: np.mean(shards_per_batch(epoch_batches(k, sizes=[64] * 12, batch_size=16), 16))
              for k in (1, 2, 4, 8)}
    assert mixing[1] < 1.3  # without a window: one shard per batch but at boundaries
    assert mixing[1] < mixing[2] < mixing[4] < mixing[8]
    assert mixing[4] > 2.5


@pytest.mark.parametrize("path", ["inline", "threads", "processes"])
def test_the_per_sample_paths_give_the_slice_paths_batches(path):
    for epoch in (0, 1):
        assert epoch_batches(3, epoch, **PATHS[path]) == epoch_batches(3, epoch)


def test_orders_are_deterministic_per_seed_and_epoch():
    assert epoch_batches(3, 0) == epoch_batches(3, 0)
    assert epoch_batches(3, 0) != epoch_batches(3, 1)
    assert epoch_batches(3, 0) != epoch_batches(3, 0, seed=12)
    assert epoch_batches(3, 0) != epoch_batches(1, 0)


def test_rollover_opens_the_next_epoch_with_the_remainder():
    with make(3, last_batch="rollover") as loader:
        first = [batch_ids(b) for b in loader]
        second = [batch_ids(b) for b in loader]
    assert all(len(b) == BS for b in first + second)
    left = set(all_ids(SIZES)) - {i for b in first for i in b}
    assert len(left) == sum(SIZES) % BS and left <= set(second[0])


@pytest.mark.parametrize("path", ["slices", "processes"])
def test_resume_at_every_batch_gives_the_same_batches_twice_in_a_row(path):
    kw = dict(last_batch="rollover", **PATHS[path])

    def run(loader, stop=None, start_epoch=0):
        return epoch_batch_ids(loader, 2, start_epoch, stop)

    with make(3, **kw) as loader:
        reference = run(loader)
    for k in range(1, len(reference), 3 if path == "processes" else 1):
        with make(3, **kw) as first:
            head = run(first, stop=k)
            state = json.loads(json.dumps(first.state_dict()))
        with make(3, **kw) as second:
            second.load_state_dict(state)
            again = json.loads(json.dumps(second.state_dict()))
            middle = run(second, stop=2, start_epoch=state["epoch"])
            state2 = second.state_dict()
        with make(3, **kw) as third:
            third.load_state_dict(state2)
            tail = run(third, start_epoch=state2["epoch"])
        assert again == state
        assert head + middle + tail == reference, f"resume after {k}"


def test_a_state_from_another_window_is_refused():
    with make(3) as loader:
        next(iter(loader))
        state = loader.state_dict()
    with make(4) as other, pytest.raises(ValueError, match="shuffle_window"):
        other.load_state_dict(state)


@pytest.mark.parametrize("num_parts", [2, 3])
def test_windows_are_formed_within_each_ranks_part(num_parts):
    parts = [epoch_batches(3, num_parts=num_parts, part_index=r) for r in range(num_parts)]
    flat = [i for p in parts for b in p for i in b]
    assert sorted(flat) == all_ids(SIZES)  # disjoint and covering
    for p in parts:
        assert len({i // 1000 for b in p for i in b}) < len(SIZES)  # a part: its own shards


def test_at_most_max_prefetch_window_plus_one_shards_are_held_and_batches_start_early():
    alive, peak = set(), []
    release = {k: threading.Event() for k in range(12)}
    release[0].set()

    def fn(key):
        assert release[key].wait(30), f"the test never released shard {key}"
        ids = np.arange(40, dtype=np.int64) + 1000 * key
        alive.add(key)
        weakref.finalize(ids, alive.discard, key)
        return ids, ids.astype(np.float32)

    src = gs.FunctionSource(range(12), fn)
    with gs.StreamLoader(src, batch_size=8, shuffle=True, seed=1, shuffle_window=4,
                         prefetch=2, producers=4) as loader:
        it = iter(loader)
        first = next(it)  # only shard 0 is in: the window does not wait for its 4 shards
        assert {i // 1000 for i in batch_ids(first)} == {0}
        for k in range(1, 12):
            release[k].set()
        for _ in it:
            peak.append(len(alive))
    assert max(peak) <= max(2, 4) + 1


def test_stats_still_count_each_shards_samples_and_len_is_unchanged():
    src = gs.FunctionSource(range(len(SIZES)), id_shards(SIZES))
    with gs.StreamLoader(src, batch_size=BS, shuffle=True, seed=2, shuffle_window=3,
                         shard_sizes=dict(enumerate(SIZES))) as loader:
        assert len(loader) == -(-sum(SIZES) // BS)
        assert sum(1 for _ in loader) == len(loader)
        per_shard = {r.key: r.samples for r in loader.stats.shards}
    assert per_shard == dict(enumerate(SIZES))


def test_a_window_needs_shuffle():
    with pytest.raises(ValueError, match="shuffle_window=3 mixes .* pass shuffle=True"):
        gs.StreamLoader(gs.FunctionSource([0], id_shards([4])), batch_size=2, shuffle_window=3)
    with pytest.raises(ValueError, match="shuffle_window must be a positive integer"):
        make(0)


def test_units_are_gathered_in_the_background_while_the_loop_trains_on_the_previous_one(
        monkeypatch):
    import gluon_stream._mx as mx_arrays
    gathered = []  # (thread name, the loop's batches delivered so far)
    delivered = [0]
    real = mx_arrays.gather_to_ndarray

    def spy(*args, **kw):
        gathered.append((threading.current_thread().name, delivered[0]))
        return real(*args, **kw)

    monkeypatch.setattr(mx_arrays, "gather_to_ndarray", spy)
    sizes = [40] * 6
    src = gs.FunctionSource(range(len(sizes)), id_shards(sizes))
    with gs.StreamLoader(src, batch_size=8, shuffle=True, seed=3, shuffle_window=3,
                         producers=2) as loader:
        ids = []
        for batch in loader:
            ids.extend(batch_ids(batch))
            delivered[0] += 1
        threads = {t.name for t in threading.enumerate()}
    assert sorted(ids) == all_ids(sizes)
    assert gathered and all(name.startswith("gluon_stream-mixer") for name, _ in gathered)
    # some unit after the first was gathered before the loop had used up the one before it
    assert any(0 < done < 5 * (i + 1) for i, (_, done) in enumerate(gathered[1:])), gathered
    assert any(name.startswith("gluon_stream-mixer") for name in threads)
    assert not any(t.name.startswith("gluon_stream-mixer") for t in threading.enumerate())


@pytest.mark.parametrize("position", [2, 4])
def test_a_failure_met_while_looking_ahead_is_raised_where_the_loop_reaches_it(position,
                                                                               monkeypatch):
    from gluon_stream import stream
    from gluon_stream._stages import feed as feed
    sizes = [12] * 6
    with make(2, sizes=sizes, seed=5) as probe:
        bad = probe.stream.dealer.epoch_keys(0)[2][position]  # the shard at this place of the order

    def fn(key):  # the bad shard's arrays have another trailing shape: SchemaMismatch
        ids, half = id_shards(sizes)(key)
        return (np.stack([ids, ids], axis=1), half) if key == bad else (ids, half)

    def run():
        with gs.StreamLoader(gs.FunctionSource(range(6), fn), batch_size=4, shuffle=True,
                             seed=5, shuffle_window=2, prefetch=3, producers=3) as loader:
            got = []
            with pytest.raises(gs.SchemaMismatch):
                for batch in loader:
                    got.extend(batch_ids(batch))
        return got

    deferred = []
    look_ahead = feed.WindowFeed._look_ahead

    def spy(self):
        look_ahead(self)
        if isinstance(self._deferred, Exception):
            deferred.append(self._deferred)

    monkeypatch.setattr(feed.WindowFeed, "_look_ahead", spy)
    monkeypatch.setattr(stream.KeyPass, "has_shard", lambda self: self.ready())  # always ahead
    ahead = run()
    assert deferred, "the look-ahead never met the failing shard"
    monkeypatch.setattr(stream.KeyPass, "has_shard", lambda self: False)  # never ahead
    assert ahead == run() and ahead  # the same batches, then the same error


@pytest.mark.parametrize("failing", [0, 2, 4, (1, 2)])
def test_resume_is_exact_around_a_skipped_shard(failing):
    """A shard that fails (on_error='skip') anywhere in the window: the state records it, so a
    resume from any batch mixes it as the empty shard it was, without producing it again."""
    failing = set(failing) if isinstance(failing, tuple) else {failing}
    made = []

    def fn(key):
        made.append(key)
        if key in failing:
            raise ValueError(f"shard {key} fails")
        return id_shards(SIZES)(key)

    def make():
        return gs.StreamLoader(gs.FunctionSource(range(len(SIZES)), fn), batch_size=3,
                               shuffle=True, seed=2, shuffle_window=3, on_error="skip")

    with make() as loader:
        reference = [batch_ids(b) for b in loader]
    for k in range(1, len(reference) + 1):
        with make() as first:
            batches = iter(first)
            head = [batch_ids(next(batches)) for _ in range(k)]
            state = json.loads(json.dumps(first.state_dict()))
        made.clear()
        with make() as second:
            order = second.stream.dealer.epoch_keys(0)[2]
            second.load_state_dict(state)
            assert head + [batch_ids(b) for b in second] == reference, k
        recorded = {order[j] for _, j in state["skipped"]}
        assert recorded <= failing
        assert not recorded & set(made)  # skipped again without being produced again


@pytest.mark.parametrize("window", [2, 3])
@pytest.mark.parametrize("given", ["iterator", "keys(pass)"])
def test_a_rollover_of_mixed_units_of_endless_keys_resumes_in_a_fresh_loader(window, given):
    """samples_per_epoch over endless keys, rollover: each epoch's last samples (parts of
    mixed units) open the next one. A state taken anywhere, the end of an epoch included,
    resumes after a JSON round trip in a fresh loader whose iterator starts from its beginning:
    the carried units' shards are named by drawing the keys again (main refused the state)."""
    def make():
        keys = (lambda epoch: itertools.count()) if given == "keys(pass)" \
            else itertools.count()
        fn = id_shards(SIZES * 4)
        return gs.StreamLoader(gs.FunctionSource(keys, fn), batch_size=BS, shuffle=True,
                               seed=11, shuffle_window=window, samples_per_epoch=23,
                               last_batch="rollover")

    def run(loader, states=None):
        batches = []
        for epoch in range(loader.epoch, 3):
            loader.set_epoch(epoch)
            for batch in loader:
                batches.append(batch_ids(batch))
                if states is not None:
                    states.append((len(batches), json.loads(json.dumps(loader.state_dict()))))
            if states is not None:  # the loop saw the end: the next epoch, with the carry
                states.append((len(batches), json.loads(json.dumps(loader.state_dict()))))
        return batches

    states: list = []
    with make() as loader:
        reference = run(loader, states)
    assert all(len(b) == BS for b in reference)
    carried = [s for _, s in states if s["carry"]]
    assert len(carried) == 3  # each epoch's end: samples of a mixed unit carried
    for after, state in states:
        with make() as resumed:
            resumed.load_state_dict(state)
            assert run(resumed) == reference[after:], (after, state["epoch"], state["carry"])


def test_a_state_whose_window_the_loaders_iterator_let_go_is_refused_at_load():
    """The same loader cannot draw its iterator again: a state whose shard is still kept but
    whose window (or carried unit) starts at a key let go is refused when loaded, naming the
    shard, not met as a StreamError of the keys mid-pass."""
    with gs.StreamLoader(gs.FunctionSource(itertools.count(), id_shards([6] * 20)),
                         batch_size=BS, shuffle=True, seed=1, shuffle_window=3,
                         samples_per_epoch=5, last_batch="rollover") as loader:
        states = []
        for epoch in range(6):
            loader.set_epoch(epoch)
            list(loader)
            states.append(loader.state_dict())
        for state in states[2:4]:  # epochs 3 and 4 start in shards 3 and 4: kept
            with pytest.raises(gs.InvalidState, match=rf"at shard {state['unit']} .*reading its "
                                                      r"keys again from shard \d+ .*were let go"):
                loader.load_state_dict(state)
        loader.load_state_dict(states[4])  # its window's keys are kept: it resumes
        assert list(loader)



@pytest.mark.parametrize("window", [2, 3])
def test_a_rolled_over_carry_mixing_shards_7_and_8_resumes_with_their_rows(window):
    """A state saved at an epoch's end carries the rows ``'rollover'`` takes into the next;
    a fresh loader gathers them again from their mixed units' shards, held in whatever order:
    shards 7 and 8 held as a set iterate 8 first, and the gather, which looked each sample's
    shard up in that order as if sorted, left rows unwritten (values of uninitialised memory
    in the resumed batch). The resumed epoch is the uninterrupted one's."""
    sizes = [5, 7, 3, 6, 5, 9, 4, 7, 1]  # 47 rows: batches of 10 carry 7, back into unit 8
    kw = dict(sizes=sizes, batch_size=10, last_batch="rollover")
    with make(window, **kw) as loader:
        [batch_ids(b) for b in loader]
        state = json.loads(json.dumps(loader.state_dict()))
        reference = [batch_ids(b) for b in loader]
    assert 8 in {c["unit"] for c in state["carry"]}, state["carry"]
    with make(window, **kw) as resumed:
        resumed.load_state_dict(state)
        assert [batch_ids(b) for b in resumed] == reference
