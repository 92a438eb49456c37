"""The pins this process holds on finished shard files, so eviction spares the shards in use.

A pin is a shared ``flock`` on the shard's file, held by a reader while it loads the shard and
by its producer from before it is published until it is read; eviction takes the exclusive
lock without waiting, so a pinned shard is skipped in every process (see :mod:`.evict`). The
files' identities (device, inode: kept through the rename that publishes a pinned temp file)
are counted here, so that this process tells its own pins from other processes' (those count
against the other process's ``cache_limit``, see :mod:`.room`).
"""
from __future__ import annotations

import collections
import fcntl
import os
import threading
from typing import BinaryIO

from ..shardfile import open_regular

__all__ = ["FilePins"]


class FilePins:
    """The shard files this process has pinned, counted by identity.

    Example:
        >>> pins = FilePins()
        >>> pins.pin("/no/such/shard.npy") is None
        True
    """

    def __init__(self) -> None:
        self._held: collections.Counter[tuple[int, int]] = collections.Counter()
        self._lock = threading.Lock()  # readers and producers pin from their threads

    def __reduce__(self) -> tuple:
        """Picklable (a cache sent to a remote executor): pins stay with the process that
        holds them, the copy starts with none."""
        return FilePins, ()

    def pin(self, path: str) -> BinaryIO | None:
        """Keep the finished shard ``path`` from eviction (a shared lock on its open file)
        until :meth:`unpin`; None if it is gone (evicted, or replaced by a regeneration, since
        it was found)."""
        try:
            fp = open_regular(path)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fp.fileno(), fcntl.LOCK_SH)  # waits only while an evictor deletes it
            held = _identity(os.fstat(fp.fileno()))
            if held != _identity(os.stat(path)):
                raise FileNotFoundError(path)
        except FileNotFoundError:
            fp.close()
            return None
        except BaseException:
            fp.close()
            raise
        with self._lock:
            self._held[held] += 1
        return fp

    def unpin(self, pin: BinaryIO | None) -> None:
        """Release a pin from :meth:`pin` (closing the file drops its lock)."""
        if pin is None:
            return
        held = _identity(os.fstat(pin.fileno()))
        with self._lock:
            self._held[held] -= 1
            if self._held[held] <= 0:
                del self._held[held]
        pin.close()

    def holds(self, path: str) -> bool:
        """Whether this process has the finished shard ``path`` pinned."""
        try:
            held = _identity(os.stat(path, follow_symlinks=False))
        except FileNotFoundError:
            return False
        with self._lock:
            return held in self._held


def _identity(info: os.stat_result) -> tuple[int, int]:
    """A file's identity, kept through a rename (a temp file pinned, then published)."""
    return info.st_dev, info.st_ino
