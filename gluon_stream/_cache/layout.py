"""Where things live in a cache directory: the names of shards, temp files and locks.

``<key>.npy``/``<key>.npz`` finished shards, ``.<key>.<pid>.<rand>.tmp<suffix>`` a file being
written (a generation, a reservation, a record), ``.<key>.lock`` the per-key lock and
``.cache-evict.lock`` the eviction lock. Held here so that every part of the cache names them
the same way, and a key never names a path outside the directory.
"""
from __future__ import annotations

import os
import uuid

from .._utils.files import TEMP_MARKER
from .lock import LOCK_SUFFIX

__all__ = ["EVICT_LOCK", "SUFFIXES", "lock_path", "shard_path", "temp_path"]

SUFFIXES = (".npy", ".npz")
EVICT_LOCK = "cache-evict"


def shard_path(root: str, name: str, suffix: str) -> str:
    """The finished shard ``name`` with ``suffix`` in ``root``; ValueError if the name would
    lead out of it."""
    path = os.path.join(root, name + suffix)
    if os.path.dirname(os.path.abspath(path)) != root:
        raise ValueError(f"shard name {name!r} escapes the cache directory {root!r}")
    return path


def temp_path(root: str, name: str, suffix: str) -> str:
    """A fresh temp path in ``root`` for ``name`` (this pid in it: cleanup spares live ones)."""
    return os.path.join(root, f".{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
                              f"{TEMP_MARKER}{suffix}")


def lock_path(root: str, name: str) -> str:
    """The lock file of key ``name`` (or of ``EVICT_LOCK``) in ``root``."""
    return os.path.join(root, f".{name}{LOCK_SUFFIX}")
