"""Shard caches: the contract (:class:`ShardCache`), a local directory
(:class:`LocalShardCache`) and an fsspec URL (:class:`RemoteShardCache`)."""
from __future__ import annotations

import os
import threading
from typing import Tuple, Type

from .._utils.fsspec import is_url, local_or_url
from .base import Create, Recipe, ShardCache
from .evict import CacheLimit, parse_cache_limit
from .local import ON_CHANGE, SUFFIXES, LocalShardCache
from .remote import RemoteShardCache

__all__ = ["CacheLimit", "Create", "IMPLEMENTATIONS", "LocalShardCache", "ON_CHANGE", "Recipe",
           "RemoteShardCache", "SUFFIXES", "ShardCache", "make_cache", "parse_cache_limit"]

#: Every cache class; typed as the contract, so mypy checks each one against it.
IMPLEMENTATIONS: Tuple[Type[ShardCache], ...] = (LocalShardCache, RemoteShardCache)


def make_cache(cache_dir: str | os.PathLike, lock_timeout: float, closed: threading.Event,
               limit: int | str | None, on_change: str = "regenerate") -> ShardCache:
    """A local cache directory, or an fsspec URL (``file://`` is a local directory)."""
    where = local_or_url(os.fspath(cache_dir))
    if is_url(where):
        return RemoteShardCache(where, lock_timeout, closed, limit, on_change)
    return LocalShardCache(where, lock_timeout, closed, limit, on_change)
