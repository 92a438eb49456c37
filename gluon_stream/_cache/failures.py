"""Failures remembered beside the shard: ``<name>.failed.json`` in the cache directory.

A shard whose generation failed (after the source's own retries) leaves a small JSON record
where its shard would be: what made it (the recipe), the error (type, text, the generator's
argv, exit status and stderr tail), how many attempts were made, when, and by which process.
The next attempt to make the shard, in this process (the next epoch, begun early or not), in
another rank or in another process sharing the cache, finds the record under the key's lock
and raises the same typed error, naming the key, the recorded cause and how to retry, instead
of running the generator again. So every rank that shares the cache agrees that the shard
failed, and ``on_error='skip'`` skips it on all of them (docs/errors.md).

The record is written under the key's lock, to a temp file renamed into place (a reader sees
all of it or none), and read with a size bound as plain JSON: nothing in it is executed or
unpickled, and a record that cannot be read counts as none (one WARNING), so the shard is made
again. It goes when the shard is made (a retry), when the source's recipe differs from the
recorded one (a changed command, ``env=`` or ``version=``), or when the failures are retried
(:meth:`~gluon_stream._cache.LocalShardCache.retry_failures`, ``gluon-stream generate
--retry-failed``, or deleting the file).

Not recorded: a program that cannot be started, a full disk, no room under ``cache_limit``, a
closed loader and other failures of this process's environment rather than of the shard.
"""
from __future__ import annotations

import glob
import json
import logging
import os
import socket
import stat
import time
from dataclasses import dataclass
from typing import Any, Mapping

from .._utils.files import remove_if_exists, replace_with_json
from ..errors import (
    CacheFull,
    CommandNotFound,
    CorruptShard,
    ShardError,
    ShardTimeout,
    StreamError,
    UnsafeShard,
)

__all__ = ["FAILED_SUFFIX", "Failure", "RECORDED", "drop_failures", "failure_path", "read_failure",
           "worth_recording", "write_failure"]

logger = logging.getLogger(__name__)

FAILED_SUFFIX = ".failed.json"
RECORDED = "failure_record"  # attribute of an error raised from a record: the record's path
MAX_RECORD_BYTES = 64 * 1024  # a record is ~1-6 kB (the stderr tail is bounded at 4 KiB)
_MAX_TEXT = 8192  # characters of the error's text kept
#: The errors a record re-raises, by name: the generator's failures, never anything else.
_TYPES: dict[str, type[StreamError]] = {cls.__name__: cls for cls in (
    ShardError, ShardTimeout, CommandNotFound, CorruptShard, UnsafeShard)}


def worth_recording(exc: BaseException) -> bool:
    """Whether ``exc``, raised while a shard was made, is a failure of the generation itself
    (its program or function, or what it wrote), which making it again elsewhere would meet."""
    if isinstance(exc, (CacheFull, CommandNotFound)) or getattr(exc, "disk_full", False):
        return False  # this process's environment (PATH, disk, room), not the shard
    return isinstance(exc, tuple(_TYPES.values()))


def failure_path(root: str, name: str) -> str:
    """Where the failure of shard ``name`` is recorded."""
    return os.path.join(root, name + FAILED_SUFFIX)


