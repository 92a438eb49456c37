"""ShardStream: shards in order with datasets, its settings, and skipping failed shards."""
from __future__ import annotations

import threading
import time
import weakref

import mxnet as mx
import numpy as np
import pytest

import gluon_stream as gs
from _helpers import batch_ids, id_shards, wait_for

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


def test_an_endless_key_iterator_that_fails_delivers_the_shards_drawn_before_it():
    def keys():
        yield from range(3)
        raise ConnectionError("the key service went away")

    with gs.ShardStream(gs.FunctionSource(keys(), id_shards([5, 6, 7])), prefetch=2) as stream:
        got = []
        with pytest.raises(ConnectionError, match="went away") as info:
            for shard in stream:
                got.append((shard.key, len(shard)))
    assert got == [(0, 5), (1, 6), (2, 7)]
    assert any("after 3 key(s)" in note for note in info.value.__notes__)


def test_with_num_epochs_the_last_epoch_does_not_produce_the_next_one_ahead():
    def keys(epoch):
        return [10 * epoch, 10 * epoch + 1]

    src = gs.FunctionSource(keys, lambda key: np.zeros(4))
    with gs.ShardStream(src, prefetch=2, num_epochs=2) as stream:
        stream.set_epoch(0)
        assert len(list(stream)) == 2
        assert stream._next_run.epoch == 1  # epoch 1 was started ahead ...
        stream.set_epoch(1)
        assert len(list(stream)) == 2
        assert stream._next_run is None  # ... epoch 2 never: nobody will train on it
    with gs.ShardStream(gs.FunctionSource(keys, lambda key: np.zeros(4)), prefetch=2) as stream:
        stream.set_epoch(1)
        list(stream)
        assert stream._next_run.epoch == 2  # without num_epochs it is
    with pytest.raises(ValueError, match="num_epochs must be a positive integer"):
        gs.ShardStream(gs.FunctionSource(keys, lambda key: np.zeros(4)), num_epochs=0)


def test_auto_producers_grow_only_while_the_consumer_waits(caplog):
    import os
    import threading

    from _helpers import wait_for

    calls = []

    def instant(key):
        calls.append(key)
        return np.zeros(4)

    # the consumer never waits: every shard is ready before it is asked for
    with gs.ShardStream(gs.FunctionSource(range(3), instant), prefetch=2) as stream:
        run = stream.start_epoch()
        run.start()
        wait_for(lambda: run.ready_ahead() == 3, what="three shards produced ahead")
        assert [run.next_shard().key for _ in range(3)] == [0, 1, 2]
        assert stream.producers == 1

    # the consumer waits while its one producer works: one more, up to min(prefetch, cores)
    gate = threading.Event()

    def gated(key):
        assert gate.wait(30)
        return np.zeros(4)

    with caplog.at_level("INFO", logger="gluon_stream"):
        with gs.ShardStream(gs.FunctionSource(range(4), gated), prefetch=2) as stream:
            run = stream.start_epoch()
            releaser = threading.Timer(0.2, gate.set)
            releaser.start()
            assert run.next_shard().key == 0  # waited for it
            releaser.join()
            assert stream.producers == min(2, os.cpu_count())
            list(stream)
    if stream.producers > 1:
        assert "producers='auto': 2 producers" in caplog.text

    gate.clear()
    with gs.ShardStream(gs.FunctionSource(range(2), gated), prefetch=1) as stream:
        run = stream.start_epoch()
        releaser = threading.Timer(0.2, gate.set)
        releaser.start()
        run.next_shard()
        releaser.join()
        assert stream.producers == 1  # never more than prefetch: nothing more to make ahead


def test_fixed_producers_and_bad_values():
    with gs.ShardStream(gs.FunctionSource(range(2), lambda k: np.zeros(2)), producers=3) as s:
        assert s.producers == 3 and not s.auto_producers
    for bad in (0, True, "many", 1.5):
        with pytest.raises(ValueError, match="producers must be a positive integer"):
            gs.ShardStream(gs.FunctionSource(range(2), lambda k: np.zeros(2)), producers=bad)


