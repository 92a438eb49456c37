"""Elastic resume: states saved on N ranks, merged, continued exactly on M ranks.

The hypothesis test draws a job (shard sizes, shuffle, even_batches, last_batch, sizes known or
not, a key list or an endless iterator, a shuffle window of 1-3 shards, samples_per_epoch or
epochs of the keys), resizes it twice at drawn steps (the second time while the ranks read the
first merge's remainder), changes the batch size each time, and checks the samples every rank
trained against :mod:`elastic_model`. ``GS_MODEL_EXAMPLES=400`` runs a deeper search.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import os
import statistics
import time
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, example, given, reject, settings
from hypothesis import strategies as st

import elastic_model as model
import gluon_stream as gs
from _helpers import batch_ids, epoch_batch_ids, id_shards

pytestmark = pytest.mark.mxnet

EXAMPLES = int(os.environ.get("GS_MODEL_EXAMPLES", "30"))


def make_loader(cfg: model.Config, parts: int, rank: int, batch_size: int) -> gs.StreamLoader:
    sizes = {k: n for k, n in enumerate(cfg.sizes)} if cfg.sizes_known else None
    return gs.StreamLoader(gs.FunctionSource(cfg.keys(), cfg.shard),
                           batch_size=batch_size, shuffle=cfg.shuffle, seed=cfg.seed,
                           num_parts=parts, part_index=rank, even_batches=cfg.even,
                           last_batch=cfg.last_batch, shard_sizes=sizes, prefetch=1,
                           shuffle_window=cfg.window, samples_per_epoch=cfg.samples_per_epoch,
                           provenance=cfg.seed % 2 == 0)  # half the draws check origins too


def train(loader: gs.StreamLoader, batch_size: int, stop: int | None) -> tuple[list, int]:
    """The real rows of the batches of one pass (up to ``stop`` batches), and their count."""
    rows, count = [], 0
    if stop == 0:
        return rows, count
    for batch in loader:
        data = batch.asnumpy()
        if loader.stream.producer.keep_origins:  # every row is the key's raw row its record names
            prov = loader.last_provenance
            assert data.tolist() == [model.SPAN * k + r for k, r in zip(prov.keys,
                                                                         prov.rows.tolist())]
        rows += data[:batch_size - loader.pad].tolist()
        count += 1
        if count == stop:
            break
    return rows, count


#: samples_per_epoch: a rank whose passes over the keys give it no sample, pass after pass
EMPTY_PASSES = "passes over the keys in a row"


def next_epoch(loader: gs.StreamLoader, batch_size: int) -> Any:
    """The next epoch's rows, or the error a rank with no sample at all meets with 'pad', or
    with samples_per_epoch where every pass gives it none (a fresh job meets them alike)."""
    try:
        return train(loader, batch_size, None)
    except gs.StreamError as exc:
        for refusal in ("has no batch to give", EMPTY_PASSES):
            if refusal in str(exc):
                return refusal
        raise


def stage(cfg, parts, batch_size, state, stop):
    """``parts`` ranks from ``state``, each training up to ``stop`` batches: (rows, batch
    counts, states, loaders still open when ``stop`` is None)."""
    rows, counts, states, loaders = [], [], [], []
    for rank in range(parts):
        loader = make_loader(cfg, parts, rank, batch_size)
        try:
            if state is not None:
                loader.load_state_dict(json.loads(json.dumps(state)))  # as saved to a file
            got, count = train(loader, batch_size, stop)
        except gs.StreamError as exc:
            for other in loaders + [loader]:
                other.close()
            if "has no batch to give" in str(exc):  # 'pad' with a rank of no sample at all:
                reject()  # refused as in any job (it has no batch to pad with)
            if EMPTY_PASSES in str(exc):  # samples_per_epoch: a rank
                reject()  # dealt only empty shards pass after pass, as in any job
            raise
        rows += got
        counts.append(count)
        states.append(loader.state_dict())
        if stop is None:
            loaders.append(loader)
        else:
            loader.close()
    return rows, counts, states, loaders


def _next_epoch(merged: dict) -> bool:
    """Whether ``merged`` starts the next epoch (every rank's pass had ended)."""
    return merged["elastic"] is None and not merged["end"]


def check(cfg: model.Config) -> dict:
    """Run the three stages; assert the promise; return the figures."""
    if cfg.samples_per_epoch is not None:
        return check_fixed(cfg)
    (n0, n1, n2), (b0, b1, b2) = cfg.parts, cfg.batch_sizes
    rows0, counts0, states0, _ = stage(cfg, n0, b0, None, cfg.stops[0])
    merged = gs.merge_states(list(reversed(states0)))  # any order
    rows1, counts1, states1, _ = stage(cfg, n1, b1, merged, cfg.stops[1])
    merged2 = gs.merge_states(states1)
    rows2, counts2, _, loaders = stage(cfg, n2, b2, merged2, None)
    try:  # (a StreamError raised by a stage closed its loaders)
        # a merge of states saved after the pass ended starts the next epoch: the stages from
        # there on read that epoch, each sample once too
        epochs = [rows0]
        for state, rows in ((merged, rows1), (merged2, rows2)):
            if _next_epoch(state):
                epochs.append([])
            epochs[-1] += rows
        for part in epochs:
            trained = collections.Counter(part)
            twice = {v: c for v, c in trained.items() if c > 1}
            assert not twice, f"trained more than once: {twice}"
            assert set(trained) <= cfg.samples()
        trained = collections.Counter(epochs[0])
        missing = cfg.samples() - set(trained)
        ended = any(s["end"] or s["epoch"] for s in states0 + states1)  # an epoch ran out: the
        if not ended:  # old job's own drops (even_batches=True) are not the resume's
            assert len(missing) <= model.missing_allowed(cfg), (len(missing), sorted(missing))
        if cfg.even:
            for counts in (counts0, counts1, counts2):
                assert len(set(counts)) == 1, counts
        epoch = loaders[0].epoch
        if cfg.last_batch != "rollover":  # the next epoch is a fresh job's
            for rank, loader in enumerate(loaders):
                fresh = make_loader(cfg, n2, rank, b2)
                fresh.set_epoch(epoch)
                try:
                    assert next_epoch(loader, b2) == next_epoch(fresh, b2)
                finally:
                    fresh.close()
    finally:
        for loader in loaders:
            loader.close()
    return {"counts": (counts0, counts1, counts2), "missing": len(missing)}


def quota(cfg: model.Config, parts: int, batch_size: int, epoch: int) -> collections.Counter:
    """samples_per_epoch: the samples the ranks of a fresh ``parts``-rank job read for
    ``epoch`` (each rank its next samples_per_epoch of its stream, as ``last_batch='keep'``
    reads them, and with ``'rollover'`` also what the epoch before rolled into it)."""
    out: collections.Counter = collections.Counter()
    modes = ["keep"] + (["rollover"] if cfg.last_batch == "rollover" else [])
    for rank in range(parts):
        before = {}  # mode -> the samples it trained in the epochs before ``epoch``
        for last_batch in modes:
            ref = dataclasses.replace(cfg, last_batch=last_batch, even=False)
            before[last_batch] = collections.Counter()
            with make_loader(ref, parts, rank, batch_size) as loader:
                for e in range(epoch + 1):
                    got = next_epoch(loader, batch_size)
                    if got == EMPTY_PASSES:  # a fresh job of this shape is refused (as the
                        reject()  # stages' own are): the resumed job is compared to none
                    if e < epoch:
                        before[last_batch].update(got[0])
                    elif last_batch == "keep":
                        out.update(got[0])
        if "rollover" in before:  # rolled in: read before it by 'keep', not yet by 'rollover'
            out += before["keep"] - before["rollover"]  # (a multiset of stream positions:
    return out  # a pass's values come again in the next, so not the union of the two reads)


def check_fixed(cfg: model.Config) -> dict:
    """samples_per_epoch: run the three stages; each epoch the stages read is within the
    samples the job that began it read for it (a multiset), missing what
    :func:`elastic_model.missing_allowed` allows; the epoch after the last stage's is a fresh
    job's, batch for batch."""
    (n0, n1, n2), (b0, b1, b2) = cfg.parts, cfg.batch_sizes
    rows0, counts0, states0, _ = stage(cfg, n0, b0, None, cfg.stops[0])
    merged = gs.merge_states(list(reversed(states0)))
    rows1, counts1, states1, _ = stage(cfg, n1, b1, merged, cfg.stops[1])
    merged2 = gs.merge_states(states1)
    rows2, counts2, _, loaders = stage(cfg, n2, b2, merged2, None)
    try:
        began = {0: (n0, b0)}  # epoch -> (ranks, batch size) of the job that began it
        read: dict[int, list] = {0: [(0, rows0)]}  # epoch -> (stage, rows) of the stages
        for k, (state, rows) in enumerate(((merged, rows1), (merged2, rows2)), 1):
            if _next_epoch(state):  # every rank had ended the epoch: the next starts afresh
                began[state["epoch"]] = (cfg.parts[k], cfg.batch_sizes[k])
            read.setdefault(state["epoch"], []).append((k, rows))
        missing = 0
        for epoch, stages in read.items():
            expected = quota(cfg, *began[epoch], epoch)
            trained = collections.Counter(v for _, rows in stages for v in rows)
            assert not trained - expected, f"epoch {epoch}: trained too often: " \
                f"{dict(trained - expected)}"
            missing = sum((expected - trained).values())
            allowed = model.missing_allowed(cfg, tuple(k for k, _ in stages))
            assert missing <= allowed, (epoch, missing, allowed)
        if cfg.even:
            for counts in (counts0, counts1, counts2):
                assert len(set(counts)) == 1, counts
        epoch = loaders[0].epoch
        for rank, loader in enumerate(loaders):  # the next epoch is a fresh job's
            with make_loader(cfg, n2, rank, b2) as fresh:
                if EMPTY_PASSES in [next_epoch(fresh, b2) for _ in range(epoch)]:
                    reject()  # a fresh job of the last stage's shape never reaches the epoch
                assert next_epoch(loader, b2) == next_epoch(fresh, b2), (rank, epoch)
    finally:
        for loader in loaders:
            loader.close()
    return {"counts": (counts0, counts1, counts2), "missing": missing}


@st.composite
def configs(draw):
    even = draw(st.sampled_from([False, True, "pad"]))
    last_batch = "keep" if even == "pad" else draw(st.sampled_from(
        ["keep", "discard"] if even else ["keep", "discard", "rollover"]))
    fixed = draw(st.one_of(st.none(), st.integers(1, 30)))  # samples_per_epoch
    window = draw(st.integers(1, 3))
    endless = draw(st.booleans())
    # samples_per_epoch with endless keys: no shard empty, or a rank dealt only empty ones
    # would run out before its epoch's samples (unequal counts in any job, even_batches too)
    smallest = 1 if fixed is not None and endless else 0
    sizes = tuple(draw(st.lists(st.integers(smallest, 12), min_size=1, max_size=6)))
    if fixed is not None and not any(sizes):
        reject()  # no sample in the stream: every job refuses it (passes without a sample)
    return model.Config(
        sizes=sizes,
        shuffle=window > 1 or draw(st.booleans()), seed=draw(st.integers(0, 3)), even=even,
        last_batch=last_batch, sizes_known=draw(st.booleans()),
        parts=tuple(draw(st.integers(1, 4)) for _ in range(3)),
        batch_sizes=tuple(draw(st.integers(1, 5)) for _ in range(3)),
        stops=(draw(st.integers(0, 6)), draw(st.integers(0, 6))), endless=endless,
        window=window, samples_per_epoch=fixed)


@settings(max_examples=EXAMPLES, deadline=None, derandomize="GS_MODEL_EXAMPLES" not in os.environ,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cfg=configs())
@example(cfg=model.Config((10, 13, 16, 7), True, 0, True, "keep", True, (2, 3, 2), (4, 5, 3),
                          (2, 1)))
@example(cfg=model.Config((10, 13, 16, 7, 9), True, 1, True, "discard", False, (4, 1, 3),
                          (2, 3, 4), (1, 2)))
@example(cfg=model.Config((10, 13, 16), False, 0, "pad", "keep", False, (1, 4, 2), (3, 2, 5),
                          (3, 2)))
@example(cfg=model.Config((5, 0, 11, 8), True, 2, False, "rollover", False, (3, 2, 1),
                          (4, 3, 5), (1, 1)))
@example(cfg=model.Config((10, 13, 16, 7, 9), True, 1, True, "discard", True, (4, 1, 3),
                          (2, 3, 4), (1, 2), endless=True))
@example(cfg=model.Config((10, 13, 16), False, 0, "pad", "keep", False, (1, 4, 2), (3, 2, 5),
                          (3, 2), endless=True))
@example(cfg=model.Config((1, 1, 1, 1, 1, 1, 1, 2, 3, 1, 1), False, 0, True, "keep", False,
                          (3, 2, 3), (1, 2, 1), (2, 1)))  # balanced strides of tiny shards:
@example(cfg=model.Config((1, 2, 1, 1, 3, 1, 1, 1, 2, 1), True, 4, True, "discard", False,
                          (4, 3, 2), (1, 1, 2), (1, 2)))  # ranks at a step stand shards apart
# shuffle windows: the ranks stop inside mixed units (and a carry of one)
@example(cfg=model.Config((10, 13, 0, 16, 7), True, 0, False, "rollover", False, (2, 3, 2),
                          (4, 5, 3), (2, 3), window=2))
@example(cfg=model.Config((10, 13, 16, 7, 9), True, 1, True, "discard", False, (3, 2, 4),
                          (3, 4, 2), (2, 1), window=3))
@example(cfg=model.Config((10, 0, 13, 16, 5), True, 2, True, "keep", True, (2, 3, 1),
                          (4, 3, 5), (3, 2), window=2))
@example(cfg=model.Config((10, 13, 16, 0), True, 3, "pad", "keep", False, (1, 3, 2),
                          (3, 2, 4), (4, 3), window=3))
@example(cfg=model.Config((9, 0, 11, 8), True, 0, "pad", "keep", True, (3, 2, 3),
                          (2, 3, 2), (2, 4), endless=True, window=2))
@example(cfg=model.Config((7, 12, 0, 9, 3), True, 1, False, "rollover", True, (4, 1, 3),
                          (3, 5, 2), (1, 2), window=3))
@example(cfg=model.Config((4, 11, 6, 11, 4), True, 3, True, "discard", True, (4, 2, 4),
                          (4, 4, 1), (0, 1), endless=True, window=2))  # the tail read before
# samples_per_epoch: finite and endless keys, 2 -> 3 -> 1 ranks, even_batches True and 'pad',
# fewer keys than ranks (turning strides), rollover, epochs longer than a pass, windows of 2, 3
@example(cfg=model.Config((10, 13, 0, 16, 7), True, 1, True, "keep", False, (2, 3, 1),
                          (4, 3, 5), (1, 1), samples_per_epoch=9))
@example(cfg=model.Config((10, 13, 0, 16, 7), True, 1, "pad", "keep", True, (2, 3, 1),
                          (4, 3, 5), (1, 2), endless=True, samples_per_epoch=9))
@example(cfg=model.Config((5, 8, 3), False, 2, False, "rollover", False, (2, 4, 3),
                          (3, 2, 5), (2, 3), samples_per_epoch=23))
@example(cfg=model.Config((5, 8, 3), True, 0, True, "discard", False, (4, 2, 4),
                          (2, 3, 2), (3, 2), samples_per_epoch=23))
@example(cfg=model.Config((4, 1, 9, 6), True, 3, "pad", "keep", False, (3, 4, 2),
                          (2, 1, 3), (1, 3), endless=True, samples_per_epoch=5))
@example(cfg=model.Config((10, 13, 0, 16, 7), True, 1, False, "rollover", False, (2, 3, 1),
                          (4, 3, 5), (2, 1), window=2, samples_per_epoch=11))  # mixed units
@example(cfg=model.Config((6, 9, 4, 12), True, 2, True, "keep", True, (3, 2, 4),
                          (2, 3, 2), (3, 2), endless=True, window=3, samples_per_epoch=17))
# ... endless keys with a window and rollover: the next epoch opens with mixed units' samples
@example(cfg=model.Config((5, 8, 3), True, 0, False, "rollover", False, (2, 4, 3),
                          (3, 2, 5), (2, 3), endless=True, window=2, samples_per_epoch=23))
@example(cfg=model.Config((6, 9, 4, 12), True, 2, False, "rollover", True, (3, 2, 4),
                          (2, 3, 2), (3, 2), endless=True, window=3, samples_per_epoch=17))
# ... a merge at an epoch's end onto a larger batch: the new rank's epoch opens with what a
# fresh job rolls into it (read again), then its whole quota (the remainder after the stop)
@example(cfg=model.Config((3,), False, 0, False, "rollover", False, (1, 1, 1), (1, 3, 1),
                          (3, 1), samples_per_epoch=2))
# ... a rank of the last stage whose passes give it no sample: refused as in a fresh job
@example(cfg=model.Config((1, 0, 0), True, 0, "pad", "keep", False, (1, 1, 3), (1, 1, 1),
                          (0, 0), window=2, samples_per_epoch=1))
# ... the next epoch opens with rows rolled over from a mixed unit of shards 7 and 8 (gathered
# again in a set's order, 8 first: rows of uninitialised memory)
@example(cfg=model.Config((3,), True, 0, False, "rollover", False, (1, 1, 1), (1, 1, 3),
                          (0, 0), endless=True, window=2, samples_per_epoch=26))
def test_resized_twice_every_sample_once(cfg):
    event("endless keys" if cfg.endless else "a key list")  # --hypothesis-show-statistics
    event(f"shuffle_window={cfg.window}")
    event("samples_per_epoch" if cfg.samples_per_epoch else "epochs of the keys")
    check(cfg)


def test_up_and_down_counts_and_sizes():
    """2 -> 3 -> 2 with even_batches=True, sizes known: equal counts, a short batch per rank
    at most left out, the next epoch a fresh 2-rank job's."""
    cfg = model.Config(tuple(range(20, 40, 2)), True, 0, True, "keep", True, (2, 3, 2),
                       (4, 4, 4), (5, 3))
    figures = check(cfg)
    assert figures["counts"][0] == [5, 5] and len(set(figures["counts"][2])) == 1
    assert figures["missing"] <= 2 * 4


# -- refusals --------------------------------------------------------------------------------
def _states(parts=2, stop=1, **overrides):
    kw = dict(batch_size=4, shuffle=True, seed=0)
    kw.update(overrides)
    states = []
    for rank in range(parts):
        loader = gs.StreamLoader(gs.FunctionSource(range(4), lambda k: np.arange(10.0) + 100 * k),
                                 num_parts=parts, part_index=rank, **kw)
        it = iter(loader)
        for _ in range(stop):
            next(it)
        states.append(loader.state_dict())
        loader.close()
    return states


def _loader(**overrides):
    kw = dict(batch_size=4, shuffle=True, seed=0, num_parts=3, part_index=0)
    kw.update(overrides)
    return gs.StreamLoader(gs.FunctionSource(range(4), lambda k: np.arange(10.0) + 100 * k), **kw)


def test_a_missing_or_duplicated_rank_is_refused_naming_it():
    states = _states(parts=3)
    with pytest.raises(gs.InvalidState, match="rank 1 of 3 is missing"):
        gs.merge_states([states[0], states[2]])
    with pytest.raises(gs.InvalidState, match="rank 2's state is given twice"):
        gs.merge_states([states[0], states[1], states[2], states[2]])
    with pytest.raises(gs.InvalidState, match="2 ranks"):
        gs.merge_states(states[:2] + _states(parts=2)[1:])


def test_states_of_different_steps_are_refused_naming_the_rank():
    early, late = _states(stop=1, even_batches=True), _states(stop=2, even_batches=True)
    with pytest.raises(gs.InvalidState, match="rank 1's state is after 2 batch"):
        gs.merge_states([early[0], late[1]])
    a = _states(stop=1)
    loader = gs.StreamLoader(gs.FunctionSource(range(4), lambda k: np.arange(10.0) + 100 * k),
                             batch_size=4, shuffle=True, seed=0, num_parts=2, part_index=1)
    loader.set_epoch(2)
    it = iter(loader)
    next(it)
    later = loader.state_dict()
    loader.close()
    with pytest.raises(gs.InvalidState, match="rank 0's state is in epoch 0"):
        gs.merge_states([a[0], later])


@pytest.mark.parametrize("field,value", [("seed", 1), ("shuffle", False),
                                         ("last_batch", "discard"),
                                         ("even_batches", "pad")])
def test_a_changed_setting_is_refused_naming_the_field(field, value):
    merged = gs.merge_states(_states())
    loader = _loader(**{field: value})
    try:
        with pytest.raises(gs.InvalidState, match=f"field '{field}'"):
            loader.load_state_dict(merged)
    finally:
        loader.close()
    other = _states(**{field: value})
    with pytest.raises(gs.InvalidState, match=f"field '{field}'"):
        gs.merge_states([_states()[0], other[1]])


def test_changed_keys_are_refused_naming_the_field():
    merged = gs.merge_states(_states())
    loader = gs.StreamLoader(gs.FunctionSource(range(5), lambda k: np.arange(10.0)),
                             batch_size=4, shuffle=True, seed=0, num_parts=3, part_index=0)
    try:
        with pytest.raises(gs.InvalidState, match="field 'keys'"):
            loader.load_state_dict(merged)
    finally:
        loader.close()


def _window_states(parts=2, stop=1, sizes=(10,) * 6, **overrides):
    """States of a ``parts``-rank job with a shuffle window of 2, ``stop`` batches in."""
    kw = dict(batch_size=4, shuffle=True, seed=0, shuffle_window=2)
    kw.update(overrides)
    states = []
    for rank in range(parts):
        with gs.StreamLoader(gs.FunctionSource(range(len(sizes)), _shard_of(sizes)),
                             num_parts=parts, part_index=rank, **kw) as loader:
            train(loader, kw["batch_size"], stop)
            states.append(loader.state_dict())
    return states


def _shard_of(sizes):
    return lambda key: np.arange(sizes[key], dtype="float32") + 100 * key


def test_a_window_state_without_its_unit_lengths_is_refused_naming_the_field():
    """A state saved inside a mixed unit must record the lengths of the unit's shards (an
    older gluon_stream's did not): the merge names the field and the rank."""
    states = _window_states()
    assert all(s["unit_lengths"] for s in states)
    old = {k: v for k, v in states[1].items() if k not in ("unit_lengths", "digest")}
    old["digest"] = gs._stages.state.checksum(old)
    with pytest.raises(gs.InvalidState, match="field 'unit_lengths': rank 1's state"):
        gs.merge_states([states[0], old])


def test_a_shard_changed_since_a_window_state_was_saved_is_refused_naming_it():
    """The lengths a state records of a mixed unit's shards decide which of their rows are
    left: a shard that gives an old rank another count now is refused when a new rank reads
    it (InvalidState naming the field and the shard), never cut wrongly."""
    merged = gs.merge_states(_window_states())
    changed = gs.StreamLoader(gs.FunctionSource(range(6), _shard_of((11,) * 6)), batch_size=4,
                              shuffle=True, seed=0, shuffle_window=2, num_parts=3, part_index=0)
    try:
        changed.load_state_dict(merged)
        key = next(p.key for p in changed.stream.dealer.remainder.pieces
                   if any(t.expect is not None for t in p.takes))
        with pytest.raises(gs.InvalidState,
                           match=rf"field 'unit_lengths'.* of shard {key} of epoch 0"):
            list(changed)
    finally:
        changed.close()


@pytest.mark.parametrize("even", [False, True])
def test_a_window_state_resumes_exactly_on_the_same_world_size(even):
    """With a shuffle window, a rank's state (which now records its units' lengths) loaded by
    the same rank of a job of the same size goes on with exactly the batches it would have
    trained, at every batch of two epochs, with even_batches's balanced strides too."""
    sizes = (9, 0, 13, 6, 11)

    def loader(rank):
        return gs.StreamLoader(gs.FunctionSource(range(len(sizes)), id_shards(sizes)),
                               batch_size=3, shuffle=True, seed=4, shuffle_window=3,
                               num_parts=2, part_index=rank, even_batches=even,
                               last_batch="keep" if even else "rollover")

    for rank in range(2):
        with loader(rank) as whole:
            reference = epoch_batch_ids(whole, 2)
        for k in range(1, len(reference)):
            with loader(rank) as first:
                head = epoch_batch_ids(first, 2, stop_after=k)
                state = json.loads(json.dumps(first.state_dict()))
            with loader(rank) as again:
                again.load_state_dict(state)
                tail = epoch_batch_ids(again, 2, start_epoch=state["epoch"])
            assert head + tail == reference, (rank, k)


def test_a_window_carry_of_the_epoch_before_is_resumed_on_another_world_size():
    """last_batch='rollover' with a shuffle window: a rank that ended epoch 0 stands at epoch
    1's start holding samples of a mixed unit of epoch 0, while the other rank trained on into
    epoch 1. Merged, the new ranks train those carried samples and the rest of epoch 1, each
    once (every epoch's keys are their own: a sample names its epoch)."""
    def keys(epoch):
        return [10 * epoch + k for k in range(5)]

    def shard(key):
        return np.arange(7 + key % 10, dtype="float32") + 1000 * key

    def loader(parts, rank):
        return gs.StreamLoader(gs.FunctionSource(keys, shard), batch_size=4, shuffle=True,
                               seed=3, shuffle_window=2, num_parts=parts, part_index=rank,
                               last_batch="rollover")

    trained, states = [], []
    for rank, steps in ((0, 0), (1, 1)):  # rank 1 trains one batch of epoch 1 too
        old = loader(2, rank)
        trained += train(old, 4, None)[0]
        old.set_epoch(1)
        trained += train(old, 4, steps)[0]
        states.append(old.state_dict())
        old.close()
    assert states[0]["epoch"] == 1 and states[0]["carry"] and states[0]["unit_lengths"]
    merged = gs.merge_states(states)
    for rank in range(3):
        new = loader(3, rank)
        new.load_state_dict(merged)
        trained += train(new, 4, None)[0]
        rolled = new.state_dict()["carry"]  # what rolls over into epoch 2
        new.close()
        assert all(seg["epoch"] == 1 for seg in rolled)
    counts = collections.Counter(trained)
    assert max(counts.values()) == 1, {v: c for v, c in counts.items() if c > 1}
    every = {v for e in (0, 1) for k in keys(e) for v in shard(k).tolist()}
    assert set(counts) <= every and len(every - set(counts)) < 3 * 4  # epoch 1's rollover


def test_edited_or_foreign_states_are_refused():
    states = _states()
    edited = dict(states[1], offset=states[1]["offset"] + 1)
    with pytest.raises(gs.InvalidState, match="checksum"):
        gs.merge_states([states[0], edited])
    with pytest.raises(gs.InvalidState, match="list of every rank's state"):
        gs.merge_states(states[0])
    merged = dict(gs.merge_states(states))
    merged["epoch"] += 1
    loader = _loader()
    try:
        with pytest.raises(gs.InvalidState, match="checksum"):
            loader.load_state_dict(merged)
    finally:
        loader.close()


def test_an_empty_list_or_a_merged_state_is_refused_saying_so():
    """The message names the cause: nothing to merge, or a merged state (not a rank's)."""
    with pytest.raises(gs.InvalidState, match="got an empty list"):
        gs.merge_states([])
    with pytest.raises(gs.InvalidState, match="got str"):
        gs.merge_states("state.json")
    states = _states()
    merged = gs.merge_states(states)
    for merged_in in ([merged], [states[0], merged]):
        with pytest.raises(gs.InvalidState, match="is a merged state"):
            gs.merge_states(merged_in)


@pytest.mark.parametrize("window,fixed", [(1, None), (4, None), (1, 400), (4, 400)])
def test_merge_cost_for_64_ranks(window, fixed):
    """The cost of merging 64 ranks' states (printed: median of runs), and of loading it
    (with a shuffle window: the units each rank stands in cut shard by shard; with
    samples_per_epoch: each old rank's stream walked to the end of its quota, by the sizes)."""
    keys, parts = range(256), 64
    states = []
    for rank in range(parts):
        loader = gs.StreamLoader(gs.FunctionSource(keys, lambda k: np.arange(50.0)),
                                 batch_size=8, shuffle=True, seed=0, num_parts=parts,
                                 part_index=rank, shard_sizes=50, shuffle_window=window,
                                 samples_per_epoch=fixed)
        it = iter(loader)
        next(it)
        states.append(loader.state_dict())
        loader.close()
    merge_ms, load_ms = [], []
    loader = gs.StreamLoader(gs.FunctionSource(keys, lambda k: np.arange(50.0)), batch_size=8,
                             shuffle=True, seed=0, num_parts=48, part_index=5, shard_sizes=50,
                             shuffle_window=window, samples_per_epoch=fixed)
    try:
        for _ in range(7):
            t0 = time.perf_counter()
            merged = gs.merge_states(states)
            t1 = time.perf_counter()
            loader.load_state_dict(merged)
            t2 = time.perf_counter()
            merge_ms.append((t1 - t0) * 1e3)
            load_ms.append((t2 - t1) * 1e3)
        count = len(loader)
    finally:
        loader.close()
    print(f"\nmerge_states of {parts} ranks' states ({len(keys)} shards, shuffle_window="
          f"{window}, samples_per_epoch={fixed}; a rank's state {len(json.dumps(states[0]))} "
          "bytes): median "
          f"{statistics.median(merge_ms):.2f} ms; load_state_dict of the merge on a rank of 48: "
          f"median {statistics.median(load_ms):.2f} ms; {len(json.dumps(merged))} bytes of JSON")
    # len(): the epoch's count from its start, as a fresh job of 48 ranks has it (issue 35)
    if fixed is None:
        assert count == -(-6 * 50 // 8)  # rank 5 is dealt 6 of the 256 shards
    else:
        assert count == fixed // 8


# -- checkpoints -----------------------------------------------------------------------------
def test_do_checkpoint_writes_every_rank_and_merges_on_another_world_size(tmp_path):
    import mxnet as mx

    def shard(key):
        return np.arange(10 + 3 * key, dtype="float32") + 100 * key

    def loader(parts, rank):
        return gs.StreamLoader(gs.FunctionSource(range(5), shard), batch_size=4, shuffle=True,
                               seed=0, num_parts=parts, part_index=rank)

    sym = mx.sym.FullyConnected(mx.sym.var("data"), num_hidden=1, name="fc")
    params = {"fc_weight": mx.nd.ones((1, 1)), "fc_bias": mx.nd.zeros((1,))}
    prefix = str(tmp_path / "net")
    trained, after = [], {}
    for rank in range(2):  # 2 ranks checkpoint after 2 batches
        old = loader(2, rank)
        batches = iter(old)
        trained += [v for _ in range(2) for v in next(batches).asnumpy().tolist()]
        gs.do_checkpoint(prefix, old)(0, sym, params, {})
        after[rank] = next(batches).asnumpy().tolist()
        old.close()
    files = sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".loader.json"))
    assert files == ["net-0001.rank0of2.loader.json", "net-0001.rank1of2.loader.json"]
    same = loader(2, 1)  # the same world size: the rank's own state
    try:
        gs.load_checkpoint(prefix, 1, same)
        assert next(iter(same)).asnumpy().tolist() == after[1]
    finally:
        same.close()
    for rank in range(3):  # another: every rank's, merged
        new = loader(3, rank)
        try:
            gs.load_checkpoint(prefix, 1, new)
            trained += [v for b in new for v in b.asnumpy().tolist()]
        finally:
            new.close()
    assert sorted(trained) == sorted(v for k in range(5) for v in shard(k).tolist())
    (tmp_path / files[1]).unlink()
    new = loader(3, 0)
    try:
        with pytest.raises(gs.InvalidState, match=r"rank state files .*rank 1 of 2 is missing"):
            gs.load_checkpoint(prefix, 1, new)
    finally:
        new.close()


