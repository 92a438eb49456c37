"""A state fuzzer: states saved at every batch of six configurations, mutated leaf by leaf
(±1, epoch + 1, huge numbers, other types, fields removed or added), then loaded into a fresh
loader. Every mutated state must be refused with InvalidState at ``load_state_dict``, or resume
exactly where the original state points: never resume elsewhere in silence, never fail later
with an untyped error.

``python tests/test_state_fuzz.py`` prints the outcome counts (used for the figures in the
issue notes, before and after).
"""
from __future__ import annotations

import collections
import copy
import json
import random
import sys

import numpy as np
import pytest

import gluon_stream as gs
from _helpers import batch_ids

pytestmark = pytest.mark.mxnet

SIZES = [7, 2, 0, 9, 5, 6, 11, 3]
CONFIGS = {
    "slices": dict(shuffle=True, seed=1),
    "per-sample": dict(shuffle=True, seed=1, batchify_fn="default"),
    "window": dict(shuffle=True, seed=1, shuffle_window=3),
    "rollover": dict(shuffle=True, seed=1, last_batch="rollover"),
    "ranks-even": dict(shuffle=True, seed=1, num_parts=2, part_index=1, even_batches=True,
                       shard_sizes=dict(enumerate(SIZES))),
    "window-skip": dict(shuffle=True, seed=1, shuffle_window=2, on_error="skip"),
}
EPOCHS = 2


def fn(key):
    if key == 5:
        raise ValueError("shard 5 fails")
    ids = np.arange(SIZES[key], dtype=np.int64) + 1000 * key
    return ids, ids.astype(np.float32)


def make(name):
    kw = dict(CONFIGS[name])
    if kw.get("batchify_fn") == "default":
        import mxnet as mx
        kw["batchify_fn"] = mx.gluon.data.dataloader.default_batchify_fn
    source = fn if kw.get("on_error") == "skip" else (lambda k: fn(k) if k != 5 else fn(4))
    return gs.StreamLoader(gs.FunctionSource(range(len(SIZES)), source), batch_size=3, **kw)


def run(loader, start_epoch=0):
    out = []
    for epoch in range(start_epoch, EPOCHS):
        loader.set_epoch(epoch)
        out += [batch_ids(b) for b in loader]
    return out


def leaves(value, path=()):
    """Paths to every leaf (and every container) of a JSON value."""
    yield path
    if isinstance(value, dict):
        for k, v in value.items():
            yield from leaves(v, path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from leaves(v, path + (i,))


def mutations(value):
    """Ways to change one leaf."""
    out = [None, "x", [], {}, 10 ** 30, -1, 1.5, True]
    if isinstance(value, bool):
        out.append(not value)
    elif isinstance(value, int):
        out += [value + 1, value - 1, value + 1000]
    return [m for m in out if not (type(m) is type(value) and m == value)]


def mutate(state, rng):
    """One mutated copy of ``state`` and a description."""
    paths = [p for p in leaves(state) if p]
    path = rng.choice(paths)
    out = copy.deepcopy(state)
    parent = out
    for step in path[:-1]:
        parent = parent[step]
    kind = rng.random()
    if kind < 0.1 and isinstance(parent, dict):
        del parent[path[-1]]
        return out, f"del {path}"
    if kind < 0.15 and isinstance(parent, dict):
        parent["extra"] = 1
        return out, f"add extra beside {path}"
    new = rng.choice(mutations(parent[path[-1]]))
    parent[path[-1]] = new
    return out, f"{path} = {new!r}"


def outcome(name, state, reference, delivered):
    """'refused', 'exact', 'wrong' or 'untyped'/'typed' (an error while iterating)."""
    with make(name) as loader:
        try:
            loader.load_state_dict(state)
        except gs.InvalidState:
            return "refused"
        except Exception as exc:  # anything but InvalidState at load is a finding
            return f"untyped at load ({type(exc).__name__})"
        try:
            first = state.get("epoch") if isinstance(state, dict) else 0
            first = first if isinstance(first, int) and 0 <= first < EPOCHS else 0
            got = run(loader, first)
        except gs.StreamError as exc:
            return f"typed ({type(exc).__name__})"
        except Exception as exc:
            return f"untyped ({type(exc).__name__})"
    return "exact" if got == reference[delivered:] else "wrong"


def fuzz(per_config=40, seed=0):
    """Outcome counts over ``per_config`` mutations of states of each configuration."""
    rng = random.Random(seed)
    counts: collections.Counter = collections.Counter()
    findings = []
    for name in CONFIGS:
        with make(name) as loader:
            reference = run(loader)
        states = []
        for k in range(1, len(reference) + 1):
            with make(name) as first:
                got = []
                for epoch in range(EPOCHS):
                    first.set_epoch(epoch)
                    for batch in first:
                        got.append(batch)
                        if len(got) == k:
                            break
                    if len(got) == k:
                        break
                states.append((k, json.loads(json.dumps(first.state_dict()))))
        for _ in range(per_config):
            k, state = rng.choice(states)
            mutated, what = mutate(state, rng)
            if mutated == state:
                continue
            result = outcome(name, mutated, reference, k)
            counts[result] += 1
            if result not in ("refused", "exact"):
                findings.append((name, k, what, result))
    return counts, findings


def test_a_mutated_state_is_refused_or_resumes_exactly():
    counts, findings = fuzz(per_config=25)
    assert not findings, findings[:10]
    assert counts["refused"] > 100


if __name__ == "__main__":
    counts, findings = fuzz(per_config=int(sys.argv[1]) if len(sys.argv) > 1 else 60)
    print(dict(counts))
    for finding in findings[:20]:
        print(finding)
