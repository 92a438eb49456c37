"""Shard keys as a source holds them: which keys are safe, and how a source's keys become
one epoch's keys.

Keys are given as a sequence (finite: every epoch has the same keys), an endless iterator
(drawn lazily, in its order, only as far as the prefetch depth needs) or a callable
``keys(epoch)`` (per-epoch resharding; it may return either of the other two).
"""
from __future__ import annotations

import re
from typing import Any, Callable, Iterable, Sequence, Union

from ..errors import UnsafeKey

__all__ = ["Keys", "MAX_KEY_LENGTH", "check_keys", "keys_for_epoch", "validate_key"]

Keys = Union[Sequence[Any], Iterable[Any], Callable[[int], Iterable[Any]]]

MAX_KEY_LENGTH = 200
_KEY_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:=+@,-]*")


def validate_key(key: Any) -> str:
    """``str(key)`` if it is safe as a file name and a command argument, else UnsafeKey.

    Allowed: letters, digits and ``_ . : = + @ , -``, not starting with ``-`` or ``.``,
    at most 200 characters. Dates (``datetime.date``) and integers pass as they are.

    Example:
        >>> validate_key("2024-01-01")
        '2024-01-01'
    """
    text = str(key)
    if not text or len(text) > MAX_KEY_LENGTH or not _KEY_PATTERN.fullmatch(text) or ".." in text:
        raise UnsafeKey(
            f"shard key {text[:80]!r} is not allowed: keys become file names and command "
            f"arguments, so they must be 1-{MAX_KEY_LENGTH} characters of letters, digits and "
            "'_.:=+@,-', must not start with '-' or '.', and must not contain '..', path "
            "separators, spaces, shell characters or NUL"
        )
    return text


def check_keys(keys: Any) -> Keys:
    """``keys`` if it is a sequence, an iterator or a callable; a TypeError otherwise."""
    if keys is None or isinstance(keys, (str, bytes)):
        raise TypeError(f"keys must be a sequence, an iterator or a callable keys(epoch), "
                        f"got {type(keys).__name__}")
    return keys


def keys_for_epoch(keys: Keys, epoch: int) -> tuple[Iterable[Any], bool]:
    """(keys, finite) for ``epoch``: a list when finite, the iterator itself when endless."""
    chosen = keys(epoch) if callable(keys) else keys
    if iter(chosen) is chosen:
        return chosen, False
    return list(chosen), True
