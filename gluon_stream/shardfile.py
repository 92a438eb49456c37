"""Validated reading and atomic writing of ``.npy`` / ``.npz`` shard files.

``np.load`` trusts its input: it raises ``EOFError`` on an empty file, loads a
valid array with junk appended without complaint, allocates whatever a forged
header claims before reading any data, and hands non-``.npy`` bytes to pickle
when pickles are allowed.  Every shard therefore goes through
:func:`inspect_shard` first, which checks the magic, the header, the dtype and
that the file size equals header + ``prod(shape) * itemsize`` *before* any
array is allocated.  Files are always loaded with ``allow_pickle=False``.

Writers use :func:`write_shard`, which writes a private temporary file in the
destination directory and renames it into place, so a reader never sees half a
shard.
"""
from __future__ import annotations

import errno
import logging
import math
import os
import struct
import tempfile
import zipfile
import zlib
from dataclasses import dataclass
from typing import Any, Mapping, Sequence, Union

import numpy as np

from .errors import CorruptShard, ShardError, UnsafeShard

__all__ = ["ArrayInfo", "inspect_shard", "load_shard", "normalize_arrays", "remove_if_exists",
           "write_shard"]

logger = logging.getLogger(__name__)

NPY_MAGIC = b"\x93NUMPY"
ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")
PICKLE_PROTO = b"\x80"
MAX_HEADER_BYTES = 1 << 20  # numpy itself refuses headers above 10 kB by default since 1.24
TEMP_MARKER = ".tmp"
MAX_PLAIN_RATIO = 64  # compression ratios above this are verified by decompressing once

ArrayLike = Union[np.ndarray, Sequence[np.ndarray], Mapping[str, np.ndarray]]


@dataclass(frozen=True)
class ArrayInfo:
    """What a shard file's header says about one stored array."""

    name: str
    shape: tuple
    dtype: np.dtype
    nbytes: int


def _corrupt(path: Any, reason: str) -> CorruptShard:
    return CorruptShard(
        f"corrupt shard {os.fspath(path)!r}: {reason}; delete it (a cached shard is regenerated "
        "on the next run) or fix the program that wrote it",
        path=path, reason=reason,
    )


def _read_npy_header(fp: Any, path: Any, available: int) -> ArrayInfo:
    """Parse and check one ``.npy`` header from ``fp``; ``available`` is the byte count from here."""
    magic = fp.read(6)
    if not magic:
        raise _corrupt(path, "empty file (0 bytes)")
    if magic != NPY_MAGIC:
        if magic[:1] == PICKLE_PROTO:
            raise UnsafeShard(
                f"unsafe shard {os.fspath(path)!r}: it is a pickle, not a .npy array; gluon_stream "
                "never unpickles shard data. Save plain numeric arrays with np.save/np.savez",
                path=path,
            )
        raise _corrupt(path, f"bad magic {magic[:6]!r} (not a .npy file)")
    version = fp.read(2)
    if len(version) < 2:
        raise _corrupt(path, "truncated header")
    major = version[0]
    if major == 1:
        raw_len = fp.read(2)
        fmt, prefix = "<H", 10
    elif major in (2, 3):
        raw_len = fp.read(4)
        fmt, prefix = "<I", 12
    else:
        raise _corrupt(path, f"unsupported .npy format version {major}.{version[1]}")
    if len(raw_len) < struct.calcsize(fmt):
        raise _corrupt(path, "truncated header")
    header_len = struct.unpack(fmt, raw_len)[0]
    if header_len > MAX_HEADER_BYTES:
        raise _corrupt(path, f"header claims {header_len} bytes (forged or damaged header)")
    if prefix + header_len > available:
        raise _corrupt(path, "truncated header")
    fp.seek(-(prefix - 8), os.SEEK_CUR)  # back to the length field, as numpy's reader expects
    try:
        if major == 1:
            shape, _fortran, dtype = np.lib.format.read_array_header_1_0(fp)
        else:
            shape, _fortran, dtype = np.lib.format.read_array_header_2_0(fp)
    except (ValueError, SyntaxError, TypeError) as exc:
        raise _corrupt(path, f"bad header ({exc})") from exc
    if dtype.hasobject:
        raise UnsafeShard(
            f"unsafe shard {os.fspath(path)!r}: dtype {dtype} holds Python objects and would need "
            "pickle to load; store numeric arrays instead",
            path=path,
        )
    if any(int(d) < 0 for d in shape):
        raise _corrupt(path, f"negative dimension in shape {shape}")
    nbytes = math.prod(int(d) for d in shape) * dtype.itemsize  # Python ints: no overflow
    expected = prefix + header_len + nbytes
    if available < expected:
        raise _corrupt(path, f"truncated: header says {shape} {dtype} = {expected} bytes, "
                             f"file has {available}")
    if available > expected:
        raise _corrupt(path, f"size mismatch: header says {expected} bytes, file has {available} "
                             "(junk appended)")
    return ArrayInfo("", tuple(int(d) for d in shape), dtype, nbytes)


