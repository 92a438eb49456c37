"""Making a shard that is missing or stale: one process per key, then recorded and published.

The shard is looked for first without a lock. Otherwise the key's cross-process lock is taken
(a lock whose holder died is released by the OS, so a waiter takes over), and under it the
shard is looked for again (whoever waited finds the finished file), a failure recorded for the
same recipe is raised again (see :mod:`.failure_gate`), room is reserved (``cache_limit``, see
:mod:`.publishing`), and ``create()`` writes a validated temp file, which gets the recipe
recorded on it and is published. A ``cache_dir`` deleted meanwhile is recreated once (one
WARNING) and the shard made again; a read-only one (or one remounted read-only) cannot make
shards, which is a :class:`~gluon_stream.ShardError`.

These are steps of a :class:`~.local.LocalShardCache`, kept here by concept as the mixin
:class:`ShardMaking`, which the cache inherits: they call back the cache for what a
:class:`~.remote.RemoteShardCache` does differently (``fresh``, ``_refresh``, ``_record``,
``_publish``, its pins) and for its locks and room (``_reserve``, see :mod:`.publishing`), each
declared on the mixin so that a type checker holds them to it.
"""
from __future__ import annotations

import errno
import logging
import os
from typing import Any, Callable, ContextManager

from .._utils.files import remove_if_exists
from ..errors import ShardError, UnsafeShard
from .base import Create, Recipe
from .failure_gate import FailureGate
from .room import CacheRoom

__all__ = ["ShardMaking"]

logger = logging.getLogger(__name__)


class ShardMaking:
    """Making a missing or stale shard under its key's lock: steps of a cache, mixed into it.

    The class-level annotations are what the cache that inherits this must provide.

    Example:
        >>> class Cache(ShardMaking, ...): ...  # doctest: +SKIP
        >>> path, hit, pin = cache._ensure("a", create, recipe)  # doctest: +SKIP
    """

    root: str
    read_only: bool
    _room: CacheRoom
    _failures: FailureGate
    fresh: Callable[[str, Recipe], str | None]
    _pin: Callable[[str], Any]
    _locked: Callable[[str, Callable[[], BaseException]], ContextManager[None]]
    _lock_timeout_error: Callable[[str], BaseException]
    _refresh: Callable[[str], None]
    _reserve: Callable[[str], str | None]
    _record: Callable[[str, Recipe], None]
    _publish: Callable[[str, str], tuple[str, Any]]

    def _ensure(self, name: str, create: Create, recipe: Recipe) -> tuple[str, bool, Any]:
        """(path, cache_hit, pin) of the shard ``name``, made if missing or stale."""
        path = self.fresh(name, recipe)
        if path is not None:
            pin = self._pin(path)
            if pin is not None:
                return path, True, pin
        if self.read_only:
            raise _cannot_generate(self.root, name)
        attempt = -1
        while True:  # a second deletion of cache_dir raises
            attempt += 1
            try:
                return self._make_locked(name, create, recipe)
            except (OSError, ShardError) as exc:
                if not _deleted_meanwhile(self.root, name, exc, attempt):
                    raise

    def _make_locked(self, name: str, create: Create, recipe: Recipe) -> tuple[str, bool, Any]:
        """Under the key's lock: the shard another process made meanwhile, or a new one."""
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
            self._failures.refuse(name, recipe)
            reservation = self._reserve(name)
            try:
                return self._make_reserved(name, create, recipe)
            finally:
                self._room.release(name, reservation)

    def _make_reserved(self, name: str, create: Create, recipe: Recipe) -> tuple[str, bool, Any]:
        """Make, record and publish the shard ``name`` (under its key's lock, room reserved)."""
        try:
            tmp = create()
        except BaseException as exc:
            self._failures.remember(name, recipe, exc)
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
        self._failures.forget(name)  # made at last: a failure recorded before is old
        return path, False, pin


def _deleted_meanwhile(root: str, name: str, exc: OSError | ShardError, attempt: int) -> bool:
    """Whether making ``name`` failed with ``exc`` because ``root`` was deleted meanwhile, the
    first time (to make it again); a second time, or a read-only directory, raises."""
    if isinstance(exc, OSError) and exc.errno == errno.EROFS:
        raise _cannot_generate(root, name) from exc  # remounted read-only since
    if os.path.isdir(root):
        return False
    if attempt:
        raise ShardError(f"shard {name!r}: cache_dir {root!r} was deleted again while the "
                         "shard was made; is another program cleaning it? Point cache_dir at "
                         "a directory nothing else removes", key=name) from exc
    logger.warning("cache_dir %s was deleted while shard %r was being made; making the shard "
                   "again", root, name)
    return True


def _cannot_generate(root: str, name: str) -> ShardError:
    return ShardError(f"shard {name!r} is not in the read-only cache_dir {root!r} and cannot "
                      "be generated there; generate it where the cache is writable, or point "
                      "cache_dir at a writable directory", key=name)
