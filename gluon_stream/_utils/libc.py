"""The C library's calls through ctypes, typed once: mmap, munmap, madvise (POSIX), and prctl
(Linux only: absent elsewhere)."""
from __future__ import annotations

import ctypes
import functools
from typing import Any

__all__ = ["libc"]


@functools.lru_cache(maxsize=None)
def libc() -> Any:
    """The C library of this process, with mmap, munmap, madvise and (on Linux) prctl typed."""
    lib = ctypes.CDLL(None, use_errno=True)
    lib.mmap.restype = ctypes.c_void_p
    lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                         ctypes.c_int, ctypes.c_long]
    lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if hasattr(lib, "prctl"):
        lib.prctl.restype = ctypes.c_int
        lib.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
    return lib
