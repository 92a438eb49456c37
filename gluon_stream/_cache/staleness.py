"""Whether a cached shard was made by the source's recipe, and recording the recipe on a new one.

On a hit the recipe recorded on the shard file (see :mod:`.recipe`) is compared with the
source's: a match serves the shard; a mismatch regenerates it with a WARNING naming the change
(INFO for further shards with the same change) or, with ``on_change='raise'``, raises
:class:`~gluon_stream.StaleShard`. A shard with no recipe (an older version, a copy without
extended attributes) is served as it is, with one WARNING per cache. A new shard's recipe is
set on its temp file before the rename that publishes it; a file system that cannot hold it
gets one WARNING and no detection.
"""
from __future__ import annotations

import errno
import logging
from typing import Any, Mapping

from ..errors import StaleShard
from .base import Recipe
from .notices import Notices
from .recipe import describe_change, normalized, write_recipe

__all__ = ["is_current", "note_unrecorded", "record_recipe"]

logger = logging.getLogger(__name__)


def is_current(path: str, name: str, recorded: Mapping[str, Any], recipe: Mapping[str, Any],
               on_change: str, notices: Notices) -> bool:
    """Whether the shard ``path`` of ``name``, made by ``recorded``, was made by ``recipe``;
    a stale one is to be regenerated (False, logged) or raises StaleShard (``on_change``)."""
    current = normalized(recipe)
    if recorded == current:
        return True
    change = describe_change(recorded, current)
    if on_change == "raise":
        raise StaleShard(f"cached shard {path!r} was made by a different recipe ({change}); "
                         "delete it, restore what made it, or pass on_change='regenerate'",
                         path=path, key=name, change=change)
    if not notices.tell_once(f"stale:{change}", logging.WARNING,
                             "cached shard %s was made by a different recipe (%s): "
                             "regenerating it (on_change='raise' refuses instead; further "
                             "shards with this change are logged at INFO)", path, change):
        logger.info("cached shard %s is stale (%s): regenerating it", path, change)
    return False


def note_unrecorded(path: str, notices: Notices) -> None:
    """Say once per cache that shards without a recorded recipe are served as they are."""
    notices.tell_once("unrecorded", logging.WARNING,
                      "cached shard %s carries no record of what made it (an older "
                      "gluon_stream, a copy without extended attributes, or a file system "
                      "without them): serving it and others like it as they are; delete the "
                      "cache if the generator changed since", path)


def record_recipe(tmp: str, recipe: Recipe, root: str, notices: Notices) -> None:
    """Record ``recipe`` on the temp file ``tmp``; where the file system cannot, say so once."""
    assert recipe is not None
    try:
        write_recipe(tmp, recipe)
    except (OSError, NotImplementedError) as exc:
        if isinstance(exc, OSError) and exc.errno == errno.ENOENT:
            raise
        notices.tell_once("no-xattr", logging.WARNING,
                          "cannot record what made the shards in %s (%s): a changed command, "
                          "env= or version= will not be detected there; delete the cache "
                          "yourself when the generator changes", root, exc)
