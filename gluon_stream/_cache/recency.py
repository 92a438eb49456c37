"""When each shard of a local cache was last used: what least-recently-used eviction goes by.

Recency is the shard file's modification time, set to now on every read (where the directory
allows it: a read-only one is served as it is, said once). A time in the future (a skewed
clock, a restored backup) is reset to now when eviction first lists the shard, so the shard
ages like any other instead of counting as the most recently used forever.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import time

from .layout import SUFFIXES
from .notices import Notices

__all__ = ["FUTURE_SLACK_S", "list_shards", "touch"]

logger = logging.getLogger(__name__)

FUTURE_SLACK_S = 5.0  # a last-used time further ahead than this is a skewed clock or a backup
_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)


def touch(path: str, root: str, notices: Notices) -> None:
    """Mark the shard ``path`` used now; where the file system refuses, say so once."""
    try:
        os.utime(path)
    except OSError as exc:
        if exc.errno not in _READ_ONLY:
            raise
        notices.tell_once("no-utime", logging.INFO, "cannot update the last-used time of "
                          "shards in %s (%s): they are served, but LRU eviction goes by when "
                          "they were made", root, exc.strerror)


def list_shards(root: str, notices: Notices) -> list[tuple[float, str, int]]:
    """(last used, path, bytes) of every finished shard in ``root``. A last-used time in the
    future is reset to now, once, so that the shard ages."""
    shards = []
    now = time.time()
    with os.scandir(root) as entries:
        for entry in entries:
            if entry.name.startswith(".") or not entry.name.endswith(SUFFIXES):
                continue
            with contextlib.suppress(FileNotFoundError):
                info = entry.stat(follow_symlinks=False)
                used = info.st_mtime
                if used > now + FUTURE_SLACK_S:
                    _reset_future(entry.path, used, now, notices)
                    used = now
                shards.append((used, entry.path, info.st_size))
    return shards


def _reset_future(path: str, used: float, now: float, notices: Notices) -> None:
    """Set a last-used time that lies in the future to ``now`` (said once per cache)."""
    notices.tell_once("future-mtime", logging.WARNING,
                      "cached shard %s was last modified in the future (%s s ahead: a skewed "
                      "clock or a restored backup); counting it as used now, so it ages like "
                      "the others", path, f"{used - now:.0f}")
    try:
        os.utime(path, (now, now))
    except OSError as exc:
        if exc.errno not in _READ_ONLY:
            raise
        logger.info("cannot reset the future last-used time of %s (%s): it counts as used "
                    "now in this pass only", path, exc.strerror)
