"""A shard copied into its NDArray while its own memory is given back, page by page.

While a producer copies a shard into its NDArray, the shard's source array and its copy both
exist: the one moment a shard costs twice its size, and what a loader's memory bound counts.
When nothing else holds the source array (a ``FunctionSource`` function's fresh result, a
shard read from a file), the copy walks it in its own row order, writes each chunk of rows to
their places in the NDArray, and hands the chunk's pages back to the OS
(``madvise(MADV_DONTNEED)``) once they are read. The source shrinks as its copy grows.

Whether nothing else holds an array is told as numpy's ``ndarray.resize`` tells it: the array
owns its memory, is writable, and its reference count is the container's own. Python 3.14 may
count fewer references than are held (borrowed references), so from 3.14 on nothing is
consumed. Without ``madvise`` (not Linux), the copy is made as usual.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys

import numpy as np

from .._utils.libc import libc

__all__ = ["CONSUME_MIN_BYTES", "consume_into", "held_alone", "held_alone_each"]

logger = logging.getLogger(__name__)

CONSUME_MIN_BYTES = 4 << 20  # smaller arrays are copied as usual: little to give back
_CHUNK_BYTES = 1 << 20
_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)
_PAGE = mmap.PAGESIZE
_EXACT_REFCOUNTS = sys.version_info < (3, 14)


def held_alone(arrays: tuple, index: int) -> bool:
    """Whether ``arrays[index]`` is a numpy array, large enough to be worth consuming, that owns
    its writable, contiguous memory and that only the tuple ``arrays`` refers to (the caller
    owns the tuple). Call it in a statement of its own: a reference pending on the caller's
    stack (an argument being built) counts as another holder."""
    array = arrays[index]
    if not (_EXACT_REFCOUNTS and _DONTNEED is not None and os.name == "posix"
            and type(array) is np.ndarray and array.flags.owndata and array.flags.writeable
            and array.flags.c_contiguous and array.nbytes >= CONSUME_MIN_BYTES):
        return False
    # the tuple, the local name ``array``, and getrefcount's own argument
    return sys.getrefcount(array) == 3


def held_alone_each(arrays: tuple) -> list[bool]:
    """:func:`held_alone` for every array of a tuple the caller owns."""
    return [held_alone(arrays, i) for i in range(len(arrays))]


def consume_into(out: np.ndarray, array: np.ndarray, order: np.ndarray | None) -> bool:
    """Write row ``order[i]`` of ``array`` (row ``i`` without ``order``) to row ``i`` of
    ``out``, reading ``array`` in its own order and giving its pages back to the OS behind
    the read. ``array`` is left zeroed where it was given back: only for an array
    :func:`held_alone` said the caller may consume, and drops next.

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
