"""Context from the previous keys: a shard's transform sees the last ``context_rows`` raw rows
before its key, in key order, followed by the shard's own raw rows.

The key order is the source's key list for the epoch the shard is made for
(``source.keys_for_epoch(epoch)``), before any shuffle or deal: the first key of the list gets
no context, every other key the last rows of the keys before it, from as many of them as it
takes (``context_rows`` may exceed a shard). ``context_break(previous_key, key) -> bool`` says
where context must not flow (a gap in the dates, a new episode): True starts the series afresh
at ``key``, which then gets the rows of the keys after the break only.

A key's transform input is so a function of the key and the epoch alone, whichever rank,
position, shuffle, resume or elastic resume reads it: every rule the loader keeps about a
shard's rows holds of what the transform makes of them.

Production stays parallel: the producer making key ``k`` makes the previous keys' raw arrays
itself (``source.produce``: a cache hit with a ``cache_dir``, generated again without one),
copies their last rows into ``k``'s input and lets them go, one previous key at a time. With a
``memory_budget`` the input (context and own rows) and one previous shard are admitted before
they are allocated (the ``'context'`` part of a shard's admission).
"""
from __future__ import annotations

import itertools
import logging
import threading
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol, Sequence

import numpy as np

from .._utils import validate as _validate
from ..errors import ContextUnavailable, LoaderClosed, SchemaMismatch, ShardError

if TYPE_CHECKING:
    from ..sources.base import RawShard, Source

__all__ = ["ContextBreak", "ContextRows", "context_rows_of"]

logger = logging.getLogger(__name__)

#: ``context_break(previous_key, key) -> bool``: True where the series starts afresh at ``key``
ContextBreak = Callable[[Any, Any], bool]
#: ``produce(key, epoch) -> RawShard``: a previous key's raw shard, made as the stream makes one
Produce = Callable[[Any, int], "RawShard"]


def context_rows_of(rows: int, context_break: ContextBreak | None, source: Source,
                    transform: Any) -> "ContextRows | None":
    """The stream's context stage for ``context_rows=rows`` (None for 0: no context).

    Raises:
        ValueError: ``rows`` is negative, or given without a ``transform``, or
            ``context_break`` is given without ``context_rows``.
        ContextUnavailable: The source's keys are an endless iterator.
    """
    rows = _validate.integer("context_rows", rows, minimum=0)
    _validate.callable_or_none("context_break", context_break)
    if not rows:
        if context_break is not None:
            raise ValueError("context_break says where context must not flow: it needs "
                             "context_rows=N (N > 0) as well")
        return None
    if transform is None:
        raise ValueError(f"context_rows={rows} puts the previous keys' last raw rows before a "
                         "shard's own for its transform: pass transform=fn (e.g. one that cuts "
                         "windows), which then returns the shard's samples")
    if not source.keys_for_epoch(0)[1]:  # an iterator is returned, not drawn
        raise ContextUnavailable(_ENDLESS)
    return ContextRows(rows, context_break, source)


_NONE = object()  # no key before: no context
_ENDLESS = ("context_rows needs a key list (a sequence, or keys(epoch) returning one): the "
            "context of a key is read from the keys before it in that list, and an endless "
            "iterator's keys cannot be looked up again")


class Reserves(Protocol):
    """What the context asks of a producer's reservations (a
    :class:`~gluon_stream._stages.produce.ShardReservations`): room before it allocates."""

    def reserve(self, part: str, nbytes: int) -> None: ...

    def largest(self, part: str) -> int: ...

    def replaced(self, part: str, arrays: Sequence[Any]) -> None: ...

    def drop(self, part: str) -> None: ...


