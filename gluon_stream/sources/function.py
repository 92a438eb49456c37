"""FunctionSource: each shard is what a Python function returns for its key."""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable

import numpy as np

from .._utils.columns import normalize_arrays
from ..errors import ShardError, StreamError
from ..shardfile import write_shard
from .base import CachingSource, Keys, RawShard, run_elsewhere

__all__ = ["FunctionSource"]

logger = logging.getLogger(__name__)


class FunctionSource(CachingSource):
    """Produce each shard by calling ``fn(key)`` in a producer thread.

    ``fn`` returns an array, a tuple of arrays (columns), a dict of arrays (in key order), or
    MXNet NDArrays in any of those places, all with the same first dimension (the samples).
    A list of arrays that differ in shape or dtype is read as columns; a list of same-shaped
    arrays is refused as ambiguous (rows or columns?): return a tuple, or ``np.stack(rows)``.
    A list of samples ``(data, label, ...)``, as a Gluon list dataset holds them
    (``[([1, 2], 0), ([3, 4], 1)]``), becomes one column per field.
    With ``cache_dir`` the result is written there atomically and later runs load it instead
    of calling ``fn``; without, ``fn`` runs every time the shard is needed and its arrays live
    only in memory while the shard is in the pipeline.

    ``fresh_arrays=True`` hands ``fn``'s result over to the loader: ``fn`` promises that it
    returns arrays it made for this call and keeps no reference to, strong or weak (no cache,
    no ``WeakValueDictionary``, no global, no array shared between keys). The loader then gives
    their memory back to the OS while it copies them (a shard's arrays and its copy do not
    both exist whole; see the memory-budget guide). By default (False) the loader never
    touches what ``fn`` returns. Shards read back from a ``cache_dir`` are the loader's own
    either way.

    Python code cannot be fingerprinted reliably, so a changed ``fn`` is detected only through
    ``version=``: change it when ``fn`` changes, and cached shards made under another version
    are regenerated (``on_change='regenerate'``, with a WARNING) or refused
    (``on_change='raise'``). The key's type is recorded too: ``fn(1)`` and ``fn('1')`` never
    share a cached shard silently (a key list holding both is refused).

    Example:
        >>> src = FunctionSource(range(3), lambda k: np.full((4, 2), k))
        >>> src.produce(2, epoch=0).arrays[0][0].tolist()
        [2, 2]
    """

    def __init__(self, keys: Keys, fn: Callable[[Any], Any], *,
                 cache_dir: str | os.PathLike | None = None, lock_timeout: float = 3600.0,
                 mmap: bool = False, cache_limit: int | str | None = None,
                 version: str | None = None, on_change: str = "regenerate",
                 fresh_arrays: bool = False) -> None:
        if not callable(fn):
            raise TypeError(f"fn must be callable fn(key) -> arrays, got {type(fn).__name__}")
        if version is not None and cache_dir is None:
            raise ValueError("version= names what made cached shards: it needs a cache_dir")
        super().__init__(keys, cache_dir, lock_timeout, mmap, cache_limit, on_change)
        self.fn = fn
        if not isinstance(fresh_arrays, bool):
            raise TypeError(f"fresh_arrays must be True or False, got {fresh_arrays!r}")
        self.fresh_arrays = fresh_arrays
        self.version = None if version is None else str(version)
        if cache_dir is not None and version is None:
            logger.info("FunctionSource(cache_dir=%r) without version=: shards cached by an "
                        "earlier fn are reused; pass version= and change it when fn changes",
                        os.fspath(cache_dir))

    def recipe(self, key: Any, epoch: int) -> dict:
        """``version`` and the key's type (what ``fn`` was called with)."""
        return {"source": "FunctionSource", "version": self.version,
                "key_type": type(key).__name__}

    def call(self, key: Any) -> tuple[np.ndarray, ...]:
        """``fn(key)`` as a checked tuple of arrays; its failures become a ShardError."""
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
            arrays, owned = self.call(key), self.fresh_arrays
        else:  # unpickled here: the loader's own
            arrays, owned = run_elsewhere(executor, _call_remote, self, key), True
        return RawShard(key, epoch, arrays, None, False, time.perf_counter() - t0, 0.0,
                        owned=owned)

    def _create(self, key: Any, epoch: int) -> str:
        arrays = self.call(key)
        suffix = ".npy" if len(arrays) == 1 else ".npz"
        temp = self._require_cache().temp_path(self.shard_name(key, epoch), suffix)
        return write_shard(temp, arrays)


def _call_remote(source: FunctionSource, key: Any) -> tuple[np.ndarray, ...]:
    """Runs on a remote executor's worker: call fn(key) there and send the arrays back."""
    return source.call(key)
