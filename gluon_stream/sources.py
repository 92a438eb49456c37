"""Shard sources: turn shard keys into arrays, generating shard files on demand.

* :class:`CommandSource` runs an external program per key (argv only, never a shell).
* :class:`FunctionSource` calls a Python function per key.
* :class:`FileSource` reads existing ``.npy`` / ``.npz`` files.

Keys are a sequence, an (endless) iterator, or a callable ``keys(epoch)`` that returns
that epoch's keys. Sources are thread-safe: a :class:`~gluon_stream.ShardStream` calls
:meth:`Source.produce` from several producer threads at once.
"""
from __future__ import annotations

import contextlib
import fcntl
import glob
import logging
import os
import re
import selectors
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence, Union

import numpy as np
from filelock import FileLock
from filelock import Timeout as LockTimeout

from ._closing import Closing
from .errors import (
    CorruptShard,
    LoaderClosed,
    ShardError,
    ShardTimeout,
    StreamError,
    UnsafeShard,
)
from .shardfile import (
    TEMP_MARKER,
    inspect_shard,
    load_shard,
    normalize_arrays,
    write_shard,
)

__all__ = ["CommandSource", "FileSource", "FunctionSource", "RawShard", "Source", "validate_key"]

logger = logging.getLogger(__name__)

Keys = Union[Sequence[Any], Iterable[Any], Callable[[int], Iterable[Any]]]

_TOKEN = re.compile(r"\{(?:key|path|epoch)\}")
_KEY_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:=+@,-]*")
MAX_KEY_LENGTH = 200
STDERR_TAIL_BYTES = 4096
WAIT_SLICE_S = 0.5  # how often a blocked wait re-checks close()
_DISK_FULL_HINTS = ("No space left on device", "ENOSPC", "[Errno 28]", "Disk quota exceeded")
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?i?B)\s*", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12,
          "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}
LOAD_ATTEMPTS = 3  # a shard evicted by another process between lookup and load is made again


def parse_cache_limit(limit: int | str | None) -> tuple[int | None, int | None]:
    """``cache_limit`` as (max shards, max bytes): an int counts shards, ``'20GB'`` is bytes."""
    if limit is None:
        return None, None
    if isinstance(limit, bool):
        raise ValueError(f"cache_limit must be a shard count or a size like '20GB', got {limit!r}")
    if isinstance(limit, int):
        if limit < 1:
            raise ValueError(f"cache_limit must keep at least 1 shard, got {limit!r}")
        return limit, None
    match = _SIZE.fullmatch(str(limit))
    if not match:
        raise ValueError(f"cache_limit must be a shard count or a size like '20GB', '500MB', "
                         f"'1.5GiB', got {limit!r}")
    size = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if size < 1:
        raise ValueError(f"cache_limit must be positive, got {limit!r}")
    return None, size


def validate_key(key: Any) -> str:
    """Return ``str(key)`` if it is safe as a file name and a command argument, else raise ValueError.

    Allowed: letters, digits and ``_ . : = + @ , -``, not starting with ``-`` or ``.``,
    at most 200 characters. Dates (``datetime.date``) and integers pass as they are.
    """
    text = str(key)
    if not text or len(text) > MAX_KEY_LENGTH or not _KEY_PATTERN.fullmatch(text) or ".." in text:
        raise ValueError(
            f"shard key {text[:80]!r} is not allowed: keys become file names and command "
            f"arguments, so they must be 1-{MAX_KEY_LENGTH} characters of letters, digits and "
            "'_.:=+@,-', must not start with '-' or '.', and must not contain '..', path "
            "separators, spaces, shell characters or NUL"
        )
    return text


@dataclass
class RawShard:
    """One produced shard before the user's transform: arrays plus where they came from."""

    key: Any
    epoch: int
    arrays: tuple
    path: str | None = None
    cache_hit: bool = False
    generate_s: float = 0.0
    load_s: float = 0.0


def _is_iterator(obj: Any) -> bool:
    return iter(obj) is obj


