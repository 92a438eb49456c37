"""Shards behind fsspec URLs (``s3://``, ``gcs://``, ``memory://``): import, globbing, downloads.

A remote shard is never read in place: it is copied to a private temporary file, validated and
loaded like a local one, and the copy is removed.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any, Iterator

from .errors import CorruptShard, UnsafeShard
from .shardfile import TEMP_MARKER, remove_if_exists

__all__ = ["downloaded", "fsspec", "glob_urls", "is_url", "local_or_url"]


def is_url(path: str) -> bool:
    """A remote or protocol-prefixed location (``s3://``, ``memory://``), read through fsspec."""
    return "://" in path and not path.startswith("file://")


def local_or_url(path: str) -> str:
    """``file://`` URLs as plain paths; everything else unchanged."""
    return path[len("file://"):] if path.startswith("file://") else path


def fsspec() -> Any:
    """The fsspec module, or an ImportError that names the extra to install."""
    try:
        import fsspec as module
    except ImportError as exc:
        raise ImportError("reading shards from URLs needs fsspec (and its backend, e.g. s3fs): "
                          "pip install 'gluon_stream[remote]'") from exc
    return module


def glob_urls(pattern: str) -> list[str]:
    """Sorted URLs matching a glob pattern on an fsspec filesystem."""
    fs, path = fsspec().core.url_to_fs(pattern)
    return sorted(fs.unstrip_protocol(p) for p in fs.glob(path))


@contextlib.contextmanager
def downloaded(fs: Any, path: str, shown: str, directory: str | None = None,
               prefix: str = "gluon_stream_fetch_") -> Iterator[str]:
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
        remove_if_exists(local)
