"""A ``cache_dir`` on an fsspec filesystem (``s3://``, ``gcs://``, ``memory://``).

Shards are generated into a temp file on this host, validated, then uploaded so that an object
appears whole: object stores (S3, GCS, Azure) publish an upload atomically; on other
filesystems the shard is uploaded to a hidden temp name and moved into place. No reader sees
part of a shard. The per-key lock (a local file per cache URL, shared by this host's
processes) keeps one process per host generating a key; hosts may make the same shard twice
(same result).

Filesystems cache their listings (s3fs keeps every directory it listed), so what this process
believes about a shard is refreshed where it matters: under the key's lock before deciding to
make a shard (another process on the host may just have uploaded it), when a shard it believed
cached turns out to be gone (another process evicted it), and before eviction lists the cache.

Object stores have no file locks: eviction cannot see readers in other processes, so it spares
only the shards this process is reading or has just made, and a reader whose shard vanished
makes it again. With ``cache_limit``, room is made before each upload, under the eviction lock
(per host): the processes of one host never exceed the limit; several hosts each count their
own uploads. Objects carry no extended attributes, so what made a shard is not recorded: a
changed generator is not detected here (one WARNING per cache); delete the objects when the
generator changes. Recency is the objects' upload times, as the store's clock gives them: most
stores cannot mark an object used without rewriting it, and fsspec's ``touch`` would create an
empty object where another process just evicted one.

Failures of the store itself (a dead endpoint, refused credentials) are raised as
:class:`~gluon_stream.ShardError` naming the shard's key and URL; how long the backend retries
first is its own setting (for S3: ``AWS_MAX_ATTEMPTS``, ``AWS_RETRY_MODE``).
"""
from __future__ import annotations

import collections
import contextlib
import hashlib
import logging
import os
import tempfile
import threading
import uuid
from typing import Any, Iterator, Mapping

from .._utils.files import TEMP_MARKER, remove_if_exists
from .._utils.fsspec import downloaded, fsspec, storage_errors
from ..errors import CorruptShard, UnsafeShard
from ..shardfile import inspect_file
from .base import Recipe
from .layout import SUFFIXES
from .local import LocalShardCache

__all__ = ["ATOMIC_UPLOADS", "RemoteShardCache"]

logger = logging.getLogger(__name__)

#: Bytes a ranged read of a shard's header fetches (an .npy header is 64 bytes to a few KiB).
HEADER_BLOCK = 1 << 16
#: Protocols whose uploads appear whole or not at all (an object store's PUT).
ATOMIC_UPLOADS = frozenset({"s3", "s3a", "gs", "gcs", "abfs", "abfss", "az", "adl", "oss"})


