"""Finding a finished shard in a local cache directory, safely.

A key's shard is ``<key>.npy`` or ``<key>.npz`` (see :mod:`.layout`). Only a regular file is
served: a symlink is refused (:class:`~gluon_stream.UnsafeShard`: the cache never follows
links), and anything else (a directory, FIFO or device) is reported as
:class:`~gluon_stream.CorruptShard` and left where it is, since gluon_stream never deletes what
it did not make.
"""
from __future__ import annotations

import os
import stat
from typing import Iterable

from ..errors import CorruptShard, UnsafeShard

__all__ = ["find_shard"]


def find_shard(paths: Iterable[str]) -> str | None:
    """The first of ``paths`` that exists, as a regular file; None if none does.

    Example:
        >>> find_shard(["/no/such/a.npy", "/no/such/a.npz"]) is None
        True
    """
    for path in paths:
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(mode):
            raise UnsafeShard(f"cached shard {path!r} is a symlink; gluon_stream does not "
                              "follow links in its cache. Remove it", path=path)
        if not stat.S_ISREG(mode):
            reason = "not a regular file (a directory, FIFO or device)"
            raise CorruptShard(f"cached shard {path!r} is {reason}; gluon_stream never "
                               "deletes what it did not make: remove it", path=path,
                               reason=reason)
        return path
    return None