# -- stragglers: idle producers generate ahead into the cache (issue 19, item 1) -------------
def _straggling_source(tmp_path, made, slow_key=1, waits_for=4):
    """Shard ``slow_key`` is generated only once shard ``waits_for`` exists: a straggler that
    only a producer generating beyond the prefetch window can get past."""
    done = {k: threading.Event() for k in range(8)}

    def fn(key):
        if key == slow_key:
            assert done[waits_for].wait(20), f"shard {waits_for} was not generated ahead"
        made.append(key)
        done[key].set()
        return np.arange(5, dtype=np.int64) + 100 * key

    return gs.FunctionSource(range(8), fn, cache_dir=tmp_path / "cache")


def test_idle_producers_generate_past_a_straggler_into_the_cache(tmp_path):
    made: list = []
    with gs.ShardStream(_straggling_source(tmp_path, made), prefetch=1, producers=2) as stream:
        assert stream.generate_ahead == 4
        shards = [s.key for s in stream]
    assert shards == list(range(8))  # delivered in order ...
    assert made.index(4) < made.index(1)  # ... though shard 4 was made before the straggler


def test_a_shard_made_before_its_callback_is_attached_generates_no_shard_of_the_window(
        tmp_path, monkeypatch):
    """The stream's thread may be descheduled between submitting shard 0 and attaching the
    callback that starts generations ahead (a busy machine): shard 0 is made by then, the
    callback runs at once, and shard 1, the window's other shard, is not submitted yet. It
    must not be generated ahead: the producer that makes shard 1 would wait for that
    generation, and a straggler at shard 1 would hold both producers (it did: the straggler
    test above failed on a busy machine)."""
    import concurrent.futures as cf

    from gluon_stream._stages.produce import Producer
    submit, generate = Producer.submit_shard, Producer.submit_generation
    ahead = []

    def made_at_once(self, key, epoch, index, run, prepare):
        fut = submit(self, key, epoch, index, run, prepare)
        if (epoch, index) == (0, 0):  # the stream's thread resumes once shard 0 is made
            cf.wait([fut])
        return fut

    def generate_spied(self, key, epoch, index, run):
        ahead.append((epoch, key))
        return generate(self, key, epoch, index, run)

    monkeypatch.setattr(Producer, "submit_shard", made_at_once)
    monkeypatch.setattr(Producer, "submit_generation", generate_spied)
    src = gs.FunctionSource(range(8), lambda k: np.arange(2) + 100 * k,
                            cache_dir=tmp_path / "cache")
    with gs.ShardStream(src, prefetch=1, producers=2) as stream:
        assert [s.key for s in stream] == list(range(8))
    assert not [key for epoch, key in ahead if epoch == 0 and key < 2], ahead  # the window


def test_a_shard_whose_generation_ahead_ends_takes_the_place_before_a_new_generation(
        tmp_path, monkeypatch):
    """A shard of the window made ahead into the cache waits (in a thread of its own) for that
    generation; when it ends, the producer that finishes starts the next generation ahead only
    if a place is left once the waiting shard has its own. It took the only place first (the
    window's shard then waited a whole generation: the tuning bench's generation-bound case,
    15 % slower). The waiting thread is held 0.2 s after the generation ends, as a busy
    machine may deschedule it."""
    from gluon_stream._stages.produce import GenerationsAhead
    events = []

    def fn(key):
        events.append(("generate", key))
        time.sleep(0.1)
        return np.arange(3) + 100 * key

    src = gs.FunctionSource(range(5), fn, cache_dir=tmp_path / "cache")
    produce = src.produce

    def spied_produce(key, epoch, *args, **kwargs):
        events.append(("load", key))
        return produce(key, epoch, *args, **kwargs)

    generated = GenerationsAhead.wait_for

    def descheduled(self, index):
        seconds = generated(self, index)
        if seconds:
            time.sleep(0.2)
        return seconds

    monkeypatch.setattr(src, "produce", spied_produce)
    monkeypatch.setattr(GenerationsAhead, "wait_for", descheduled)
    with gs.ShardStream(src, prefetch=0, producers=1, generate_ahead=2) as stream:
        assert [s.key for s in stream] == list(range(5))
    ahead = [key for what, key in events if what == "generate" and key > 0]
    assert ahead, events  # shards were generated ahead
    for key in ahead:  # each one's load came before the next generation began
        if key + 1 in ahead:
            assert events.index(("load", key)) < events.index(("generate", key + 1)), events


