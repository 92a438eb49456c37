"""The cache contract: what a source asks of a shard cache, local or remote.

:class:`ShardCache` is a :class:`typing.Protocol`; :class:`~.local.LocalShardCache` and
:class:`~.remote.RemoteShardCache` implement it, and ``make_cache`` is typed to return it, so
mypy refuses an implementation whose methods drift from the contract (a ``num_samples`` that
lost its ``recipe`` argument raised a ``TypeError`` in ``len(loader)`` only at run time).

A shard handed out by :meth:`ShardCache.pinned` or being read in :meth:`ShardCache.reading`
is *pinned*: no eviction removes it, in any process (a shared ``flock`` on a local file) or at
least in this one (an object store has no locks). Pins last while a shard is made and read,
milliseconds to seconds, so a cache that must make room waits for its own (bounded by
``lock_timeout``) rather than exceed ``cache_limit``; never for another process's, which count
against that process's limit (see :mod:`.room`).
"""
from __future__ import annotations

from typing import Any, Callable, ContextManager, Mapping, Optional, Protocol, Tuple

__all__ = ["Create", "Recipe", "ShardCache"]

Recipe = Optional[Mapping[str, Any]]
#: Writes a shard to a validated temp file in the cache's ``root`` and returns its path.
Create = Callable[[], str]


class ShardCache(Protocol):
    """Finished shards by name; one process makes a name at a time; bounded by ``cache_limit``.

    Attributes:
        root: A local directory for temp files: generators write shards there before they are
            published (for a remote cache, before the upload).
    """

    root: str

    def temp_path(self, name: str, suffix: str) -> str:
        """A fresh temp path in ``root`` for a generation of ``name``."""

    def lookup(self, name: str) -> str | None:
        """Where the finished shard for ``name`` is (a path or an object name), or None."""

    def num_samples(self, name: str, recipe: Recipe = None) -> int | None:
        """Samples of a cached shard made by ``recipe``, if known without reading it."""

    def pinned(self, name: str, create: Create,
               recipe: Recipe = None) -> ContextManager[Tuple[str, bool]]:
        """Make sure the shard is cached, and keep it from eviction for the with-block:
        ``(path, cache_hit)``. A shard missing, or stale for ``recipe``, is made by ``create``
        under a lock that keeps other processes on this host from making it too."""

    def get_or_create(self, name: str, create: Create,
                      recipe: Recipe = None) -> Tuple[str, bool]:
        """As :meth:`pinned`, unpinned once it returns (a remote executor's worker makes the
        shard; the loading side reads it)."""

    def reading(self, path: str) -> ContextManager[str]:
        """A local file to load a finished shard from, pinned while the with-block runs;
        ``FileNotFoundError`` if it was evicted meanwhile."""

    def evict(self, path: str) -> None:
        """Remove a finished shard (it is unreadable); gone already is fine."""

    def retry_failures(self, names: list[str] | None = None) -> list[str]:
        """Forget the failures recorded for ``names`` (None: all): they are made again when
        next asked for. The names whose record went (none where failures are not recorded)."""

    def recorded_sizes(self) -> Mapping[str, Mapping[str, Any]]:
        """Shard name -> ``{"samples", "recipe"}`` recorded when the cache was filled ahead."""

    def record_sizes(self, sizes: Mapping[str, Mapping[str, Any]]) -> None:
        """Add to the sizes recorded (``gluon-stream generate``)."""
