"""samples_per_epoch: epochs of N samples over a stream of shards (endless keys, or epochs that
cut across the key list), every sample once across epochs, len() known ahead, exact resume."""
from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

import gluon_stream as gs
from _helpers import batch_ids

pytestmark = pytest.mark.mxnet


def dated(key):
    """Shard ``key`` holds 7 samples with ids 100 * key .. 100 * key + 6."""
    return np.arange(7, dtype=np.int64) + 100 * key


def endless():
    return gs.FunctionSource(itertools.count(), dated)


def epochs(loader, n):
    out = []
    for epoch in range(n):
        loader.set_epoch(epoch)
        expected = len(loader)
        out.append([batch_ids(b) for b in loader])
        assert len(out[-1]) == expected, epoch  # len() is known ahead and right
    return out


@pytest.mark.parametrize("last_batch, counts", [("keep", [4, 4, 4]), ("discard", [3, 3, 3]),
                                                ("rollover", [3, 4, 4])])
def test_endless_keys_get_epochs_of_n_samples_continuing_in_the_stream(last_batch, counts):
    with gs.StreamLoader(endless(), batch_size=4, samples_per_epoch=15,
                         last_batch=last_batch) as loader:
        got = epochs(loader, 3)
    assert [len(e) for e in got] == counts
    flat = [i for e in got for b in e for i in b]
    stream = [100 * k + r for k in range(7) for r in range(7)]
    if last_batch == "keep":  # exactly N samples per epoch, in stream order
        assert [sum(len(b) for b in e) for e in got] == [15, 15, 15] and flat == stream[:45]
    elif last_batch == "discard":  # the tail of each epoch's N is dropped, not repeated
        assert flat == stream[:12] + stream[15:27] + stream[30:42]
    else:  # the tail opens the next epoch's first batch
        assert flat == stream[:len(flat)] and all(len(b) == 4 for e in got for b in e)


def test_finite_keys_cycle_in_a_fresh_shuffle_and_nothing_is_lost_or_repeated():
    src = gs.FunctionSource(range(5), dated)  # 35 samples a pass over the keys
    with gs.StreamLoader(src, batch_size=5, samples_per_epoch=20, shuffle=True,
                         seed=1) as loader:
        got = epochs(loader, 7)  # 140 samples: four passes over the keys
    flat = [i for e in got for b in e for i in b]
    passes = [sorted(flat[i:i + 35]) for i in range(0, 140, 35)]
    every = sorted(100 * k + r for k in range(5) for r in range(7))
    assert all(p == every for p in passes)  # each pass holds every sample once
    assert flat[:35] != flat[35:70]  # and is shuffled afresh


@pytest.mark.parametrize("kw", [{}, {"shuffle": True, "seed": 3, "shuffle_window": 2},
                                {"num_parts": 2, "part_index": 1, "even_batches": True},
                                {"even_batches": "pad"}])
def test_a_state_taken_after_any_batch_resumes_exactly(kw):
    def make():
        return gs.StreamLoader(gs.FunctionSource(range(4), dated), batch_size=4,
                               samples_per_epoch=10, **kw)
    with make() as loader:
        reference = [b for e in epochs(loader, 4) for b in e]
    for k in range(1, len(reference) + 1):
        with make() as first:
            head = []
            for epoch in range(4):
                first.set_epoch(epoch)
                for batch in first:
                    head.append(batch_ids(batch))
                    if len(head) == k:
                        break
                if len(head) == k:
                    break
            state = json.loads(json.dumps(first.state_dict()))
        with make() as second:
            second.load_state_dict(state)
            tail = []
            for epoch in range(state["epoch"], 4):
                second.set_epoch(epoch)
                tail += [batch_ids(b) for b in second]
        assert head + tail == reference, (k, state["epoch"], state["end"])


def test_epochs_are_read_in_order():
    with gs.StreamLoader(endless(), batch_size=4, samples_per_epoch=8) as loader:
        loader.set_epoch(3)
        with pytest.raises(gs.InvalidState, match="epoch 3 starts where epoch 2 stopped"):
            list(loader)
    with pytest.raises(ValueError, match="samples_per_epoch"):
        gs.StreamLoader(endless(), batch_size=4, samples_per_epoch=0)


def test_a_stream_with_no_samples_is_an_error_not_a_hang():
    src = gs.FunctionSource(range(3), lambda k: np.zeros((0,), np.int64))
    with gs.StreamLoader(src, batch_size=4, samples_per_epoch=8) as loader:
        with pytest.raises(gs.StreamError, match="16 passes over the keys in a row"):
            list(loader)


def test_an_endless_iterator_that_ends_ends_the_epoch_short():
    src = gs.FunctionSource(iter(range(3)), dated)  # 21 samples, then no more keys
    with gs.StreamLoader(src, batch_size=4, samples_per_epoch=15) as loader:
        first = [batch_ids(b) for b in loader]
        second = [batch_ids(b) for b in loader]
    assert sum(len(b) for b in first) == 15 and sum(len(b) for b in second) == 6


@pytest.mark.parametrize("kw", [{}, {"batchify_fn": "default"}, {"shuffle": True, "seed": 2}])
def test_epochs_go_on_in_the_same_run_so_no_shard_is_made_twice(kw):
    """An epoch that stops inside a shard hands the run to the next epoch: the shard it stopped
    in, and those produced ahead, are not produced again."""
    import collections

    import mxnet as mx

    if kw.get("batchify_fn") == "default":
        kw = dict(kw, batchify_fn=mx.gluon.data.dataloader.default_batchify_fn)
    made = collections.Counter()

    def fn(key):
        made[key] += 1
        return dated(key)

    with gs.StreamLoader(gs.FunctionSource(range(12), fn), batch_size=4, samples_per_epoch=10,
                         prefetch=2, **kw) as loader:  # 4 epochs: 40 of a pass's 84 samples
        flat = [i for e in epochs(loader, 4) for b in e for i in b]
    assert len(flat) == len(set(flat)) == 40
    assert max(made.values()) == 1, made


@pytest.mark.timeout(120)
def test_an_endless_iterator_whose_keys_dealt_here_are_all_empty_is_an_error_not_a_hang():
    """Issue 24 §3: endless keys dealt to 4 ranks, every key of rank 3 empty (a weekday
    without data): rank 3 waited for a sample forever. It raises StreamError naming its part
    and keys after EMPTY_SHARDS empty shards in a row; the other ranks read their epochs."""
    from gluon_stream._stages.feed import EMPTY_SHARDS

    def fn(key):
        return np.arange(0 if key % 4 == 3 else 5, dtype=np.int64) + 100 * key

    def loader(rank):
        return gs.StreamLoader(gs.FunctionSource(itertools.count(), fn), batch_size=4,
                               samples_per_epoch=8, num_parts=4, part_index=rank)

    for rank in range(3):
        ids = [i for b in loader(rank) for i in batch_ids(b)]
        assert len(ids) == 8 and all((i // 100) % 4 == rank for i in ids)
    with pytest.raises(gs.StreamError, match=rf"part 3 of 4: {EMPTY_SHARDS} shards in a row "
                       r"\(keys 3 \.\. 255 of an endless key iterator") as raised:
        list(loader(3))
    assert "every 4th key to this one" in str(raised.value)


def test_every_nth_in_messages_is_a_proper_ordinal():
    """Issue 35: messages said 'every 2th'."""
    from gluon_stream._utils.validate import every_nth, ordinal
    assert [ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 22, 23, 101, 112)] == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "23rd", "101st",
        "112th"]
    assert every_nth(2, "key") == "every 2nd key" and every_nth(1, "date") == "every date"
