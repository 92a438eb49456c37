"""When to try again: one rule for every retry loop in gluon_stream.

Generator runs (``CommandSource(retries=...)``), shards of a stream (``on_error=('retry', n)``)
and batches lost with a dead worker all ask the same two questions: can another attempt
change the outcome (:func:`is_permanent`), and how long to wait before it
(:class:`RetryPolicy`).
"""
from __future__ import annotations

import concurrent.futures as cf
from dataclasses import dataclass
from typing import Iterator, Literal, Tuple, Union

from ..errors import (
    CommandNotFound,
    CorruptShard,
    InvalidState,
    LoaderClosed,
    MemoryBudgetTooSmall,
    SchemaMismatch,
    UnsafeShard,
)

__all__ = ["NEVER_SKIPPED", "ON_ERROR_MODES", "ErrorPolicy", "OnError", "RetryPolicy",
           "is_permanent"]

#: failures no ``on_error`` skips or retries: the loader closed or a pass cancelled, a resumed
#: state that does not fit the data, settings that cannot hold a shard (the settings' fault)
NEVER_SKIPPED = (LoaderClosed, cf.CancelledError, InvalidState, MemoryBudgetTooSmall)

ON_ERROR_MODES = ("raise", "skip")
OnError = Union[Literal["raise", "skip"], Tuple[str, int]]  # ("retry", n) for the tuple


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


@dataclass(frozen=True)
class ErrorPolicy:
    """What a stream does with a shard that failed: ``on_error='raise'``, ``'skip'`` or
    ``('retry', n)`` (produce it again up to n times, unless :func:`is_permanent`).

    Example:
        >>> ErrorPolicy.parse(("retry", 2))
        ErrorPolicy(mode='retry', retry=RetryPolicy(retries=2, backoff=0.0))
    """

    mode: str = "raise"
    retry: RetryPolicy = RetryPolicy()

    @classmethod
    def parse(cls, on_error: "str | tuple | ErrorPolicy") -> "ErrorPolicy":
        if isinstance(on_error, ErrorPolicy):
            return on_error
        if isinstance(on_error, str) and on_error in ON_ERROR_MODES:
            return cls(on_error)
        if (isinstance(on_error, (tuple, list)) and len(on_error) == 2 and on_error[0] == "retry"
                and isinstance(on_error[1], int) and not isinstance(on_error[1], bool)
                and on_error[1] >= 1):
            return cls("retry", RetryPolicy(on_error[1]))
        raise ValueError(f"on_error must be 'raise', 'skip' or ('retry', n) with n >= 1, "
                         f"got {on_error!r}")

    @property
    def retries(self) -> int:
        """Extra attempts per shard (0 unless ``('retry', n)``)."""
        return self.retry.retries if self.mode == "retry" else 0

    def verdict(self, exc: BaseException, retried: int = 0) -> str:
        """What a shard that failed with ``exc`` (after ``retried`` retries) gets: ``'retry'``,
        ``'skip'`` or ``'raise'``. The one place the policy is applied: a pass waiting for its
        shard, a size counted by producing one, a batch borrowed from one."""
        if not isinstance(exc, Exception) or isinstance(exc, NEVER_SKIPPED):
            return "raise"
        if self.mode == "retry" and retried < self.retries and not is_permanent(exc):
            return "retry"
        return "skip" if self.mode == "skip" else "raise"
