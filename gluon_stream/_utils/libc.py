"""The C library's memory calls (POSIX) through ctypes, typed once: mmap, munmap, madvise."""
from __future__ import annotations

import ctypes
import functools
from typing import Any

__all__ = ["libc"]


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