class RemoteShardCache(LocalShardCache):
    """Finished shards as objects under ``url``; temp and lock files in a local directory.

    Implements :class:`~gluon_stream._cache.ShardCache`; takes the arguments of
    :class:`~gluon_stream._cache.LocalShardCache`, with ``url`` for its directory. Nothing is
    read or written on the store until the first shard is asked for.
    """

    #: No failure records: ``root`` is a directory of this host, which other hosts do not see.
    remembers_failures = False

    def __init__(self, url: str, lock_timeout: float, closed: threading.Event | None = None,
                 limit: int | str | None = None, on_change: str = "regenerate") -> None:
        self.fs, path = fsspec().core.url_to_fs(url)
        self.remote_root = path.rstrip("/")
        self.url = url
        protocols = self.fs.protocol if isinstance(self.fs.protocol, (tuple, list)) \
            else (self.fs.protocol,)
        self._atomic = bool(ATOMIC_UPLOADS.intersection(protocols))
        self._root_made = False
        self._pins: collections.Counter[str] = collections.Counter()
        self._pins_lock = threading.Lock()  # pins and sizes
        self._sizes: dict[str, int] = {}  # object path -> samples, read from its header
        digest = hashlib.sha1(url.encode("utf-8")).hexdigest()[:16]
        local = os.path.join(tempfile.gettempdir(), "gluon_stream_cache", digest)
        super().__init__(local, lock_timeout, closed, limit, on_change)

    def __getstate__(self) -> dict:
        """Picklable: pins stay with the process that holds them."""
        state = super().__getstate__()
        del state["_pins_lock"]
        state["_pins"] = collections.Counter()
        state["_sizes"] = {}
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._pins_lock = threading.Lock()

    def _final(self, name: str, suffix: str) -> str:
        return f"{self.remote_root}/{name}{suffix}"

    def where(self) -> str:
        return self.url

    def _shown(self, path: str) -> str:
        """An object's URL, for messages."""
        return str(self.fs.unstrip_protocol(path))

    def lookup(self, name: str) -> str | None:
        for suffix in SUFFIXES:
            path = self._final(name, suffix)
            with storage_errors(self._shown(path), name, "looking up"):
                if self.fs.exists(path):
                    return path
        return None

    def _refresh(self, name: str) -> None:
        """Drop the filesystem's cached listing of this shard's objects (and their parents):
        another process may have uploaded or evicted them since it was listed."""
        for suffix in SUFFIXES:
            self.fs.invalidate_cache(self._final(name, suffix))
            self._forget_size(self._final(name, suffix))

    def recipe_of(self, path: str) -> dict | None:
        return None  # objects carry no extended attributes: nothing was recorded

    def _record(self, tmp: str, recipe: Recipe) -> None:
        self._note_unrecorded(tmp)

    def _note_unrecorded(self, path: str) -> None:
        self.tell_once("no-xattr", logging.WARNING,
                       "fsspec cache %s cannot record what made its shards: a changed command, "
                       "env= or version= is not detected there; delete its objects when the "
                       "generator changes", self.url)

    def num_samples(self, name: str, recipe: Recipe = None) -> int | None:
        """Samples of a cached shard from its header, as a local cache reads them: read in
        place, by ranged reads of a few KiB (the ``.npy`` header, an ``.npz``'s directory and
        its members' headers), never the shard's data; None if it is not cached. Remembered
        per object until this process makes, evicts or refreshes it. A damaged object counts
        as unknown here: producing it makes it again."""
        path = self.fresh(name, recipe)
        if path is None:
            return None
        with self._pins_lock:
            known = self._sizes.get(path)
        if known is not None:
            return known
        shown = self._shown(path)
        try:
            with storage_errors(shown, name, "reading the header of"):
                with self.fs.open(path, "rb", block_size=HEADER_BLOCK) as fp:
                    size = getattr(fp, "size", None)
                    if size is None:
                        size = fp.seek(0, os.SEEK_END)
                        fp.seek(0)
                    samples = inspect_file(fp, int(size), shown)[0].shape[0]
        except FileNotFoundError:  # evicted since the lookup: unknown until made again
            self.fs.invalidate_cache(path)
            return None
        except (CorruptShard, UnsafeShard) as exc:
            logger.debug("size of %s unknown (%s): the shard is made again when produced",
                         shown, exc)
            return None
        with self._pins_lock:
            self._sizes[path] = samples
        return samples

    def _forget_size(self, path: str) -> None:
        with self._pins_lock:
            self._sizes.pop(path, None)

    def recorded_sizes(self) -> dict[str, dict]:
        """None recorded: ``gluon-stream generate`` fills local caches only."""
        return {}

    def record_sizes(self, sizes: Mapping[str, Mapping[str, Any]]) -> None:
        raise NotImplementedError("sizes are recorded for local cache directories only")

    # -- pins: this process only (an object store has no locks) -----------------------------
    def _pin(self, path: str) -> Any:
        with self._pins_lock:
            self._pins[path] += 1
        return path

    def _unpin(self, pin: Any) -> None:
        if pin is None:
            return
        with self._pins_lock:
            self._pins[pin] -= 1
            if self._pins[pin] <= 0:
                del self._pins[pin]

    def pinned_here(self, path: str) -> bool:
        with self._pins_lock:
            return self._pins[path] > 0

    # -- reading -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def reading(self, path: str) -> Iterator[str]:
        """Download the shard to a private temp file for validation; removed afterwards.

        The copy's name carries this pid, so another process's stale-temp cleanup spares it.
        A shard gone from the store raises FileNotFoundError, and this process forgets its
        listing of it. Objects are not touched (see the module docstring).
        """
        shown = self._shown(path)
        name = path.rsplit("/", 1)[-1].rsplit(".", 1)[0]
        pin = self._pin(path)
        try:
            with downloaded(self.fs, path, shown, self.root, f".fetch.{os.getpid()}.",
                            key=name) as local:
                yield local
        except FileNotFoundError:
            self.fs.invalidate_cache(path)
            raise
        finally:
            self._unpin(pin)

    # -- publishing ------------------------------------------------------------------------------
    def _publish(self, tmp: str, name: str) -> tuple[str, Any]:
        """Upload a finished temp file (then removed) after making room for it: (path, pin)."""
        suffix = os.path.splitext(tmp)[1]
        final = self._final(name, suffix)
        self._forget_size(final)
        try:
            with self._room_for(name, os.path.getsize(tmp)):
                with storage_errors(self._shown(final), name, "uploading to"):
                    self._upload(tmp, final)
                    for other in SUFFIXES:
                        if other != suffix:
                            self._remove(self._final(name, other))
                return final, self._pin(final)
        finally:
            remove_if_exists(tmp)

    def _upload(self, tmp: str, final: str) -> None:
        """Put ``tmp`` at ``final`` so that readers see all of it or nothing."""
        if not self._root_made:
            self.fs.makedirs(self.remote_root, exist_ok=True)
            self._root_made = True
        if self._atomic:
            self.fs.put_file(tmp, final)
            return
        staged = (f"{self.remote_root}/.{os.path.basename(final)}.{os.getpid()}."
                  f"{uuid.uuid4().hex[:8]}{TEMP_MARKER}")
        self.fs.put_file(tmp, staged)
        try:
            self.fs.mv(staged, final)
        except BaseException:
            self._remove(staged)
            raise

    def _remove(self, path: str) -> None:
        """Delete an object that may already be gone."""
        self._forget_size(path)
        try:
            self.fs.rm(path)
        except FileNotFoundError:
            logger.debug("%s already removed", path)

    # -- bounding the cache ----------------------------------------------------------------------
    def _make_room(self, name: str, size: int, replacing: bool = True) -> bool:
        with storage_errors(self.url, name, "making room in"):
            return super()._make_room(name, size, replacing)

    def listing(self) -> list[tuple[float, str, int]]:
        """(last modified, path, bytes) of every finished shard, listed afresh."""
        self.fs.invalidate_cache(self.remote_root)
        try:
            entries = self.fs.ls(self.remote_root, detail=True)
        except FileNotFoundError:
            return []
        shards = []
        for info in entries:
            name = info["name"].rstrip("/").rsplit("/", 1)[-1]
            if info.get("type") == "file" and name.endswith(SUFFIXES) \
                    and not name.startswith("."):
                shards.append((_stamp(info), info["name"], int(info.get("size") or 0)))
        return shards

    def try_evict(self, path: str) -> bool:
        """Delete an object unless this process is reading it or has just made it (readers in
        other processes are not seen: they make the shard again)."""
        if self.pinned_here(path):
            return False
        self._remove(path)
        return True

    def evict(self, path: str) -> None:
        with storage_errors(self._shown(path), None, "deleting"):
            self._remove(path)


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
