"""A shard copied into its NDArray while its own memory is given back, page by page.

While a producer copies a shard into its NDArray, the shard's source array and its copy both
exist: the one moment a shard costs twice its size. When the loader owns the source array
(it read the shard from a file itself, or a ``FunctionSource(fresh_arrays=True)`` handed its
function's result over), the copy walks it in its own row order, writes each chunk of rows to
their places in the NDArray, and hands the chunk's pages back to the OS
(``madvise(MADV_DONTNEED)``) once they are read. The source shrinks as its copy grows.

Who owns an array is never inferred here (a reference count does not see weak references, nor
memory a C extension keeps): the stream says it, as data, where the arrays are made
(:class:`~gluon_stream._stages.produce.Owned`). :func:`consumable` only checks that an owned
array can be given back page by page. Without ``madvise`` (not Linux), the copy is made as
usual.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import os

import numpy as np

from .._utils.libc import libc

__all__ = ["CONSUME_MIN_BYTES", "consumable", "consume_into"]

logger = logging.getLogger(__name__)

CONSUME_MIN_BYTES = 4 << 20  # smaller arrays are copied as usual: little to give back
_CHUNK_BYTES = 1 << 20
_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)
_PAGE = mmap.PAGESIZE


def consumable(array: object) -> bool:
    """Whether an array the loader owns can be consumed by its copy: a numpy array that owns
    its writable, C-contiguous memory, large enough to be worth it, on a system with
    ``madvise``. Says nothing of who owns it: only call it for arrays the loader owns."""
    return (_DONTNEED is not None and os.name == "posix" and type(array) is np.ndarray
            and array.flags.owndata and array.flags.writeable and array.flags.c_contiguous
            and array.nbytes >= CONSUME_MIN_BYTES)


def consume_into(out: np.ndarray, array: np.ndarray, order: np.ndarray | None) -> bool:
    """Write row ``order[i]`` of ``array`` (row ``i`` without ``order``) to row ``i`` of
    ``out``, reading ``array`` in its own order and giving its pages back to the OS behind
    the read. ``array`` is left zeroed where it was given back: only for an array the loader
    owns (:func:`consumable`), and drops next.

    False, with nothing written, for an ``order`` that names a row twice (read in the array's
    order, a row goes to one place): the caller copies as usual."""
    rows = array.shape[0]
    row_bytes = max(1, array.nbytes // max(1, rows))
    step = max(1, _CHUNK_BYTES // row_bytes)
    where = None
    if order is not None:
        where = np.full(rows, -1, dtype=np.int64)  # each row's place in out (-1: not read)
        where[order] = np.arange(len(order), dtype=np.int64)
        if np.count_nonzero(where >= 0) != len(order):
            return False
    base = array.ctypes.data
    # the first and last pages may hold other memory (the allocator's header, the next
    # block): only whole pages within the array are given back
    given = -(-base // _PAGE) * _PAGE
    for begin in range(0, rows, step):
        end = min(rows, begin + step)
        if where is None:
            out[begin:end] = array[begin:end]
        else:
            places = where[begin:end]
            wanted = places >= 0
            if wanted.all():
                out[places] = array[begin:end]
            elif wanted.any():
                out[places[wanted]] = array[begin:end][wanted]
        read = (base + end * row_bytes) // _PAGE * _PAGE
        if read > given:
            _give_back(given, read - given)
            given = read
    return True


def _give_back(address: int, size: int) -> None:
    """Hand pages back to the OS (they read as zeros after). A refusal only costs memory."""
    if libc().madvise(address, size, _DONTNEED):
        err = ctypes.get_errno()
        logger.debug("madvise(MADV_DONTNEED) of %d bytes refused: %s", size, os.strerror(err))
