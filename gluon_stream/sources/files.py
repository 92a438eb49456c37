"""FileSource: shards that already exist as ``.npy``/``.npz`` files, local or behind fsspec URLs."""
from __future__ import annotations

import contextlib
import glob
import os
import time
from typing import Any, Iterator, Sequence

from .._cache import SUFFIXES
from .._utils.fsspec import downloaded, fsspec, glob_urls, is_url, local_or_url
from ..errors import CorruptShard
from ..shardfile import inspect_shard, load_shard
from .base import RawShard, Source, header_bytes

__all__ = ["FileSource", "expand_paths"]


def expand_paths(pattern: str) -> list[str]:
    """The shard files one path argument names: a directory's ``.npy``/``.npz`` files, a glob
    pattern's matching files, both sorted; otherwise the path itself if something is there
    (a FIFO or directory in a list is refused when read, never opened); ``[]`` if nothing.

    ``FileSource`` and ``gluon-stream inspect`` read their arguments with this one rule.
    """
    if os.path.isdir(pattern):
        return sorted(p for p in glob.glob(os.path.join(glob.escape(pattern), "*"))
                      if p.endswith(SUFFIXES) and os.path.isfile(p))
    if glob.has_magic(pattern):
        return sorted(p for p in glob.glob(pattern) if os.path.isfile(p))
    return [pattern] if os.path.lexists(pattern) else []


class FileSource(Source):
    """Read existing shard files (``.npy`` / ``.npz``); each file's path is its key.

    Paths may be fsspec URLs (``s3://bucket/shards/*.npy``, ``gcs://...``, ``memory://...``,
    ``file://...``; needs ``fsspec`` and the protocol's backend): a remote shard is copied to a
    private temporary file, validated and loaded like a local one, and the copy is removed.

    Args:
        paths: A directory (its ``.npy``/``.npz`` files, sorted), a glob pattern (its sorted
            matching files), or a list of paths or URLs. Only regular files are ever opened.
        mmap: Memory-map local ``.npy`` files instead of reading them.

    Example:
        >>> src = FileSource("shards/*.npy")  # doctest: +SKIP
    """

    def __init__(self, paths: str | os.PathLike | Sequence[str | os.PathLike], *,
                 mmap: bool = False) -> None:
        if isinstance(paths, (str, os.PathLike)):
            pattern = os.fspath(paths)
            matched = glob_urls(pattern) if is_url(pattern) else expand_paths(local_or_url(pattern))
            if not matched:
                what = "no .npy/.npz files in" if os.path.isdir(pattern) else "no files match"
                raise FileNotFoundError(f"FileSource: {what} {pattern!r}")
            paths = matched
        super().__init__([local_or_url(os.fspath(p)) for p in paths])
        self._mmap = mmap

    def produce(self, key: Any, epoch: int, executor: Any = None) -> RawShard:
        self._check_open()
        t0 = time.perf_counter()
        if is_url(key):
            with _fetched(key) as local:
                arrays = load_shard(local)
        else:
            arrays = load_shard(key, mmap=self._mmap)
        # read here: the loader's own arrays, unless memory-mapped (the file's pages)
        return RawShard(key, epoch, arrays, key, True, 0.0, time.perf_counter() - t0,
                        owned=is_url(key) or not self._mmap)

    def raw_bytes(self, key: Any, epoch: int) -> tuple[int, bool, float] | None:
        """From the local file's headers (None: a URL, or memory-mapped)."""
        if is_url(key) or self._mmap:
            return None
        nbytes = header_bytes(key)
        return None if nbytes is None else (nbytes, True, 0.0)

    def num_samples(self, key: Any, epoch: int) -> int | None:
        if is_url(key):
            return None  # known after the first pass, without downloading every shard twice
        return inspect_shard(key)[0].shape[0]

    def unknown_size_reason(self) -> str:
        return "remote files' headers are not read ahead"

    def known_size(self, key: Any, epoch: int) -> int | None:
        """A local file's header (remote files' headers are not read ahead)."""
        return self.num_samples(key, epoch)


@contextlib.contextmanager
def _fetched(url: str) -> Iterator[str]:
    """A remote shard (a FileSource key) as a private local copy; a missing one is corrupt."""
    fs, path = fsspec().core.url_to_fs(url)
    try:
        with downloaded(fs, path, url, key=url) as local:
            yield local
    except FileNotFoundError as exc:
        raise CorruptShard(f"shard {url!r} does not exist", path=url,
                           reason="file does not exist") from exc
