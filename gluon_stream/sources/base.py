"""The source contract: an epoch's keys, and a key to a :class:`RawShard`; the shared cache logic.

Sources are thread-safe: a :class:`~gluon_stream.ShardStream` calls :meth:`Source.produce`
from several producer threads at once. They are also picklable, so a remote executor (a dask
worker) can generate shards into a ``cache_dir`` both sides see.

At the end, keys as a source holds them: which keys are safe (:func:`validate_key`), and how a
source's keys become one epoch's keys (:func:`keys_for_epoch`).
"""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import os
import re
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence, TypeVar, Union

from .._cache import ShardCache, make_cache
from .._cache.recipe import recipe_digest
from .._utils import validate as _validate
from .._utils.closing import Closing
from ..errors import CorruptShard, LoaderClosed, ShardError, UnsafeKey, UnsafeShard
from ..shardfile import inspect_shard, load_shard

__all__ = ["CachingSource", "Keys", "LOAD_ATTEMPTS", "MAX_KEY_LENGTH", "NAMESPACE_SEPARATOR",
           "RawShard", "Source", "check_keys", "header_bytes", "keys_for_epoch", "run_elsewhere",
           "validate_key"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

LOAD_ATTEMPTS = 3  # a shard evicted by another process between lookup and load is made again
#: Between a namespace and a shard's name in the cache (``recent+2024-01-08``): a character
#: a key may hold (a safe file-name character), and that no namespace may contain.
NAMESPACE_SEPARATOR = "+"


@dataclass
class RawShard:
    """One produced shard before the user's transform: arrays plus where they came from.

    ``source`` names the source it came from within a :class:`~gluon_stream.MixSource`
    (None for a source used alone). ``owned``: the loader owns the arrays, nothing else holds
    them (it read them from a file itself, not memory-mapped; or a function handed them over,
    ``FunctionSource(fresh_arrays=True)``): a copy of them may give their memory back.
    """

    key: Any
    epoch: int
    arrays: tuple
    path: str | None = None
    cache_hit: bool = False
    generate_s: float = 0.0
    load_s: float = 0.0
    source: str | None = None
    owned: bool = False


class Source(Closing):
    """Base class: maps an epoch to its keys and a key to a :class:`RawShard`.

    Subclasses implement :meth:`produce`; they may override :meth:`num_samples` when
    the sample count is known without loading (file headers).
    """

    def __init__(self, keys: Keys) -> None:
        self._keys = check_keys(keys)
        self._closed = threading.Event()

    @property
    def per_epoch(self) -> bool:
        """Whether a key's shard differs between epochs (a ``{epoch}`` command); False here."""
        return False

    @property
    def same_keys(self) -> bool:
        """Whether every epoch has the same keys (a sequence; not ``keys(epoch)`` or an
        iterator)."""
        return not callable(self._keys) and iter(self._keys) is not self._keys

    def keys_for_epoch(self, epoch: int) -> tuple[Iterable[Any], bool]:
        """Return (keys, finite) for ``epoch``; an iterator is drawn lazily and is not finite."""
        return keys_for_epoch(self._keys, epoch)

    def produce(self, key: Any, epoch: int, executor: Any = None) -> RawShard:
        """The shard's raw arrays; ``executor`` (a ``concurrent.futures.Executor``) may run
        the generation elsewhere."""
        raise NotImplementedError  # pragma: no cover - abstract

    def num_samples(self, key: Any, epoch: int) -> int | None:
        """Sample count of a shard if known without producing it, else None."""
        return None

    def raw_bytes(self, key: Any, epoch: int) -> tuple[int, bool, float] | None:
        """``(bytes, cache_hit, seconds)``: the memory the shard's raw arrays will hold once
        :meth:`produce` loads them, told by its file's headers before it is read (a
        ``memory_budget`` admits them first), or None where nothing tells it. A source whose
        shards another program writes makes the shard first (``cache_hit``, ``seconds``: as
        :meth:`ensure_file` says), holding no lock on return."""
        return None

    def unknown_size_reason(self) -> str:
        """Why this source cannot tell a shard's size without producing it, in words."""
        return "they are made on demand"

    @property
    def cached(self) -> bool:
        """Whether shards are kept in a ``cache_dir`` (and :meth:`ensure_file` makes them there
        without loading them); False here."""
        return False

    @property
    def cache_room(self) -> int | None:
        """The most shards the cache keeps (``cache_limit`` as a count); None: no count bound."""
        return None

    @property
    def generates_apart(self) -> bool:
        """Whether :meth:`ensure_file` makes a shard in the cache without holding its data in
        this process (another program writes it): a ``memory_budget`` does not count it."""
        return False

    def ensure_file(self, key: Any, epoch: int) -> tuple[str | None, bool, float]:
        """Make sure the shard is in the cache: ``(path, cache_hit, seconds)``; a source
        without a cache makes nothing ahead: ``(None, True, 0.0)``."""
        return None, True, 0.0

    @property
    def agrees_on_failures(self) -> bool:
        """Whether every process making this source's shards sees the same failures: a shard
        fails once, is recorded in a cache they share, and is never made again (ranks can
        then skip it alike); False here."""
        return False

    def retry_failures(self, keys: Iterable[Any] | None = None, epoch: int = 0) -> list[str]:
        """Forget the recorded failures of ``keys`` (None: all) made for ``epoch``, so that
        they are made again when next asked for; the shard names whose record went."""
        return []

    def known_size(self, key: Any, epoch: int) -> int | None:
        """Sample count of a shard known before any process produces it, the same in every
        process (file headers; sizes recorded when a cache was filled ahead), else None.

        Unlike :meth:`num_samples`, it cannot change while a job runs: ranks that decide how
        to deal shards from it all decide alike.
        """
        return None

    def _check_open(self) -> None:
        if self._closed.is_set():
            raise LoaderClosed(f"{type(self).__name__} is closed")

    def close(self) -> None:
        """Stop running work; further use raises LoaderClosed. Idempotent."""
        self._closed.set()

    def __getstate__(self) -> dict:
        """Picklable for a remote executor: configuration only; the closed flag stays here."""
        state = dict(self.__dict__)
        state.pop("_closed", None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._closed = threading.Event()


class CachingSource(Source):
    """Shared logic of sources that may write shards into a cache directory.

    Subclasses implement :meth:`_create` (write the shard for a key to a validated temp file
    in the cache and return its path) and :meth:`recipe` (what makes a key's shard, recorded
    on the cached file and compared on every hit).
    """

    def __init__(self, keys: Keys, cache_dir: str | os.PathLike | None, lock_timeout: float,
                 mmap: bool, cache_limit: int | str | None = None,
                 on_change: str = "regenerate") -> None:
        super().__init__(keys)
        lock_timeout = _validate.seconds("lock_timeout", lock_timeout)
        if cache_limit is not None and cache_dir is None:
            raise ValueError("cache_limit needs a cache_dir")
        self._cache: ShardCache | None = (
            make_cache(cache_dir, lock_timeout, self._closed, cache_limit, on_change)
            if cache_dir is not None else None)
        self._mmap = mmap
        self._recorded: dict[str, Any] | None = None  # sizes recorded in the cache, once read
        self._namespace: str | None = None

    @property
    def cached(self) -> bool:
        """Whether shards are kept in a ``cache_dir`` (else they are made each time)."""
        return self._cache is not None

    @property
    def cache_room(self) -> int | None:
        limit = getattr(self._cache, "limit", None)
        return getattr(limit, "max_shards", None)

    @property
    def agrees_on_failures(self) -> bool:
        """With a local ``cache_dir`` and no ``cache_limit``, every shard is made once for all
        processes sharing the directory, and a failure is recorded beside it (see
        :mod:`gluon_stream._cache.failures`): they all see the same failures. A ``cache_limit``
        may evict a shard one rank read and make it again, failing, for another."""
        cache = self._cache
        return (cache is not None and getattr(cache, "remembers_failures", False)
                and not getattr(getattr(cache, "limit", None), "bounded", False))

    def retry_failures(self, keys: Iterable[Any] | None = None, epoch: int = 0) -> list[str]:
        """Forget the recorded failures of ``keys`` (None: every one in the cache) made for
        ``epoch``: the shards are made again when next asked for. Returns the shard names
        whose record went.

        Example:
            >>> src.retry_failures(["2024-01-08"])  # doctest: +SKIP
            ['2024-01-08']
        """
        if self._cache is None:
            return []
        names = None if keys is None else [self.cache_name(key, epoch) for key in keys]
        return self._cache.retry_failures(names)

    def recipe(self, key: Any, epoch: int) -> Mapping[str, Any] | None:
        """What makes this key's shard (JSON-able); a cached shard made otherwise is stale."""
        return None

    def _create(self, key: Any, epoch: int) -> str:  # pragma: no cover - abstract
        """Write the shard for ``key`` to a validated temp file in the cache; return its path."""
        raise NotImplementedError

    def shard_name(self, key: Any, epoch: int) -> str:
        """The shard's own name (validated; without namespace and suffix)."""
        return validate_key(key)

    @property
    def namespace(self) -> str | None:
        """The prefix of this source's shard names in the cache (None: no prefix)."""
        return self._namespace

    def set_namespace(self, namespace: str) -> None:
        """Cache this source's shards as ``<namespace>+<shard name>``, apart from those of
        other sources in the same ``cache_dir`` whose keys may be equal. A
        :class:`~gluon_stream.MixSource` gives each caching source its name as namespace.

        Raises:
            UnsafeKey: ``namespace`` is not a safe file name, or contains ``'+'``.
            ValueError: The source has another namespace already (it is in another mix).

        Example:
            >>> from gluon_stream import FunctionSource
            >>> src = FunctionSource(range(2), lambda k: [k])
            >>> src.set_namespace("recent")
            >>> src.cache_name(1, epoch=0)
            'recent+1'
        """
        if NAMESPACE_SEPARATOR in str(namespace):
            raise UnsafeKey(f"namespace {namespace!r} must not contain {NAMESPACE_SEPARATOR!r}: "
                            "it separates the namespace from the shard's name")
        validate_key(namespace)
        if self._namespace is not None and self._namespace != namespace:
            raise ValueError(f"this {type(self).__name__} caches its shards under namespace "
                             f"{self._namespace!r} already (it is part of another MixSource); "
                             f"create a separate source for {namespace!r}")
        self._namespace = namespace

    def cache_name(self, key: Any, epoch: int) -> str:
        """The shard's name in the cache (without suffix): :meth:`shard_name`, after the
        :attr:`namespace` if there is one. Every lookup, lock and recorded size uses it."""
        name = self.shard_name(key, epoch)
        if self._namespace is None:
            return name
        return validate_key(f"{self._namespace}{NAMESPACE_SEPARATOR}{name}")

    def _require_cache(self) -> ShardCache:
        if self._cache is None:
            raise AssertionError(f"{type(self).__name__} has no cache_dir")  # callers check
        return self._cache

    def ensure_file(self, key: Any, epoch: int) -> tuple[str, bool, float]:
        """Make sure the shard is in the cache: (path, cache_hit, seconds).

        Runs wherever ``cache_dir`` is visible, e.g. on a dask worker of a shared filesystem.
        """
        t0 = time.perf_counter()
        path, hit = self._require_cache().get_or_create(
            self.cache_name(key, epoch), lambda: self._create(key, epoch), self.recipe(key, epoch))
        return path, hit, time.perf_counter() - t0

    def produce(self, key: Any, epoch: int, executor: Any = None) -> RawShard:
        """Generate (locally, or on ``executor``) unless cached, then load and validate."""
        self._check_open()
        validate_key(key)
        return self._load_cached(key, epoch, executor)

    def keys_for_epoch(self, epoch: int) -> tuple[Iterable[Any], bool]:
        """As :meth:`Source.keys_for_epoch`; finite keys of a cache are all validated up front.

        Keys become file names (and command arguments), so a hostile key fails the epoch
        before any shard is produced; keys drawn from an iterator are checked one by one.
        Two different keys with one file name (``1`` and ``'1'``) are refused: they would
        share a cached shard.
        """
        keys, finite = super().keys_for_epoch(epoch)
        if finite and self._cache is not None:
            seen: dict[str, Any] = {}
            for key in keys:
                name = self.cache_name(key, epoch)  # validates the key
                other = seen.setdefault(name, key)
                if not _same_key(other, key):
                    raise UnsafeKey(
                        f"keys {other!r} and {key!r} are different keys with one cache file "
                        f"{name!r}: they would share a shard; use keys of one type (e.g. all "
                        "str)")
        return keys, finite

    def raw_bytes(self, key: Any, epoch: int) -> tuple[int, bool, float] | None:
        """The shard made in the cache by another program (:attr:`generates_apart`), then its
        headers read; None for a function's shards (made in this process), a memory-mapped
        one (the file's pages) or a cache this process cannot read as a local file."""
        if self._cache is None or not self.generates_apart or self._mmap:
            return None
        self._check_open()
        path, hit, seconds = self.ensure_file(key, epoch)
        nbytes = header_bytes(path)
        return None if nbytes is None else (nbytes, hit, seconds)

    def num_samples(self, key: Any, epoch: int) -> int | None:
        if self._cache is None:
            return None
        return self._cache.num_samples(self.cache_name(key, epoch), self.recipe(key, epoch))

    def unknown_size_reason(self) -> str:
        if self._cache is None:
            return "the shards are made by a function and not cached"
        if self.per_epoch:
            return "the command uses {epoch}, so every epoch has new shards"
        return "they are not in the cache yet"

    def known_size(self, key: Any, epoch: int) -> int | None:
        """The size recorded for this shard, made with this recipe, when ``gluon-stream
        generate`` filled the cache ahead (read once: the record a job starts with)."""
        if self._cache is None:
            return None
        if self._recorded is None:
            self._recorded = dict(self._cache.recorded_sizes())
        entry = self._recorded.get(self.cache_name(key, epoch))
        if entry is None or entry.get("recipe") != _recipe_digest(self.recipe(key, epoch)):
            return None
        return int(entry["samples"])

    def record_sizes(self, sizes: Mapping[Any, int], epoch: int) -> None:
        """Record ``{key: samples}`` of shards in the cache, so that loaders know them ahead
        (:meth:`known_size`); ``gluon-stream generate`` does this once it has filled it."""
        self._require_cache().record_sizes(
            {self.cache_name(key, epoch): {"samples": int(n),
                                           "recipe": _recipe_digest(self.recipe(key, epoch))}
             for key, n in sizes.items()})

    @contextlib.contextmanager
    def _ensured(self, key: Any, epoch: int,
                 executor: cf.Executor | None) -> Iterator[tuple[str, bool]]:
        """The shard made or found in the cache, ``(path, cache_hit)``; made here pinned until
        the with-block ends, or on ``executor`` (whose pin ends when it returns)."""
        cache = self._require_cache()
        if executor is not None:
            path, hit, _ = run_elsewhere(executor, _ensure_remote, self, key, epoch)
            yield path, hit
            return
        with cache.pinned(self.cache_name(key, epoch), lambda: self._create(key, epoch),
                          self.recipe(key, epoch)) as found:
            yield found

    def _load_cached(self, key: Any, epoch: int, executor: cf.Executor | None) -> RawShard:
        """Make sure the shard is cached, then load it pinned (so no process evicts it)."""
        cache = self._require_cache()
        generate_s = 0.0
        for attempt in range(LOAD_ATTEMPTS):
            t0 = time.perf_counter()
            with self._ensured(key, epoch, executor) as (path, hit):
                t1 = time.perf_counter()
                generate_s += t1 - t0
                try:
                    with cache.reading(path) as local:
                        arrays = load_shard(local, mmap=self._mmap)
                except FileNotFoundError:
                    logger.info("shard %r was evicted (or replaced) before it could be read; "
                                "making it again", key)
                    continue
                except (CorruptShard, UnsafeShard):
                    cache.evict(path)
                    if not hit or attempt:
                        raise
                    logger.warning("cached shard %s for key %r is unreadable; deleted it, "
                                   "regenerating", path, key)
                    continue
            # read here: the loader's own arrays, unless memory-mapped (the file's pages)
            return RawShard(key, epoch, arrays, path, hit, generate_s, time.perf_counter() - t1,
                            owned=not self._mmap)
        raise ShardError(f"shard {key!r}: gone from the cache {LOAD_ATTEMPTS} times before it "
                         "could be read: deleted by another program, or evicted by a process "
                         "that cannot see this reader (an fsspec cache_dir shared by several "
                         "processes: give it a cache_limit above the shards they read at once)",
                         key=key)


def header_bytes(path: str) -> int | None:
    """Bytes the arrays of a local shard file hold, from its headers (None: not a local file,
    gone, or unreadable: loading it says what is wrong)."""
    if not os.path.isfile(path):
        return None
    try:
        return sum(int(info.nbytes) for info in inspect_shard(path))
    except (OSError, CorruptShard, UnsafeShard):
        return None


def _recipe_digest(recipe: Mapping[str, Any] | None) -> str | None:
    return None if recipe is None else recipe_digest(recipe)


def _same_key(a: Any, b: Any) -> bool:
    """One key (listed twice, or ``1`` and ``np.int64(1)``, which compare equal), not two."""
    try:
        return a is b or bool(a == b)
    except (TypeError, ValueError):  # keys whose == is not a plain bool
        return False


def _ensure_remote(source: CachingSource, key: Any, epoch: int) -> tuple[str, bool, float]:
    """Runs on a remote executor's worker: generate the shard into the shared cache_dir."""
    return source.ensure_file(key, epoch)


def run_elsewhere(executor: cf.Executor, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` run on ``executor``, waited for. Each call is a new task: dask's executor
    submits *pure* tasks, which hand an identical call the result of the first, so a retry of
    a failed shard would get the same failure back without running anything."""
    return executor.submit(_run_task, fn, args, uuid.uuid4().hex).result()


def _run_task(fn: Callable[..., T], args: tuple, task_id: str) -> T:
    """Runs on the executor: ``task_id`` only makes each submission a task of its own."""
    return fn(*args)


# -- keys: which are safe, and an epoch's keys -----------------------------------------------------
# Shard keys as a source holds them: which keys are safe, and how a source's keys become
# one epoch's keys.
#
# Keys are given as a sequence (finite: every epoch has the same keys), an endless iterator
# (drawn lazily, in its order, only as far as the prefetch depth needs) or a callable
# ``keys(epoch)`` (per-epoch resharding; it may return either of the other two).
Keys = Union[Sequence[Any], Iterable[Any], Callable[[int], Iterable[Any]]]

MAX_KEY_LENGTH = 200
_KEY_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:=+@,-]*")


def validate_key(key: Any) -> str:
    """``str(key)`` if it is safe as a file name and a command argument, else UnsafeKey.

    Allowed: letters, digits and ``_ . : = + @ , -``, not starting with ``-`` or ``.``,
    at most 200 characters. Dates (``datetime.date``) and integers pass as they are.

    Example:
        >>> validate_key("2024-01-01")
        '2024-01-01'
    """
    text = str(key)
    if not text or len(text) > MAX_KEY_LENGTH or not _KEY_PATTERN.fullmatch(text) or ".." in text:
        raise UnsafeKey(
            f"shard key {text[:80]!r} is not allowed: keys become file names and command "
            f"arguments, so they must be 1-{MAX_KEY_LENGTH} characters of letters, digits and "
            "'_.:=+@,-', must not start with '-' or '.', and must not contain '..', path "
            "separators, spaces, shell characters or NUL"
        )
    return text


def check_keys(keys: Any) -> Keys:
    """``keys`` if it is a sequence, an iterator or a callable; a TypeError otherwise."""
    if keys is None or isinstance(keys, (str, bytes)):
        raise TypeError(f"keys must be a sequence, an iterator or a callable keys(epoch), "
                        f"got {type(keys).__name__}")
    return keys


def keys_for_epoch(keys: Keys, epoch: int) -> tuple[Iterable[Any], bool]:
    """(keys, finite) for ``epoch``: a list when finite, the iterator itself when endless."""
    chosen = keys(epoch) if callable(keys) else keys
    if iter(chosen) is chosen:
        return chosen, False
    return list(chosen), True
