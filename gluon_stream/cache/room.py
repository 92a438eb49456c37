"""Room under ``cache_limit``: made before a shard is generated, checked again at publication.

A :class:`CacheRoom` holds a cache's limit, the largest shard it has seen and the reservations
of the shards this process is making. It decides what must go and how long to wait; the cache
it serves (a :class:`Shelf`) says which shards it holds and removes one unless it is pinned.
Its owner calls :meth:`CacheRoom.make` under the eviction lock, so the directory never holds
more than the limit: each shard being made has a reservation (``.<key>.<pid>.<rand>.tmp.room``,
an empty file) that every generating process on the host counts, as large as the largest shard
seen so far, until it is published.
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
        self._reserved[name] = path
        return path

    def release(self, name: str, reservation: str | None) -> None:
        """Drop the reservation of ``name`` (published, or given up)."""
        if reservation is not None:
            self._reserved.pop(name, None)
            remove_if_exists(reservation)

    def make(self, shelf: Shelf, name: str, size: int, replaced: set[str],
             wait: bool = True) -> bool:
        """Evict least recently used, unpinned shards of ``shelf`` (but ``replaced``, which the
        new shard replaces) until one more of ``size`` bytes fits beside the shards other
        generations are making (each counted as the largest seen); whether it fits.

        Called under the eviction lock. While every shard that would have to go is pinned,
        waits for one to be released, at most ``lock_timeout`` (``wait=False``: returns False
        at once, for a caller that waits with the lock released, see :meth:`pause`).
        """
        if self.limit.max_bytes is not None and size > self.limit.max_bytes:
            raise CacheFull(f"shard {name!r} is {size} bytes, more than cache_limit "
                             f"({self.limit}) allows in all; raise cache_limit", key=name)
        deadline = time.monotonic() + shelf.lock_timeout
        while True:
            shards = [s for s in shelf.listing() if s[1] not in replaced]
            self._largest = max([self._largest, size] + [s[2] for s in shards])
            making = self._reservations(shelf.root, besides=self._reserved.get(name))
            incoming = (1 + making, size + making * self._largest)
            if evict_lru(shards, self.limit, shelf.try_evict, incoming=incoming):
                return True
            if not wait:
                return False
            self.pause(shelf, name, deadline)

    def pause(self, shelf: Shelf, name: str, deadline: float) -> None:
        """Wait a moment for room for ``name``; CacheFull past ``deadline``, LoaderClosed once
        the cache closes."""
        if time.monotonic() >= deadline:
            raise CacheFull(
                f"shard {name!r}: cache_limit ({self.limit}) leaves no room for it: the shards "
                f"in {shelf.where()} stayed pinned (being read, or made and not yet read) for "
                f"lock_timeout={shelf.lock_timeout:g} s; raise cache_limit above the number of "
                "shards read or made at once", key=name)
        shelf.tell_once("full", logging.INFO,
                        "cache_limit (%s): every shard in %s that could make room for %r is "
                        "being read or was just made; waiting for one to be released (at "
                        "most lock_timeout=%g s)", self.limit, shelf.where(), name,
                        shelf.lock_timeout)
        if shelf.closed.wait(ROOM_POLL_S):
            raise LoaderClosed(f"closed while waiting for room for shard {name!r}")

    @staticmethod
    def _reservations(root: str, besides: str | None) -> int:
        """How many shards are being made in ``root`` (by any process on this host), but
        ``besides``."""
        with os.scandir(root) as entries:
            return sum(1 for entry in entries if entry.name.endswith(TEMP_MARKER + RESERVATION)
                       and entry.path != besides)
