"""Cross-process locks on files in a cache directory: one per key, and one for eviction.

A lock is an exclusive ``flock`` on a small file that its holder removes before releasing it,
so no lock files pile up. A waiter that opened the removed file would then hold a lock nobody
else sees; so after each ``flock`` the holder checks that the path still names the file it
locked, and otherwise starts again on the new file. The check makes the lock a true mutex
across processes whichever version of any third-party lock library is installed.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from typing import Callable, Iterator

from .._utils.files import remove_if_exists
from ..errors import LoaderClosed

__all__ = ["LOCK_SUFFIX", "exclusive", "remove_if_unheld"]

LOCK_SUFFIX = ".lock"
_POLL_S = (0.001, 0.05)  # first and longest pause between tries while another process holds it


def _try_lock(path: str) -> int | None:
    """An fd holding the exclusive lock on the file ``path`` names now, or None if held."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        locked = os.fstat(fd)
        current = os.stat(path)
    except (BlockingIOError, FileNotFoundError):  # held; or removed by its holder: try again
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    if (locked.st_dev, locked.st_ino) != (current.st_dev, current.st_ino):
        os.close(fd)  # we locked a file its holder removed; the path names a new one now
        return None
    return fd


@contextlib.contextmanager
def exclusive(path: str, timeout: float, closed: threading.Event,
              timed_out: Callable[[], BaseException], waiting: Callable[[], None] | None = None
              ) -> Iterator[None]:
    """Hold the lock ``path`` for the with-block; the file is removed on the way out.

    Waits at most ``timeout`` seconds, then raises ``timed_out()``; a set ``closed`` raises
    ``LoaderClosed`` within one pause. ``waiting()`` is called once if the lock is held.
    """
    deadline = time.monotonic() + timeout
    pause = _POLL_S[0]
    fd = _try_lock(path)
    if fd is None and waiting is not None:
        waiting()
    while fd is None:
        if closed.is_set():
            raise LoaderClosed(f"closed while waiting for the lock {path}")
        if time.monotonic() >= deadline:
            raise timed_out()
        closed.wait(pause)
        pause = min(pause * 2, _POLL_S[1])
        fd = _try_lock(path)
    try:
        yield
    finally:
        try:
            remove_if_exists(path)  # while held: the next holder starts on a new file
        finally:
            os.close(fd)


def remove_if_unheld(path: str) -> bool:
    """Remove a lock file nobody holds (its holder was killed); True if it was removed."""
    try:
        fd = _try_lock(path)
    except FileNotFoundError:
        return False
    if fd is None:
        return False
    try:
        remove_if_exists(path)
    finally:
        os.close(fd)
    return True