def test_a_checkpoint_name_written_again_by_another_world_size_resumes_from_the_new_states(
        tmp_path):
    """A resized job reaches the same epoch number and writes a checkpoint of the same name:
    the state files the job of the other size left there went into the merge beside the new
    ones ('rank 0 of 2 is duplicated' or states of two steps), or, on one rank, were merged in
    place of its own file. Writing a checkpoint removes them; the resume reads the new ones."""
    import mxnet as mx

    def loader(parts, rank):
        return gs.StreamLoader(gs.FunctionSource(range(6), id_shards([9] * 6)), batch_size=3,
                               shuffle=True, seed=1, num_parts=parts, part_index=rank)

    sym = mx.sym.FullyConnected(mx.sym.var("data"), num_hidden=1, name="fc")
    params = {"fc_weight": mx.nd.ones((1, 1)), "fc_bias": mx.nd.zeros((1,))}
    prefix = str(tmp_path / "net")
    for parts, steps in ((2, 1), (3, 2), (1, 4)):  # each size writes epoch 1 at its own step
        after = []
        for rank in range(parts):
            job = loader(parts, rank)
            batches = iter(job)
            for _ in range(steps):
                next(batches)
            gs.do_checkpoint(prefix, job)(0, sym, params, {})
            after.append(batch_ids(next(batches)))
            job.close()
        names = sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".loader.json"))
        assert names == ([f"net-0001.rank{r}of{parts}.loader.json" for r in range(parts)]
                         if parts > 1 else ["net-0001.loader.json"])
        for rank in range(parts):  # the same size resumes from its own, new state
            again = loader(parts, rank)
            try:
                gs.load_checkpoint(prefix, 1, again)
                assert batch_ids(next(iter(again))) == after[rank]
            finally:
                again.close()


