"""Shard caches: a local directory (:class:`ShardCache`) or an fsspec URL (:class:`RemoteShardCache`)."""
from __future__ import annotations

import os
import threading

from .._fsspec import is_url, local_or_url
from .evict import CacheLimit, parse_cache_limit
from .local import ON_CHANGE, SUFFIXES, ShardCache
from .remote import RemoteShardCache

__all__ = ["CacheLimit", "ON_CHANGE", "RemoteShardCache", "SUFFIXES", "ShardCache", "make_cache",
           "parse_cache_limit"]


def make_cache(cache_dir: str | os.PathLike, lock_timeout: float, closed: threading.Event,
               limit: int | str | None, on_change: str = "regenerate") -> ShardCache:
    """A local cache directory, or an fsspec URL (``file://`` is a local directory)."""
    where = local_or_url(os.fspath(cache_dir))
    if is_url(where):
        return RemoteShardCache(where, lock_timeout, closed, limit, on_change)
    return ShardCache(where, lock_timeout, closed, limit, on_change)
