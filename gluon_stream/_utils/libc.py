"""The C library's memory calls (POSIX) through ctypes, typed once: mmap, munmap, madvise, and
glibc's malloc_trim (:func:`trim_freed`)."""
from __future__ import annotations

import ctypes
import functools
from typing import Any

__all__ = ["libc", "trim_freed"]


@functools.lru_cache(maxsize=None)
def libc() -> Any:
    """The C library of this process, with mmap, munmap and madvise typed."""
    lib = ctypes.CDLL(None, use_errno=True)
    lib.mmap.restype = ctypes.c_void_p
    lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                         ctypes.c_int, ctypes.c_long]
    lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return lib


def trim_freed() -> None:
    """Give the pages of memory already freed back to the OS (glibc's ``malloc_trim(0)``, every
    arena; a no-op where the C library has none).

    glibc keeps what a large array frees for later allocations: once one such block is freed,
    it raises its mmap threshold (up to 32 MiB), so later arrays of that size come from heaps
    that keep their pages after ``free``, in every producer thread's arena. A process's resident
    memory then grows past what it holds (a loader with ``memory_budget`` of 64 MiB over
    shards of 20 MiB: 2.6 times the budget, against 0.8 with trims). Only free memory is
    touched: nothing any code still holds."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.lru_cache(maxsize=None)
def _malloc_trim() -> Any:
    lib = libc()
    if not hasattr(lib, "malloc_trim"):  # not glibc (musl, macOS)
        return None
    lib.malloc_trim.restype = ctypes.c_int
    lib.malloc_trim.argtypes = [ctypes.c_size_t]
    return lib.malloc_trim
