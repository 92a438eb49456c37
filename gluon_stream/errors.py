"""Exceptions raised by gluon_stream.

Every error derives from :class:`StreamError`; most also mix in the built-in
they resemble, so ``except ValueError`` or ``except TimeoutError`` keep working::

    StreamError
        ShardError(RuntimeError)        the generator failed: key, argv, exit code, stderr tail
            ShardTimeout(TimeoutError)  the generator ran past its timeout
            CommandNotFound             the generator's program is missing or not executable
            CacheFull                   cache_limit leaves no room: every cached shard in use
        CorruptShard(ValueError)        bad magic/header/size, truncated, junk appended
        UnsafeShard(ValueError)         pickles, object arrays, symlinks out of the cache
        SchemaMismatch(ValueError)      dtypes or trailing shapes differ between shards
            UnbatchableShard            a dtype or shape MXNet cannot batch (datetime64, str, ...)
        StaleShard(ValueError)          a cached shard was made by another command or version
        WorkerDied(RuntimeError)        a DataLoader worker process died mid-shard
        BatchTimeout(TimeoutError)      one batch took longer than ``timeout``
        LoaderClosed(RuntimeError)      a closed loader or stream was used
        UnsafeKey(ValueError)           a shard key unsafe as a file name or command argument
        InvalidState(ValueError)        a resume state that is malformed or from other settings
        CheckpointConflict(ValueError)  another checkpoint handler beside a StreamCheckpoint
        SizeUnknown(TypeError)          len() or even_batches needs a shard size not known yet
        MemoryBudgetTooSmall(MemoryError) memory_budget cannot hold the shards the loader needs
        ContextUnavailable(ValueError)  context_rows cannot find a key's place in a key list
"""
from __future__ import annotations

from typing import Any, Sequence

__all__ = [
    "BatchTimeout",
    "CacheFull",
    "CheckpointConflict",
    "CommandNotFound",
    "ContextUnavailable",
    "CorruptShard",
    "InvalidState",
    "LoaderClosed",
    "MemoryBudgetTooSmall",
    "SchemaMismatch",
    "ShardError",
    "ShardTimeout",
    "SizeUnknown",
    "StaleShard",
    "StreamError",
    "UnbatchableShard",
    "UnsafeKey",
    "UnsafeShard",
    "WorkerDied",
    "add_note",
]


class StreamError(Exception):
    """Base class of every error gluon_stream raises on purpose."""


class ShardError(StreamError, RuntimeError):
    """Producing a shard failed.

    Attributes:
        key: The shard key.
        argv: The generator's argument vector (``None`` for Python functions).
        returncode: The generator's exit status (negative: killed by that signal).
        stderr_tail: The last lines the generator wrote to stderr.
        disk_full: The disk filled up (``ENOSPC``): retrying cannot help, so it is not retried.
    """

    def __init__(
        self,
        message: str,
        *,
        key: Any = None,
        argv: Sequence[str] | None = None,
        returncode: int | None = None,
        stderr_tail: str = "",
        disk_full: bool = False,
    ) -> None:
        super().__init__(message)
        self.key = key
        self.argv = list(argv) if argv is not None else None
        self.returncode = returncode
        self.stderr_tail = stderr_tail
        self.disk_full = disk_full


class ShardTimeout(ShardError, TimeoutError):
    """The generator for a shard ran longer than its ``timeout``."""


class CorruptShard(StreamError, ValueError):
    """A shard file is not a complete, valid ``.npy``/``.npz`` file.

    Attributes:
        path: The offending file.
        reason: What is wrong (bad magic, header, size mismatch, truncated, ...).
    """

    def __init__(self, message: str, *, path: Any = None, reason: str = "") -> None:
        super().__init__(message)
        self.path = path
        self.reason = reason


class UnsafeShard(StreamError, ValueError):
    """A shard would need pickle to load (object arrays, pickled data) or escapes the cache."""

    def __init__(self, message: str, *, path: Any = None) -> None:
        super().__init__(message)
        self.path = path


class SchemaMismatch(StreamError, ValueError):
    """A shard's arrays differ in count, dtype or trailing shape from the expected schema."""