class Source(Closing):
    """Base class: maps an epoch to its keys and a key to a :class:`RawShard`.

    Subclasses implement :meth:`produce`; they may override :meth:`num_samples` when
    the sample count is known without loading (file headers).
    """

    def __init__(self, keys: Keys) -> None:
        if keys is None or isinstance(keys, (str, bytes)):
            raise TypeError(f"keys must be a sequence, an iterator or a callable keys(epoch), "
                            f"got {type(keys).__name__}")
        self._keys = keys
        self._closed = threading.Event()

    def keys_for_epoch(self, epoch: int) -> tuple[Iterable[Any], bool]:
        """Return (keys, finite) for ``epoch``; an iterator is drawn lazily and is not finite."""
        keys = self._keys(epoch) if callable(self._keys) else self._keys
        if _is_iterator(keys):
            return keys, False
        return list(keys), True

    def produce(self, key: Any, epoch: int, executor: Any = None) -> RawShard:
        """The shard's raw arrays; ``executor`` (a ``concurrent.futures.Executor``) may run
        the generation elsewhere."""
        raise NotImplementedError  # pragma: no cover - abstract

    def num_samples(self, key: Any, epoch: int) -> int | None:
        """Sample count of a shard if known without producing it, else None."""
        return None

    def _check_open(self) -> None:
        if self._closed.is_set():
            raise LoaderClosed(f"{type(self).__name__} is closed")

    def close(self) -> None:
        """Stop running work; further use raises LoaderClosed. Idempotent."""
        self._closed.set()


class _ShardCache:
    """A directory of finished shard files, filled atomically under per-key file locks.

    Layout: ``<key>.npy``/``<key>.npz`` finished shards, ``.<key>.<pid>.<rand>.tmp.npy`` a
    generation in progress, ``.<key>.lock`` the per-key cross-process lock (removed by its
    holder once the shard is in place).
    """

    SUFFIXES = (".npy", ".npz")

    def __init__(self, cache_dir: str | os.PathLike, lock_timeout: float,
                 closed: threading.Event | None = None, limit: int | str | None = None) -> None:
        if lock_timeout <= 0:
            raise ValueError(f"lock_timeout must be positive seconds, got {lock_timeout!r}")
        self.max_shards, self.max_bytes = parse_cache_limit(limit)
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

    @contextlib.contextmanager
    def reading(self, path: str) -> Any:
        """Hold a shared lock on a finished shard while it is read: eviction skips it.

        Raises FileNotFoundError when the shard was evicted before the lock was taken.
        """
        with open(path, "rb") as fp:
            fcntl.flock(fp.fileno(), fcntl.LOCK_SH)
            if os.fstat(fp.fileno()).st_ino != os.stat(path).st_ino:
                raise FileNotFoundError(path)  # replaced: read the new one instead
            os.utime(path)  # least recently used goes first
            yield path

    def enforce_limit(self, keep: str) -> None:
        """Evict least recently used shards until the cache fits ``cache_limit``.

        Shards held by a reader anywhere (a shared lock) and ``keep`` are never evicted;
        one process evicts at a time.
        """
        if self.max_shards is None and self.max_bytes is None:
            return
        lock = self.lock("cache-evict")
        with lock:
            shards = sorted(self._listing())
            count, total = len(shards), sum(size for _, _, size in shards)
            for _, path, size in shards:
                if not self._over(count, total):
                    break
                if path.rstrip("/") == keep.rstrip("/") or not self._try_evict(path):
                    continue
                count, total = count - 1, total - size
                logger.info("cache_limit: evicted %s (%d shards, %d bytes left)", path, count,
                            total)
            _unlink_missing_ok(lock.lock_file)

    def _listing(self) -> list[tuple[float, str, int]]:
        """(last used, path, bytes) of every finished shard."""
        shards = []
        for entry in os.scandir(self.root):
            if entry.name.startswith(".") or not entry.name.endswith(self.SUFFIXES):
                continue
            with contextlib.suppress(FileNotFoundError):
                info = entry.stat(follow_symlinks=False)
                shards.append((info.st_mtime, entry.path, info.st_size))
        return shards

    def _try_evict(self, path: str) -> bool:
        return _evict_if_unread(path)

    def _over(self, count: int, total: int) -> bool:
        return ((self.max_shards is not None and count > self.max_shards)
                or (self.max_bytes is not None and total > self.max_bytes))

    def _remove_stale_temps(self) -> None:
        """Delete temp files left by crashed runs (their writer's pid is gone)."""
        for path in glob.glob(os.path.join(glob.escape(self.root), f".*{TEMP_MARKER}*")):
            match = re.search(r"\.(\d+)\.[^.]+" + re.escape(TEMP_MARKER), os.path.basename(path))
            if match and _pid_alive(int(match.group(1))):
                continue
            logger.info("removing temp file %s left by a crashed run", path)
            _unlink_missing_ok(path)

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
                _unlink_missing_ok(path)
            finally:
                lock.release()

    def path_for(self, name: str, suffix: str) -> str:
        path = os.path.join(self.root, name + suffix)
        if os.path.dirname(os.path.abspath(path)) != self.root:
            raise ValueError(f"shard name {name!r} escapes the cache directory {self.root!r}")
        return path

    def lookup(self, name: str) -> str | None:
        """Path of a finished shard for ``name``, or None. Symlinks are never followed."""
        for suffix in self.SUFFIXES:
            path = self.path_for(name, suffix)
            if os.path.islink(path):
                raise UnsafeShard(f"cached shard {path!r} is a symlink; gluon_stream does not follow "
                                  "links in its cache. Remove it", path=path)
            if os.path.exists(path):
                return path
        return None

    def temp_path(self, name: str, suffix: str) -> str:
        return os.path.join(self.root, f".{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
                                        f"{TEMP_MARKER}{suffix}")

    def lock(self, name: str) -> FileLock:
        return FileLock(os.path.join(self.root, f".{name}.lock"), timeout=self.lock_timeout)

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
                _unlink_missing_ok(tmp)
                raise UnsafeShard(f"shard {name!r}: the generator left a symlink at {tmp!r}; "
                                  "gluon_stream does not follow links in its cache. Write the "
                                  "shard itself to the '{path}' argument", path=tmp)
            return self._publish(tmp, name), False
        finally:
            _unlink_missing_ok(lock.lock_file)  # while held: late waiters see the finished file
            lock.release()

    def _publish(self, tmp: str, name: str) -> str:
        """Move a finished, validated temp file into place; readers see all of it or nothing."""
        final = self.path_for(name, os.path.splitext(tmp)[1])
        os.replace(tmp, final)
        return final

    def num_samples(self, name: str) -> int | None:
        path = self.lookup(name)
        return None if path is None else inspect_shard(path)[0].shape[0]

    def evict(self, path: str) -> None:
        _unlink_missing_ok(path)


