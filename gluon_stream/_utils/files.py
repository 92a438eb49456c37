"""Files the library writes: temporary names, removal that tolerates gone files, disk full."""
from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import stat
from typing import Any

__all__ = ["TEMP_MARKER", "discard_path", "is_disk_full", "remove_if_exists",
           "replace_with_json"]

logger = logging.getLogger(__name__)

TEMP_MARKER = ".tmp"  # in the name of every temporary file the library writes
_SHORT_WRITE = re.compile(r"\d+ requested and \d+ written")  # numpy's tofile: no errno
_DISK_FULL_TEXT = ("No space left on device", "ENOSPC", "[Errno 28]", "Disk quota exceeded",
                   "[Errno 122]")


def is_disk_full(error: BaseException | str) -> bool:
    """Whether an error (or a generator's stderr text) says the disk or quota is full.

    numpy reports a short write as ``OSError('N requested and M written')`` without an errno,
    so the text counts as well as ``ENOSPC``/``EDQUOT``.
    """
    if isinstance(error, BaseException):
        if not isinstance(error, OSError):
            return False
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        error = str(error)
    return any(hint in error for hint in _DISK_FULL_TEXT) or bool(_SHORT_WRITE.search(error))


def remove_if_exists(path: str | os.PathLike) -> None:
    """Remove a file that may already be gone."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        logger.debug("%s already removed", os.fspath(path))


def replace_with_json(path: str, value: Any, tmp: str) -> None:
    """Put ``value`` as JSON at ``path`` atomically: written to the new temp path ``tmp``
    (created, never an existing file; removed either way), then renamed into place. Values
    JSON has no form for are written as their ``str``."""
    try:
        with open(tmp, "x", encoding="utf-8") as fp:
            json.dump(value, fp, sort_keys=True, default=str)
        os.replace(tmp, path)
    finally:
        remove_if_exists(tmp)


def discard_path(path: str | os.PathLike) -> None:
    """Remove whatever is at a temp path of ours: a file, FIFO or symlink (never followed), or a
    directory tree a generator made there. Gone already is fine."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(path)
    else:
        remove_if_exists(path)