def inspect_shard(path: str | os.PathLike) -> list[ArrayInfo]:
    """Validate a shard file without loading its data and describe its arrays.

    Raises:
        CorruptShard: empty, truncated, bad magic/header, size mismatch.
        UnsafeShard: a pickle or an object dtype.
    """
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as fp:
            head = fp.read(6)
            fp.seek(0)
            if head[:4] in ZIP_MAGICS:
                return _inspect_npz(path)
            info = _read_npy_header(fp, path, size)
    except FileNotFoundError as exc:
        raise _corrupt(path, "file does not exist") from exc
    return [ArrayInfo("arr_0", info.shape, info.dtype, info.nbytes)]


def _inspect_npz(path: Any) -> list[ArrayInfo]:
    infos = []
    try:
        with zipfile.ZipFile(path) as zf:
            for member in zf.infolist():
                if not member.filename.endswith(".npy"):
                    raise _corrupt(path, f"member {member.filename!r} is not a .npy array")
                _check_member_size(zf, member, path)
                with zf.open(member) as fp:
                    info = _read_npy_header(_Seekless(fp), path, member.file_size)
                infos.append(ArrayInfo(member.filename[:-4], info.shape, info.dtype, info.nbytes))
    except (zipfile.BadZipFile, EOFError, zlib.error, NotImplementedError) as exc:
        raise _corrupt(path, f"bad .npz archive ({type(exc).__name__}: {exc})") from exc
    if not infos:
        raise _corrupt(path, "empty .npz archive (no arrays)")
    return infos


def _check_member_size(zf: zipfile.ZipFile, member: zipfile.ZipInfo, path: Any) -> None:
    """Make sure a member really holds the bytes its zip entry claims, before numpy allocates them.

    A stored member must occupy exactly its size. A compressed member whose claimed size is far
    beyond what its compressed bytes could plausibly hold (a forged entry) is decompressed once,
    in chunks, and counted; ordinary ratios are left to zipfile's own size and CRC checks.
    """
    if member.header_offset + member.compress_size > os.path.getsize(path):
        raise _corrupt(path, f"member {member.filename!r} claims {member.compress_size} stored "
                             "bytes, more than the archive holds (forged or truncated)")
    if member.compress_type == zipfile.ZIP_STORED:
        if member.compress_size != member.file_size:
            raise _corrupt(path, f"member {member.filename!r} claims {member.file_size} bytes but "
                                 f"stores {member.compress_size}")
        return
    if member.file_size <= MAX_PLAIN_RATIO * member.compress_size + (1 << 20):
        return
    actual = 0
    with zf.open(member) as fp:
        while actual <= member.file_size:
            chunk = fp.read(1 << 20)
            if not chunk:
                break
            actual += len(chunk)
    if actual != member.file_size:
        raise _corrupt(path, f"member {member.filename!r} claims {member.file_size} bytes but "
                             f"decompresses to {actual} (forged size)")