class _RemoteShardCache(_ShardCache):
    """A ``cache_dir`` on an fsspec filesystem (``s3://``, ``gcs://``, ``memory://``).

    Shards are generated into a temp file on this host (``root``, a directory per cache URL
    shared by this host's processes, holding temp and lock files), validated, then uploaded:
    an object appears whole, so no reader sees part of a shard. The per-key lock keeps one
    process per host generating a key; hosts may make the same shard twice (same result).
    Object stores have no file locks: eviction cannot see readers elsewhere, and a reader whose
    shard vanished makes it again.
    """

    def __init__(self, url: str, lock_timeout: float, closed: threading.Event | None = None,
                 limit: int | str | None = None) -> None:
        import hashlib

        self.fs, path = _fsspec().core.url_to_fs(url)
        self.remote_root = path.rstrip("/")
        self.fs.makedirs(self.remote_root, exist_ok=True)
        digest = hashlib.sha1(url.encode("utf-8")).hexdigest()[:16]
        local = os.path.join(tempfile.gettempdir(), "gluon_stream_cache", digest)
        super().__init__(local, lock_timeout, closed, limit)

    def _remote(self, name: str, suffix: str) -> str:
        return f"{self.remote_root}/{name}{suffix}"

    def lookup(self, name: str) -> str | None:
        for suffix in self.SUFFIXES:
            if self.fs.exists(self._remote(name, suffix)):
                return self._remote(name, suffix)
        return None

    def _publish(self, tmp: str, name: str) -> str:
        final = self._remote(name, os.path.splitext(tmp)[1])
        try:
            self.fs.put_file(tmp, final)
        finally:
            _unlink_missing_ok(tmp)
        return final

    @contextlib.contextmanager
    def reading(self, path: str) -> Any:
        """Download the shard to a private temp file for validation; removed afterwards.

        The copy's name carries this pid, so another process's stale-temp cleanup spares it.
        """
        shown = self.fs.unstrip_protocol(path)
        with _downloaded(self.fs, path, shown, self.root, f".fetch.{os.getpid()}.") as local:
            with contextlib.suppress(NotImplementedError, OSError, ValueError):
                self.fs.touch(path, truncate=False)  # least recently used goes first, if it can
            yield local

    def num_samples(self, name: str) -> int | None:
        return None  # known after the first pass, without downloading every shard twice

    def _listing(self) -> list[tuple[float, str, int]]:
        shards = []
        for info in self.fs.ls(self.remote_root, detail=True):
            name = info["name"].rstrip("/").rsplit("/", 1)[-1]
            if info.get("type") == "file" and name.endswith(self.SUFFIXES):
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


