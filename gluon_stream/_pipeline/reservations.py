"""A producer's reservations for the shard it makes, against the stream's
:class:`~gluon_stream._pipeline.admission.MemoryGate`: what each part of a shard holds (its
raw arrays, the transform's output, the copy), counted as memory, and the shard deferred when
it must give way to the one the loop needs first."""
from __future__ import annotations

import logging
import mmap
from typing import Any, Callable, ContextManager, Sequence

import numpy as np

from .._utils.validate import format_bytes
from .admission import Admission, GiveWay
from .offsets import Deferred

__all__ = ["ShardReservations", "copy_bytes", "memory_of"]

logger = logging.getLogger(__name__)


def memory_of(arrays: Sequence[Any], counted: set[int]) -> int:
    """Bytes of memory ``arrays`` hold, each block once: a view counts the array that owns its
    memory, unless ``counted`` holds it already (a transform's windows over the raw arrays
    cost nothing more); memory-mapped files hold no memory of this process. Adds to
    ``counted``."""
    total = 0
    for a in arrays:
        root = a  # down the views (as_strided's too, through numpy's DummyArray) to the owner
        while (base := getattr(root, "base", None)) is not None \
                and not isinstance(base, (mmap.mmap, bytes, bytearray, memoryview)):
            root = base
        if id(root) in counted:
            continue
        counted.add(id(root))
        if isinstance(getattr(root, "base", None), mmap.mmap):
            continue
        total += int(getattr(root, "nbytes", 0))
    return total


def copy_bytes(arrays: Sequence[Any], order: np.ndarray | None) -> int:
    """Bytes of a copy of ``arrays``'s rows in ``order`` (all of them without)."""
    total = 0
    for a in arrays:
        rows = len(a)
        total += (int(getattr(a, "nbytes", 0)) // rows if rows else 0) * (
            rows if order is None else len(order))
    return total


class ShardReservations:
    """A producer's reservations for one shard (nothing without an admission, i.e. without a
    ``memory_budget``): it waits for room in ``outside()`` (its producer's place given up;
    None where it holds none) and stops once ``closed()``."""

    def __init__(self, adm: Admission | None, closed: Callable[[], bool],
                 outside: Callable[[], ContextManager[Any]] | None) -> None:
        self.adm, self._closed, self._outside = adm, closed, outside
        self._counted: set[int] = set()  # memory blocks counted already (raw, then transformed)

    def reserve(self, part: str, nbytes: int | None = None) -> None:
        """Hold ``nbytes`` for ``part`` (None: not known yet, the largest seen, or the raw
        arrays' for the first transform's output)."""
        adm = self.adm
        if adm is None:
            return
        exact = nbytes is not None
        if nbytes is None:
            nbytes = adm.gate.largest[part] or (adm.held["raw"] if part == "transformed" else 0)
        try:
            adm.reserve(part, nbytes, self._closed, self._outside, exact)
        except GiveWay as exc:
            logger.info("%s: made again when the loop reaches it", exc)
            raise Deferred(f"{exc}: made again when the loop reaches it") from None

    def made(self, part: str, arrays: Sequence[Any]) -> None:
        """``part`` is made: the memory its arrays hold (a transform's views of the raw
        arrays add nothing) is counted at once.

        Raises:
            Deferred: It grew beyond its reservation and leaves too little room for the
                shards the loop needs first: freed, it is made again when the loop reaches it.
        """
        adm = self.adm
        if adm is None:
            return
        nbytes = memory_of(arrays, self._counted)
        if not adm.made(part, nbytes):
            logger.info("%s: its %s arrays (%s) grew beyond the room left within "
                        "memory_budget for the shards before it: made again when the loop "
                        "reaches it", adm.what, part, format_bytes(nbytes))
            raise Deferred(f"{adm.what} deferred: its {part} arrays ({format_bytes(nbytes)}) "
                           "leave too little room within memory_budget for the shards before "
                           "it")

    def largest(self, part: str) -> int:
        """The largest ``part`` seen in the stream, in bytes (0 without a budget)."""
        return 0 if self.adm is None else self.adm.gate.largest[part]

    def replaced(self, part: str, arrays: Sequence[Any]) -> None:
        """``part``'s arrays were replaced by ``arrays`` (made from them, the old ones let
        go: the raw arrays with ``context_rows`` before them): it holds what they hold."""
        if self.adm is not None:
            self.adm.gate.set(self.adm, part, memory_of(arrays, self._counted))

    def drop(self, part: str) -> None:
        """``part`` is freed (a previous key's shard read for context)."""
        if self.adm is not None:
            self.adm.drop(part)

    def source_bytes(self) -> int:
        """The raw and transformed arrays' bytes: alive beside the copy while it is made."""
        return 0 if self.adm is None else self.adm.held["raw"] + self.adm.held["transformed"]

    def copied(self, copied: bool) -> None:
        """The shard is prepared: a copy frees its source; else (no copy, or a form that keeps
        the source arrays: a shuffle window's shards) its arrays are what it holds."""
        if self.adm is None:
            return
        if copied:
            self.adm.drop("raw", "transformed")
        else:
            self.adm.drop("copy")