def test_states_saved_after_a_pass_resume_at_the_next_epoch_on_another_world_size(tmp_path):
    """``do_checkpoint`` (and the docs' loop) save after the pass ended: every rank stands at
    the next epoch's start. Merged, the new ranks stand there too (``epoch`` says so) and their
    first pass is that epoch as a fresh job of their size reads it, not an empty pass."""
    import mxnet as mx

    def shard(key):
        return np.arange(10 + 3 * key, dtype="float32") + 100 * key

    def loader(parts, rank):
        return gs.StreamLoader(gs.FunctionSource(range(5), shard), batch_size=4, shuffle=True,
                               seed=0, num_parts=parts, part_index=rank, even_batches=True)

    sym = mx.sym.FullyConnected(mx.sym.var("data"), num_hidden=1, name="fc")
    params = {"fc_weight": mx.nd.ones((1, 1)), "fc_bias": mx.nd.zeros((1,))}
    prefix = str(tmp_path / "net")
    for rank in range(2):
        old = loader(2, rank)
        try:
            assert len(list(old)) > 0
            gs.do_checkpoint(prefix, old)(0, sym, params, {})
        finally:
            old.close()
    for rank in range(3):
        new, fresh = loader(3, rank), loader(3, rank)
        try:
            gs.load_checkpoint(prefix, 1, new)
            fresh.set_epoch(1)
            assert new.epoch == 1
            expected = [b.asnumpy().tolist() for b in fresh]
            assert expected and [b.asnumpy().tolist() for b in new] == expected
        finally:
            new.close()
            fresh.close()


