"""One resume contract, held by every stage of the chain (issue 36).

Each stage resumes by its own mechanism: the keys' deal from a pass and a position in it, the
planner from a :class:`Position`, the shuffle window from a unit, the loader (the chain's end)
from its ``state_dict()``. The same generic test holds each to the contract, as torchdata's
``run_test_save_load_state`` does: take the state after any number of items, build the stage
anew from it (the state through JSON, as a checkpoint keeps it), and the items that follow
equal those of an uninterrupted run.
"""
from __future__ import annotations

import itertools
import json
from typing import Any, Callable, Iterator

import numpy as np
import pytest

import gluon_stream as gs
from _helpers import batch_ids
from gluon_stream._stages.batching import BatchPlanner, Position, WindowMixer


class Adapter:
    """A stage as the contract sees it: its items in order, its state, and a stage of the
    same configuration resumed from a state."""

    def items(self) -> Iterator[Any]:
        raise NotImplementedError

    def state(self) -> dict:
        raise NotImplementedError

    def resumed(self, state: dict) -> Iterator[Any]:
        raise NotImplementedError

    def close(self) -> None:
        """Nothing to close unless the stage owns threads."""


# -- the keys stage: one part's deal of each pass --------------------------------------------
class Keys(Adapter):
    def __init__(self, keys: Any, passes: int, **kwargs: Any) -> None:
        self.passes = passes
        self.stream = gs.ShardStream(gs.FunctionSource(keys, lambda k: np.zeros(1)), **kwargs)
        self.at = (0, 0)

    def _from(self, epoch: int, index: int) -> Iterator[tuple[int, int, Any]]:
        for e in range(epoch, self.passes):
            first = index if e == epoch else 0
            keys = self.stream.dealer.epoch_keys(e, start=first)[0]
            for i, key in enumerate(itertools.islice(keys, max(0, 6 - first)), first):
                self.at = (e, i + 1)  # at most 6 keys a pass (endless keys have no end)
                yield e, i, key

    def items(self) -> Iterator[Any]:
        return self._from(0, 0)

    def state(self) -> dict:
        return {"epoch": self.at[0], "index": self.at[1]}

    def resumed(self, state: dict) -> Iterator[Any]:
        return self._from(state["epoch"], state["index"])

    def close(self) -> None:
        self.stream.close()


# -- the plan stage: batches of one epoch's units --------------------------------------------
class Plan(Adapter):
    def __init__(self, lengths: list[int], batch_size: int, last_batch: str,
                 epoch_samples: int | None = None) -> None:
        self.lengths, self.bs, self.last = lengths, batch_size, last_batch
        self.samples = epoch_samples
        self.at = Position(0)

    def _from(self, start: Position) -> Iterator[tuple]:
        planner = BatchPlanner(self.bs, self.last, start, self.samples)
        for unit in range(start.unit, len(self.lengths)):
            if planner.exhausted:
                break
            for batch in planner.add(unit, self.lengths[unit]).batches():
                self.at = batch.after
                yield tuple((s.unit, s.start, s.stop) for s in batch.segments)
        final, end = planner.finish()
        if final is not None:
            self.at = end
            yield tuple((s.unit, s.start, s.stop) for s in final.segments)

    def items(self) -> Iterator[Any]:
        return self._from(Position(0))

    def state(self) -> dict:
        p = self.at
        return {"unit": p.unit, "offset": p.offset, "taken": p.taken, "end": p.end,
                "carry": [[s.epoch, s.unit, s.start, s.stop] for s in p.carry]}

    def resumed(self, state: dict) -> Iterator[Any]:
        if state["end"]:
            return iter(())
        from gluon_stream._stages.batching import Segment
        carry = tuple(Segment(*s) for s in state["carry"])
        return self._from(Position(0, state["unit"], state["offset"], carry,
                                   taken=state["taken"]))


# -- the window stage: a shuffle window's mixed units ---------------------------------------
class Window(Adapter):
    def __init__(self, lengths: list[int], window: int) -> None:
        self.lengths, self.window = lengths, window
        self.next_unit = 0

    def _from(self, unit: int) -> Iterator[tuple]:
        mixer = WindowMixer(self.window, seed=5, epoch=1, first_unit=unit)
        for j in range(WindowMixer.first_shard(unit, self.window), len(self.lengths)):
            for mixed in mixer.add(j, self.lengths[j]):
                self.next_unit = mixed.index + 1
                yield mixed.index, mixed.shards.tolist(), mixed.rows.tolist()
        for mixed in mixer.finish():
            self.next_unit = mixed.index + 1
            yield mixed.index, mixed.shards.tolist(), mixed.rows.tolist()

    def items(self) -> Iterator[Any]:
        return self._from(0)

    def state(self) -> dict:
        return {"unit": self.next_unit}

    def resumed(self, state: dict) -> Iterator[Any]:
        return self._from(state["unit"])


