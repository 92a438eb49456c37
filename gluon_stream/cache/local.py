"""A directory of finished shard files, filled atomically under per-key cross-process locks.

Layout: ``<key>.npy``/``<key>.npz`` finished shards, ``.<key>.<pid>.<rand>.tmp.npy`` a
generation in progress, ``.<key>.lock`` the per-key lock and ``.cache-evict.lock`` the
eviction lock (each removed by its holder), ``<key>.failed.json`` a generation that failed
(see :mod:`.failures`). A generation writes a private temp file that is
validated, then renamed into place, so a reader never sees half a shard. Temp files (and
directories a generator made at its temp path) and lock files left by crashed runs are removed
at the next start; symlinks are never followed, and only regular files are read.

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

With ``cache_limit``, room is made *before* a shard is generated (see :mod:`.room`, whose
:class:`~.room.CacheRoom` this cache holds), under the eviction lock that every generating
process takes (as MosaicML's streaming evicts before it downloads): the least recently used
shards that nobody has pinned are evicted until the published shards, the ones being made and
the new one fit, and a reservation (``.<key>.<pid>.<rand>.tmp.room``, an empty file) says that a
shard is being made; at publication room is made again with the shard's real size (never
waiting: the shard is on disk already), then it is renamed into place and its reservation
goes. A byte limit counts a shard being made as large as the largest shard seen so far. A shard
is pinned (a shared ``flock``) while it is read, and from before it is published until its
producer has read it. Shards that another process has pinned
or is making count against that process's limit: this one evicts around them but never waits for
them. So one process keeps the directory within its limit, temp files included, whatever its
number of producers; several processes with different limits all go on (see docs/caches.md for
how their shards count). If this process's own shards in use fill its limit, the generation
waits for one to be released (they are held for the time of a read), with the eviction lock
released, at most ``lock_timeout``, then raises :class:`~gluon_stream.CacheFull` saying to raise
``cache_limit``: waiting keeps a limit close to the shards in flight working, and the bound turns
a reader that never lets go into an error rather than a hang. Recency is
the file's modification time, set on every read; a time in the future (a skewed clock, a
restored backup) is reset to now when eviction first sees it, so such a shard ages like any
other instead of counting as the most recently used forever.

A read-only ``cache_dir`` serves the shards it holds (one INFO line): no cleanup, no LRU
time updates, no eviction; a missing shard is a ``ShardError``. A ``cache_dir`` deleted while
running is recreated (one WARNING) and the shard being made is made again.
"""
from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import logging
import os
import stat
import threading
import time
import uuid
from typing import Any, Callable, Iterator, Mapping

from .._utils.closing import WAIT_SLICE_S
from .._utils.files import TEMP_MARKER, remove_if_exists
from ..errors import CorruptShard, ShardError, StaleShard, UnsafeShard
from ..shardfile import inspect_shard, open_regular
from .base import Create, Recipe
from .evict import CacheLimit, evict_if_unread
from .failures import drop_failures, read_failure, worth_recording, write_failure
from .leftovers import remove_leftovers
from .lock import LOCK_SUFFIX, exclusive
from .recipe import describe_change, normalized, read_recipe, write_recipe
from .recorded import add_sizes, read_sizes
from .room import RESERVATION, CacheRoom

__all__ = ["EVICT_LOCK", "FUTURE_SLACK_S", "LocalShardCache", "ON_CHANGE", "RESERVATION",
           "SUFFIXES", "WAIT_SLICE_S"]

logger = logging.getLogger(__name__)

SUFFIXES = (".npy", ".npz")
EVICT_LOCK = "cache-evict"
FUTURE_SLACK_S = 5.0  # a last-used time further ahead than this is a skewed clock or a backup
ON_CHANGE = ("regenerate", "raise")
_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)