def test_producers_take_places_in_the_order_the_loop_needs_the_shards(tmp_path, monkeypatch):
    """Every load and every generation ahead waits for its place ranked by the pass's epoch
    and the shard's position in it (the throttle hands places out in that order: a shard of
    the window before a generation ahead of a later shard or of the next epoch)."""
    from gluon_stream._stages.produce import Throttle
    held = threading.local()
    take = Throttle.take

    def ranked_take(self, rank=()):
        take(self, rank)
        held.rank = rank

    made = []
    src = gs.FunctionSource(range(6), lambda k: np.arange(3) + 100 * k,
                            cache_dir=tmp_path / "cache")
    produce, ensure = src.produce, src.ensure_file

    def spied_produce(key, epoch, *args, **kwargs):
        made.append(("load", key, epoch, held.rank))
        return produce(key, epoch, *args, **kwargs)

    def spied_ensure(key, epoch, *args, **kwargs):
        made.append(("generate", key, epoch, held.rank))
        return ensure(key, epoch, *args, **kwargs)

    monkeypatch.setattr(Throttle, "take", ranked_take)
    monkeypatch.setattr(src, "produce", spied_produce)
    monkeypatch.setattr(src, "ensure_file", spied_ensure)
    positions = {}
    with gs.ShardStream(src, prefetch=1, producers=2, shuffle=True, seed=3,
                        num_epochs=2) as stream:
        for epoch in range(2):
            stream.set_epoch(epoch)
            for shard in stream:
                positions[(epoch, shard.key)] = shard.index
    assert {what for what, *_ in made} == {"load", "generate"}, made
    assert [sorted(k for (e, k) in positions if e == epoch) for epoch in range(2)] == \
        [list(range(6))] * 2
    for what, key, epoch, rank in made:
        assert rank == (epoch, positions[(epoch, key)]), (what, key, epoch, rank)


def test_a_shard_waiting_for_its_running_generation_keeps_no_other_producer_idle(tmp_path):
    """While shard 1 of the window waits for its own generation ahead, which holds a producer's
    place, the other producer generates further ahead: the waiting shard takes the place its
    generation leaves, so counting it as queued before then (as a fix of the test above first
    did) kept that producer idle (1.16x the best grid setting in the tuning bench's
    stragglers)."""
    times = {}

    def fn(key):
        times[("start", key)] = time.monotonic()
        time.sleep(0.3 if key == 1 else 0.05)
        times[("end", key)] = time.monotonic()
        return np.arange(3) + 100 * key

    src = gs.FunctionSource(range(5), fn, cache_dir=tmp_path / "cache")
    with gs.ShardStream(src, prefetch=0, producers=2, generate_ahead=3) as stream:
        assert [s.key for s in stream] == list(range(5))
    assert times[("start", 3)] < times[("end", 1)], times  # 2 came and went meanwhile


