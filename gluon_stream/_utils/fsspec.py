"""Shards behind fsspec URLs (``s3://``, ``gcs://``, ``memory://``): import, globbing, downloads.

A remote shard is never read in place: it is copied to a private temporary file, validated and
loaded like a local one, and the copy is removed. A failure of the store itself (a dead
endpoint, refused credentials, throttling that outlasted the backend's retries) becomes a
:class:`~gluon_stream.ShardError` naming the shard and its URL (:func:`storage_errors`); a
missing object stays a ``FileNotFoundError``, which callers treat as evicted or absent.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any, Iterator

from ..errors import CorruptShard, ShardError, StreamError, UnsafeShard
from .files import TEMP_MARKER, remove_if_exists

__all__ = ["downloaded", "fsspec", "glob_urls", "is_url", "local_or_url", "storage_errors"]


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


@contextlib.contextmanager
def storage_errors(url: str, key: Any = None, doing: str = "reading") -> Iterator[None]:
    """Raise a storage backend's own failure inside the block (botocore's
    ``EndpointConnectionError``, a refused credential, an aiohttp error) as a ShardError that
    names the shard ``key`` and ``url``. A missing object (``FileNotFoundError``) and
    gluon_stream's own errors pass unchanged. Keep the block to the store calls themselves.
    """
    try:
        yield
    except (FileNotFoundError, StreamError):
        raise
    except Exception as exc:  # backends raise their own types (botocore, aiohttp, google)
        shard = "" if key is None else f"shard {key!r}: "
        raise ShardError(f"{shard}{doing} {url} failed: {type(exc).__name__}: {exc}; check the "
                         "URL, endpoint, credentials and network (how long the backend retries "
                         "first is its own setting, e.g. AWS_MAX_ATTEMPTS for S3)",
                         key=key) from exc


def glob_urls(pattern: str) -> list[str]:
    """Sorted URLs matching a glob pattern on an fsspec filesystem."""
    fs, path = fsspec().core.url_to_fs(pattern)
    with storage_errors(pattern, None, "listing"):
        return sorted(fs.unstrip_protocol(p) for p in fs.glob(path))


@contextlib.contextmanager
def downloaded(fs: Any, path: str, shown: str, directory: str | None = None,
               prefix: str = "gluon_stream_fetch_", key: Any = None) -> Iterator[str]:
    """Copy a remote shard to a private temp file to validate and load it; removed afterwards.

    Errors about the copy name ``shown`` (the shard's URL), not the copy; a missing remote
    file raises FileNotFoundError; the store's own failures a ShardError naming ``key``.
    """
    fd, local = tempfile.mkstemp(prefix=prefix, suffix=f"{TEMP_MARKER}{os.path.splitext(path)[1]}",
                                 dir=directory)
    os.close(fd)
    try:
        with storage_errors(shown, key):
            fs.get_file(path, local)
        try:
            yield local
        except (CorruptShard, UnsafeShard) as exc:  # name the shard, not the private copy
            exc.args = (str(exc).replace(local, shown),)
            exc.path = shown
            raise
    finally:
        remove_if_exists(local)
