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

import contextlib
import logging
import os
import threading
from typing import Any, Callable, Iterator, Mapping

from .._utils.closing import WAIT_SLICE_S
from .._utils.files import remove_if_exists
from ..errors import ShardError, StaleShard
from ..shardfile import inspect_shard
from .base import Create, Recipe
from .evict import CacheLimit, evict_if_unread
from .failure_gate import FailureGate
from .layout import EVICT_LOCK, SUFFIXES, lock_path, shard_path, temp_path
from .leftovers import remove_leftovers
from .lock import exclusive
from .lookup import find_shard
from .making import ShardMaking
from .notices import Notices
from .pins import FilePins
from .publishing import ShardPublishing
from .recency import FUTURE_SLACK_S, list_shards, touch
from .recipe import read_recipe
from .recorded import add_sizes, read_sizes
from .room import RESERVATION, CacheRoom
from .staleness import is_current, note_unrecorded, record_recipe

__all__ = ["EVICT_LOCK", "FUTURE_SLACK_S", "LocalShardCache", "ON_CHANGE", "RESERVATION",
           "SUFFIXES", "WAIT_SLICE_S"]

logger = logging.getLogger(__name__)

ON_CHANGE = ("regenerate", "raise")


class LocalShardCache(ShardMaking, ShardPublishing):
    """Finished shards in ``cache_dir``; one process generates a key at a time.

    Implements :class:`~gluon_stream._cache.ShardCache`. The cache's parts live beside it, one
    concept each: the directory's names (:mod:`.layout`), finding a shard (:mod:`.lookup`),
    whether it is stale (:mod:`.staleness`), pins (:mod:`.pins`), last-used times
    (:mod:`.recency`), making (:mod:`.making`) and publishing (:mod:`.publishing`) a shard (the
    mixins :class:`~.making.ShardMaking` and :class:`~.publishing.ShardPublishing`, whose steps
    are methods of this cache), failure records (:mod:`.failure_gate`), room (:mod:`.room`). The
    methods with a leading underscore are the steps a :class:`~.remote.RemoteShardCache` does
    its own way.

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
        self._notices = Notices(logger)  # one-time log lines already written
        self._held = FilePins()  # the shards this process has pinned
        self._failures = FailureGate(self.root, self.remembers_failures)
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
        del state["closed"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.closed = threading.Event()

    def tell_once(self, what: str, level: int, message: str, *args: Any) -> bool:
        """Log ``message`` the first time ``what`` happens in this cache; True if it was logged
        (once per cache: its :class:`~.room.CacheRoom` says it is full this way too)."""
        return self._notices.tell_once(what, level, message, *args)

    # -- names in the directory (see .layout) -------------------------------------------------
    def path_for(self, name: str, suffix: str) -> str:
        return shard_path(self.root, name, suffix)

    def _final(self, name: str, suffix: str) -> str:
        """Where the finished shard ``name`` with ``suffix`` is published."""
        return self.path_for(name, suffix)

    def temp_path(self, name: str, suffix: str) -> str:
        return temp_path(self.root, name, suffix)

    def lock_path(self, name: str) -> str:
        """The lock file of key ``name`` (or of ``EVICT_LOCK``)."""
        return lock_path(self.root, name)

    def where(self) -> str:
        """The cache's location, for messages."""
        return self.root

    # -- finding and reading shards ----------------------------------------------------------
    def lookup(self, name: str) -> str | None:
        """Path of a finished shard for ``name``, or None. Symlinks are never followed, and
        anything but a regular file is refused (gluon_stream never deletes what it did not make)."""
        return find_shard(self.path_for(name, suffix) for suffix in SUFFIXES)

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
        return path if is_current(path, name, recorded, recipe, self.on_change,
                                  self._notices) else None

    def recipe_of(self, path: str) -> dict | None:
        """The recipe recorded on a finished shard (None: none recorded, or no support)."""
        return read_recipe(path)

    def _note_unrecorded(self, path: str) -> None:
        note_unrecorded(path, self._notices)

    def _pin(self, path: str) -> Any:
        """Keep a finished shard from eviction until ``_unpin``; None if it is gone."""
        return self._held.pin(path)

    def _unpin(self, pin: Any) -> None:
        """Release a pin from :meth:`_pin`."""
        self._held.unpin(pin)

    def pinned_here(self, path: str) -> bool:
        """Whether this cache holds a pin on the finished shard ``path`` (a reader or producer
        of this process); a shard pinned only elsewhere counts against another limit."""
        return self._held.holds(path)

    @contextlib.contextmanager
    def reading(self, path: str) -> Iterator[str]:
        """Pin a finished shard while it is read (eviction skips it) and mark it used now.

        Raises FileNotFoundError when the shard was evicted before the pin was taken.
        """
        pin = self._pin(path)
        if pin is None:
            raise FileNotFoundError(path)
        try:
            if not self.read_only:
                touch(path, self.root, self._notices)
            yield path
        finally:
            self._unpin(pin)

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

    # -- making shards (see .making and .publishing) -----------------------------------------
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

    def retry_failures(self, names: list[str] | None = None) -> list[str]:
        """Forget the recorded failures of ``names`` (None: all), so the shards are made again
        when next asked for; the names whose record went."""
        if self.read_only:
            return []
        return self._failures.retry(names)

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
        record_recipe(tmp, recipe, self.root, self._notices)

    def _publish(self, tmp: str, name: str) -> tuple[str, Any]:
        """Move a finished, validated temp file into place, pinned: ``(path, pin)``."""
        return self._publish_file(tmp, name)

    # -- bounding the cache: what its CacheRoom asks of it (room.Shelf) ----------------------
    def _make_room(self, name: str, size: int, replacing: bool = True) -> bool:
        """Make room for one more shard of ``size`` bytes (see :meth:`CacheRoom.make`; never
        waits); ``replacing``: it replaces the cached shard of the same key, which then does
        not count. Whether it fits."""
        replaced = {self._final(name, suffix) for suffix in SUFFIXES} if replacing else set()
        return self._room.make(self, name, size, replaced)

    def listing(self) -> list[tuple[float, str, int]]:
        """(last used, path, bytes) of every finished shard. A last-used time in the future
        (a skewed clock, a restored backup) is reset to now, once, so that the shard ages."""
        return list_shards(self.root, self._notices)

    def try_evict(self, path: str) -> bool:
        """Delete a finished shard unless someone has it pinned; True if it went."""
        return evict_if_unread(path)
