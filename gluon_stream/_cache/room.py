"""Room under ``cache_limit``: made before a shard is generated, checked again at publication.

A :class:`CacheRoom` holds a cache's limit, the largest shard it has seen and the reservations
of the shards this process is making. It decides what must go; the cache it serves (a
:class:`Shelf`) says which shards it holds and removes one unless it is pinned. Its owner
calls :meth:`CacheRoom.make` under the eviction lock and releases the lock before it waits
(:meth:`CacheRoom.pause`): another process may need the lock to publish the shard that ends
the wait. Each shard being made has a reservation (``.<key>.<pid>.<rand>.tmp.room``, an empty
file), counted as large as the largest shard seen so far until it is published.

Every process applies its own limit when it adds a shard, counting every shard in the
directory: it evicts least recently used shards nobody has pinned until they fit. Shards that
*other* processes are making, or have pinned (reading, or made and not yet read), cannot be
evicted and count against those processes' own limits: they never make this one wait. It waits
only while its own shards in use fill its limit. So a process alone keeps the directory within
its limit, and processes with different limits on one directory all finish (a process waiting
on a larger limit elsewhere could wait for ever).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Protocol

from .._utils.files import TEMP_MARKER, remove_if_exists
from ..errors import CacheFull, LoaderClosed
from .evict import CacheLimit, evict_lru

__all__ = ["CacheRoom", "RESERVATION", "ROOM_POLL_S", "Shelf"]

RESERVATION = ".room"  # suffix of the empty file that stands for a shard being made
ROOM_POLL_S = 0.02  # how often a publisher waiting for room looks for a released shard


class Shelf(Protocol):
    """What :class:`CacheRoom` needs of the cache it makes room in."""

    root: str
    lock_timeout: float
    closed: threading.Event

    def listing(self) -> list[tuple[float, str, int]]:
        """(last used, path, bytes) of every finished shard."""

    def try_evict(self, path: str) -> bool:
        """Remove a finished shard unless it is pinned; True if it went."""

    def where(self) -> str:
        """The cache's location, for messages."""

    def tell_once(self, what: str, level: int, message: str, *args: Any) -> bool:
        """Log ``message`` the first time ``what`` happens in this cache."""

    def pinned_here(self, path: str) -> bool:
        """Whether this process (this cache) has the finished shard ``path`` pinned."""


class CacheRoom:
    """Room for new shards within ``limit``, for the shards one process makes.

    Example:
        >>> room = CacheRoom(CacheLimit(2))
        >>> room.bounded, room.largest
        (True, 0)
    """

    def __init__(self, limit: CacheLimit) -> None:
        self.limit = limit
        self._largest = 0  # bytes of the largest shard seen: what a shard being made may take
        self._reserved: dict[str, str] = {}  # key -> its reservation, while this process makes it
        self._reserved_lock = threading.Lock()  # producers reserve and release from threads

    def __getstate__(self) -> dict:
        """Picklable (a remote executor's worker): the limit and the largest shard seen come
        along; the reservations stay with the process that made them."""
        return {"limit": self.limit, "_largest": self._largest}

    def __setstate__(self, state: dict) -> None:
        self.limit, self._largest = state["limit"], state["_largest"]
        self._reserved = {}
        self._reserved_lock = threading.Lock()

    @property
    def bounded(self) -> bool:
        return self.limit.bounded

    @property
    def largest(self) -> int:
        """Bytes of the largest shard seen so far: what a shard being made is counted as."""
        return self._largest

    def reserve(self, name: str, path: str) -> str:
        """Leave the reservation ``path`` for the shard ``name`` (room made for it already)."""
        with open(path, "x", encoding="utf-8"):
            pass
        with self._reserved_lock:
            self._reserved[name] = path
        return path

    def release(self, name: str, reservation: str | None) -> None:
        """Drop the reservation of ``name`` (published, or given up)."""
        if reservation is not None:
            with self._reserved_lock:
                self._reserved.pop(name, None)
            remove_if_exists(reservation)

    def make(self, shelf: Shelf, name: str, size: int, replaced: set[str]) -> bool:
        """Evict least recently used, unpinned shards of ``shelf`` (but ``replaced``, which the
        new shard replaces) until one more of ``size`` bytes fits beside the shards being made
        (each counted as the largest seen); whether it fits.

        Called under the eviction lock; never waits (its caller waits with the lock released,
        see :meth:`pause`). Shards another process is making or has pinned count too, and
        are evicted around, but never keep this one waiting: they count against that
        process's own limit. Only this process's own shards in use can fill its limit.
        """
        if self.limit.max_bytes is not None and size > self.limit.max_bytes:
            raise CacheFull(f"shard {name!r} is {size} bytes, more than cache_limit "
                             f"({self.limit}) allows in all; raise cache_limit", key=name)
        shards = [s for s in shelf.listing() if s[1] not in replaced]
        self._largest = max([self._largest, size] + [s[2] for s in shards])
        with self._reserved_lock:
            besides = self._reserved.get(name)
            mine = set(self._reserved.values()) - {besides}
        theirs = self._others_making(shelf.root, besides, mine)
        return evict_lru(shards, self.limit, shelf.try_evict,
                         incoming=(1 + len(mine), size + len(mine) * self._largest),
                         elsewhere=(theirs, theirs * self._largest),
                         pinned_here=shelf.pinned_here)

    def pause(self, shelf: Shelf, name: str, deadline: float) -> None:
        """Wait a moment for room for ``name``; CacheFull past ``deadline``, LoaderClosed once
        the cache closes."""
        if time.monotonic() >= deadline:
            raise CacheFull(
                f"shard {name!r}: cache_limit ({self.limit}) leaves no room for it: the shards "
                f"this process holds in {shelf.where()} stayed pinned (being read, or made and "
                f"not yet read) for lock_timeout={shelf.lock_timeout:g} s; raise cache_limit "
                "above the number of shards it reads or makes at once", key=name)
        shelf.tell_once("full", logging.INFO,
                        "cache_limit (%s): the shards this process holds in %s fill it (being "
                        "read, or just made); %r waits for one to be released (at most "
                        "lock_timeout=%g s)", self.limit, shelf.where(), name,
                        shelf.lock_timeout)
        if shelf.closed.wait(ROOM_POLL_S):
            raise LoaderClosed(f"closed while waiting for room for shard {name!r}")

    @staticmethod
    def _others_making(root: str, besides: str | None, mine: set[str]) -> int:
        """How many shards other processes (or other caches of this process) are making in
        ``root``: the reservations there but ``besides`` and ``mine``."""
        with os.scandir(root) as entries:
            return sum(1 for entry in entries if entry.name.endswith(TEMP_MARKER + RESERVATION)
                       and entry.path != besides and entry.path not in mine)
