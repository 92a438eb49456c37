"""Validated reading and atomic writing of ``.npy`` / ``.npz`` shard files.

``np.load`` trusts its input: it raises ``EOFError`` on an empty file, loads a
valid array with junk appended without complaint, allocates whatever a forged
header claims before reading any data, and hands non-``.npy`` bytes to pickle
when pickles are allowed.  Every shard therefore goes through
:func:`inspect_shard` first, which checks the magic, the header, the dtype and
that the file size equals header + ``prod(shape) * itemsize`` *before* any
array is allocated.  Files are always loaded with ``allow_pickle=False``.

The contract, kept by a fuzz test (``tests/test_fuzz.py``): a file yields arrays identical
to ``np.load(path, allow_pickle=False)`` or raises a :class:`~gluon_stream.StreamError`
(:class:`CorruptShard` or :class:`UnsafeShard`), never another exception, never a hang.
Only regular files are opened (a FIFO is refused without blocking), and the file that was
checked is the one loaded. A shard's arrays all have a sample axis of one length.

What MXNet can batch is ``_batchable``'s rule; it runs on numpy arrays and on
:class:`ArrayInfo` headers alike, so ``gluon-stream inspect`` and the loader refuse the same
files for the same reason. What a function may return as a shard is ``_columns``'.

Writers use :func:`write_shard`, which writes a private temporary file in the
destination directory and renames it into place, so a reader never sees half a
shard.
"""
from __future__ import annotations

import logging
import lzma
import math
import os
import stat
import struct
import tempfile
import tokenize
import zipfile
import zlib
from dataclasses import dataclass
from typing import Any, BinaryIO, Mapping, Sequence, Union

import numpy as np

from ._utils.columns import Columns, normalize_arrays, sample_axis_problem
from ._utils.files import TEMP_MARKER, is_disk_full, remove_if_exists
from .errors import CorruptShard, ShardError, StreamError, UnsafeShard

__all__ = ["ArrayInfo", "inspect_file", "inspect_shard", "load_shard", "open_regular",
           "write_shard"]

logger = logging.getLogger(__name__)

NPY_MAGIC = b"\x93NUMPY"
ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")
PICKLE_PROTO = b"\x80"
MAX_HEADER_BYTES = 1 << 20  # numpy itself refuses headers above 10 kB by default since 1.24
MAX_PLAIN_RATIO = 64  # compression ratios above this are verified by decompressing once
MAX_INTP = np.iinfo(np.intp).max


#: Errors numpy's header parser raises on hostile text (tokenize: an unclosed bracket or quote).
_HEADER_ERRORS = (ValueError, SyntaxError, TypeError, OverflowError, KeyError, IndexError,
                  RecursionError, tokenize.TokenError)
#: Errors reading a damaged zip archive or member raises (bz2 reports bad data as OSError).
_ZIP_ERRORS = (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, zlib.error, lzma.LZMAError,
               NotImplementedError, OSError, ValueError, struct.error)
_ZIP_METHODS = (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA)

ArrayLike = Union[np.ndarray, Sequence[np.ndarray], Mapping[str, np.ndarray]]


@dataclass(frozen=True)
class ArrayInfo:
    """What a shard file's header says about one stored array."""

    name: str
    shape: tuple
    dtype: np.dtype
    nbytes: int


@dataclass(frozen=True)
class _NpyLayout:
    """A checked ``.npy`` header: the array and where its data starts."""

    info: ArrayInfo
    offset: int
    fortran: bool


def _corrupt(path: Any, reason: str, fix: str | None = None) -> CorruptShard:
    fix = fix or ("delete it (a cached shard is regenerated on the next run) or fix the "
                  "program that wrote it")
    return CorruptShard(f"corrupt shard {os.fspath(path)!r}: {reason}; {fix}",
                        path=path, reason=reason)


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def open_regular(path: str | os.PathLike) -> BinaryIO:
    """Open ``path`` for reading only if it is a regular file (symlinks to one are followed).

    A FIFO, device, socket or directory is refused with :class:`CorruptShard` without
    blocking: it is stat'ed first, opened with ``O_NONBLOCK`` and checked again on the open
    descriptor, so a file swapped in between cannot block either. A missing file raises
    ``FileNotFoundError``.
    """
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise _not_regular(path, mode)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _not_regular(path, mode)
    return os.fdopen(fd, "rb")


