"""A bounded cache: ``cache_limit`` parsing and least-recently-used eviction that spares readers.

A shard is *pinned* by a shared ``flock`` on its file: held by a reader while it loads it, and
by the producer that made it from before it is published until it is read. Eviction takes the
exclusive lock without waiting, so a pinned shard is skipped, never removed under its reader.
Room is made before a shard is published (see ``LocalShardCache``), so a process alone never
holds more than its ``cache_limit``; shards other processes have pinned or are making count
against their own limits (see :mod:`.room`).
"""
from __future__ import annotations

import fcntl
import logging
import re
from dataclasses import dataclass
from typing import Callable, Iterable

from .._utils.files import remove_if_exists
from ..errors import CorruptShard
from ..shardfile import open_regular

__all__ = ["CacheLimit", "evict_if_unread", "evict_lru", "parse_cache_limit"]

logger = logging.getLogger(__name__)

_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?i?B)\s*", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12,
          "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}


def parse_cache_limit(limit: int | str | None) -> tuple[int | None, int | None]:
    """``cache_limit`` as (max shards, max bytes): an int counts shards, ``'20GB'`` is bytes.

    Example:
        >>> parse_cache_limit("1.5KiB")
        (None, 1536)
    """
    if limit is None:
        return None, None
    if isinstance(limit, bool):
        raise ValueError(f"cache_limit must be a shard count or a size like '20GB', got {limit!r}")
    if isinstance(limit, int):
        if limit < 1:
            raise ValueError(f"cache_limit must keep at least 1 shard, got {limit!r}")
        return limit, None
    match = _SIZE.fullmatch(str(limit))
    if not match:
        raise ValueError(f"cache_limit must be a shard count or a size like '20GB', '500MB', "
                         f"'1.5GiB', got {limit!r}")
    size = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if size < 1:
        raise ValueError(f"cache_limit must be positive, got {limit!r}")
    return None, size


@dataclass(frozen=True)
class CacheLimit:
    """At most ``max_shards`` shards and ``max_bytes`` bytes (None: no bound)."""

    max_shards: int | None = None
    max_bytes: int | None = None

    @classmethod
    def parse(cls, limit: int | str | None) -> "CacheLimit":
        return cls(*parse_cache_limit(limit))

    @property
    def bounded(self) -> bool:
        return self.max_shards is not None or self.max_bytes is not None

    def __str__(self) -> str:
        parts = ([f"{self.max_shards} shards"] if self.max_shards is not None else []) + \
                ([f"{self.max_bytes} bytes"] if self.max_bytes is not None else [])
        return " and ".join(parts) or "unbounded"

    def over(self, count: int, total: int) -> bool:
        """Whether ``count`` shards of ``total`` bytes exceed the limit."""
        return ((self.max_shards is not None and count > self.max_shards)
                or (self.max_bytes is not None and total > self.max_bytes))


def evict_lru(shards: Iterable[tuple[float, str, int]], limit: CacheLimit,
              try_evict: Callable[[str], bool], incoming: tuple[int, int] = (0, 0),
              elsewhere: tuple[int, int] = (0, 0),
              pinned_here: Callable[[str], bool] = lambda path: True) -> bool:
    """Evict the least recently used of ``shards`` ((last used, path, bytes)) until they,
    ``incoming`` ((shards, bytes) this process adds or is making) and ``elsewhere`` ((shards,
    bytes) other processes are making) fit ``limit``; True if they fit now, or if all that
    keeps them over is in use by other processes.

    A shard ``try_evict`` refuses (pinned: being read, or just made) stays. One that is not
    ``pinned_here`` (by this process) is in use elsewhere: like ``elsewhere``, it counts
    against the other process's limit, so this one evicts what it can for it but never
    waits for it (a smaller limit in one process must not wait on a larger one in another).

    Example:
        >>> gone = []
        >>> evict_lru([(2.0, "b", 1), (1.0, "a", 1)], CacheLimit(2),
        ...           lambda path: not gone.append(path), incoming=(1, 1))
        True
        >>> gone
        ['a']
        >>> evict_lru([(1.0, "a", 1)], CacheLimit(1), lambda path: False, incoming=(1, 1),
        ...           pinned_here=lambda path: False)  # a: read by another process
        True
    """
    shards = sorted(shards)
    count = len(shards) + incoming[0] + elsewhere[0]
    total = sum(size for _, _, size in shards) + incoming[1] + elsewhere[1]
    theirs, their_bytes = elsewhere
    for _, path, size in shards:
        if not limit.over(count, total):
            break
        if try_evict(path):
            count, total = count - 1, total - size
            logger.info("cache_limit: evicted %s (%d shards, %d bytes with the ones to add)",
                        path, count, total)
        elif not pinned_here(path):
            theirs, their_bytes = theirs + 1, their_bytes + size
    return not limit.over(count - theirs, total - their_bytes)


def evict_if_unread(path: str) -> bool:
    """Delete a shard unless someone holds a shared lock on it (is reading it).

    Only regular files are opened (a FIFO would block) and deleted."""
    try:
        fp = open_regular(path)
    except (FileNotFoundError, CorruptShard):
        return False
    with fp:
        try:
            fcntl.flock(fp.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        remove_if_exists(path)
        return True
