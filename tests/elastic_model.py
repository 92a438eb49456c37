"""What an elastic resume promises, as an oracle over the samples the ranks trained.

A job of ``parts[0]`` ranks trains to a step of epoch 0 and stops; ``merge_states`` joins its
states, ``parts[1]`` ranks load them, train to another step and stop; ``parts[2]`` ranks load
the merge of those and train the rest. Every sample of epoch 0 is a shard's row, named by its
value (``1000 * key + row``). The oracle says which samples may be missing (never one trained
twice): none with ``'pad'`` or ``last_batch='keep'``; a short batch per rank with
``'discard'``/``'rollover'`` (rolled into the next epoch) or ``even_batches=True``, sizes known
or not (the new ranks' strides turn from piece to piece by the rows left before each, counted
ahead or learned as the pieces are made). With ``endless`` keys (an iterator per epoch) the
same holds: the merge deals the iterator's keys as the old ranks drew them, and the new ranks
read the pieces left, then the iterator's keys after them. With a shuffle ``window`` of 2 or 3
shards too: the merge cuts the mixed units the old ranks stood in by the lengths their states
record, and the new ranks mix the pieces left by the same window.

With ``samples_per_epoch`` an epoch is no pass over the keys: each rank's epoch is its next
``samples_per_epoch`` samples of its own stream (a sample may come twice, from two passes), so
the oracle is a multiset: the samples the ranks of the job that began the epoch read for it
(as a loader with ``last_batch='keep'`` reads them, and with ``'rollover'`` what a fresh job
rolls into it from the epoch before), of which the stages train each at most as
often, missing at most :func:`missing_allowed`; the next epoch is a fresh job's. Endless keys
then cycle through the shards (a long iterator: one pass, as an endless iterator is).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

SPAN = 1000  # a sample's value: SPAN * key + row
#: samples_per_epoch with endless keys: the iterator's keys, round the shards (enough for the
#: epochs the test reads: 4 of 30 samples on each of 4 ranks, a sample a shard)
CYCLED = 500


@dataclass(frozen=True)
class Config:
    sizes: tuple[int, ...]  # samples of shard k (the keys are 0 .. len - 1)
    shuffle: bool
    seed: int
    even: Any  # False, True or 'pad'
    last_batch: str
    sizes_known: bool
    parts: tuple[int, int, int]  # ranks of the three stages
    batch_sizes: tuple[int, int, int]
    stops: tuple[int, int]  # batches the first two stages train before they stop
    endless: bool = False  # the keys are an iterator per epoch (``keys(epoch)``), not a list
    window: int = 1  # shuffle_window (> 1 with shuffle only)
    samples_per_epoch: int | None = None  # epochs of this many samples per rank

    def keys(self) -> Any:
        n = len(self.sizes)
        if self.endless and self.samples_per_epoch is not None:  # one pass, cycling
            return lambda epoch: itertools.islice(itertools.cycle(range(n)), CYCLED)
        if self.endless:
            return lambda epoch: iter(range(n))
        return range(n)

    def shard(self, key: int) -> np.ndarray:
        return np.arange(self.sizes[key], dtype="float32") + SPAN * key

    def samples(self) -> set:
        return {SPAN * k + r for k, n in enumerate(self.sizes) for r in range(n)}


def missing_allowed(cfg: Config, stages: tuple[int, ...] = (2,)) -> int:
    """The most samples of the interrupted epoch that may go untrained across the stages
    (``stages``: with samples_per_epoch, those that read the epoch: its end may fall in any
    of them, and each leaves a short batch per rank out at most, its counts differing by one
    at most as the remainder's strides turn by the sizes the merge counted)."""
    if cfg.samples_per_epoch is not None:
        if cfg.even == "pad" or (cfg.last_batch == "keep" and cfg.even is not True):
            return 0
        return sum(cfg.parts[s] * cfg.batch_sizes[s] for s in stages)
    last_ranks, last_bs = cfg.parts[2], cfg.batch_sizes[2]
    if cfg.even == "pad" or (cfg.last_batch == "keep" and cfg.even is not True):
        return 0
    # a short batch per rank (one more row: equal deals); the remainder's strides turn from
    # piece to piece, sizes known or not (learned as the pieces are made), issue 35
    return last_ranks * last_bs