@dataclass(frozen=True)
class Failure:
    """A recorded failure of shard ``name``: ``recipe`` made it, ``error`` says how it failed."""

    name: str
    path: str
    recipe: Any
    key: str  # the key's repr, as the source knew it
    error_type: str
    error: str
    attempts: int
    when: float
    where: str  # "pid P on HOST"
    fields: Mapping[str, Any]  # argv, returncode, stderr_tail of a ShardError

    def error_for(self) -> StreamError:
        """The recorded error again, of its recorded type, saying it was recorded and how to
        retry."""
        first = self.error.splitlines()[0] if self.error else self.error_type
        first = first.replace(f"shard {self.key}: ", "", 1)
        rest = "\n".join(self.error.splitlines()[1:])
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.when))
        message = (f"shard {self.key}: its generation failed before and is not run again: "
                   f"{first}\n(recorded at {stamp} by {self.where} after {self.attempts} "
                   f"attempt(s), in {self.path}; once the cause is fixed, retry it: "
                   "source.retry_failures(), gluon-stream generate --retry-failed, or delete "
                   "that file; a changed command, env= or version= retries it too)"
                   + (f"\n{rest}" if rest else ""))
        cls = _TYPES.get(self.error_type, ShardError)
        error: StreamError
        if issubclass(cls, ShardError):
            error = cls(message, key=self.name, argv=self.fields.get("argv"),
                        returncode=self.fields.get("returncode"),
                        stderr_tail=self.fields.get("stderr_tail") or "")
        elif cls is CorruptShard:
            error = CorruptShard(message, path=self.path, reason=first)
        else:
            error = cls(message)  # UnsafeShard
        setattr(error, RECORDED, self.path)  # where it was read: the CLI offers to retry it
        return error


def write_failure(root: str, name: str, recipe: Any, exc: BaseException, tmp: str) -> str:
    """Record that making shard ``name`` with ``recipe`` failed with ``exc``, through the temp
    path ``tmp`` (removed either way); the record's path."""
    key = getattr(exc, "key", None)
    record = {"version": 1, "name": name, "key": repr(name if key is None else key),
              "recipe": recipe,
              "error_type": type(exc).__name__, "error": str(exc)[:_MAX_TEXT],
              "attempts": int(getattr(exc, "attempts", 1)), "time": time.time(),
              "where": f"pid {os.getpid()} on {socket.gethostname()}"}
    if isinstance(exc, ShardError):
        record.update(argv=exc.argv, returncode=exc.returncode,
                      stderr_tail=exc.stderr_tail[-_MAX_TEXT:])
    path = failure_path(root, name)
    replace_with_json(path, record, tmp)
    return path


def read_failure(root: str, name: str) -> Failure | None:
    """The recorded failure of shard ``name``, or None (none, or unreadable: one WARNING)."""
    path = failure_path(root, name)
    try:
        data = _read_bounded(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        logger.warning("cannot read the failure record %s (%s): making shard %r as if it had "
                       "not failed", path, exc, name)
        return None
    try:
        return Failure(name, path, data.get("recipe"), str(data["key"]), str(data["error_type"]),
                       str(data["error"]), int(data["attempts"]), float(data["time"]),
                       str(data["where"]), {k: data.get(k) for k in
                                            ("argv", "returncode", "stderr_tail")})
    except (KeyError, TypeError, ValueError) as exc:
        logger.warning("the failure record %s lacks %s: making shard %r as if it had not "
                       "failed", path, exc, name)
        return None


def _read_bounded(path: str) -> dict:
    """A JSON object from a regular file (never through a symlink) of at most
    ``MAX_RECORD_BYTES``."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0)
                 | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as fp:
        info = os.fstat(fp.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_RECORD_BYTES:
            raise ValueError("not a regular file of at most "
                             f"{MAX_RECORD_BYTES} bytes")
        data = json.loads(fp.read(MAX_RECORD_BYTES + 1).decode("utf-8"))
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    return data


def drop_failures(root: str, names: list[str] | None = None) -> list[str]:
    """Remove the failure records of ``names`` (None: every one in ``root``); the names whose
    record was removed."""
    if names is None:
        paths = glob.glob(os.path.join(glob.escape(root), "*" + FAILED_SUFFIX))
        names = sorted(os.path.basename(p)[:-len(FAILED_SUFFIX)] for p in paths)
    dropped = []
    for name in names:
        path = failure_path(root, name)
        if os.path.lexists(path):
            remove_if_exists(path)
            dropped.append(name)
            logger.info("dropped the failure record of shard %r (%s): it will be made again",
                        name, path)
    return dropped