def test_generate_ahead_keeps_batches_and_resumes_exactly(tmp_path):
    def make(ahead, sub):
        src = gs.FunctionSource(range(8), lambda k: np.arange(3 + k, dtype=np.int64) + 100 * k,
                                cache_dir=tmp_path / sub)
        return gs.StreamLoader(gs.ShardStream(src, prefetch=1, producers=2, shuffle=True,
                                              seed=4, generate_ahead=ahead), batch_size=4)
    with make(0, "a") as plain:
        reference = [b.asnumpy().tolist() for b in plain]
    with make(5, "b") as ahead:
        assert [b.asnumpy().tolist() for b in ahead] == reference
    with make(5, "c") as first:
        batches = iter(first)
        head = [next(batches).asnumpy().tolist() for _ in range(3)]
        state = first.state_dict()
    with make(5, "c") as second:
        second.load_state_dict(state)
        assert head + [b.asnumpy().tolist() for b in second] == reference


def test_a_failure_met_ahead_follows_the_shards_error_policy(tmp_path):
    calls: list = []

    def fn(key):
        calls.append(key)
        if key == 3 and calls.count(3) == 1:
            raise ValueError("shard 3 fails once")
        return np.arange(2, dtype=np.int64) + 100 * key

    src = gs.FunctionSource(range(6), fn, cache_dir=tmp_path / "cache")
    with gs.ShardStream(src, prefetch=1, producers=2, on_error=("retry", 1)) as stream:
        assert [s.key for s in stream] == list(range(6))
    assert calls.count(3) == 2  # generated once ahead (failed), once more by the retry
    src = gs.FunctionSource(range(6), fn, cache_dir=tmp_path / "other")
    calls.clear()
    with gs.ShardStream(src, prefetch=1, producers=2) as stream:
        with pytest.raises(gs.ShardError, match="shard 3 fails once"):
            list(stream)


def test_generate_ahead_needs_a_cache():
    src = gs.FunctionSource(range(3), lambda k: np.zeros(2))
    assert gs.ShardStream(src).generate_ahead == 0
    with pytest.raises(ValueError, match="needs a source with a cache_dir"):
        gs.ShardStream(src, generate_ahead=3)


def test_idle_producers_generate_the_next_epoch_while_a_window_holds_its_shards(tmp_path):
    """With a shuffle window, the shards it holds leave one shard in flight; the producer that
    idles then generates the next epoch's first shards into the cache. Here the last shard of
    epoch 0 is made only once a shard of epoch 1 exists: impossible without that."""
    import threading
    made: list = []
    epoch1_made = threading.Event()
    started0 = []

    def fn(key):
        epoch, _ = key.split("-")
        if epoch == "e0":
            started0.append(key)
            if len(started0) == 6:  # the last of epoch 0's six shards
                assert epoch1_made.wait(20), "no shard of epoch 1 was generated ahead"
        made.append(key)
        if epoch == "e1":
            epoch1_made.set()
        return np.arange(8, dtype=np.int64) + 100 * int(key.split("-")[1])

    src = gs.FunctionSource(lambda epoch: [f"e{epoch}-{i}" for i in range(6)], fn,
                            cache_dir=tmp_path / "cache")
    # 3 producers: the one making the last shard, one that may wait for it (its production
    # waits for a generation ahead of the same shard), and one idle
    with gs.StreamLoader(src, batch_size=4, shuffle=True, seed=3, shuffle_window=4, prefetch=1,
                         producers=3) as loader:
        assert sum(len(b) for b in loader) == 48  # epoch 0, whole and in order
        loader.set_epoch(1)
        assert sum(len(b) for b in loader) == 48
    first_e1 = next(i for i, k in enumerate(made) if k.startswith("e1"))
    assert first_e1 < max(i for i, k in enumerate(made) if k.startswith("e0"))


def test_generating_ahead_reaches_the_next_epoch_only(tmp_path):
    """While epoch 0 is read, idle producers may make epoch 1's shards, never epoch 2's (the run
    made ahead for epoch 1 must not start one for epoch 2, cancelling itself)."""
    import time
    made: list = []

    def fn(key):
        made.append(key)
        return np.arange(4, dtype=np.int64)

    src = gs.FunctionSource(lambda epoch: [f"e{epoch}-{i}" for i in range(3)], fn,
                            cache_dir=tmp_path / "cache")
    with gs.ShardStream(src, prefetch=2, producers=2) as stream:
        for _ in stream:
            time.sleep(0.3)  # slow training: every producer idles long enough to run ahead
    assert any(k.startswith("e1") for k in made), made  # epoch 1 was made ahead ...
    assert not any(k.startswith("e2") for k in made), made  # ... and nothing of epoch 2


