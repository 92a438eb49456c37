"""What made a cached shard: a recipe recorded on the shard file itself, compared on every hit.

A recipe is a small JSON object built by the source: its kind, the command template with its
fixed arguments, a digest of ``env`` (never the values: they may hold secrets), the user's
``version=``, and for a ``FunctionSource`` the key's type (``fn(1)`` and ``fn('1')`` may differ,
while a command only ever sees the text ``1``). It is stored as the extended attribute
``user.gluon_stream.recipe`` of the shard file, set on the temp file before the atomic rename:
the shard and its recipe appear together or not at all, in every process and on every host
that shares the file system, with no second file to publish, lose or race, and the cache keeps
its plain ``<key>.npy`` layout. ``shutil.copy2`` and ``cp -a`` keep it; plain ``cp`` does not.

Python code cannot be fingerprinted reliably (closures, imports, data files), so a changed
``fn`` or a rebuilt program with the same command line is only detected through ``version=``.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
from typing import Any, Mapping

__all__ = ["MAX_RECIPE_BYTES", "XATTR", "describe_change", "normalized", "read_recipe",
           "recipe_digest", "write_recipe"]

XATTR = "user.gluon_stream.recipe"
MAX_RECIPE_BYTES = 2048  # well inside one ext4 block, which holds all of a file's attributes
_UNSUPPORTED = (errno.ENOTSUP, errno.EOPNOTSUPP, getattr(errno, "ENODATA", errno.ENOENT))


def recipe_digest(value: Any) -> str:
    """A short, stable digest of a JSON-able value (``env``, an over-long command)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _encode(recipe: Mapping[str, Any]) -> bytes:
    data = json.dumps(recipe, sort_keys=True, separators=(",", ":")).encode("utf-8")
    if len(data) > MAX_RECIPE_BYTES and "command" in recipe:
        shorter = dict(recipe, command=f"sha256:{recipe_digest(recipe['command'])}")
        data = json.dumps(shorter, sort_keys=True, separators=(",", ":")).encode("utf-8")
    return data


def write_recipe(path: str, recipe: Mapping[str, Any]) -> None:
    """Record ``recipe`` on the file at ``path``.

    Raises OSError where the file system cannot hold extended attributes (``ENOTSUP``), or
    NotImplementedError on a platform without them.
    """
    if not hasattr(os, "setxattr"):
        raise NotImplementedError("this platform has no extended attributes (os.setxattr)")
    os.setxattr(path, XATTR, _encode(recipe), follow_symlinks=False)


def read_recipe(path: str) -> dict | None:
    """The recipe recorded on ``path``; None if none was (or the platform or file system has no
    extended attributes); ``{}`` if the record is damaged (it then matches nothing)."""
    if not hasattr(os, "getxattr"):
        return None
    try:
        data = os.getxattr(path, XATTR, follow_symlinks=False)
    except OSError as exc:
        if exc.errno in _UNSUPPORTED:
            return None
        raise
    try:
        recipe = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return {}
    return recipe if isinstance(recipe, dict) else {}


def normalized(recipe: Mapping[str, Any]) -> dict:
    """``recipe`` as it reads back once recorded (an over-long command becomes its digest)."""
    return json.loads(_encode(recipe).decode("utf-8"))


def describe_change(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> str:
    """What differs between a shard's recorded recipe and the source's, in words.

    Example:
        >>> describe_change({"command": ["gen", "--rows", "4000"]},
        ...                 {"command": ["gen", "--rows", "500"]})
        "command argument 2: '4000' -> '500'"
    """
    if not recorded:
        return "its recorded recipe is unreadable"
    parts = []
    for field in sorted(set(recorded) | set(current)):
        old, new = recorded.get(field), current.get(field)
        if old == new:
            continue
        if field == "command" and isinstance(old, list) and isinstance(new, list) \
                and len(old) == len(new):
            parts.append("command " + ", ".join(
                f"argument {i}: {a!r} -> {b!r}"
                for i, (a, b) in enumerate(zip(old, new)) if a != b))
        elif field == "env":
            parts.append("env= changed" if old and new else
                         f"env= {'given' if new else 'no longer given'}")
        else:
            parts.append(f"{field} {old!r} -> {new!r}")
    return "; ".join(parts)
