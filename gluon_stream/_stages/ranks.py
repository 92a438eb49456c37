"""How the ranks split an epoch so that every rank yields the same batch count: pure arithmetic,
decided from what every rank knows alike (the settings, the key count, declared sizes).

A synchronous job hangs when one rank yields fewer batches, or raises, while the others go on.
So a topology that dealing whole shards cannot serve (fewer keys than ranks) falls back to
every rank taking its stride of every shard, and the counts every rank yields are computed
here from every part's samples, the same on every rank.

With ``even_batches=True`` every rank stops at the smallest part's count of full batches, so
an epoch leaves out at most :func:`loss_bound` samples (``parts * batch_size - 1``), with sizes
known or not: balanced strides hold ``total // parts`` samples or one more on every part, and
whole shards are dealt only where every deal of them keeps within the bound
(:func:`whole_shards_keep`).

Example:
    >>> choose_deal(True, False, True, parts=3, keys=2)[0], choose_deal(True, False, True, 3, 9)[0]
    ('balanced', 'balanced')
    >>> choose_deal(True, False, True, 2, 4, sizes=[8, 8, 8, 8], batch_size=4)[0]
    'shards'
    >>> even_count("pad", [5, 3, 0], 4), even_count(True, [5, 3, 0], 4)
    (2, 0)
"""
from __future__ import annotations

from typing import Sequence

__all__ = ["choose_deal", "even_count", "loss_bound", "whole_shards_keep"]


def choose_deal(even: bool | str, fixed_size: bool, sizes_known: bool, parts: int,
                keys: int | None, *, sizes: Sequence[int] | None = None, batch_size: int = 1,
                skip: bool = False) -> tuple[str, str]:
    """(deal, why) for ``parts`` ranks: ``'shards'`` (each rank its own shards), ``'samples'``
    (every rank an equal stride of every shard), ``'strides'`` (every rank its stride, nothing
    dropped), ``'turns'`` (strides whose first row turns to the next rank from shard to shard
    and pass to pass) or ``'balanced'`` (strides that go on from where the last shard's
    stopped, so the ranks' counts never differ by more than one). ``fixed_size``:
    ``samples_per_epoch`` is set; ``keys``: epoch 0's key count (None for an endless
    iterator, which deals keys to every rank); ``sizes``: every shard's size, where every
    epoch deals the same shards of the same sizes (None: unknown, or they may change);
    ``skip``: ``on_error='skip'``.

    * ``samples_per_epoch`` with fewer keys than ranks: turning strides (a rank dealt no key
      would read no sample, pass after pass; fixed strides starve the last ranks of shards
      smaller than the rank count, while turning ones reach every rank within ``parts``
      passes; every rank reads N samples an epoch either way).
    * even_batches with sizes unknown: strides (``'balanced'`` for True: every rank holds
      ``total // parts`` samples or one more, and yields the batches the smallest holds).
    * even_batches=True with fewer keys than ranks: balanced strides (dealt whole, some rank
      has no shard, so every rank's count would be 0).
    * even_batches=True with sizes known: whole shards only where every deal of ``sizes``
      leaves out at most :func:`loss_bound` samples (:func:`whole_shards_keep`), else
      balanced strides, which always do. ``on_error='skip'`` keeps whole shards: a shard
      failing on one rank alone would shift the strides of that rank only.
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
    if even is True and not skip and (sizes is None
                                      or not whole_shards_keep(sizes, parts, batch_size)):
        return "balanced", (f"even_batches=True: shards dealt whole could leave out more than "
                            f"{loss_bound(parts, batch_size)} samples an epoch"
                            if sizes is not None else "even_batches=True with shard keys or "
                            "sizes that may change between epochs")
    return "shards", ""


def loss_bound(parts: int, batch_size: int) -> int:
    """The most samples an epoch leaves out with even_batches=True: every part's short tail
    (``batch_size - 1`` each) and the ``total % parts`` samples no equal split can place."""
    return parts * (batch_size - 1) + parts - 1


def whole_shards_keep(sizes: Sequence[int], parts: int, batch_size: int) -> bool:
    """Whether every deal of whole shards of ``sizes`` to ``parts`` parts leaves out at most
    :func:`loss_bound` samples when every part yields the smallest part's full batches.

    A deal gives part ``p`` every ``parts``-th shard of a permutation, so the smallest part
    holds ``len(sizes) // parts`` shards at least, and at worst the smallest of them: every
    deal drawn in any epoch keeps within the bound if that one does."""
    fewest = sorted(sizes)[:len(sizes) // parts]
    batches = sum(fewest) // batch_size
    return sum(sizes) - parts * batches * batch_size <= loss_bound(parts, batch_size)


def even_count(even: bool | str, part_samples: Sequence[int], batch_size: int) -> int:
    """Batches every part yields, from every part's samples: with ``'pad'`` the largest part's
    batches (the last one short), with True the smallest part's full batches."""
    if even == "pad":
        return -(-max(part_samples) // batch_size)
    return min(part_samples) // batch_size
