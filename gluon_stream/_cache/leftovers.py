"""What crashed runs leave in a cache directory, removed when a cache opens the directory.

A generation's temp file is named ``.<key>.<pid>.<rand>.tmp<suffix>`` (``temp_path`` of
:class:`~gluon_stream._cache.LocalShardCache`): one whose writer's pid is gone is removed (a
directory a generator made at its temp path too); one whose writer is alive is spared. A lock
file nobody holds (its holder was killed) is removed; a held one is left alone.
"""
from __future__ import annotations

import glob
import logging
import os
import re

from .._utils.files import TEMP_MARKER, discard_path
from .lock import LOCK_SUFFIX, remove_if_unheld

__all__ = ["remove_leftovers"]

logger = logging.getLogger(__name__)


def remove_leftovers(root: str) -> None:
    """Delete the temp files and unheld lock files that crashed runs left in ``root``."""
    _remove_stale_temps(root)
    _remove_stale_locks(root)


def _remove_stale_temps(root: str) -> None:
    """Delete temp files left by crashed runs (their writer's pid is gone)."""
    for path in glob.glob(os.path.join(glob.escape(root), f".*{TEMP_MARKER}*")):
        match = re.search(r"\.(\d+)\.[^.]+" + re.escape(TEMP_MARKER), os.path.basename(path))
        if match and _pid_alive(int(match.group(1))):
            continue
        if not match and os.path.isdir(path):
            continue  # not a temp path of ours: a directory is only removed when it is
        logger.info("removing temp file %s left by a crashed run", path)
        discard_path(path)  # a generator may have made a directory at its temp path


def _remove_stale_locks(root: str) -> None:
    """Delete lock files nobody holds (their holder was killed); held ones are left alone."""
    for path in glob.glob(os.path.join(glob.escape(root), f".*{LOCK_SUFFIX}")):
        if remove_if_unheld(path):
            logger.info("removed lock file %s left by a crashed run", path)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