# -- the chain's end: the loader, its state_dict() in a loader built anew --------------------
def _rows(key: int, n: int = 5) -> np.ndarray:
    return np.arange(n, dtype=np.float32) + 1000 * key


class Loader(Adapter):
    def __init__(self, epochs: int = 2, keys: Any = range(5), **kwargs: Any) -> None:
        self.epochs, self.keys, self.kwargs = epochs, keys, kwargs
        self.loader = self._new()
        self.live: list = []

    def _new(self) -> gs.StreamLoader:
        kwargs = dict(self.kwargs)
        rows = kwargs.pop("rows", lambda k: _rows(k))
        return gs.StreamLoader(gs.FunctionSource(self.keys, rows), **kwargs)

    def _batches(self, loader: gs.StreamLoader, epochs: int) -> Iterator[list]:
        for _ in range(epochs):
            for batch in loader:
                yield batch_ids(batch)

    def items(self) -> Iterator[Any]:
        return self._batches(self.loader, self.epochs)

    def state(self) -> dict:
        return self.loader.state_dict()

    def resumed(self, state: dict) -> Iterator[Any]:
        again = self._new()
        self.live.append(again)
        again.load_state_dict(state)
        left = self.epochs - again.epoch  # the passes the resumed loader still owes
        return self._batches(again, left)

    def close(self) -> None:
        for loader in [self.loader, *self.live]:
            loader.close()


STAGES: dict[str, Callable[[], Adapter]] = {
    "keys, list, shuffled": lambda: Keys(list(range(7)), 3, shuffle=True, seed=2),
    "keys, 3 ranks, strides": lambda: Keys(list(range(7)), 2, shuffle=True, seed=2,
                                           num_parts=3, part_index=1, deal="strides"),
    "keys, endless, 2 ranks": lambda: Keys(lambda e: itertools.count(10 * e), 2,
                                           num_parts=2, part_index=0),
    "plan, keep": lambda: Plan([5, 0, 3, 7, 2], 4, "keep"),
    "plan, rollover": lambda: Plan([5, 0, 3, 7, 2], 4, "rollover"),
    "plan, discard": lambda: Plan([1, 1, 9], 4, "discard"),
    "plan, samples_per_epoch": lambda: Plan([5, 3, 7, 2], 3, "keep", epoch_samples=11),
    "window of 2": lambda: Window([4, 0, 3, 5], 2),
    "window of 3": lambda: Window([2, 6, 1, 4, 3], 3),
    "loader": lambda: Loader(batch_size=3),
    "loader, shuffle, rollover": lambda: Loader(batch_size=4, shuffle=True, seed=1,
                                                last_batch="rollover"),
    "loader, shuffle window": lambda: Loader(batch_size=4, shuffle=True, seed=1,
                                             shuffle_window=2),
    "loader, rank 1 of 2, even": lambda: Loader(batch_size=2, num_parts=2, part_index=1,
                                                even_batches=True, seed=0),
    "loader, samples_per_epoch": lambda: Loader(epochs=3, batch_size=3, samples_per_epoch=7,
                                                shuffle=True, seed=4),
    "loader, context_rows": lambda: Loader(batch_size=4, context_rows=2,
                                           transform=lambda raw: raw[2:] * 10 + raw[:-2]),
    "loader, provenance, pad": lambda: Loader(batch_size=4, provenance=True,
                                              even_batches="pad", num_parts=2, part_index=0,
                                              seed=0),
}


def _take(items: Iterator[Any], n: int) -> list:
    return list(itertools.islice(items, n))


@pytest.mark.parametrize("name", sorted(STAGES))
def test_every_stage_resumes_anywhere(name):
    """Take the state after any number of items; a stage resumed from it (the state through
    JSON) gives the rest of an uninterrupted run."""
    whole_stage = STAGES[name]()
    try:
        whole = list(whole_stage.items())
    finally:
        whole_stage.close()
    assert whole, "a stage with no items would prove nothing"
    for cut in range(len(whole) + 1):
        stage = STAGES[name]()
        try:
            head = _take(stage.items(), cut)
            state = json.loads(json.dumps(stage.state()))
            rest = list(stage.resumed(state))
        finally:
            stage.close()
        assert head + rest == whole, (name, cut, state)
