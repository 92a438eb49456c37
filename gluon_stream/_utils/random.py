"""Deterministic randomness: every order the library draws comes from (seed, epoch, what, ...)."""
from __future__ import annotations

import zlib
from typing import Any

import numpy as np

__all__ = ["batch_seed", "key_hash", "seeded_rng"]


def seeded_rng(*parts: int) -> np.random.Generator:
    """A generator seeded deterministically from integers (seed, epoch, purpose, ...)."""
    return np.random.default_rng(np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]))


def key_hash(key: Any) -> int:
    """A stable hash of a shard key (Python's hash() differs between processes)."""
    return zlib.crc32(str(key).encode("utf-8"))


def batch_seed(seed: int, epoch: int, number: int) -> int:
    """The seed of the global RNGs while batch ``number`` of ``epoch`` is made (per-sample
    augmentation): the same for any worker count, different for every batch and epoch."""
    return int(seeded_rng(seed, epoch, 0xBA7C, number).integers(2 ** 31))