# -- sources and failures ----------------------------------------------------------------------
def _mix(weights):
    a = gs.FunctionSource(range(4), lambda k: np.arange(7.0) + 100 * k)
    b = gs.FunctionSource(range(3), lambda k: np.arange(5.0) + 1000 + 100 * k)
    return gs.MixSource({"a": a, "b": b}, weights=weights, shards_per_epoch=6, seed=3)


def _rows(loader, stop=None):
    out = []
    for batch in loader:
        out += batch.asnumpy().tolist()
        if stop is not None and len(out) >= stop:
            break
    return out


def _stop_and_merge(loader, parts, stop):
    """Every rank of a ``parts``-rank job trains ``stop`` rows, saves and closes: what they
    trained, and the merge of their states."""
    trained, states = [], []
    for rank in range(parts):
        old = loader(parts, rank)
        trained += _rows(old, stop=stop)
        states.append(old.state_dict())
        old.close()
    return trained, gs.merge_states(states)


def _resume_rows(loader, parts, merged):
    """What every rank of a ``parts``-rank job trains after loading ``merged``."""
    trained = []
    for rank in range(parts):
        new = loader(parts, rank)
        new.load_state_dict(merged)
        trained += _rows(new)
        new.close()
    return trained


def test_a_mix_resumed_on_another_world_size_and_a_changed_mix_refused():
    def loader(parts, rank, weights=None):
        return gs.StreamLoader(_mix(weights or {"a": 1, "b": 2}), batch_size=3, shuffle=True,
                               seed=0, num_parts=parts, part_index=rank)

    whole = []
    for rank in range(2):  # what a 2-rank epoch 0 trains, as a multiset
        full = loader(2, rank)
        whole += _rows(full)
        full.close()
    trained, merged = _stop_and_merge(loader, 2, stop=3)
    trained += _resume_rows(loader, 3, merged)
    assert sorted(trained) == sorted(whole)  # each sample of the mix's epoch once
    other = loader(3, 0, weights={"a": 2, "b": 1})
    try:
        with pytest.raises(gs.InvalidState, match="field 'keys'"):
            other.load_state_dict(merged)
    finally:
        other.close()