def _not_regular(path: Any, mode: int) -> CorruptShard:
    kind = _kind(mode)
    fix = ("a directory of shards is read as FileSource('dir'), which means its .npy/.npz "
           "files" if stat.S_ISDIR(mode) else "shards are regular .npy/.npz files; remove it")
    return _corrupt(path, f"is {kind}, not a shard file", fix)


def _read_npy_header(fp: Any, path: Any, available: int) -> _NpyLayout:
    """Parse and check one ``.npy`` header from ``fp``; ``available``: the bytes from here on."""
    _check_magic(fp, path)
    major, prefix, header_len = _header_length(fp, path, available)
    if major == 3:  # numpy decodes 3.0 headers as UTF-8; our reader below would use latin-1
        text = fp.read(header_len)
        if not text.isascii():
            raise _corrupt(path, "a version 3.0 header with non-ASCII text (unicode field names)",
                           "store plain numeric arrays with np.save")
        fp.seek(-header_len, os.SEEK_CUR)
    fp.seek(-(prefix - 8), os.SEEK_CUR)  # back to the length field, as numpy's reader expects
    shape, fortran, dtype = _array_header(fp, path, major)
    nbytes = math.prod(shape) * dtype.itemsize  # Python ints: no overflow
    _check_size(path, shape, dtype, prefix + header_len + nbytes, available)
    return _NpyLayout(ArrayInfo("", shape, dtype, nbytes), prefix + header_len, bool(fortran))


def _check_magic(fp: Any, path: Any) -> None:
    """Refuse an empty file, a pickle, or anything else that is not a ``.npy`` array."""
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


def _header_length(fp: Any, path: Any, available: int) -> tuple[int, int, int]:
    """``(major version, bytes before the header text, the header text's length)``, read
    after the magic and checked against the format versions and ``available``."""
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
    if version[1] != 0:
        raise _corrupt(path, f"unsupported .npy format version {major}.{version[1]}")
    if len(raw_len) < struct.calcsize(fmt):
        raise _corrupt(path, "truncated header")
    header_len = struct.unpack(fmt, raw_len)[0]
    if header_len > MAX_HEADER_BYTES:
        raise _corrupt(path, f"header claims {header_len} bytes (forged or damaged header)")
    if prefix + header_len > available:
        raise _corrupt(path, "truncated header")
    return major, prefix, header_len


def _array_header(fp: Any, path: Any, major: int) -> tuple[tuple, bool, np.dtype]:
    """``(shape, fortran order, dtype)`` read by numpy's own header reader (``fp`` at the
    length field), refused if the dtype needs pickle or the shape is not plain integers."""
    try:
        if major == 1:
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(fp)
        else:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(fp)
    except _HEADER_ERRORS as exc:
        raise _corrupt(path, f"bad header ({type(exc).__name__}: {exc})") from exc
    if dtype.hasobject:
        raise UnsafeShard(
            f"unsafe shard {os.fspath(path)!r}: dtype {dtype} holds Python objects and would need "
            "pickle to load; store numeric arrays instead",
            path=path,
        )
    if any(isinstance(d, bool) for d in shape):  # numpy's parser takes True for 1; its reader not
        raise _corrupt(path, f"shape {shape} holds a bool, not an integer")
    shape = tuple(int(d) for d in shape)
    _check_dtype(path, shape, dtype)
    return shape, fortran, dtype


