"""Room for a shard and its publication: a finished temp file moved into place, pinned.

With ``cache_limit``, room is made *before* a shard is generated, under the eviction lock that
every generating process takes (as MosaicML's streaming evicts before it downloads), and a
reservation (``.<key>.<pid>.<rand>.tmp.room``) says that a shard is being made: see
:class:`~.room.CacheRoom`, whose wait for room happens with the lock released. At publication
room is made again with the shard's real size, never waiting (the shard is on disk already);
then the shard is renamed into place (readers see all of it or nothing) and its reservation
goes. A new shard is pinned from before it is published until its producer has read it, so no
eviction takes it unread.

These are steps of a :class:`~.local.LocalShardCache`, kept here by concept: they call back the
cache for what a :class:`~.remote.RemoteShardCache` does differently (``_make_room``,
``_final``, its pins) and for its locks.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import TYPE_CHECKING, Any, Iterator

from .._utils.files import remove_if_exists
from .layout import EVICT_LOCK, SUFFIXES
from .room import RESERVATION

if TYPE_CHECKING:
    from .local import LocalShardCache

__all__ = ["publish_file", "reserve", "room_for"]


def reserve(cache: LocalShardCache, name: str) -> str | None:
    """With ``cache_limit``, make room for the shard ``name`` before it is made and leave a
    reservation that other generations count until it is published; its path, or None."""
    room = cache._room
    if not room.bounded:
        return None
    deadline = time.monotonic() + cache.lock_timeout
    while True:  # waiting with the eviction lock released: shards being made publish
        with cache._locked(EVICT_LOCK, lambda: cache._lock_timeout_error(EVICT_LOCK)):
            if cache._make_room(name, room.largest, replacing=False):
                return room.reserve(name, cache.temp_path(name, RESERVATION))
        room.pause(cache, name, deadline)  # never waits holding the lock


@contextlib.contextmanager
def room_for(cache: LocalShardCache, name: str, size: int,
             replacing: bool = True) -> Iterator[None]:
    """With ``cache_limit``, hold the eviction lock with room made for one more shard of
    ``size`` bytes (``replacing``: it replaces a cached shard of the same key), for the
    with-block to publish it.

    Never waits: the shard is on disk already, as a temp file its reservation made room for,
    so publishing it adds nothing to the directory; room is made again with its real size,
    evicting what can go. A shard larger than the reservation's estimate (the largest seen)
    may leave a byte limit exceeded until the next reservation makes room: waiting here
    instead would hang producers that each wait for the other's shard, estimated at the new
    size, to be published (two growing shards under a limit that holds one of them)."""
    if not cache._room.bounded:
        yield
        return
    with cache._locked(EVICT_LOCK, lambda: cache._lock_timeout_error(EVICT_LOCK)):
        if not cache._make_room(name, size, replacing):
            cache.tell_once("over", logging.INFO,
                            "cache_limit (%s): shard %r (%d bytes) is larger than the room "
                            "made for it, and the shards that could make up for it are in "
                            "use: publishing it (it is on disk already); the next shards "
                            "wait until %s is back within the limit", cache._room.limit, name,
                            size, cache.root)
        yield


def publish_file(cache: LocalShardCache, tmp: str, name: str) -> tuple[str, Any]:
    """Move a finished, validated temp file into place, pinned, after making room for it
    (``cache_limit``); readers see all of it or nothing: ``(path, pin)``."""
    pin = cache._pin(tmp)  # before it is published: no eviction can take it unread
    if pin is None:
        raise FileNotFoundError(tmp)
    try:
        with room_for(cache, name, os.path.getsize(tmp)):
            return _place(cache, tmp, name, os.path.splitext(tmp)[1]), pin
    except BaseException:
        cache._unpin(pin)
        raise


def _place(cache: LocalShardCache, tmp: str, name: str, suffix: str) -> str:
    """Move the temp file to its final name; remove the key's shard of the other suffix (made
    before the format changed), so that lookups cannot find it first."""
    final = cache._final(name, suffix)
    os.replace(tmp, final)
    for other in SUFFIXES:
        if other != suffix:
            remove_if_exists(cache._final(name, other))
    return final
