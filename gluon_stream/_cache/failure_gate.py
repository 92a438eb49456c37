"""Where making a shard meets the failure records of :mod:`.failures`.

Under the key's lock, before a shard is made, a failure recorded for the same recipe is raised
again instead of running the generator (a record of another recipe is dropped: the shard is
made again); a generation that fails is recorded, so that no process makes it again until it
is retried; one that succeeds drops any record left from before. Held per cache: its directory,
and whether it records failures at all (a remote cache does not: its temp directory is this
host's, which other hosts do not see).
"""
from __future__ import annotations

import logging

from .base import Recipe
from .failures import drop_failures, read_failure, worth_recording, write_failure
from .layout import temp_path
from .recipe import describe_change, normalized

__all__ = ["FailureGate"]

logger = logging.getLogger(__name__)


class FailureGate:
    """The failure records of the cache directory ``root`` (``enabled``: kept at all).

    Example:
        >>> FailureGate("/tmp", enabled=False).retry(None)
        []
    """

    def __init__(self, root: str, enabled: bool) -> None:
        self.root = root
        self.enabled = enabled

    def refuse(self, name: str, recipe: Recipe) -> None:
        """Raise the failure recorded for ``name`` if ``recipe`` made it (under the key's
        lock); a record of another recipe is dropped, and the shard made again."""
        if not self.enabled:
            return
        failure = read_failure(self.root, name)
        if failure is None:
            return
        current = None if recipe is None else normalized(recipe)
        if failure.recipe == current:
            raise failure.error_for()
        logger.info("shard %r failed before with another recipe (%s): making it again", name,
                    describe_change(failure.recipe or {}, current or {}))
        drop_failures(self.root, [name])

    def remember(self, name: str, recipe: Recipe, exc: BaseException) -> None:
        """Record that making ``name`` failed with ``exc`` (a failure of the generation), so
        that no process makes it again until it is retried."""
        if not self.enabled or not worth_recording(exc):
            return
        try:
            path = write_failure(self.root, name, None if recipe is None else normalized(recipe),
                                 exc, temp_path(self.root, name, ".failed"))
        except OSError as err:  # the failure itself is what the caller must see
            logger.warning("cannot record the failure of shard %r in %s (%s): other processes "
                           "will make it again", name, self.root, err)
            return
        logger.info("recorded the failure of shard %r in %s: no process makes it again until "
                    "it is retried", name, path)

    def forget(self, name: str) -> None:
        """``name`` was made at last: a failure recorded before is old."""
        if self.enabled:
            drop_failures(self.root, [name])

    def retry(self, names: list[str] | None) -> list[str]:
        """Forget the recorded failures of ``names`` (None: all); the names whose record
        went."""
        if not self.enabled:
            return []
        return drop_failures(self.root, names)
