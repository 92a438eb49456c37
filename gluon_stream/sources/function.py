"""FunctionSource: each shard is what a Python function returns for its key."""
from __future__ import annotations

import os
import time
from typing import Any, Callable

import numpy as np

from ..errors import ShardError, StreamError
from ..keys import Keys
from ..shardfile import normalize_arrays, write_shard
from .base import CachingSource, RawShard

__all__ = ["FunctionSource"]


class FunctionSource(CachingSource):
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
            arrays = self.call(key)
        else:
            arrays = executor.submit(_call_remote, self, key).result()
        return RawShard(key, epoch, arrays, None, False, time.perf_counter() - t0, 0.0)

    def _create(self, key: Any, epoch: int) -> str:
        arrays = self.call(key)
        suffix = ".npy" if len(arrays) == 1 else ".npz"
        return write_shard(self._cache.temp_path(self.shard_name(key, epoch), suffix), arrays)


def _call_remote(source: FunctionSource, key: Any) -> tuple[np.ndarray, ...]:
    """Runs on a remote executor's worker: call fn(key) there and send the arrays back."""
    return source.call(key)