@pytest.mark.parametrize("window", [1, 3])
def test_failing_shards_skipped_before_and_after_a_resize(window):
    def shard(key):
        if key == 3:
            raise RuntimeError("shard 3 cannot be made")
        return np.arange(9.0) + 100 * key

    def loader(parts, rank):
        return gs.StreamLoader(gs.FunctionSource(range(8), shard), batch_size=4, shuffle=True,
                               seed=1, num_parts=parts, part_index=rank, on_error="skip",
                               shuffle_window=window)

    trained, merged = _stop_and_merge(loader, 3, stop=4)
    trained += _resume_rows(loader, 2, merged)
    expected = [v for k in range(8) if k != 3 for v in (np.arange(9.0) + 100 * k).tolist()]
    assert sorted(trained) == sorted(expected)


def _plus_zero(x):
    return x


@pytest.mark.parametrize("window", [1, 2])
def test_num_workers_may_change_at_a_resize(window):
    """Slices on 2 ranks, then per-sample work in 2 worker processes on each of 3 ranks."""
    def loader(parts, rank, **kw):
        return gs.StreamLoader(gs.FunctionSource(range(6), lambda k: np.arange(11.0) + 100 * k),
                               batch_size=4, shuffle=True, seed=5, num_parts=parts,
                               part_index=rank, even_batches="pad", shuffle_window=window, **kw)

    trained, states = [], []
    for rank in range(2):
        old = loader(2, rank)
        batches = iter(old)
        trained += [v for _ in range(2) for v in next(batches).asnumpy().tolist()]
        states.append(old.state_dict())
        old.close()
    merged = gs.merge_states(states)
    counts = []
    for rank in range(3):
        new = loader(3, rank, sample_transform=_plus_zero, num_workers=2)
        try:
            new.load_state_dict(merged)
            count = 0
            for batch in new:
                trained += batch.asnumpy()[:4 - new.pad].tolist()
                count += 1
            counts.append(count)
        finally:
            new.close()
    assert len(set(counts)) == 1, counts
    assert sorted(trained) == sorted(v for k in range(6) for v in (np.arange(11.0) + 100 * k))