class _Seekless:
    """Wrap a zip member stream so the header parser can step back inside what it has read."""

    def __init__(self, fp: Any) -> None:
        self._fp = fp
        self._buf = b""
        self._pos = 0

    def read(self, n: int = -1) -> bytes:
        need = len(self._buf) - self._pos
        if n < 0 or n > need:
            more = self._fp.read(-1 if n < 0 else n - need)
            self._buf += more
        end = len(self._buf) if n < 0 else min(len(self._buf), self._pos + n)
        out = self._buf[self._pos:end]
        self._pos = end
        return out

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self._pos = offset if whence == os.SEEK_SET else self._pos + offset
        return self._pos


def load_shard(path: str | os.PathLike, *, mmap: bool = False) -> tuple[np.ndarray, ...]:
    """Validate then load a shard: one array for ``.npy``, the stored arrays in order for ``.npz``.

    Args:
        path: The shard file.
        mmap: Memory-map a ``.npy`` file instead of reading it (large shards).
    """
    infos = inspect_shard(path)
    try:
        with open(path, "rb") as fp:
            is_npz = fp.read(4) in ZIP_MAGICS
        if not is_npz:
            arr = np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
            return (arr,)
        with np.load(path, allow_pickle=False) as npz:
            return tuple(npz[info.name] for info in infos)
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        raise _corrupt(path, f"unreadable ({type(exc).__name__}: {exc})") from exc


def normalize_arrays(value: Any, *, what: str) -> tuple[np.ndarray, ...]:
    """Turn an array, a tuple/list of arrays or a dict of arrays into a checked tuple of arrays.

    All arrays must share their first dimension (the samples) and hold no Python objects.
    ``what`` names the shard in error messages.
    """
    if isinstance(value, np.ndarray):
        arrays = (value,)
    elif isinstance(value, Mapping):
        arrays = tuple(value.values())
    elif isinstance(value, (tuple, list)):
        arrays = tuple(value)
    else:
        arrays = (np.asarray(value),)
    if not arrays:
        raise ValueError(f"{what}: no arrays (expected an array, a tuple of arrays or a dict)")
    out = []
    for i, arr in enumerate(arrays):
        arr = np.asarray(arr)
        if arr.dtype.hasobject:
            raise UnsafeShard(f"{what}: array {i} has dtype {arr.dtype} (Python objects); "
                              "only numeric arrays can be batched")
        if arr.ndim == 0:
            raise ValueError(f"{what}: array {i} is a scalar; arrays need a sample dimension")
        out.append(arr)
    lengths = {a.shape[0] for a in out}
    if len(lengths) > 1:
        raise ValueError(f"{what}: arrays differ in their first (sample) dimension: "
                         f"{[a.shape for a in out]}")
    return tuple(out)


def write_shard(path: str | os.PathLike, value: ArrayLike) -> str:
    """Atomically write arrays to ``path`` (``.npy`` for one array, ``.npz`` otherwise).

    Writes a private temporary file beside ``path`` and renames it into place, so a
    concurrent reader sees either nothing or the whole shard. Returns the path written.

    Raises:
        ShardError: the disk is full (``ENOSPC``); no partial file is left.
    """
    path = os.fspath(path)
    if isinstance(value, Mapping):
        names = list(value)
        arrays = normalize_arrays(value, what=path)
    else:
        arrays = normalize_arrays(value, what=path)
        names = [f"arr_{i}" for i in range(len(arrays))]
    directory, base = os.path.split(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{base}.{os.getpid()}.", suffix=TEMP_MARKER,
                               dir=directory or ".")
    try:
        with os.fdopen(fd, "wb") as fp:
            if len(arrays) == 1 and path.endswith(".npy"):
                np.lib.format.write_array(fp, arrays[0], allow_pickle=False)
            else:
                np.savez(fp, **dict(zip(names, arrays)))
            fp.flush()
            os.fsync(fp.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        remove_if_exists(tmp)
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            raise ShardError(f"disk full while writing shard {path!r}: free space in "
                             f"{directory or '.'!r} or point cache_dir elsewhere (not retried)",
                             disk_full=True) from exc
        raise
    return path


def remove_if_exists(path: str | os.PathLike) -> None:
    """Remove a file that may already be gone."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        logger.debug("%s already removed", os.fspath(path))
