"""A directory of finished shard files, filled atomically under per-key cross-process locks.

Layout: ``<key>.npy``/``<key>.npz`` finished shards, ``.<key>.<pid>.<rand>.tmp.npy`` a
generation in progress, ``.<key>.lock`` the per-key lock (removed by its holder once the shard
is in place). A generation writes a private temp file that is validated, then renamed into
place, so a reader never sees half a shard. Temp and lock files left by crashed runs are
removed at the next start; symlinks are never followed.
"""
from __future__ import annotations

import contextlib
import fcntl
import glob
import logging
import os
import re
import threading
import time
import uuid
from typing import Callable, Iterator

from filelock import FileLock
from filelock import Timeout as LockTimeout

from ..errors import LoaderClosed, ShardError, UnsafeShard
from ..shardfile import TEMP_MARKER, inspect_shard, remove_if_exists
from .evict import CacheLimit, evict_if_unread, evict_lru

__all__ = ["SUFFIXES", "ShardCache", "WAIT_SLICE_S"]

logger = logging.getLogger(__name__)

SUFFIXES = (".npy", ".npz")
WAIT_SLICE_S = 0.5  # how often a blocked wait re-checks close()


class ShardCache:
    """Finished shards in ``cache_dir``; one process generates a key at a time.

    Args:
        cache_dir: The directory (created if missing).
        lock_timeout: Seconds to wait for another process generating the same key.
        closed: Set when the owner closes: waits give up with LoaderClosed.
        limit: ``cache_limit`` (shards or bytes); None keeps everything.
    """

    def __init__(self, cache_dir: str | os.PathLike, lock_timeout: float,
                 closed: threading.Event | None = None, limit: int | str | None = None) -> None:
        if lock_timeout <= 0:
            raise ValueError(f"lock_timeout must be positive seconds, got {lock_timeout!r}")
        self.limit = CacheLimit.parse(limit)
        self.root = os.path.realpath(os.fspath(cache_dir))
        os.makedirs(self.root, exist_ok=True)
        self.lock_timeout = lock_timeout
        self.closed = closed if closed is not None else threading.Event()
        self._remove_stale_temps()
        self._remove_stale_locks()

    def __getstate__(self) -> dict:
        """Picklable (for a remote executor): the closed flag stays with this process."""
        state = dict(self.__dict__)
        del state["closed"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.closed = threading.Event()

    # -- finding and reading shards ----------------------------------------------------------
    def path_for(self, name: str, suffix: str) -> str:
        path = os.path.join(self.root, name + suffix)
        if os.path.dirname(os.path.abspath(path)) != self.root:
            raise ValueError(f"shard name {name!r} escapes the cache directory {self.root!r}")
        return path

    def lookup(self, name: str) -> str | None:
        """Path of a finished shard for ``name``, or None. Symlinks are never followed."""
        for suffix in SUFFIXES:
            path = self.path_for(name, suffix)
            if os.path.islink(path):
                raise UnsafeShard(f"cached shard {path!r} is a symlink; gluon_stream does not follow "
                                  "links in its cache. Remove it", path=path)
            if os.path.exists(path):
                return path
        return None

    @contextlib.contextmanager
    def reading(self, path: str) -> Iterator[str]:
        """Hold a shared lock on a finished shard while it is read: eviction skips it.

        Raises FileNotFoundError when the shard was evicted before the lock was taken.
        """
        with open(path, "rb") as fp:
            fcntl.flock(fp.fileno(), fcntl.LOCK_SH)
            if os.fstat(fp.fileno()).st_ino != os.stat(path).st_ino:
                raise FileNotFoundError(path)  # replaced: read the new one instead
            os.utime(path)  # least recently used goes first
            yield path

    def num_samples(self, name: str) -> int | None:
        """Samples of a cached shard from its header, or None if it is not cached."""
        path = self.lookup(name)
        return None if path is None else inspect_shard(path)[0].shape[0]

    def evict(self, path: str) -> None:
        remove_if_exists(path)

    # -- making shards ---------------------------------------------------------------------
    def temp_path(self, name: str, suffix: str) -> str:
        return os.path.join(self.root, f".{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
                                        f"{TEMP_MARKER}{suffix}")

    def lock(self, name: str) -> FileLock:
        return FileLock(os.path.join(self.root, f".{name}.lock"), timeout=self.lock_timeout)

    def get_or_create(self, name: str, create: Callable[[], str]) -> tuple[str, bool]:
        """Return (path, cache_hit); ``create()`` writes a validated temp file and returns its path.

        One process generates a key at a time (a cross-process lock); whoever waited finds the
        finished file. A lock whose holder died is released by the OS, so a waiter takes over.
        """
        path = self.lookup(name)
        if path is not None:
            return path, True
        lock = self.lock(name)
        self._acquire(lock, name)
        try:
            path = self.lookup(name)
            if path is not None:
                return path, True
            tmp = create()
            if os.path.islink(tmp):
                remove_if_exists(tmp)
                raise UnsafeShard(f"shard {name!r}: the generator left a symlink at {tmp!r}; "
                                  "gluon_stream does not follow links in its cache. Write the "
                                  "shard itself to the '{path}' argument", path=tmp)
            return self._publish(tmp, name), False
        finally:
            remove_if_exists(lock.lock_file)  # while held: late waiters see the finished file
            lock.release()

    def _acquire(self, lock: FileLock, name: str) -> None:
        """Wait for the key's lock in slices, re-checking ``closed`` so close() never waits long."""
        deadline = time.monotonic() + self.lock_timeout
        while True:
            remaining = deadline - time.monotonic()
            try:
                lock.acquire(timeout=max(0.0, min(WAIT_SLICE_S, remaining)))
                return
            except LockTimeout as exc:
                if self.closed.is_set():
                    raise LoaderClosed(f"closed while waiting for the lock of shard {name!r}") \
                        from None
                if remaining <= WAIT_SLICE_S:
                    raise ShardError(
                        f"shard {name!r}: waited {self.lock_timeout:g} s for another process "
                        f"generating it (lock {lock.lock_file}); raise lock_timeout, or remove the "
                        "lock file if no gluon_stream process is running", key=name) from exc

    def _publish(self, tmp: str, name: str) -> str:
        """Move a finished, validated temp file into place; readers see all of it or nothing."""
        final = self.path_for(name, os.path.splitext(tmp)[1])
        os.replace(tmp, final)
        return final

    # -- bounding the cache ------------------------------------------------------------------
    def enforce_limit(self, keep: str) -> None:
        """Evict least recently used shards until the cache fits ``cache_limit``.

        Shards held by a reader anywhere (a shared lock) and ``keep`` are never evicted;
        one process evicts at a time.
        """
        if not self.limit.bounded:
            return
        lock = self.lock("cache-evict")
        with lock:
            evict_lru(self._listing(), self.limit, keep, self._try_evict)
            remove_if_exists(lock.lock_file)

    def _listing(self) -> list[tuple[float, str, int]]:
        """(last used, path, bytes) of every finished shard."""
        shards = []
        for entry in os.scandir(self.root):
            if entry.name.startswith(".") or not entry.name.endswith(SUFFIXES):
                continue
            with contextlib.suppress(FileNotFoundError):
                info = entry.stat(follow_symlinks=False)
                shards.append((info.st_mtime, entry.path, info.st_size))
        return shards

    def _try_evict(self, path: str) -> bool:
        return evict_if_unread(path)

    # -- what crashed runs left behind ---------------------------------------------------------
    def _remove_stale_temps(self) -> None:
        """Delete temp files left by crashed runs (their writer's pid is gone)."""
        for path in glob.glob(os.path.join(glob.escape(self.root), f".*{TEMP_MARKER}*")):
            match = re.search(r"\.(\d+)\.[^.]+" + re.escape(TEMP_MARKER), os.path.basename(path))
            if match and _pid_alive(int(match.group(1))):
                continue
            logger.info("removing temp file %s left by a crashed run", path)
            remove_if_exists(path)

    def _remove_stale_locks(self) -> None:
        """Delete lock files nobody holds (their holder was killed); held ones are left alone."""
        for path in glob.glob(os.path.join(glob.escape(self.root), ".*.lock")):
            lock = FileLock(path, timeout=0)
            try:
                lock.acquire()
            except LockTimeout:
                continue  # a live process holds it
            try:
                logger.info("removing lock file %s left by a crashed run", path)
                remove_if_exists(path)
            finally:
                lock.release()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
