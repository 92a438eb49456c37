"""When to try again: one rule for every retry loop in gluon_stream.

Generator runs (``CommandSource(retries=...)``), shards of a stream (``on_error=('retry', n)``)
and batches lost with a dead worker all ask the same two questions: can another attempt
change the outcome (:func:`is_permanent`), and how long to wait before it
(:class:`RetryPolicy`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from ..errors import (
    CommandNotFound,
    CorruptShard,
    SchemaMismatch,
    UnsafeShard,
)

__all__ = ["RetryPolicy", "is_permanent"]

def is_permanent(exc: BaseException) -> bool:
    """Failures that producing the shard again cannot fix, so they are never retried.

    A schema that differs (a dtype MXNet cannot batch too), unsafe output (pickles, symlinks),
    a full disk, a generator program that cannot be started (missing, not executable), and
    invalid arguments such as a bad key or a stale cached shard (a ValueError other than a
    corrupt file).
    """
    if isinstance(exc, (SchemaMismatch, UnsafeShard, CommandNotFound)) \
            or getattr(exc, "disk_full", False):
        return True
    return isinstance(exc, ValueError) and not isinstance(exc, CorruptShard)


@dataclass(frozen=True)
class RetryPolicy:
    """Up to ``retries`` more attempts after the first, waiting ``backoff * 2**k`` before the
    k-th retry (k from 0).

    Example:
        >>> list(RetryPolicy(retries=2, backoff=0.5).delays())
        [0.5, 1.0]
    """

    retries: int = 0
    backoff: float = 0.0

    @property
    def attempts(self) -> int:
        """Attempts in all, the first one included."""
        return self.retries + 1

    def delays(self) -> Iterator[float]:
        """The wait before each retry, in order."""
        for attempt in range(self.retries):
            yield self.backoff * (2 ** attempt)

    def delay(self, attempt: int) -> float:
        """The wait after failed attempt ``attempt`` (0 = the first)."""
        return self.backoff * (2 ** attempt)

    def should_retry(self, exc: BaseException, attempt: int) -> bool:
        """Whether failed attempt ``attempt`` (0 = the first) is worth another."""
        return attempt + 1 < self.attempts and not is_permanent(exc)