@pytest.mark.parametrize("even", [True, "pad"])
@pytest.mark.parametrize("sizes", [None, 5])
def test_endless_keys_with_even_batches_give_every_rank_its_stride_of_every_shard(even, sizes):
    """even_batches without sizes has every rank read every shard and take its stride of the
    samples: with an endless iterator too (each rank read its own keys' strides, dropping the
    others' half), the strides going on from shard to shard (True), and with shard_sizes given (an
    endless epoch's end is unknown all the same: True raised SizeUnknown, 'pad' gave the ranks
    unequal counts)."""
    def shard(key):
        return np.arange(5, dtype="float32") + 1000 * key

    rows, counts = [], []
    for rank in range(2):
        loader = gs.StreamLoader(gs.FunctionSource(lambda epoch: iter(range(5)), shard),
                                 batch_size=2, num_parts=2, part_index=rank, even_batches=even,
                                 seed=0, shard_sizes=sizes)
        got, count = train(loader, 2, None)
        loader.close()
        rows += got
        counts.append(count)
    assert len(rows) == len(set(rows)) and counts[0] == counts[1]
    every = {1000 * k + r for k in range(5) for r in range(5)}
    if even == "pad":
        assert set(rows) == every
    else:  # balanced strides: the ranks hold 13 and 12 of the 25, and train 6 batches each
        assert counts == [6, 6] and len(every - set(rows)) == 1


