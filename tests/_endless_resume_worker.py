"""One process of a ``samples_per_epoch`` job over endless keys (started by
``test_endless_resume.py``, not a test itself)::

    python _endless_resume_worker.py --keys KIND --out OUT.json [--states IN.json] [--window K]

It builds its source and loader anew, as a new process does (the key iterator starts from its
beginning). Without ``--states`` it runs epochs ``0 .. EPOCHS - 1`` uninterrupted and writes
every batch's sample ids and the state after each batch (and after each epoch's loop ended).
With ``--states`` it resumes from each state in turn, each time in a newly built loader, and
writes the batches that follow, up to the end of epoch ``EPOCHS - 1`` (or the error it got).
Importing this module imports neither MXNet nor gluon_stream.
"""
from __future__ import annotations

import argparse
import itertools
import json

EPOCHS = 4
KINDS = ("iterator", "callable_endless", "callable_lists")


def shard(key: str):
    """Shard ``k<n>`` (or ``p<pass>-<n>``): 7 samples with ids ``100 * n + i`` (+ 10000 * pass)."""
    import numpy as np

    head, _, n = key.rpartition("-") if "-" in key else ("", "", key[1:])
    base = 100 * int(n) + (10000 * (1 + int(head[1:])) if head else 0)
    return np.arange(7, dtype=np.int64) + base


def keys(kind: str):
    """The keys as a new process builds them: an endless iterator from its beginning, or a
    ``keys(pass)`` callable (endless iterators, or a finite list per pass)."""
    if kind == "iterator":
        return (f"k{i}" for i in itertools.count())
    if kind == "callable_endless":
        return lambda epoch: (f"k{i}" for i in itertools.count())
    return lambda epoch: [f"p{epoch}-{i}" for i in range(5 + epoch % 2)]


def build(kind: str, window: int):
    import gluon_stream as gs

    return gs.StreamLoader(gs.FunctionSource(keys(kind), shard), batch_size=8,
                           samples_per_epoch=100, shuffle=True, seed=4, shuffle_window=window)


def ids(batch) -> list:
    return [int(x) for x in batch.asnumpy()]


def run(loader, record_states: bool) -> tuple[list, list]:
    batches, states = [], []
    for epoch in range(loader.epoch, EPOCHS):
        loader.set_epoch(epoch)
        for batch in loader:
            batches.append(ids(batch))
            if record_states:
                states.append({"after": len(batches), "epoch": epoch,
                               "state": loader.state_dict()})
        if record_states:  # the loop saw the end: "the next epoch, from its start"
            states.append({"after": len(batches), "epoch": epoch + 1,
                           "state": loader.state_dict()})
    return batches, states


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--keys", choices=KINDS, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--states")
    parser.add_argument("--window", type=int, default=1)
    args = parser.parse_args()
    out: dict = {}
    if args.states is None:
        loader = build(args.keys, args.window)
        out["batches"], out["states"] = run(loader, True)
        loader.close()
    else:
        with open(args.states) as fp:
            states = json.load(fp)
        out["resumed"] = []
        for state in states:
            loader = build(args.keys, args.window)  # new source objects, keys from the start
            try:
                loader.load_state_dict(state)
                out["resumed"].append({"batches": run(loader, False)[0]})
            except Exception as exc:  # the test asserts on the type and message
                out["resumed"].append({"error": type(exc).__name__, "message": str(exc)})
            finally:
                loader.close()
    with open(args.out, "w") as fp:
        json.dump(out, fp)


if __name__ == "__main__":
    main()