def _make_cache(cache_dir: str | os.PathLike, lock_timeout: float, closed: threading.Event,
                limit: int | str | None) -> _ShardCache:
    """A local cache directory, or an fsspec URL (``file://`` is a local directory)."""
    where = _local_or_url(os.fspath(cache_dir))
    if _is_url(where):
        return _RemoteShardCache(where, lock_timeout, closed, limit)
    return _ShardCache(where, lock_timeout, closed, limit)


def _evict_if_unread(path: str) -> bool:
    """Delete a shard unless someone holds a shared lock on it (is reading it)."""
    try:
        fp = open(path, "rb")
    except FileNotFoundError:
        return False
    with fp:
        try:
            fcntl.flock(fp.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        _unlink_missing_ok(path)
        return True


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _unlink_missing_ok(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        logger.debug("%s already removed", path)


class _CachingSource(Source):
    """Shared logic of sources that may write shards into a cache directory."""

    def __init__(self, keys: Keys, cache_dir: str | os.PathLike | None, lock_timeout: float,
                 mmap: bool, cache_limit: int | str | None = None) -> None:
        super().__init__(keys)
        if cache_limit is not None and cache_dir is None:
            raise ValueError("cache_limit needs a cache_dir")
        self._cache = (_make_cache(cache_dir, lock_timeout, self._closed, cache_limit)
                       if cache_dir is not None else None)
        self._mmap = mmap

    def __getstate__(self) -> dict:
        """Picklable for a remote executor: configuration only, no threads or processes."""
        state = dict(self.__dict__)
        for name in ("_closed", "_procs", "_procs_lock"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._closed = threading.Event()
        if "command" in state:
            self._procs, self._procs_lock = set(), threading.Lock()

    def _create(self, key: Any, epoch: int) -> str:  # pragma: no cover - abstract
        """Write the shard for ``key`` to a validated temp file in the cache; return its path."""
        raise NotImplementedError

    def ensure_file(self, key: Any, epoch: int) -> tuple[str, bool, float]:
        """Make sure the shard is in the cache: (path, cache_hit, seconds).

        Runs wherever ``cache_dir`` is visible, e.g. on a dask worker of a shared filesystem.
        """
        name = self._shard_name(key, epoch)
        t0 = time.perf_counter()
        path, hit = self._cache.get_or_create(name, lambda: self._create(key, epoch))
        if not hit:
            self._cache.enforce_limit(keep=path)
        return path, hit, time.perf_counter() - t0

    def produce(self, key: Any, epoch: int, executor: Any = None) -> RawShard:
        """Generate (locally, or on ``executor``) unless cached, then load and validate."""
        self._check_open()
        validate_key(key)
        if executor is None:
            return self._load_cached(key, epoch, self.ensure_file)
        return self._load_cached(
            key, epoch, lambda k, e: executor.submit(_ensure_remote, self, k, e).result())

    def keys_for_epoch(self, epoch: int) -> tuple[Iterable[Any], bool]:
        """As :meth:`Source.keys_for_epoch`; finite keys of a cache are all validated up front.

        Keys become file names (and command arguments), so a hostile key fails the epoch
        before any shard is produced; keys drawn from an iterator are checked one by one.
        """
        keys, finite = super().keys_for_epoch(epoch)
        if finite and self._cache is not None:
            for key in keys:
                validate_key(key)
        return keys, finite

    def _shard_name(self, key: Any, epoch: int) -> str:
        return validate_key(key)

    def num_samples(self, key: Any, epoch: int) -> int | None:
        if self._cache is None:
            return None
        return self._cache.num_samples(self._shard_name(key, epoch))

    def _load_cached(self, key: Any, epoch: int,
                     ensure: Callable[[Any, int], tuple[str, bool, float]]) -> RawShard:
        """``ensure`` the file, then load it under a shared lock (so no process evicts it)."""
        assert self._cache is not None
        generate_s = 0.0
        for attempt in range(LOAD_ATTEMPTS):
            path, hit, seconds = ensure(key, epoch)
            generate_s += seconds
            t1 = time.perf_counter()
            try:
                with self._cache.reading(path) as local:
                    arrays = load_shard(local, mmap=self._mmap)
            except FileNotFoundError:
                logger.info("shard %r was evicted before it could be read; making it again", key)
                continue
            except (CorruptShard, UnsafeShard):
                self._cache.evict(path)
                if not hit or attempt:
                    raise
                logger.warning("cached shard %s for key %r is unreadable; deleted it, "
                               "regenerating", path, key)
                continue
            return RawShard(key, epoch, arrays, path, hit, generate_s, time.perf_counter() - t1)
        raise ShardError(f"shard {key!r}: evicted {LOAD_ATTEMPTS} times before it could be read; "
                         "raise cache_limit above the number of shards in flight", key=key)


class CommandSource(_CachingSource):
    """Generate each shard by running an external program.

    Args:
        keys: Shard keys (sequence, iterator, or ``keys(epoch)``).
        command: Argument vector; ``{key}``, ``{path}`` and ``{epoch}`` are replaced per shard.
            The program must write the shard to ``{path}`` (a temporary file in ``cache_dir``
            that is renamed into place only once complete and valid). Never run through a shell.
        cache_dir: Directory of finished shards; keys already there are not regenerated.
            With ``{epoch}`` in the command, shards are cached per (key, epoch).
        timeout: Seconds one run may take before its whole process group is killed.
        retries: Extra attempts after a failed run, with exponential backoff.
        backoff: Seconds before the first retry (doubling each time).
        suffix: ``.npy`` or ``.npz``: what the program writes.
        env: Environment for the program (default: inherited).
        lock_timeout: Seconds to wait for another process generating the same key.
        mmap: Memory-map loaded ``.npy`` files.

    Example:
        >>> src = CommandSource(["2024-01-01"], ["./gen", "--date", "{key}", "--out", "{path}"],
        ...                     cache_dir="shards")  # doctest: +SKIP
    """

    def __init__(self, keys: Keys, command: Sequence[str], *, cache_dir: str | os.PathLike,
                 timeout: float | None = 600.0, retries: int = 2, backoff: float = 0.5,
                 suffix: str = ".npy", env: dict | None = None, lock_timeout: float = 3600.0,
                 mmap: bool = False, cache_limit: int | str | None = None) -> None:
        if isinstance(command, (str, bytes)) or not command:
            raise TypeError("command must be a non-empty list of arguments (argv), e.g. "
                            "['./gen', '--date', '{key}', '--out', '{path}']; it never runs in a shell")
        if not any("{path}" in str(arg) for arg in command):
            raise ValueError("command must contain '{path}': the program writes the shard there")
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries!r}")
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout must be positive seconds or None, got {timeout!r}")
        if suffix not in _ShardCache.SUFFIXES:
            raise ValueError(f"suffix must be '.npy' or '.npz', got {suffix!r}")
        if cache_dir is None:
            raise ValueError("CommandSource needs a cache_dir: the program writes files there")
        super().__init__(keys, cache_dir, lock_timeout, mmap, cache_limit)
        self.command = [str(arg) for arg in command]
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self.suffix = suffix
        self.env = env
        self._per_epoch = any("{epoch}" in arg for arg in self.command)
        self._procs: set[subprocess.Popen] = set()
        self._procs_lock = threading.Lock()

    def _shard_name(self, key: Any, epoch: int) -> str:
        name = validate_key(key)
        return f"{name}@e{epoch}" if self._per_epoch else name

    def argv_for(self, key: Any, epoch: int, path: str) -> list[str]:
        """The argument vector for one run (tokens replaced literally, no other formatting)."""
        values = {"{key}": validate_key(key), "{path}": path, "{epoch}": str(epoch)}
        # one pass, so a token inside a substituted value (a cache_dir named '{epoch}') stays
        return [_TOKEN.sub(lambda m: values[m.group(0)], arg) for arg in self.command]

    def _create(self, key: Any, epoch: int) -> str:
        name = self._shard_name(key, epoch)
        attempts = self.retries + 1
        for attempt in range(attempts):
            tmp = self._cache.temp_path(name, self.suffix)
            try:
                self._run_once(key, epoch, tmp)
                if not os.path.islink(tmp):
                    inspect_shard(tmp)
                return tmp
            except (ShardError, CorruptShard, UnsafeShard) as exc:
                _unlink_missing_ok(tmp)
                self._check_open()
                final = (attempt + 1 == attempts or isinstance(exc, UnsafeShard)
                         or getattr(exc, "disk_full", False))
                if final:
                    if attempt and isinstance(exc, ShardError) and exc.args:
                        exc.args = (f"{exc.args[0]}\n(gave up after {attempt + 1} attempts; "
                                    "retries= sets how many)",)
                    raise
                delay = self.backoff * (2 ** attempt)
                logger.warning("shard %r: attempt %d/%d failed (%s); retrying in %.1f s",
                               key, attempt + 1, attempts, exc, delay)
                if self._closed.wait(delay):
                    self._check_open()
            except BaseException:
                _unlink_missing_ok(tmp)
                raise
        raise AssertionError("unreachable")

    def _run_once(self, key: Any, epoch: int, tmp: str) -> None:
        """Run the generator once: argv only, stdin closed, own session, stderr tail kept."""
        argv = self.argv_for(key, epoch, tmp)
        read_fd, write_fd = os.pipe()
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=write_fd, start_new_session=True, close_fds=True,
                                    env=self.env)
        except OSError as exc:
            os.close(read_fd)
            raise ShardError(f"shard {key!r}: cannot start {argv[0]!r}: {exc}; check the first "
                             "element of command (an executable path)", key=key,
                             argv=argv) from exc
        finally:
            os.close(write_fd)
        with self._procs_lock:
            self._procs.add(proc)
        tail = _TailBuffer(STDERR_TAIL_BYTES)
        try:
            timed_out = self._wait(proc, read_fd, tail)
        finally:
            _kill_group(proc)
            with self._procs_lock:
                self._procs.discard(proc)
            _drain(read_fd, tail)
            os.close(read_fd)
        self._check_open()
        text = tail.text()
        if timed_out:
            raise ShardTimeout(
                f"shard {key!r}: generator ran longer than timeout={self.timeout} s and was killed "
                f"with its process group; raise timeout= or make the program faster; command: "
                f"{argv}; stderr tail:\n{text}",
                key=key, argv=argv, returncode=proc.returncode, stderr_tail=text)
        if proc.returncode != 0:
            if any(hint in text for hint in _DISK_FULL_HINTS):
                raise ShardError(
                    f"shard {key!r}: disk full: the generator failed with 'No space left on "
                    f"device' writing {tmp!r}; free space in {self._cache.root!r} or point "
                    f"cache_dir elsewhere (not retried); command: {argv}; stderr tail:\n{text}",
                    key=key, argv=argv, returncode=proc.returncode, stderr_tail=text,
                    disk_full=True)
            how = (f"killed by signal {-proc.returncode}" if proc.returncode < 0
                   else f"exit code {proc.returncode}")
            raise ShardError(f"shard {key!r}: generator failed ({how}); command: {argv}; "
                             f"stderr tail:\n{text}", key=key, argv=argv,
                             returncode=proc.returncode, stderr_tail=text)
        if not os.path.lexists(tmp):
            raise ShardError(f"shard {key!r}: generator exited 0 but wrote no file at {tmp!r} "
                             f"(it must write to the '{{path}}' argument); command: {argv}; "
                             f"stderr tail:\n{text}", key=key, argv=argv, returncode=0,
                             stderr_tail=text)

    def _wait(self, proc: subprocess.Popen, fd: int, tail: "_TailBuffer") -> bool:
        """Sleep until the generator exits, collecting stderr; True if it ran past ``timeout``.

        Blocks in ``select`` (no busy-waiting), waking at least every WAIT_SLICE_S to honour
        ``close()``. Returns as soon as the generator itself exits, even if a grandchild still
        holds its stderr open (the caller then kills the whole group).
        """
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            open_pipe = True
            while True:
                if self._closed.is_set():
                    return False
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return True
                slice_s = WAIT_SLICE_S if remaining is None else min(WAIT_SLICE_S, remaining)
                if open_pipe:
                    if sel.select(slice_s):
                        data = os.read(fd, 65536)
                        if data:
                            tail.feed(data)
                        else:
                            sel.unregister(fd)
                            open_pipe = False
                    if proc.poll() is not None:
                        return False
                else:
                    try:
                        proc.wait(timeout=slice_s)
                        return False
                    except subprocess.TimeoutExpired:
                        continue

    def close(self) -> None:
        """Kill every running generator (whole process groups); idempotent."""
        super().close()
        with self._procs_lock:
            procs = list(self._procs)
        for proc in procs:
            _kill_group(proc)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group of a generator started in its own session, then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        logger.debug("process group %d already gone", proc.pid)
    except PermissionError:
        logger.debug("process group %d is no longer ours", proc.pid)
    proc.wait()


class _TailBuffer:
    """The last ``limit`` bytes written to a pipe: bounded however much the generator writes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._buf = bytearray()

    def feed(self, data: bytes) -> None:
        self._buf += data
        if len(self._buf) > 2 * self.limit:
            del self._buf[:-self.limit]

    def text(self) -> str:
        return bytes(self._buf[-self.limit:]).decode("utf-8", errors="replace").strip()


def _drain(fd: int, tail: _TailBuffer, limit: int = 1 << 20) -> None:
    """Read what is left in a pipe whose writers are dead, without blocking."""
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        read = 0
        while read < limit and sel.select(0):
            data = os.read(fd, 65536)
            if not data:
                return
            tail.feed(data)
            read += len(data)


class FunctionSource(_CachingSource):
    """Produce each shard by calling ``fn(key)`` in a producer thread.

    ``fn`` returns an array, a tuple/list of arrays or a dict of arrays (all with the same
    first dimension). With ``cache_dir`` the result is written there atomically and later
    runs load it instead of calling ``fn``; without, ``fn`` runs every time the shard is
    needed and its arrays live only in memory while the shard is in the pipeline.

    Example:
        >>> src = FunctionSource(range(3), lambda k: np.full((4, 2), k))
        >>> src.produce(2, epoch=0).arrays[0][0].tolist()
        [2, 2]
    """

    def __init__(self, keys: Keys, fn: Callable[[Any], Any], *,
                 cache_dir: str | os.PathLike | None = None, lock_timeout: float = 3600.0,
                 mmap: bool = False, cache_limit: int | str | None = None) -> None:
        if not callable(fn):
            raise TypeError(f"fn must be callable fn(key) -> arrays, got {type(fn).__name__}")
        super().__init__(keys, cache_dir, lock_timeout, mmap, cache_limit)
        self.fn = fn

    def _call(self, key: Any) -> tuple[np.ndarray, ...]:
        try:
            value = self.fn(key)
        except StreamError:
            raise
        except Exception as exc:
            raise ShardError(f"shard {key!r}: {getattr(self.fn, '__name__', 'fn')}({key!r}) "
                             f"raised {type(exc).__name__}: {exc}", key=key) from exc
        return normalize_arrays(value, what=f"shard {key!r}")

    def produce(self, key: Any, epoch: int, executor: Any = None) -> RawShard:
        self._check_open()
        if self._cache is not None:
            return super().produce(key, epoch, executor)
        t0 = time.perf_counter()
        if executor is None:
            arrays = self._call(key)
        else:
            arrays = executor.submit(_call_remote, self, key).result()
        return RawShard(key, epoch, arrays, None, False, time.perf_counter() - t0, 0.0)

    def _create(self, key: Any, epoch: int) -> str:
        arrays = self._call(key)
        suffix = ".npy" if len(arrays) == 1 else ".npz"
        return write_shard(self._cache.temp_path(self._shard_name(key, epoch), suffix), arrays)


def _ensure_remote(source: _CachingSource, key: Any, epoch: int) -> tuple[str, bool, float]:
    """Runs on a remote executor's worker: generate the shard into the shared cache_dir."""
    return source.ensure_file(key, epoch)


def _call_remote(source: FunctionSource, key: Any) -> tuple[np.ndarray, ...]:
    """Runs on a remote executor's worker: call fn(key) there and send the arrays back."""
    return source._call(key)


def _is_url(path: str) -> bool:
    """A remote or protocol-prefixed location (``s3://``, ``memory://``), read through fsspec."""
    return "://" in path and not path.startswith("file://")


def _fsspec() -> Any:
    try:
        import fsspec
    except ImportError as exc:
        raise ImportError("reading shards from URLs needs fsspec (and its backend, e.g. s3fs): "
                          "pip install 'gluon_stream[remote]'") from exc
    return fsspec


class FileSource(Source):
    """Read existing shard files (``.npy`` / ``.npz``); each file's path is its key.

    Paths may be fsspec URLs (``s3://bucket/shards/*.npy``, ``gcs://...``, ``memory://...``,
    ``file://...``; needs ``fsspec`` and the protocol's backend): a remote shard is copied to a
    private temporary file, validated and loaded like a local one, and the copy is removed.

    Args:
        paths: A glob pattern (sorted matches), or a list of paths or URLs.
        mmap: Memory-map local ``.npy`` files instead of reading them.

    Example:
        >>> src = FileSource("shards/*.npy")  # doctest: +SKIP
    """

    def __init__(self, paths: str | os.PathLike | Sequence[str | os.PathLike], *,
                 mmap: bool = False) -> None:
        if isinstance(paths, (str, os.PathLike)):
            pattern = os.fspath(paths)
            matched = _glob_urls(pattern) if "://" in pattern else sorted(glob.glob(pattern))
            if not matched:
                raise FileNotFoundError(f"FileSource: no files match {pattern!r}")
            paths = matched
        super().__init__([_local_or_url(os.fspath(p)) for p in paths])
        self._mmap = mmap

    def produce(self, key: Any, epoch: int, executor: Any = None) -> RawShard:
        self._check_open()
        t0 = time.perf_counter()
        if _is_url(key):
            with _fetched(key) as local:
                arrays = load_shard(local)
        else:
            arrays = load_shard(key, mmap=self._mmap)
        return RawShard(key, epoch, arrays, key, True, 0.0, time.perf_counter() - t0)

    def num_samples(self, key: Any, epoch: int) -> int | None:
        if _is_url(key):
            return None  # known after the first pass, without downloading every shard twice
        return inspect_shard(key)[0].shape[0]


def _local_or_url(path: str) -> str:
    return path[len("file://"):] if path.startswith("file://") else path


def _glob_urls(pattern: str) -> list[str]:
    fs, path = _fsspec().core.url_to_fs(pattern)
    return sorted(fs.unstrip_protocol(p) for p in fs.glob(path))


@contextlib.contextmanager
def _fetched(url: str) -> Any:
    """A remote shard (a FileSource key) as a private local copy; a missing one is corrupt."""
    fs, path = _fsspec().core.url_to_fs(url)
    try:
        with _downloaded(fs, path, url) as local:
            yield local
    except FileNotFoundError as exc:
        raise CorruptShard(f"shard {url!r} does not exist", path=url,
                           reason="file does not exist") from exc


@contextlib.contextmanager
def _downloaded(fs: Any, path: str, shown: str, directory: str | None = None,
                prefix: str = "gluon_stream_fetch_") -> Any:
    """Copy a remote shard to a private temp file to validate and load it; removed afterwards.

    Errors about the copy name ``shown`` (the shard's URL), not the copy; a missing remote
    file raises FileNotFoundError.
    """
    fd, local = tempfile.mkstemp(prefix=prefix, suffix=f"{TEMP_MARKER}{os.path.splitext(path)[1]}",
                                 dir=directory)
    os.close(fd)
    try:
        fs.get_file(path, local)
        try:
            yield local
        except (CorruptShard, UnsafeShard) as exc:  # name the shard, not the private copy
            exc.args = (str(exc).replace(local, shown),)
            exc.path = shown
            raise
    finally:
        _unlink_missing_ok(local)
