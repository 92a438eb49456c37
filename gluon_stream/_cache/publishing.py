"""Room for a shard and its publication: a finished temp file moved into place, pinned.

With ``cache_limit``, room is made *before* a shard is generated, under the eviction lock that
every generating process takes (as MosaicML's streaming evicts before it downloads), and a
reservation (``.<key>.<pid>.<rand>.tmp.room``) says that a shard is being made: see
:class:`~.room.CacheRoom`, whose wait for room happens with the lock released. At publication
room is made again with the shard's real size, never waiting (the shard is on disk already);
then the shard is renamed into place (readers see all of it or nothing) and its reservation
goes. A new shard is pinned from before it is published until its producer has read it, so no
eviction takes it unread.

These are steps of a :class:`~.local.LocalShardCache`, kept here by concept as the mixin
:class:`ShardPublishing`, which the cache inherits: they call back the cache for what a
:class:`~.remote.RemoteShardCache` does differently (``_make_room``, ``_final``, its pins) and
for its locks, each declared on the mixin so that a type checker holds them to it.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Any, Callable, ContextManager, Iterator

from .._utils.files import remove_if_exists
from .layout import EVICT_LOCK, SUFFIXES
from .room import RESERVATION, CacheRoom

__all__ = ["ShardPublishing"]


class ShardPublishing:
    """Reserving room for a shard, then publishing it: steps of a cache, mixed into it.

    The class-level annotations are what the cache that inherits this must provide.

    Example:
        >>> class Cache(ShardPublishing, ...): ...  # doctest: +SKIP
        >>> path, pin = cache._publish_file(tmp, "a")  # doctest: +SKIP
    """

    root: str
    lock_timeout: float
    closed: threading.Event
    _room: CacheRoom
    _locked: Callable[[str, Callable[[], BaseException]], ContextManager[None]]
    _lock_timeout_error: Callable[[str], BaseException]
    _make_room: Callable[[str, int, bool], bool]
    _final: Callable[[str, str], str]
    _pin: Callable[[str], Any]
    _unpin: Callable[[Any], None]
    temp_path: Callable[[str, str], str]
    tell_once: Callable[..., bool]
    listing: Callable[[], list[tuple[float, str, int]]]
    try_evict: Callable[[str], bool]
    where: Callable[[], str]
    pinned_here: Callable[[str], bool]

    def _reserve(self, name: str) -> str | None:
        """With ``cache_limit``, make room for the shard ``name`` before it is made and leave a
        reservation that other generations count until it is published; its path, or None."""
        room = self._room
        if not room.bounded:
            return None
        deadline = time.monotonic() + self.lock_timeout
        while True:  # waiting with the eviction lock released: shards being made publish
            with self._locked(EVICT_LOCK, lambda: self._lock_timeout_error(EVICT_LOCK)):
                if self._make_room(name, room.largest, False):  # not replacing
                    return room.reserve(name, self.temp_path(name, RESERVATION))
            room.pause(self, name, deadline)  # never waits holding the lock

    @contextlib.contextmanager
    def _room_for(self, name: str, size: int, replacing: bool = True) -> Iterator[None]:
        """With ``cache_limit``, hold the eviction lock with room made for one more shard of
        ``size`` bytes (``replacing``: it replaces a cached shard of the same key), for the
        with-block to publish it.

        Never waits: the shard is on disk already, as a temp file its reservation made room
        for, so publishing it adds nothing to the directory; room is made again with its real
        size, evicting what can go. A shard larger than the reservation's estimate (the largest
        seen) may leave a byte limit exceeded until the next reservation makes room: waiting
        here instead would hang producers that each wait for the other's shard, estimated at
        the new size, to be published (two growing shards under a limit that holds one of
        them)."""
        if not self._room.bounded:
            yield
            return
        with self._locked(EVICT_LOCK, lambda: self._lock_timeout_error(EVICT_LOCK)):
            if not self._make_room(name, size, replacing):
                self.tell_once("over", logging.INFO,
                               "cache_limit (%s): shard %r (%d bytes) is larger than the room "
                               "made for it, and the shards that could make up for it are in "
                               "use: publishing it (it is on disk already); the next shards "
                               "wait until %s is back within the limit", self._room.limit,
                               name, size, self.root)
            yield

    def _publish_file(self, tmp: str, name: str) -> tuple[str, Any]:
        """Move a finished, validated temp file into place, pinned, after making room for it
        (``cache_limit``); readers see all of it or nothing: ``(path, pin)``."""
        pin = self._pin(tmp)  # before it is published: no eviction can take it unread
        if pin is None:
            raise FileNotFoundError(tmp)
        try:
            with self._room_for(name, os.path.getsize(tmp)):
                return self._place(tmp, name, os.path.splitext(tmp)[1]), pin
        except BaseException:
            self._unpin(pin)
            raise

    def _place(self, tmp: str, name: str, suffix: str) -> str:
        """Move the temp file to its final name; remove the key's shard of the other suffix
        (made before the format changed), so that lookups cannot find it first."""
        final = self._final(name, suffix)
        os.replace(tmp, final)
        for other in SUFFIXES:
            if other != suffix:
                remove_if_exists(self._final(name, other))
        return final