def _check_size(path: Any, shape: tuple, dtype: np.dtype, expected: int, available: int) -> None:
    """Refuse a file whose size is not the ``expected`` bytes its header says, or an array
    numpy could not address."""
    if available < expected:
        raise _corrupt(path, f"truncated: header says {shape} {dtype} = {expected} bytes, "
                             f"file has {available}")
    if available > expected:
        raise _corrupt(path, f"size mismatch: header says {expected} bytes, file has {available} "
                             "(junk appended)")
    if math.prod(d for d in shape if d) * dtype.itemsize > MAX_INTP:  # an empty array's other axes
        raise _corrupt(path, f"shape {shape} of {dtype} is larger than numpy can address")


def _check_dtype(path: Any, shape: tuple, dtype: np.dtype) -> None:
    """Refuse headers whose size check would prove nothing, or that numpy cannot read back."""
    if any(d < 0 for d in shape):
        raise _corrupt(path, f"negative dimension in shape {shape}")
    if dtype.itemsize == 0:
        raise _corrupt(path, f"dtype {dtype} has 0-byte items, so the file size cannot confirm "
                             f"shape {shape} (forged or damaged header)")
    if dtype.shape:  # np.load cannot read a top-level subarray dtype back either
        raise _corrupt(path, f"dtype {dtype} is a subarray dtype (np.save never writes one)")


def inspect_shard(path: str | os.PathLike) -> list[ArrayInfo]:
    """Validate a shard file without loading its data and describe its arrays.

    Raises:
        CorruptShard: empty, truncated, bad magic/header, size mismatch, not a regular file,
            arrays without a sample axis or with sample axes of different lengths.
        UnsafeShard: a pickle or an object dtype.
    """
    with _opened(path) as fp:
        return _inspect_open(fp, path)[0]


def inspect_file(fp: BinaryIO, size: int, path: Any) -> list[ArrayInfo]:
    """:func:`inspect_shard` of an open, seekable binary file of ``size`` bytes that is not a
    local file (an fsspec file: only the headers, and an ``.npz``'s directory, are read);
    ``path`` names it in errors."""
    return _inspect_open(fp, path, size)[0]


class _opened:
    """``open_regular`` as a context manager whose missing file is a CorruptShard."""

    def __init__(self, path: Any) -> None:
        self.path = path

    def __enter__(self) -> BinaryIO:
        try:
            self.fp = open_regular(self.path)
        except FileNotFoundError as exc:
            raise _corrupt(self.path, "file does not exist") from exc
        return self.fp

    def __exit__(self, *exc: Any) -> None:
        self.fp.close()


def _inspect_open(fp: BinaryIO, path: Any, size: int | None = None
                  ) -> tuple[list[ArrayInfo], _NpyLayout | None]:
    """Infos of an open shard, and the ``.npy`` layout (None for ``.npz``)."""
    if size is None:
        size = os.fstat(fp.fileno()).st_size
    head = fp.read(6)
    fp.seek(0)
    if head[:4] in ZIP_MAGICS:
        infos, layout = _inspect_npz(fp, path, size), None
    else:
        layout = _read_npy_header(fp, path, size)
        info = layout.info
        infos = [ArrayInfo("arr_0", info.shape, info.dtype, info.nbytes)]
    problem = sample_axis_problem((i.name, i.shape) for i in infos)
    if problem:
        raise _corrupt(path, problem, "every array of a shard needs the same number of samples "
                                      "along its first axis; fix the program that wrote it")
    return infos, layout




def _inspect_npz(fp: BinaryIO, path: Any, size: int) -> list[ArrayInfo]:
    infos = []
    try:
        with zipfile.ZipFile(fp) as zf:
            members = zf.infolist()
            _check_member_names(members, path)
            for member in members:
                _check_member(zf, member, path, size)
                with zf.open(member) as mfp:
                    info = _read_npy_header(_Seekless(mfp), path, member.file_size).info
                infos.append(ArrayInfo(member.filename[:-4], info.shape, info.dtype, info.nbytes))
    except StreamError:
        raise
    except _ZIP_ERRORS as exc:
        raise _corrupt(path, f"bad .npz archive ({type(exc).__name__}: {exc})") from exc
    if not infos:
        raise _corrupt(path, "empty .npz archive (no arrays)")
    return infos


