"""A ``cache_dir`` on an fsspec filesystem (``s3://``, ``gcs://``, ``memory://``).

Shards are generated into a temp file on this host, validated, then uploaded: an object
appears whole, so no reader sees part of a shard. The per-key lock (a local file per cache URL,
shared by this host's processes) keeps one process per host generating a key; hosts may make
the same shard twice (same result). Object stores have no file locks: eviction cannot see
readers elsewhere, and a reader whose shard vanished makes it again. Objects carry no extended
attributes, so what made a shard is not recorded: a changed generator is not detected here
(one WARNING per cache); delete the objects when the generator changes.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import tempfile
import threading
from typing import Any, Iterator, Mapping

from .._fsspec import downloaded, fsspec
from ..shardfile import remove_if_exists
from .local import SUFFIXES, ShardCache

__all__ = ["RemoteShardCache"]


class RemoteShardCache(ShardCache):
    """Finished shards as objects under ``url``; temp and lock files in a local directory."""

    def __init__(self, url: str, lock_timeout: float, closed: threading.Event | None = None,
                 limit: int | str | None = None, on_change: str = "regenerate") -> None:
        self.fs, path = fsspec().core.url_to_fs(url)
        self.remote_root = path.rstrip("/")
        self.fs.makedirs(self.remote_root, exist_ok=True)
        digest = hashlib.sha1(url.encode("utf-8")).hexdigest()[:16]
        local = os.path.join(tempfile.gettempdir(), "gluon_stream_cache", digest)
        super().__init__(local, lock_timeout, closed, limit, on_change)
        self.url = url

    def _remote(self, name: str, suffix: str) -> str:
        return f"{self.remote_root}/{name}{suffix}"

    def lookup(self, name: str) -> str | None:
        for suffix in SUFFIXES:
            if self.fs.exists(self._remote(name, suffix)):
                return self._remote(name, suffix)
        return None

    def recipe_of(self, path: str) -> dict | None:
        return None  # objects carry no extended attributes: nothing was recorded

    def _record(self, tmp: str, recipe: Mapping[str, Any]) -> None:
        self._note_unrecorded(tmp)

    def _note_unrecorded(self, path: str) -> None:
        self._tell_once("no-xattr", logging.WARNING,
                        "fsspec cache %s cannot record what made its shards: a changed command, "
                        "env= or version= is not detected there; delete its objects when the "
                        "generator changes", self.url)

    def _publish(self, tmp: str, name: str) -> str:
        final = self._remote(name, os.path.splitext(tmp)[1])
        try:
            self.fs.put_file(tmp, final)
        finally:
            remove_if_exists(tmp)
        return final

    @contextlib.contextmanager
    def reading(self, path: str) -> Iterator[str]:
        """Download the shard to a private temp file for validation; removed afterwards.

        The copy's name carries this pid, so another process's stale-temp cleanup spares it.
        """
        shown = self.fs.unstrip_protocol(path)
        with downloaded(self.fs, path, shown, self.root, f".fetch.{os.getpid()}.") as local:
            with contextlib.suppress(NotImplementedError, OSError, ValueError):
                self.fs.touch(path, truncate=False)  # least recently used goes first, if it can
            yield local

    def num_samples(self, name: str) -> int | None:
        return None  # known after the first pass, without downloading every shard twice

    def _listing(self) -> list[tuple[float, str, int]]:
        shards = []
        for info in self.fs.ls(self.remote_root, detail=True):
            name = info["name"].rstrip("/").rsplit("/", 1)[-1]
            if info.get("type") == "file" and name.endswith(SUFFIXES):
                shards.append((_stamp(info), info["name"], int(info.get("size") or 0)))
        return shards

    def _try_evict(self, path: str) -> bool:
        self.evict(path)  # no file locks on an object store: readers elsewhere are not seen
        return True

    def evict(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(path)


def _stamp(info: dict) -> float:
    """Modification time of an fsspec listing entry, as seconds (backends name it differently)."""
    for field in ("LastModified", "mtime", "created", "updated"):
        value = info.get(field)
        if value is None:
            continue
        if hasattr(value, "timestamp"):
            return float(value.timestamp())
        with contextlib.suppress(TypeError, ValueError):
            return float(value)
    return 0.0