@pytest.mark.parametrize("even", [False, "pad"])
def test_a_truly_endless_iterator_resized_up_then_down_trains_each_sample_once(even):
    """Keys that never end (a new generator per loader, as a new process builds it): 2 ranks
    train, 3 ranks load the merge and train, are stopped in the iterator's tail and 2 ranks
    load the merge of those. Nothing is trained twice and every shard up to the last one each
    final rank reached is trained whole; with even_batches='pad' too, where every rank of
    each stage reads every shard and takes its stride of it."""
    def shard(key):
        return np.arange(6, dtype="float32") + 1000 * key

    def loader(parts, rank, batch_size):
        return gs.StreamLoader(gs.FunctionSource((k for k in itertools.count()), shard),
                               batch_size=batch_size, shuffle=True, seed=3, num_parts=parts,
                               part_index=rank, prefetch=1, even_batches=even)

    trained, state, last = [], None, []
    for parts, batch_size, stop in ((2, 4, 3), (3, 5, 7), (2, 3, 12)):
        states, last = [], []
        for rank in range(parts):
            resumed = loader(parts, rank, batch_size)
            if state is not None:
                resumed.load_state_dict(json.loads(json.dumps(state)))
            rows, count = train(resumed, batch_size, stop)
            assert count == stop  # an endless epoch: every rank trains as far as it is let
            trained += rows
            last.append(max(int(v) // 1000 for v in rows))
            states.append(resumed.state_dict())
            resumed.close()
        assert all("keys" not in s for s in states)  # an endless iterator: no key list
        state = gs.merge_states(states)
        assert state["elastic"]["endless"]
    counts = collections.Counter(trained)
    assert max(counts.values()) == 1, {v: c for v, c in counts.items() if c > 1}
    whole = {1000 * k + r for k in range(min(last)) for r in range(6)}
    assert whole <= set(counts), sorted(whole - set(counts))[:10]
    assert min(last) > 10


def test_a_rank_stopped_in_an_endless_tail_resumes_its_own_state_exactly():
    """A state saved while reading an endless iterator's tail after a resize, loaded by a new
    loader of the same rank (no merge), goes on with exactly the batches the rank would have
    trained next."""
    def shard(key):
        return np.arange(5, dtype="float32") + 1000 * key

    def loader(parts, rank):
        return gs.StreamLoader(gs.FunctionSource((k for k in itertools.count()), shard),
                               batch_size=3, shuffle=True, seed=1, num_parts=parts,
                               part_index=rank, prefetch=1)

    states = []
    for rank in range(2):
        old = loader(2, rank)
        train(old, 3, 2)
        states.append(old.state_dict())
        old.close()
    merged = gs.merge_states(states)
    for rank in range(3):
        whole = loader(3, rank)
        whole.load_state_dict(merged)
        expected, _ = train(whole, 3, 12)
        whole.close()
        first = loader(3, rank)
        first.load_state_dict(merged)
        head, _ = train(first, 3, 5)
        state = first.state_dict()
        first.close()
        # past the pieces (the rest of the shard each old rank was in: one per old rank)
        assert state["unit"] > len(merged["elastic"]["ranks"])
        again = loader(3, rank)
        again.load_state_dict(json.loads(json.dumps(state)))
        rest, _ = train(again, 3, 7)
        again.close()
        assert head + rest == expected


@pytest.mark.parametrize("saved_endless", [True, False])
def test_a_merge_of_endless_keys_and_a_key_list_do_not_mix(saved_endless):
    """A merge of an endless iterator's states loaded by a loader of a key list (or the other
    way round) is refused naming the keys: the two deal their shards differently."""
    def shard(key):
        return np.arange(5, dtype="float32") + 1000 * key

    def keys(endless):
        return (k for k in range(6)) if endless else list(range(6))

    states = []
    for rank in range(2):
        old = gs.StreamLoader(gs.FunctionSource(keys(saved_endless), shard), batch_size=2,
                              num_parts=2, part_index=rank, seed=0)
        train(old, 2, 2)
        states.append(old.state_dict())
        old.close()
    merged = gs.merge_states(states)
    new = gs.StreamLoader(gs.FunctionSource(keys(not saved_endless), shard), batch_size=2,
                          num_parts=3, part_index=0, seed=0)
    try:
        with pytest.raises(gs.InvalidState, match="field 'keys'.*(endless|key list)"):
            new.load_state_dict(merged)
    finally:
        new.close()


def test_states_at_the_start_of_a_remainder_of_a_later_epoch_stay_in_it():
    """Ranks that load a merge of epoch 1 and are stopped before their first batch stand at the
    start of the remainder they read: in epoch 1, not at the end of epoch 0 (a merge of them
    then started epoch 1 afresh, retraining what the first job trained of it)."""
    sizes = (10, 13, 16, 7, 9)

    def loader(parts, rank):
        return gs.StreamLoader(gs.FunctionSource(range(5), _shard_of(sizes)), batch_size=4,
                               shuffle=True, seed=1, num_parts=parts, part_index=rank,
                               prefetch=1)

    trained, states = [], []
    for rank in range(2):
        with loader(2, rank) as old:
            train(old, 4, None)
            old.set_epoch(1)
            trained += train(old, 4, 2)[0]
            states.append(old.state_dict())
    merged = gs.merge_states(states)
    states = []
    for rank in range(3):
        with loader(3, rank) as idle:
            idle.load_state_dict(merged)
            states.append(idle.state_dict())
    merged = gs.merge_states(states)
    assert merged["epoch"] == 1 and merged["elastic"] is not None
    for rank in range(2):
        with loader(2, rank) as new:
            new.load_state_dict(merged)
            trained += train(new, 4, None)[0]
    assert sorted(trained) == sorted(_shard_of(sizes)(k)[i] for k, n in enumerate(sizes)
                                     for i in range(n))


# -- samples_per_epoch ------------------------------------------------------------------------
def _fixed_loader(parts, rank, batch_size=3, keys=None, **kw):
    sizes = (7, 0, 11, 5, 9)
    return gs.StreamLoader(gs.FunctionSource(range(5) if keys is None else keys,
                                             _shard_of(sizes)),
                           batch_size=batch_size, shuffle=True, seed=2, num_parts=parts,
                           part_index=rank, samples_per_epoch=13, prefetch=1, **kw)


def test_a_samples_per_epoch_state_saved_in_the_remainder_resumes_exactly_on_its_size():
    """A rank stopped while it reads the remainder saves a state that resumes on its own world
    size exactly (the rest of the remainder, then the fresh job's next epoch), as the rank that
    went on without a stop reads them."""
    states = []
    for rank in range(2):
        with _fixed_loader(2, rank) as old:
            train(old, 3, 2)
            states.append(old.state_dict())
    merged = gs.merge_states(states)
    for rank in range(3):
        with _fixed_loader(3, rank, 2) as whole, _fixed_loader(3, rank, 2) as cut:
            whole.load_state_dict(merged)
            cut.load_state_dict(merged)
            expected = [train(whole, 2, None)[0], next_epoch(whole, 2)]
            head, _ = train(cut, 2, 1)
            saved = json.loads(json.dumps(cut.state_dict()))
            assert "remainder" in saved  # it reads the remainder: the state says which
            with _fixed_loader(3, rank, 2) as resumed:
                resumed.load_state_dict(saved)
                got = [head + train(resumed, 2, None)[0], next_epoch(resumed, 2)]
                after = resumed.state_dict()
            assert got == expected, rank
            assert "remainder" not in after  # the next epoch reads the stream


def test_samples_per_epoch_with_an_iterator_given_itself_is_refused_naming_the_keys():
    """An endless iterator given itself gives its keys once: the merge cannot draw it again
    for what each old rank left and where a fresh job's epoch starts. Refused on load, naming
    the field and the fix (keys=fn(pass) building it anew)."""
    states = []
    for rank in range(2):
        with _fixed_loader(2, rank, keys=iter(range(5))) as old:
            train(old, 3, 1)
            states.append(old.state_dict())
    merged = gs.merge_states(states)
    with _fixed_loader(3, 0, keys=iter(range(5))) as new:
        with pytest.raises(gs.InvalidState, match="field 'keys'.*builds the iterator anew"):
            new.load_state_dict(merged)
    with _fixed_loader(3, 0, keys=lambda epoch: iter(range(5))) as new:
        new.load_state_dict(merged)  # a new iterator each call: drawn again
        assert train(new, 3, None)[1]


@pytest.mark.parametrize("window", [2, 3])
def test_samples_per_epoch_with_a_window_rollover_and_endless_keys_resizes_exactly(window):
    """Once refused: the new ranks' next epoch starts with samples rolled over from mixed units
    of an endless iterator, whose shards a resumed loader names by drawing the iterator again.
    2 ranks stop in epoch 0; 3 read the rest of it, then epoch 1 as a fresh 3-rank job reads
    it, batch for batch, and so does a new loader resumed from the state each saved at epoch
    1's start (its carry of mixed units, after a JSON round trip)."""
    def loader(parts, rank):
        return _fixed_loader(parts, rank, shuffle_window=window, last_batch="rollover",
                             keys=lambda epoch: itertools.islice(itertools.cycle(range(5)), 200))

    _, merged = _stop_and_merge(loader, 2, 6)  # 2 batches of 3
    assert merged["elastic"]["endless"] and merged["elastic"]["window"] == window
    for rank in range(3):
        with loader(3, rank) as new, loader(3, rank) as fresh, loader(3, rank) as resumed:
            new.load_state_dict(merged)
            assert train(new, 3, None)[1]  # the rest of epoch 0
            saved = json.loads(json.dumps(new.state_dict()))
            assert saved["epoch"] == 1 and saved["carry"], saved  # samples of a mixed unit
            resumed.load_state_dict(saved)
            next_epoch(fresh, 3)
            expected = next_epoch(fresh, 3)
            assert next_epoch(new, 3) == expected, rank
            assert next_epoch(resumed, 3) == expected, rank


@pytest.mark.parametrize("window", [2, 3])
def test_a_carry_of_mixed_units_of_a_remainders_endless_tail_resumes(window):
    """Epochs of an endless iterator that ends (no samples_per_epoch), a window, rollover: the
    new ranks read the remainder's pieces, then the iterator's keys after them, and epoch 1
    opens with samples of the last mixed units. The state each saved there resumes in a fresh
    loader exactly (those units' shards named from the iterator built anew); an iterator given
    itself, which gives its keys once, is refused naming 'keys'."""
    sizes = (7, 3, 11, 5, 9, 6, 8)

    def loader(parts, rank, keys=None):
        keys = keys if keys is not None else (lambda epoch: iter(range(len(sizes))))
        return gs.StreamLoader(gs.FunctionSource(keys, _shard_of(sizes)), batch_size=4,
                               shuffle=True, seed=2, num_parts=parts, part_index=rank,
                               shuffle_window=window, last_batch="rollover", prefetch=1)

    _, merged = _stop_and_merge(loader, 2, 4)
    carried = 0
    for rank in range(3):
        with loader(3, rank) as new, loader(3, rank) as resumed:
            new.load_state_dict(merged)
            train(new, 4, None)
            saved = json.loads(json.dumps(new.state_dict()))
            carried += bool(saved["carry"])
            resumed.load_state_dict(saved)
            assert next_epoch(resumed, 4) == next_epoch(new, 4), rank
        if saved["carry"]:
            with loader(3, rank, keys=iter(range(len(sizes)))) as given:
                given.load_state_dict(saved)
                with pytest.raises(gs.InvalidState, match="field 'keys'.*builds the iterator "
                                                          "anew"):
                    next(iter(given))
    assert carried  # a rank's epoch 1 opens with samples of the tail's mixed units


def _next_epochs_match(loader, parts, merged, epoch):
    """Every rank of a ``parts``-rank job that loads ``merged`` reads the rest of the epoch,
    then epoch ``epoch`` exactly as a fresh job of ``parts`` ranks reads it: what they
    trained of the rest."""
    trained = []
    for rank in range(parts):
        with loader(parts, rank) as new, loader(parts, rank) as fresh:
            new.load_state_dict(merged)
            trained += _rows(new)
            for _ in range(epoch):
                _rows(fresh)
            assert _rows(new) == _rows(fresh), rank
    return trained


@pytest.mark.parametrize("window", [1, 2])
def test_samples_per_epoch_resizes_a_mix_exactly(window):
    """A MixSource read in epochs of samples_per_epoch: 2 ranks stop, 3 read the rest of
    their epoch (each sample as often as the old ranks' epochs held it), then epoch 1 as a
    fresh 3-rank job."""
    def loader(parts, rank):
        return gs.StreamLoader(_mix({"a": 1, "b": 2}), batch_size=3, shuffle=True, seed=0,
                               num_parts=parts, part_index=rank, samples_per_epoch=25,
                               shuffle_window=window)

    whole = []
    for rank in range(2):
        with loader(2, rank) as full:
            whole += _rows(full)
    trained, merged = _stop_and_merge(loader, 2, stop=7)
    trained += _next_epochs_match(loader, 3, merged, 1)
    assert sorted(trained) == sorted(whole)


def test_samples_per_epoch_skips_failing_shards_alike_and_counts_sizes_from_a_cache(tmp_path):
    """A shard that fails (on_error='skip') counts as empty in the walks, as a pass skips it;
    with a shared cache_dir the new ranks count sizes from the shards the old job made
    (cache hits: nothing is made again)."""
    made = collections.Counter()

    def shard(key):
        made[key] += 1
        if key == 3:
            raise RuntimeError("shard 3 cannot be made")
        return np.arange(9.0) + 100 * key

    def loader(parts, rank):
        return gs.StreamLoader(gs.FunctionSource(range(8), shard, cache_dir=tmp_path),
                               batch_size=4, shuffle=True, seed=1, num_parts=parts,
                               part_index=rank, on_error="skip", samples_per_epoch=30)

    whole = []
    for rank in range(3):
        with loader(3, rank) as full:
            whole += _rows(full)
    trained, merged = _stop_and_merge(loader, 3, stop=8)
    before = dict(made)
    trained += _next_epochs_match(loader, 2, merged, 1)
    assert sorted(trained) == sorted(whole)
    assert all(made[k] == before[k] for k in before if k != 3)  # cache hits, the walks too


def test_a_samples_per_epoch_checkpoint_at_an_epoch_end_resumes_as_a_fresh_job(tmp_path):
    """do_checkpoint at the end of epoch 0 on 2 ranks; 3 ranks load the checkpoint and read
    epoch 1 exactly as a fresh 3-rank job reads it (its start counted in each new rank's own
    stream)."""
    import mxnet as mx

    def loader(parts, rank):
        return gs.StreamLoader(gs.FunctionSource(range(5), _shard_of((10, 13, 16, 19, 22))),
                               batch_size=4, shuffle=True, seed=0, num_parts=parts,
                               part_index=rank, samples_per_epoch=15, last_batch="rollover")

    sym = mx.sym.FullyConnected(mx.sym.var("data"), num_hidden=1, name="fc")
    params = {"fc_weight": mx.nd.ones((1, 1)), "fc_bias": mx.nd.zeros((1,))}
    prefix = str(tmp_path / "net")
    for rank in range(2):
        with loader(2, rank) as old:
            _rows(old)
            gs.do_checkpoint(prefix, old)(0, sym, params, {})
    for rank in range(3):
        with loader(3, rank) as new, loader(3, rank) as fresh:
            gs.load_checkpoint(prefix, 1, new)
            assert new.epoch == 1
            _rows(fresh)
            assert _rows(new) == _rows(fresh), rank