class LocalShardCache:
    """Finished shards in ``cache_dir``; one process generates a key at a time.

    Implements :class:`~gluon_stream.cache.ShardCache`.

    Args:
        cache_dir: The directory (created if missing).
        lock_timeout: Seconds to wait for another process generating the same key, and for a
            pinned shard to be released when the cache is full.
        closed: Set when the owner closes: waits give up with LoaderClosed.
        limit: ``cache_limit`` (shards or bytes); None keeps everything.
        on_change: A cached shard whose recorded recipe differs from the source's is
            ``'regenerate'``d (default) or ``'raise'``s :class:`~gluon_stream.StaleShard`.

    Example:
        >>> cache = LocalShardCache(tmp, lock_timeout=10, limit=2)  # doctest: +SKIP
        >>> with cache.pinned("a", make_a) as (path, hit):  # doctest: +SKIP
        ...     arrays = load_shard(path)
    """

    #: Whether failed generations are recorded beside the shard, for every process to see.
    remembers_failures = True

    def __init__(self, cache_dir: str | os.PathLike, lock_timeout: float,
                 closed: threading.Event | None = None, limit: int | str | None = None,
                 on_change: str = "regenerate") -> None:
        if lock_timeout <= 0:
            raise ValueError(f"lock_timeout must be positive seconds, got {lock_timeout!r}")
        if on_change not in ON_CHANGE:
            raise ValueError(f"on_change must be 'regenerate' or 'raise', got {on_change!r}")
        self.limit = CacheLimit.parse(limit)
        self._room = CacheRoom(self.limit)  # room within the limit, for the shards made here
        self.on_change = on_change
        self.root = os.path.realpath(os.fspath(cache_dir))
        os.makedirs(self.root, exist_ok=True)
        self.lock_timeout = lock_timeout
        self.closed = closed if closed is not None else threading.Event()
        self._told: set[str] = set()  # one-time log lines already written
        self._told_lock = threading.Lock()
        self._held: collections.Counter[tuple[int, int]] = collections.Counter()  # our pins
        self._held_lock = threading.Lock()
        self.read_only = not os.access(self.root, os.W_OK)
        if self.read_only:
            self.tell_once("read-only", logging.INFO, "cache_dir %s is read-only: serving the "
                           "shards in it as they are (no cleanup, no LRU updates, no eviction); "
                           "a shard missing from it cannot be generated", self.root)
            return
        remove_leftovers(self.root)

    def __getstate__(self) -> dict:
        """Picklable (for a remote executor): the closed flag stays with this process."""
        state = dict(self.__dict__)
        del state["closed"], state["_told_lock"], state["_held"], state["_held_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.closed = threading.Event()
        self._told_lock = threading.Lock()
        self._held = collections.Counter()
        self._held_lock = threading.Lock()

    def tell_once(self, what: str, level: int, message: str, *args: Any) -> bool:
        """Log ``message`` the first time ``what`` happens in this cache; True if it was logged
        (once per cache: its :class:`~.room.CacheRoom` says it is full this way too)."""
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

    def _final(self, name: str, suffix: str) -> str:
        """Where the finished shard ``name`` with ``suffix`` is published."""
        return self.path_for(name, suffix)

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
                raise UnsafeShard(f"cached shard {path!r} is a symlink; gluon_stream does not "
                                  "follow links in its cache. Remove it", path=path)
            if not stat.S_ISREG(mode):
                reason = "not a regular file (a directory, FIFO or device)"
                raise CorruptShard(f"cached shard {path!r} is {reason}; gluon_stream never "
                                   "deletes what it did not make: remove it", path=path,
                                   reason=reason)
            return path
        return None

    def fresh(self, name: str, recipe: Recipe) -> str | None:
        """Path of a finished shard for ``name`` made by ``recipe``, or None (missing, or stale
        and to be regenerated). Raises StaleShard for a stale one with ``on_change='raise'``."""
        path = self.lookup(name)
        if path is None or recipe is None:
            return path
        try:
            recorded = self.recipe_of(path)
        except FileNotFoundError:  # evicted since the lookup (room made for another shard)
            return None
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
        if not self.tell_once(f"stale:{change}", logging.WARNING,
                              "cached shard %s was made by a different recipe (%s): "
                              "regenerating it (on_change='raise' refuses instead; further "
                              "shards with this change are logged at INFO)", path, change):
            logger.info("cached shard %s is stale (%s): regenerating it", path, change)
        return None

    def recipe_of(self, path: str) -> dict | None:
        """The recipe recorded on a finished shard (None: none recorded, or no support)."""
        return read_recipe(path)

    def _note_unrecorded(self, path: str) -> None:
        self.tell_once("unrecorded", logging.WARNING,
                       "cached shard %s carries no record of what made it (an older "
                       "gluon_stream, a copy without extended attributes, or a file system "
                       "without them): serving it and others like it as they are; delete the "
                       "cache if the generator changed since", path)

    def _pin(self, path: str) -> Any:
        """Keep a finished shard from eviction (a shared lock on its file) until ``_unpin``;
        None if it is gone (evicted, or replaced by a regeneration, since it was found)."""
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
        with self._held_lock:
            self._held[held] += 1
        return fp

    def _unpin(self, pin: Any) -> None:
        """Release a pin from :meth:`_pin` (closing the file drops its lock)."""
        if pin is None:
            return
        held = _identity(os.fstat(pin.fileno()))
        with self._held_lock:
            self._held[held] -= 1
            if self._held[held] <= 0:
                del self._held[held]
        pin.close()

    def pinned_here(self, path: str) -> bool:
        """Whether this cache holds a pin on the finished shard ``path`` (a reader or producer
        of this process); a shard pinned only elsewhere counts against another limit."""
        try:
            held = _identity(os.stat(path, follow_symlinks=False))
        except FileNotFoundError:
            return False
        with self._held_lock:
            return held in self._held

    @contextlib.contextmanager
    def reading(self, path: str) -> Iterator[str]:
        """Pin a finished shard while it is read (eviction skips it) and mark it used now.

        Raises FileNotFoundError when the shard was evicted before the pin was taken.
        """
        pin = self._pin(path)
        if pin is None:
            raise FileNotFoundError(path)
        try:
            self._touch(path)
            yield path
        finally:
            self._unpin(pin)

    def _touch(self, path: str) -> None:
        """Mark a shard used now (least recently used goes first), where the cache allows it."""
        if self.read_only:
            return
        try:
            os.utime(path)
        except OSError as exc:
            if exc.errno not in _READ_ONLY:
                raise
            self.tell_once("no-utime", logging.INFO, "cannot update the last-used time of "
                           "shards in %s (%s): they are served, but LRU eviction goes by when "
                           "they were made", self.root, exc.strerror)

    def num_samples(self, name: str, recipe: Recipe = None) -> int | None:
        """Samples of a cached shard from its header, or None if it is not cached (or stale)."""
        try:
            path = self.fresh(name, recipe)
        except StaleShard:
            return None  # raised when the shard is produced, not while counting
        return None if path is None else inspect_shard(path)[0].shape[0]

    def evict(self, path: str) -> None:
        remove_if_exists(path)

    # -- sizes recorded when the cache was filled ahead -------------------------------------
    def recorded_sizes(self) -> dict[str, dict]:
        """Shard name -> ``{"samples": n, "recipe": digest}``, as ``gluon-stream generate``
        recorded them when it filled this cache ahead (empty if it never did)."""
        return read_sizes(self.root)

    def record_sizes(self, sizes: Mapping[str, Mapping[str, Any]]) -> None:
        """Add ``sizes`` (as :meth:`recorded_sizes` gives them) to the record, written whole
        and atomically: a reader sees the record before or after, never a part."""
        add_sizes(self.root, sizes, self.temp_path("sizes", ".json"))

    # -- making shards ---------------------------------------------------------------------
    def temp_path(self, name: str, suffix: str) -> str:
        return os.path.join(self.root, f".{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
                                        f"{TEMP_MARKER}{suffix}")

    def lock_path(self, name: str) -> str:
        """The lock file of key ``name`` (or of ``EVICT_LOCK``)."""
        return os.path.join(self.root, f".{name}{LOCK_SUFFIX}")

    @contextlib.contextmanager
    def pinned(self, name: str, create: Create,
               recipe: Recipe = None) -> Iterator[tuple[str, bool]]:
        """Make sure the shard is cached and pin it for the with-block: ``(path, cache_hit)``.

        ``create()`` writes a validated temp file and returns its path. One process generates
        a key at a time (a cross-process lock); whoever waited finds the finished file. A lock
        whose holder died is released by the OS, so a waiter takes over. With ``recipe``, a
        cached shard made by another recipe counts as missing (or raises, see ``on_change``),
        and the new shard is published with ``recipe`` recorded on it. A ``cache_dir`` deleted
        meanwhile is recreated once and the shard made again. A new shard is pinned from
        before it is published, so no other producer's eviction takes it before it is read.
        """
        path, hit, pin = self._ensure(name, create, recipe)
        try:
            yield path, hit
        finally:
            self._unpin(pin)

    def get_or_create(self, name: str, create: Create,
                      recipe: Recipe = None) -> tuple[str, bool]:
        """As :meth:`pinned`, unpinned on return: ``(path, cache_hit)``."""
        with self.pinned(name, create, recipe) as found:
            return found

    def _ensure(self, name: str, create: Create, recipe: Recipe) -> tuple[str, bool, Any]:
        """(path, cache_hit, pin) of the shard ``name``, made if missing or stale."""
        path = self.fresh(name, recipe)
        if path is not None:
            pin = self._pin(path)
            if pin is not None:
                return path, True, pin
        if self.read_only:
            raise self._cannot_generate(name)
        attempt = -1
        while True:  # a second deletion of cache_dir raises
            attempt += 1
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

    def _cannot_generate(self, name: str) -> ShardError:
        return ShardError(f"shard {name!r} is not in the read-only cache_dir {self.root!r} and "
                          "cannot be generated there; generate it where the cache is writable, "
                          "or point cache_dir at a writable directory", key=name)

    def _create_locked(self, name: str, create: Create, recipe: Recipe) -> tuple[str, bool, Any]:
        if not os.path.isdir(self.root):
            logger.warning("cache_dir %s was deleted while running; recreating it", self.root)
            os.makedirs(self.root, exist_ok=True)
        with self._locked(name, lambda: self._lock_timeout_error(name)):
            self._refresh(name)
            path = self.fresh(name, recipe)
            if path is not None:
                pin = self._pin(path)
                if pin is not None:
                    return path, True, pin
            self._refuse_failed(name, recipe)
            reservation = self._reserve(name)
            try:
                return self._create_reserved(name, create, recipe)
            finally:
                self._release(name, reservation)

    def _create_reserved(self, name: str, create: Create,
                         recipe: Recipe) -> tuple[str, bool, Any]:
        """Make, record and publish the shard ``name`` (under its key's lock, room reserved)."""
        try:
            tmp = create()
        except BaseException as exc:
            self._remember_failure(name, recipe, exc)
            raise
        try:
            if os.path.islink(tmp):
                raise UnsafeShard(f"shard {name!r}: the generator left a symlink at {tmp!r}; "
                                  "gluon_stream does not follow links in its cache. Write the "
                                  "shard itself to the '{path}' argument", path=tmp)
            if recipe is not None:
                self._record(tmp, recipe)
            path, pin = self._publish(tmp, name)
        except BaseException:
            remove_if_exists(tmp)
            raise
        if self.remembers_failures:
            drop_failures(self.root, [name])  # made at last: a failure recorded before is old
        return path, False, pin

    # -- failures remembered beside the shard (see .failures) -------------------------------
    def _refuse_failed(self, name: str, recipe: Recipe) -> None:
        """Raise the failure recorded for ``name`` if ``recipe`` made it (under the key's
        lock); a record of another recipe is dropped, and the shard made again."""
        if not self.remembers_failures:
            return
        failure = read_failure(self.root, name)
        if failure is None:
            return
        current = None if recipe is None else normalized(recipe)
        if failure.recipe == current:
            raise failure.error_for()
        logger.info("shard %r failed before with another recipe (%s): making it again", name,
                    describe_change(failure.recipe or {}, current or {}))
        drop_failures(self.root, [name])

    def _remember_failure(self, name: str, recipe: Recipe, exc: BaseException) -> None:
        """Record that making ``name`` failed with ``exc`` (a failure of the generation), so
        that no process makes it again until it is retried."""
        if not self.remembers_failures or not worth_recording(exc):
            return
        try:
            path = write_failure(self.root, name, None if recipe is None else normalized(recipe),
                                 exc, self.temp_path(name, ".failed"))
        except OSError as err:  # the failure itself is what the caller must see
            logger.warning("cannot record the failure of shard %r in %s (%s): other processes "
                           "will make it again", name, self.root, err)
            return
        logger.info("recorded the failure of shard %r in %s: no process makes it again until "
                    "it is retried", name, path)

    def retry_failures(self, names: list[str] | None = None) -> list[str]:
        """Forget the recorded failures of ``names`` (None: all), so the shards are made again
        when next asked for; the names whose record went."""
        if self.read_only or not self.remembers_failures:
            return []
        return drop_failures(self.root, names)

    def _reserve(self, name: str) -> str | None:
        """With ``cache_limit``, make room for the shard ``name`` before it is made and leave a
        reservation that other generations count until it is published; its path, or None."""
        if not self._room.bounded:
            return None
        deadline = time.monotonic() + self.lock_timeout
        while True:  # waiting with the eviction lock released: shards being made publish
            with self._locked(EVICT_LOCK, lambda: self._lock_timeout_error(EVICT_LOCK)):
                if self._make_room(name, self._room.largest, replacing=False):
                    return self._room.reserve(name, self.temp_path(name, RESERVATION))
            self._room.pause(self, name, deadline)  # never waits holding the lock

    def _release(self, name: str, reservation: str | None) -> None:
        """Drop the reservation of ``name`` (published, or given up)."""
        self._room.release(name, reservation)

    @contextlib.contextmanager
    def _locked(self, name: str, timed_out: Callable[[], BaseException]) -> Iterator[None]:
        """Hold the cross-process lock of key ``name`` (or of ``EVICT_LOCK``)."""
        with exclusive(self.lock_path(name), self.lock_timeout, self.closed, timed_out,
                       waiting=lambda: self._waiting(name)):
            yield

    def _waiting(self, name: str) -> None:
        """Called once when another process holds the lock of ``name``."""
        logger.debug("waiting for another process holding the lock of %r in %s", name, self.root)

    def _lock_timeout_error(self, name: str) -> ShardError:
        if name == EVICT_LOCK:
            return ShardError(
                f"waited {self.lock_timeout:g} s for the eviction lock of {self.where()} (lock "
                f"{self.lock_path(name)}), held by another process making room; raise "
                "lock_timeout, or remove the lock file if no gluon_stream process is running")
        return ShardError(
            f"shard {name!r}: waited {self.lock_timeout:g} s for another process generating it "
            f"(lock {self.lock_path(name)}); raise lock_timeout, or remove the lock file if no "
            "gluon_stream process is running", key=name)

    def _refresh(self, name: str) -> None:
        """Forget what this process believes about ``name`` (a local directory: nothing)."""

    def _record(self, tmp: str, recipe: Recipe) -> None:
        """Record the recipe on the temp file; where the file system cannot, say so once."""
        assert recipe is not None
        try:
            write_recipe(tmp, recipe)
        except (OSError, NotImplementedError) as exc:
            if isinstance(exc, OSError) and exc.errno == errno.ENOENT:
                raise
            self.tell_once("no-xattr", logging.WARNING,
                           "cannot record what made the shards in %s (%s): a changed command, "
                           "env= or version= will not be detected there; delete the cache "
                           "yourself when the generator changes", self.root, exc)

    def _publish(self, tmp: str, name: str) -> tuple[str, Any]:
        """Move a finished, validated temp file into place, pinned, after making room for it
        (``cache_limit``); readers see all of it or nothing: ``(path, pin)``.

        A shard of the other suffix for the same key (made before the format changed) goes, so
        lookups cannot find it first.
        """
        pin = self._pin(tmp)  # before it is published: no eviction can take it unread
        if pin is None:
            raise FileNotFoundError(tmp)
        try:
            with self._room_for(name, os.path.getsize(tmp)):
                return self._place(tmp, name, os.path.splitext(tmp)[1]), pin
        except BaseException:
            self._unpin(pin)
            raise

    @contextlib.contextmanager
    def _room_for(self, name: str, size: int, replacing: bool = True) -> Iterator[None]:
        """With ``cache_limit``, hold the eviction lock with room made for one more shard of
        ``size`` bytes (``replacing``: the shard then replaces a cached shard of the same key),
        for the with-block to publish it.

        Never waits: the shard is on disk already, as a temp file its reservation made room
        for, so publishing it adds nothing to the directory; room is made again with its real
        size, evicting what can go. A shard larger than the reservation's estimate (the largest
        seen) may leave a byte limit exceeded until the next reservation makes room: waiting here
        instead would hang producers that each wait for the other's shard, estimated at the new
        size, to be published (two growing shards under a limit that holds one of them)."""
        if not self._room.bounded:
            yield
            return
        with self._locked(EVICT_LOCK, lambda: self._lock_timeout_error(EVICT_LOCK)):
            if not self._make_room(name, size, replacing):
                self.tell_once("over", logging.INFO,
                               "cache_limit (%s): shard %r (%d bytes) is larger than the room "
                               "made for it, and the shards that could make up for it are in "
                               "use: publishing it (it is on disk already); the next shards "
                               "wait until %s is back within the limit", self._room.limit, name,
                               size, self.root)
            yield

    def _place(self, tmp: str, name: str, suffix: str) -> str:
        """Move the temp file to its final name; remove the key's shard of the other suffix."""
        final = self._final(name, suffix)
        os.replace(tmp, final)
        for other in SUFFIXES:
            if other != suffix:
                remove_if_exists(self._final(name, other))
        return final

    # -- bounding the cache: what its CacheRoom asks of it (room.Shelf) ----------------------
    def _make_room(self, name: str, size: int, replacing: bool = True) -> bool:
        """Make room for one more shard of ``size`` bytes (see :meth:`CacheRoom.make`; never
        waits); ``replacing``: it replaces the cached shard of the same key, which then does
        not count. Whether it fits."""
        replaced = {self._final(name, suffix) for suffix in SUFFIXES} if replacing else set()
        return self._room.make(self, name, size, replaced)

    def where(self) -> str:
        """The cache's location, for messages."""
        return self.root

    def listing(self) -> list[tuple[float, str, int]]:
        """(last used, path, bytes) of every finished shard. A last-used time in the future
        (a skewed clock, a restored backup) is reset to now, once, so that the shard ages."""
        shards = []
        now = time.time()
        with os.scandir(self.root) as entries:
            for entry in entries:
                if entry.name.startswith(".") or not entry.name.endswith(SUFFIXES):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    info = entry.stat(follow_symlinks=False)
                    used = info.st_mtime
                    if used > now + FUTURE_SLACK_S:
                        self._reset_future(entry.path, used, now)
                        used = now
                    shards.append((used, entry.path, info.st_size))
        return shards

    def _reset_future(self, path: str, used: float, now: float) -> None:
        """Set a last-used time that lies in the future to ``now`` (said once per cache)."""
        self.tell_once("future-mtime", logging.WARNING,
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

    def try_evict(self, path: str) -> bool:
        """Delete a finished shard unless someone has it pinned; True if it went."""
        return evict_if_unread(path)


def _identity(info: os.stat_result) -> tuple[int, int]:
    """A file's identity, kept through a rename (a temp file pinned, then published)."""
    return info.st_dev, info.st_ino