class CommandNotFound(ShardError):
    """The generator's program cannot be started (``ENOENT``, ``EACCES``, ``ENOEXEC``).

    Another attempt would fail the same way, so it is never retried.
    """


class UnbatchableShard(SchemaMismatch):
    """An array MXNet cannot hold or batch: its dtype (datetime64, str, complex, uint16,
    structured, ...) or a zero-size sample dimension.

    Attributes:
        array: The array's name (``.npz`` member or dict key) or its index.
        dtype: Its numpy dtype.
        shape: Its shape.
        fix: What to convert it to, e.g. ``".astype('int32')"``.
    """

    def __init__(self, message: str, *, array: Any = None, dtype: Any = None,
                 shape: tuple | None = None, fix: str = "") -> None:
        super().__init__(message)
        self.array = array
        self.dtype = dtype
        self.shape = shape
        self.fix = fix


class StaleShard(StreamError, ValueError):
    """A cached shard was made by a different command, environment or ``version=`` than the
    source's now (raised with ``on_change='raise'``; the default regenerates it).

    Attributes:
        path: The cached file.
        key: The shard key.
        change: What differs, in words.
    """

    def __init__(self, message: str, *, path: Any = None, key: Any = None,
                 change: str = "") -> None:
        super().__init__(message)
        self.path = path
        self.key = key
        self.change = change


class WorkerDied(StreamError, RuntimeError):
    """A DataLoader worker process died (killed by a signal, out of memory).

    Attributes:
        pid: The dead worker's process id.
        signal: The signal number that killed it, if any.
        key: The shard being loaded at the time.
    """

    def __init__(self, message: str, *, pid: int | None = None, signal: int | None = None,
                 key: Any = None) -> None:
        super().__init__(message)
        self.pid = pid
        self.signal = signal
        self.key = key


class BatchTimeout(StreamError, TimeoutError):
    """Waiting for one batch took longer than the loader's ``timeout``."""


class LoaderClosed(StreamError, RuntimeError):
    """The loader, stream or source was used after ``close()``."""


class UnsafeKey(StreamError, ValueError):
    """A shard key cannot be a file name and a command argument safely (``../x``, ``$(id)``),
    or two keys would share one cache file (``1`` and ``'1'``)."""


class CacheFull(ShardError):
    """``cache_limit`` leaves no room for a shard: it is larger than the limit, or every cached
    shard stayed in use (being read, or made and not yet read) for ``lock_timeout``."""


class InvalidState(StreamError, ValueError):
    """A ``load_state_dict`` state is malformed, or was saved by a loader with other settings,
    keys or epoch than this one: resuming from it would repeat or skip samples."""


class ContextUnavailable(StreamError, ValueError):
    """``context_rows`` cannot place a key in its epoch's key list: the keys are an endless
    iterator, a key is listed twice, or a shard's key is not in the list."""


class CheckpointConflict(StreamError, ValueError):
    """A :class:`~gluon_stream.StreamCheckpoint` shares an ``Estimator.fit`` with another
    checkpoint handler: each would shorten what a resumed run trains, and only one writes the
    loader's state. The message names the other handler."""


class MemoryBudgetTooSmall(StreamError, MemoryError):
    """``memory_budget`` cannot hold what the loader needs at the least: the shard being
    trained on plus one more (and the copy a producer makes of it), or a shard is larger than
    the whole budget. Raised before the first batch of the shard that showed it; the message
    names the budget, the shard's key and its size."""


class SizeUnknown(StreamError, TypeError):
    """A count that needs shard sizes not known without producing the shards: ``len(loader)``
    (a TypeError, as ``len()`` of anything without a known length), or even_batches' batch
    count on every rank. The message says which shards and what to pass."""


def add_note(exc: BaseException, note: str) -> None:
    """Attach ``note`` to ``exc`` without changing its type (``BaseException.add_note``).

    Python 3.11 shows notes under the traceback; on 3.9 and 3.10 the note is kept in
    ``exc.__notes__`` the same way (tools such as pytest print it), never replacing the error.
    """
    if hasattr(exc, "add_note"):
        exc.add_note(note)
        return
    try:
        notes = exc.__dict__.setdefault("__notes__", [])
    except AttributeError:  # an exception type without a __dict__: keep it unchanged
        return
    notes.append(note)