class ContextRows:
    """Puts the previous keys' last raw rows before a shard's own (see the module doc).

    Thread-safe: producers call :meth:`extend` at once; the key lists of the epochs seen are
    kept (the last two).
    """

    def __init__(self, rows: int, context_break: ContextBreak | None, source: Source) -> None:
        self.rows = rows
        self.context_break = context_break
        self._source = source
        self._lock = threading.Lock()
        self._lists: dict[int, tuple[list, dict]] = {}  # epoch -> (keys, key -> position)

    def keys_before(self, key: Any, epoch: int) -> Iterator[Any]:
        """The keys ``key``'s context may come from, nearest first, up to a break (or the
        list's start), drawn as they are read (the rows needed decide how many).

        Raises:
            ContextUnavailable: ``key`` is not in the epoch's key list, or the list is an
                endless iterator or names a key twice.
        """
        keys, where = self._key_list(epoch)
        try:
            i = where[key]
        except (KeyError, TypeError):
            raise ContextUnavailable(f"shard {key!r} is not in the key list of epoch {epoch}: "
                                     "its context (context_rows) cannot be placed") from None
        return self._walk_back(keys, i)

    def _walk_back(self, keys: list, i: int) -> Iterator[Any]:
        later = keys[i]
        for j in range(i - 1, -1, -1):
            if self.context_break is not None and self.context_break(keys[j], later):
                return
            yield keys[j]
            later = keys[j]

    def _key_list(self, epoch: int) -> tuple[list, dict]:
        with self._lock:
            found = self._lists.get(epoch)
        if found is not None:
            return found
        keys, finite = self._source.keys_for_epoch(epoch)
        if not finite:
            raise ContextUnavailable(f"epoch {epoch}: {_ENDLESS}")
        keys = list(keys)
        where: dict = {}
        for i, key in enumerate(keys):
            try:
                if where.setdefault(key, i) != i:
                    raise ContextUnavailable(
                        f"key {key!r} is listed twice in epoch {epoch}'s keys: with "
                        "context_rows each key's context is the rows before its one place in "
                        "the list; list every key once")
            except TypeError:
                raise ContextUnavailable(f"key {key!r} cannot be looked up (unhashable): "
                                         "context_rows needs hashable keys") from None
        with self._lock:
            self._lists[epoch] = (keys, where)
            for old in sorted(self._lists)[:-2]:
                del self._lists[old]
        return keys, where

    def extend(self, raw: RawShard, epoch: int, produce: Produce, gate: Reserves,
               stopped: Callable[[], bool]) -> None:
        """Put the context of ``raw``'s key before its rows, in place (``raw.arrays``; the
        previous keys' generation and load seconds are added to ``raw``'s): ``produce`` makes
        a previous key's raw shard; ``stopped()`` ends the work (a cancelled pass)."""
        own = raw.arrays
        before = self.keys_before(raw.key, epoch)
        first = next(before, _NONE)
        if first is _NONE or not own:
            return
        out = self._allocate(own, gate)
        filled = 0
        for prev in itertools.chain([first], before):
            if stopped():
                raise LoaderClosed("epoch pass cancelled")
            filled += self._copy_tail(raw, prev, epoch, produce, out, filled)
            if filled == self.rows:  # before the next key is drawn (and the break rule asked)
                break
        raw.arrays = tuple(o[self.rows - filled:] for o in out)
        gate.replaced("raw", raw.arrays)  # own rows and context, in one block per array
        gate.drop("context")

    def _allocate(self, own: Sequence[Any], gate: Reserves) -> list[np.ndarray]:
        """The transform's input arrays, context rows first (filled from the end), own rows
        copied in; admitted with room for one previous shard beside them."""
        rows = self.rows
        row_bytes = sum(int(a.nbytes) // max(1, len(a)) if len(a) else
                        int(np.dtype(a.dtype).itemsize * np.prod(a.shape[1:], dtype=np.int64))
                        for a in own)
        gate.reserve("context", row_bytes * (rows + len(own[0])) + gate.largest("raw"))
        out = [np.empty((rows + len(a),) + tuple(a.shape[1:]), dtype=a.dtype) for a in own]
        for o, a in zip(out, own):
            o[rows:] = a
        return out

    def _copy_tail(self, raw: RawShard, prev: Any, epoch: int, produce: Produce,
                   out: list[np.ndarray], filled: int) -> int:
        """Copy the last rows of ``prev``'s shard into ``out`` before the ``filled`` rows of
        context there; the rows copied."""
        try:
            made = produce(prev, epoch)
        except LoaderClosed:
            raise
        except Exception as exc:
            raise ShardError(f"shard {raw.key!r} (epoch {epoch}): its context (context_rows="
                             f"{self.rows}) needs shard {prev!r}, which failed: "
                             f"{type(exc).__name__}: {exc}", key=raw.key) from exc
        arrays = made.arrays
        _check_schema(raw.key, prev, out, arrays)
        n = len(arrays[0])
        take = min(n, self.rows - filled)
        stop = self.rows - filled
        for o, a in zip(out, arrays):
            o[stop - take:stop] = a[n - take:]
        raw.generate_s += made.generate_s
        raw.load_s += made.load_s
        del arrays, made  # the previous shard goes at once: only its tail was needed
        return take


def _check_schema(key: Any, prev: Any, out: list[np.ndarray], arrays: Sequence[Any]) -> None:
    want = [(np.dtype(o.dtype).str, tuple(o.shape[1:])) for o in out]
    found = [(np.dtype(a.dtype).str, tuple(a.shape[1:])) for a in arrays]
    if want != found:
        raise SchemaMismatch(f"shard {key!r} has raw arrays {want} as [(dtype, trailing "
                             f"shape)], the shard {prev!r} its context comes from {found}: "
                             "context rows (context_rows) are stacked before a shard's own, "
                             "so every raw shard must have the same arrays")