def test_generate_ahead_auto_stays_within_a_cache_limit(tmp_path):
    """Shards made ahead must be read before the cache evicts them: 'auto' leaves room for the
    prefetch window, the shard in use and one being made."""
    def stream(limit, prefetch=2, **kw):
        src = gs.FunctionSource(range(4), lambda k: np.zeros(2), cache_dir=tmp_path,
                                cache_limit=limit)
        return gs.ShardStream(src, prefetch=prefetch, **kw)

    for limit, ahead in [(None, 6), (100, 6), (8, 4), (6, 2), (3, 0), ("1GB", 6)]:
        with stream(limit) as s:
            assert s.generate_ahead == ahead, limit
    with stream(3, generate_ahead=5) as s:  # asked for: as given
        assert s.generate_ahead == 5


# -- memory: the shards a pass holds (issue 25) ---------------------------------------------
@pytest.fixture
def shards_alive(monkeypatch):
    """``shards_alive(key)``: Shard objects of ``key`` that something still references. Each
    Shard made in the test is followed by a weak reference, not found by ``gc.get_objects()``:
    that, called in a producer thread, may catch the loop's thread building a tuple, whose
    ``tuple()`` then fails with SystemError (it resizes only a tuple nothing else holds)."""
    from gluon_stream.stream import Shard
    made = []
    init = Shard.__init__

    def followed(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(weakref.ref(self))

    monkeypatch.setattr(Shard, "__init__", followed)
    return lambda key: sum(1 for ref in list(made) if getattr(ref(), "key", None) == key)


def test_while_a_shard_is_in_use_only_prefetch_more_are_made():
    """Asking whether the next shard is ready (the loop does at each shard's last batch) or
    for the next shard must not start a shard beyond ``prefetch`` while one is in use: the
    one in use is alive until the next is handed out (was: prefetch + 1 started, one shard
    over the memory bound)."""
    started, lock = [], threading.Lock()

    def make(key):
        with lock:
            started.append(key)
        return np.full(4, key, np.int64)

    src = gs.FunctionSource(range(8), make)
    with gs.ShardStream(src, prefetch=2, producers=3) as stream:
        run = stream.start_epoch()
        try:
            for k in range(6):
                shard = run.next_shard()
                assert shard.key == k
                wait_for(lambda k=k: run.ready_ahead() == min(2, 7 - k),
                         what="the window to be made")
                assert run.ready()  # asked at the shard's last batch: starts nothing more
                time.sleep(0.05)  # an idle producer would start shard k + 3 by now
                with lock:
                    assert max(started) == min(k + 2, 7), (k, started)  # k + 1, k + 2 ahead
                del shard
        finally:
            run.cancel()


def test_the_loader_lets_go_of_a_shard_before_waiting_for_the_next(shards_alive):
    """While the loop waits for shard k + 1, nothing of the loader references shard k (was:
    the feed kept the shard handed out last, a shard over the memory bound)."""
    held = []

    def make(key):
        if key:  # the loop waits for this shard: shard key - 1 must be let go of meanwhile
            deadline = time.monotonic() + 10
            while shards_alive(key - 1) and time.monotonic() < deadline:
                time.sleep(0.01)
            held.append((key - 1, shards_alive(key - 1)))
        return np.full(8, key, np.float32)

    loader = gs.StreamLoader(gs.FunctionSource(range(4), make), batch_size=8, prefetch=1,
                             producers=1)
    assert [float(b.asnumpy()[0]) for b in loader] == [0.0, 1.0, 2.0, 3.0]
    assert held == [(0, 0), (1, 0), (2, 0)]
    loader.close()
