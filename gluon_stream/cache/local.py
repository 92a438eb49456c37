"""A directory of finished shard files, filled atomically under per-key cross-process locks.

Layout: ``<key>.npy``/``<key>.npz`` finished shards, ``.<key>.<pid>.<rand>.tmp.npy`` a
generation in progress, ``.<key>.lock`` the per-key lock (removed by its holder once the shard
is in place). A generation writes a private temp file that is validated, then renamed into
place, so a reader never sees half a shard. Temp files (and directories a generator made at
its temp path) and lock files left by crashed runs are removed at the next start; symlinks are
never followed, and only regular files are read.

What made a shard (its *recipe*: the command template and fixed arguments, a digest of
``env``, ``version=``; see :mod:`.recipe`) is recorded on the shard file as an extended
attribute, set on the temp file before the rename: shard and recipe are published together in
one atomic step, so no process or host ever pairs a shard with another run's recipe, and the
layout stays ``<key>.npy``. On a hit the recorded recipe is compared with the source's; a
mismatch regenerates the shard (under the key's lock, replacing the file atomically; readers
of the old file keep their open copy) with a WARNING naming the change, or raises
:class:`~gluon_stream.StaleShard` with ``on_change='raise'``. A shard with no recipe (made by an
older version, copied without extended attributes) is served as it is, with one WARNING per
cache; a file system without extended attributes gets one WARNING and no detection.

A read-only ``cache_dir`` serves the shards it holds (one INFO line): no cleanup, no LRU
time updates, no eviction; a missing shard is a ``ShardError``. A ``cache_dir`` deleted while
running is recreated (one WARNING) and the shard being made is made again.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import logging
import os
import re
import stat
import threading
import time
import uuid
from typing import Any, Callable, Iterator, Mapping

from filelock import FileLock
from filelock import Timeout as LockTimeout

from ..errors import CorruptShard, LoaderClosed, ShardError, StaleShard, UnsafeShard
from ..shardfile import TEMP_MARKER, discard_path, inspect_shard, open_regular, remove_if_exists
from .evict import CacheLimit, evict_if_unread, evict_lru
from .recipe import describe_change, normalized, read_recipe, write_recipe

__all__ = ["ON_CHANGE", "SUFFIXES", "ShardCache", "WAIT_SLICE_S"]

logger = logging.getLogger(__name__)

SUFFIXES = (".npy", ".npz")
WAIT_SLICE_S = 0.5  # how often a blocked wait re-checks close()
ON_CHANGE = ("regenerate", "raise")
_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)


class ShardCache:
    """Finished shards in ``cache_dir``; one process generates a key at a time.

    Args:
        cache_dir: The directory (created if missing).
        lock_timeout: Seconds to wait for another process generating the same key.
        closed: Set when the owner closes: waits give up with LoaderClosed.
        limit: ``cache_limit`` (shards or bytes); None keeps everything.
        on_change: A cached shard whose recorded recipe differs from the source's is
            ``'regenerate'``d (default) or ``'raise'``s :class:`~gluon_stream.StaleShard`.
    """

    def __init__(self, cache_dir: str | os.PathLike, lock_timeout: float,
                 closed: threading.Event | None = None, limit: int | str | None = None,
                 on_change: str = "regenerate") -> None:
        if lock_timeout <= 0:
            raise ValueError(f"lock_timeout must be positive seconds, got {lock_timeout!r}")
        if on_change not in ON_CHANGE:
            raise ValueError(f"on_change must be 'regenerate' or 'raise', got {on_change!r}")
        self.limit = CacheLimit.parse(limit)
        self.on_change = on_change
        self.root = os.path.realpath(os.fspath(cache_dir))
        os.makedirs(self.root, exist_ok=True)
        self.lock_timeout = lock_timeout
        self.closed = closed if closed is not None else threading.Event()
        self._told: set[str] = set()  # one-time log lines already written
        self._told_lock = threading.Lock()
        self.read_only = not os.access(self.root, os.W_OK)
        if self.read_only:
            self._tell_once("read-only", logging.INFO, "cache_dir %s is read-only: serving the "
                            "shards in it as they are (no cleanup, no LRU updates, no eviction); "
                            "a shard missing from it cannot be generated", self.root)
            return
        self._remove_stale_temps()
        self._remove_stale_locks()

    def __getstate__(self) -> dict:
        """Picklable (for a remote executor): the closed flag stays with this process."""
        state = dict(self.__dict__)
        del state["closed"], state["_told_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.closed = threading.Event()
        self._told_lock = threading.Lock()

    def _tell_once(self, what: str, level: int, message: str, *args: Any) -> bool:
        """Log ``message`` the first time ``what`` happens in this cache; True if it was logged."""
        with self._told_lock:
            if what in self._told:
                return False
            self._told.add(what)
        logger.log(level, message, *args)
        return True

    # -- finding and reading shards ----------------------------------------------------------
    def path_for(self, name: str, suffix: str) -> str:
        path = os.path.join(self.root, name + suffix)
        if os.path.dirname(os.path.abspath(path)) != self.root:
            raise ValueError(f"shard name {name!r} escapes the cache directory {self.root!r}")
        return path

    def lookup(self, name: str) -> str | None:
        """Path of a finished shard for ``name``, or None. Symlinks are never followed, and
        anything but a regular file is refused (gluon_stream never deletes what it did not make)."""
        for suffix in SUFFIXES:
            path = self.path_for(name, suffix)
            try:
                mode = os.lstat(path).st_mode
            except FileNotFoundError:
                continue
            if stat.S_ISLNK(mode):
                raise UnsafeShard(f"cached shard {path!r} is a symlink; gluon_stream does not follow "
                                  "links in its cache. Remove it", path=path)
            if not stat.S_ISREG(mode):
                reason = "not a regular file (a directory, FIFO or device)"
                raise CorruptShard(f"cached shard {path!r} is {reason}; gluon_stream never "
                                   "deletes what it did not make: remove it", path=path,
                                   reason=reason)
            return path
        return None

    def fresh(self, name: str, recipe: Mapping[str, Any] | None) -> str | None:
        """Path of a finished shard for ``name`` made by ``recipe``, or None (missing, or stale
        and to be regenerated). Raises StaleShard for a stale one with ``on_change='raise'``."""
        path = self.lookup(name)
        if path is None or recipe is None:
            return path
        recorded = self.recipe_of(path)
        if recorded is None:
            self._note_unrecorded(path)
            return path
        current = normalized(recipe)
        if recorded == current:
            return path
        change = describe_change(recorded, current)
        if self.on_change == "raise":
            raise StaleShard(f"cached shard {path!r} was made by a different recipe ({change}); "
                             "delete it, restore what made it, or pass on_change='regenerate'",
                             path=path, key=name, change=change)
        if not self._tell_once(f"stale:{change}", logging.WARNING,
                               "cached shard %s was made by a different recipe (%s): "
                               "regenerating it (on_change='raise' refuses instead; further "
                               "shards with this change are logged at INFO)", path, change):
            logger.info("cached shard %s is stale (%s): regenerating it", path, change)
        return None

    def recipe_of(self, path: str) -> dict | None:
        """The recipe recorded on a finished shard (None: none recorded, or no support)."""
        return read_recipe(path)

    def _note_unrecorded(self, path: str) -> None:
        self._tell_once("unrecorded", logging.WARNING,
                        "cached shard %s carries no record of what made it (an older "
                        "gluon_stream, a copy without extended attributes, or a file system "
                        "without them): serving it and others like it as they are; delete the "
                        "cache if the generator changed since", path)

    @contextlib.contextmanager
    def reading(self, path: str) -> Iterator[str]:
        """Hold a shared lock on a finished shard while it is read: eviction skips it.

        Raises FileNotFoundError when the shard was evicted before the lock was taken.
        """
        with open_regular(path) as fp:
            fcntl.flock(fp.fileno(), fcntl.LOCK_SH)
            if os.fstat(fp.fileno()).st_ino != os.stat(path).st_ino:
                raise FileNotFoundError(path)  # replaced: read the new one instead
            self._touch(path)
            yield path

    def _touch(self, path: str) -> None:
        """Mark a shard used now (least recently used goes first), where the cache allows it."""
        if self.read_only:
            return
        try:
            os.utime(path)
        except OSError as exc:
            if exc.errno not in _READ_ONLY:
                raise
            self._tell_once("no-utime", logging.INFO, "cannot update the last-used time of "
                            "shards in %s (%s): they are served, but LRU eviction goes by when "
                            "they were made", self.root, exc.strerror)

    def num_samples(self, name: str, recipe: Mapping[str, Any] | None = None) -> int | None:
        """Samples of a cached shard from its header, or None if it is not cached (or stale)."""
        try:
            path = self.fresh(name, recipe)
        except StaleShard:
            return None  # raised when the shard is produced, not while counting
        return None if path is None else inspect_shard(path)[0].shape[0]

    def evict(self, path: str) -> None:
        remove_if_exists(path)

    # -- making shards ---------------------------------------------------------------------
    def temp_path(self, name: str, suffix: str) -> str:
        return os.path.join(self.root, f".{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
                                        f"{TEMP_MARKER}{suffix}")

    def lock(self, name: str) -> FileLock:
        return FileLock(os.path.join(self.root, f".{name}.lock"), timeout=self.lock_timeout)

    def get_or_create(self, name: str, create: Callable[[], str],
                      recipe: Mapping[str, Any] | None = None) -> tuple[str, bool]:
        """Return (path, cache_hit); ``create()`` writes a validated temp file and returns its path.

        One process generates a key at a time (a cross-process lock); whoever waited finds the
        finished file. A lock whose holder died is released by the OS, so a waiter takes over.
        With ``recipe``, a cached shard made by another recipe counts as missing (or raises,
        see ``on_change``), and the new shard is published with ``recipe`` recorded on it.
        A ``cache_dir`` deleted meanwhile is recreated once and the shard made again.
        """
        path = self.fresh(name, recipe)
        if path is not None:
            return path, True
        if self.read_only:
            raise self._cannot_generate(name)
        for attempt in range(2):
            try:
                return self._create_locked(name, create, recipe)
            except (OSError, ShardError) as exc:
                if isinstance(exc, OSError) and exc.errno == errno.EROFS:
                    raise self._cannot_generate(name) from exc  # remounted read-only since
                if os.path.isdir(self.root):
                    raise
                if attempt:
                    raise ShardError(f"shard {name!r}: cache_dir {self.root!r} was deleted again "
                                     "while the shard was made; is another program cleaning "
                                     "it? Point cache_dir at a directory nothing else removes",
                                     key=name) from exc
                logger.warning("cache_dir %s was deleted while shard %r was being made; "
                               "making the shard again", self.root, name)
        raise AssertionError("unreachable")

    def _cannot_generate(self, name: str) -> ShardError:
        return ShardError(f"shard {name!r} is not in the read-only cache_dir {self.root!r} and "
                          "cannot be generated there; generate it where the cache is writable, "
                          "or point cache_dir at a writable directory", key=name)

    def _create_locked(self, name: str, create: Callable[[], str],
                       recipe: Mapping[str, Any] | None) -> tuple[str, bool]:
        if not os.path.isdir(self.root):
            logger.warning("cache_dir %s was deleted while running; recreating it", self.root)
            os.makedirs(self.root, exist_ok=True)
        lock = self.lock(name)
        self._acquire(lock, name)
        try:
            path = self.fresh(name, recipe)
            if path is not None:
                return path, True
            tmp = create()
            if os.path.islink(tmp):
                remove_if_exists(tmp)
                raise UnsafeShard(f"shard {name!r}: the generator left a symlink at {tmp!r}; "
                                  "gluon_stream does not follow links in its cache. Write the "
                                  "shard itself to the '{path}' argument", path=tmp)
            try:
                if recipe is not None:
                    self._record(tmp, recipe)
                return self._publish(tmp, name), False
            except BaseException:
                remove_if_exists(tmp)
                raise
        finally:
            with contextlib.suppress(FileNotFoundError):  # the cache_dir itself may be gone
                remove_if_exists(lock.lock_file)  # while held: late waiters see the finished file
            lock.release()

    def _record(self, tmp: str, recipe: Mapping[str, Any]) -> None:
        """Record the recipe on the temp file; where the file system cannot, say so once."""
        try:
            write_recipe(tmp, recipe)
        except (OSError, NotImplementedError) as exc:
            if isinstance(exc, OSError) and exc.errno == errno.ENOENT:
                raise
            self._tell_once("no-xattr", logging.WARNING,
                            "cannot record what made the shards in %s (%s): a changed command, "
                            "env= or version= will not be detected there; delete the cache "
                            "yourself when the generator changes", self.root, exc)

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
        """Move a finished, validated temp file into place; readers see all of it or nothing.

        A shard of the other suffix for the same key (made before the format changed) goes, so
        lookups cannot find it first.
        """
        suffix = os.path.splitext(tmp)[1]
        final = self.path_for(name, suffix)
        os.replace(tmp, final)
        for other in SUFFIXES:
            if other != suffix:
                remove_if_exists(self.path_for(name, other))
        return final

    # -- bounding the cache ------------------------------------------------------------------
    def enforce_limit(self, keep: str) -> None:
        """Evict least recently used shards until the cache fits ``cache_limit``.

        Shards held by a reader anywhere (a shared lock) and ``keep`` are never evicted;
        one process evicts at a time.
        """
        if not self.limit.bounded or self.read_only:
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
            if not match and os.path.isdir(path):
                continue  # not a temp path of ours: a directory is only removed when it is
            logger.info("removing temp file %s left by a crashed run", path)
            discard_path(path)  # a generator may have made a directory at its temp path

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
