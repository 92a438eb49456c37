"""How the ranks split an epoch so that every rank yields the same batch count: pure arithmetic,
decided from what every rank knows alike (the settings, the key count, declared sizes).

A synchronous job hangs when one rank yields fewer batches, or raises, while the others go on.
So a topology that dealing whole shards cannot serve (fewer keys than ranks) falls back to
every rank taking its stride of every shard, and the counts every rank yields are computed
here from every part's samples, the same on every rank.

Example:
    >>> choose_deal(True, False, True, parts=3, keys=2)[0], choose_deal(True, False, True, 3, 9)[0]
    ('balanced', 'shards')
    >>> even_count("pad", [5, 3, 0], 4), even_count(True, [5, 3, 0], 4)
    (2, 0)
"""
from __future__ import annotations

from typing import Sequence

__all__ = ["choose_deal", "even_count"]


def choose_deal(even: bool | str, fixed_size: bool, sizes_known: bool, parts: int,
                keys: int | None) -> tuple[str, str]:
    """(deal, why) for ``parts`` ranks: ``'shards'`` (each rank its own shards), ``'samples'``
    (every rank an equal stride of every shard), ``'strides'`` (every rank its stride, nothing
    dropped), ``'turns'`` (strides whose first row turns to the next rank from shard to shard
    and pass to pass) or ``'balanced'`` (strides that go on from where the last shard's
    stopped, so the ranks' counts never differ by more than one). ``fixed_size``:
    ``samples_per_epoch`` is set; ``keys``: epoch 0's key count (None for an endless
    iterator, which deals keys to every rank).

    * ``samples_per_epoch`` with fewer keys than ranks: turning strides (a rank dealt no key
      would read no sample, pass after pass; fixed strides starve the last ranks of shards
      smaller than the rank count, while turning ones reach every rank within ``parts``
      passes; every rank reads N samples an epoch either way).
    * even_batches with sizes unknown: strides (``'balanced'`` for True: every rank holds
      ``total // parts`` samples or one more, and yields the batches the smallest holds).
    * even_batches=True with fewer keys than ranks: balanced strides (dealt whole, some rank
      has no shard, so every rank's count would be 0).
    * otherwise shards; with ``'pad'`` a rank dealt no sample pads with another shard's rows.
    """
    few = keys is not None and keys < parts
    if fixed_size:
        if few:
            return "turns", (f"samples_per_epoch with {keys} key(s) on {parts} ranks (fewer "
                             "keys than ranks)")
        return "shards", ""
    if even and not sizes_known:
        return ("strides" if even == "pad" else "balanced"), \
            f"even_batches={even!r} with shard sizes unknown"
    if even is True and few:
        return "balanced", f"even_batches=True with {keys} shard(s) on {parts} ranks"
    return "shards", ""


def even_count(even: bool | str, part_samples: Sequence[int], batch_size: int) -> int:
    """Batches every part yields, from every part's samples: with ``'pad'`` the largest part's
    batches (the last one short), with True the smallest part's full batches."""
    if even == "pad":
        return -(-max(part_samples) // batch_size)
    return min(part_samples) // batch_size