def _check_member_names(members: list[zipfile.ZipInfo], path: Any) -> None:
    """Each member is an ``.npy`` whose name ``np.load`` maps to it and to nothing else."""
    names = [m.filename for m in members]
    for name in names:
        if not name.endswith(".npy"):
            raise _corrupt(path, f"member {name!r} is not a .npy array")
    stripped = [n[:-4] for n in names]
    clash = next((n for n in names if names.count(n) > 1 or n in stripped), None)
    if clash is not None:
        raise _corrupt(path, f"member name {clash!r} is ambiguous (duplicate members, or one "
                             "named like another without its .npy)")


def _check_member(zf: zipfile.ZipFile, member: zipfile.ZipInfo, path: Any, size: int) -> None:
    """Make sure a member can be read and holds the bytes its zip entry claims, before numpy
    allocates them.

    An encrypted member or an unknown compression method is refused. A stored member must
    occupy exactly its size. A compressed member whose claimed size is far beyond what its
    compressed bytes could plausibly hold (a forged entry) is decompressed once, in chunks, and
    counted; ordinary ratios are left to zipfile's own size and CRC checks.
    """
    if member.flag_bits & 0x1:
        raise _corrupt(path, f"member {member.filename!r} is encrypted (np.savez never "
                             "encrypts; damaged or foreign archive)")
    if member.compress_type not in _ZIP_METHODS:
        raise _corrupt(path, f"member {member.filename!r} uses zip compression method "
                             f"{member.compress_type}, which zipfile cannot read")
    if member.header_offset + member.compress_size > size:
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
    with zf.open(member) as mfp:
        while actual <= member.file_size:
            chunk = mfp.read(1 << 20)
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
    """Validate then load a shard: one array for ``.npy``, the stored arrays in order for ``.npz``
    (a :class:`Columns` that carries their names, unless they are numpy's ``arr_0, arr_1, ...``).

    The file is opened once (a regular file only), checked, and loaded from that same open
    file, so what was checked is what is read.

    Args:
        path: The shard file.
        mmap: Memory-map a ``.npy`` file instead of reading it (large shards).
    """
    with _opened(path) as fp:
        infos, layout = _inspect_open(fp, path)
        fp.seek(0)
        try:
            if layout is None:
                with np.load(fp, allow_pickle=False) as npz:
                    names = [info.name for info in infos]
                    positional = names == [f"arr_{i}" for i in range(len(names))]
                    return Columns((npz[n + ".npy"] for n in names),
                                   None if positional else names)
            if mmap:  # np.load maps only by name, which could be swapped for a FIFO meanwhile
                return (np.memmap(fp, dtype=layout.info.dtype, mode="r", offset=layout.offset,
                                  shape=layout.info.shape, order="F" if layout.fortran else "C"),)
            return (np.load(fp, allow_pickle=False),)
        except StreamError:
            raise
        except _ZIP_ERRORS as exc:
            raise _corrupt(path, f"unreadable ({type(exc).__name__}: {exc})") from exc


def write_shard(path: str | os.PathLike, value: ArrayLike) -> str:
    """Atomically write arrays to ``path`` (``.npy`` for one array, ``.npz`` otherwise).

    Writes a private temporary file beside ``path`` and renames it into place, so a
    concurrent reader sees either nothing or the whole shard. Returns the path written.

    Raises:
        ShardError: the disk is full (``ENOSPC``, or numpy's short write); no partial file is
            left.
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
        if is_disk_full(exc):
            raise ShardError(f"disk full while writing shard {path!r} ({exc}): free space in "
                             f"{directory or '.'!r} or point cache_dir elsewhere (not retried)",
                             disk_full=True) from exc
        raise
    return path
