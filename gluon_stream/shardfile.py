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

:func:`check_batchable` is the rule for what MXNet can batch (:data:`MXNET_DTYPES`, no
zero-size sample axes); it runs on numpy arrays and on :class:`ArrayInfo` headers alike, so
``gluon-stream inspect`` and the loader refuse the same files for the same reason.

Writers use :func:`write_shard`, which writes a private temporary file in the
destination directory and renames it into place, so a reader never sees half a
shard.
"""
from __future__ import annotations

import errno
import logging
import lzma
import math
import os
import re
import shutil
import stat
import struct
import tempfile
import tokenize
import zipfile
import zlib
from dataclasses import dataclass
from typing import Any, BinaryIO, Iterable, Mapping, Sequence, Union

import numpy as np

from .errors import (CorruptShard, SchemaMismatch, ShardError, StreamError, UnbatchableShard,
                     UnsafeShard)

__all__ = ["ArrayInfo", "Columns", "MXNET_DTYPES", "check_batchable", "discard_path",
           "inspect_shard", "is_disk_full", "load_shard", "names_of", "normalize_arrays",
           "open_regular", "remove_if_exists", "write_shard"]

logger = logging.getLogger(__name__)

NPY_MAGIC = b"\x93NUMPY"
ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")
PICKLE_PROTO = b"\x80"
MAX_HEADER_BYTES = 1 << 20  # numpy itself refuses headers above 10 kB by default since 1.24
TEMP_MARKER = ".tmp"
MAX_PLAIN_RATIO = 64  # compression ratios above this are verified by decompressing once
MAX_INTP = np.iinfo(np.intp).max

#: What MXNet 1.9 can hold in an NDArray (``mxnet.ndarray.ndarray._DTYPE_NP_TO_MX``, less its
#: structured bfloat16 stand-in), either byte order. ``tests/test_shardfile.py`` checks this
#: against the installed MXNet. bool is held, but ``nd.concat`` has no bool kernel.
MXNET_DTYPES = frozenset(np.dtype(t) for t in (np.float16, np.float32, np.float64, np.uint8,
                                                np.int8, np.int32, np.int64, np.bool_))
_MXNET_TYPES = frozenset(d.type for d in MXNET_DTYPES)

#: Errors numpy's header parser raises on hostile text (tokenize: an unclosed bracket or quote).
_HEADER_ERRORS = (ValueError, SyntaxError, TypeError, OverflowError, KeyError, IndexError,
                  RecursionError, tokenize.TokenError)
#: Errors reading a damaged zip archive or member raises (bz2 reports bad data as OSError).
_ZIP_ERRORS = (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, zlib.error, lzma.LZMAError,
               NotImplementedError, OSError, ValueError, struct.error)
_ZIP_METHODS = (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA)
_SHORT_WRITE = re.compile(r"\d+ requested and \d+ written")  # numpy's tofile: no errno
_DISK_FULL_TEXT = ("No space left on device", "ENOSPC", "[Errno 28]", "Disk quota exceeded",
                   "[Errno 122]")

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
    if version[1] != 0:
        raise _corrupt(path, f"unsupported .npy format version {major}.{version[1]}")
    if len(raw_len) < struct.calcsize(fmt):
        raise _corrupt(path, "truncated header")
    header_len = struct.unpack(fmt, raw_len)[0]
    if header_len > MAX_HEADER_BYTES:
        raise _corrupt(path, f"header claims {header_len} bytes (forged or damaged header)")
    if prefix + header_len > available:
        raise _corrupt(path, "truncated header")
    if major == 3:  # numpy decodes 3.0 headers as UTF-8; our reader below would use latin-1
        text = fp.read(header_len)
        if not text.isascii():
            raise _corrupt(path, "a version 3.0 header with non-ASCII text (unicode field names)",
                           "store plain numeric arrays with np.save")
        fp.seek(-header_len, os.SEEK_CUR)
    fp.seek(-(prefix - 8), os.SEEK_CUR)  # back to the length field, as numpy's reader expects
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
    nbytes = math.prod(shape) * dtype.itemsize  # Python ints: no overflow
    expected = prefix + header_len + nbytes
    if available < expected:
        raise _corrupt(path, f"truncated: header says {shape} {dtype} = {expected} bytes, "
                             f"file has {available}")
    if available > expected:
        raise _corrupt(path, f"size mismatch: header says {expected} bytes, file has {available} "
                             "(junk appended)")
    if math.prod(d for d in shape if d) * dtype.itemsize > MAX_INTP:  # an empty array's other axes
        raise _corrupt(path, f"shape {shape} of {dtype} is larger than numpy can address")
    return _NpyLayout(ArrayInfo("", shape, dtype, nbytes), prefix + header_len, bool(fortran))


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


def _inspect_open(fp: BinaryIO, path: Any) -> tuple[list[ArrayInfo], _NpyLayout | None]:
    """Infos of an open shard, and the ``.npy`` layout (None for ``.npz``)."""
    size = os.fstat(fp.fileno()).st_size
    head = fp.read(6)
    fp.seek(0)
    if head[:4] in ZIP_MAGICS:
        infos, layout = _inspect_npz(fp, path, size), None
    else:
        layout = _read_npy_header(fp, path, size)
        info = layout.info
        infos = [ArrayInfo("arr_0", info.shape, info.dtype, info.nbytes)]
    problem = _sample_axis_problem((i.name, i.shape) for i in infos)
    if problem:
        raise _corrupt(path, problem, "every array of a shard needs the same number of samples "
                                      "along its first axis; fix the program that wrote it")
    return infos, layout


def _sample_axis_problem(shapes: Iterable[tuple[Any, tuple]]) -> str | None:
    """Why ``(name, shape)`` pairs cannot form one shard (no sample axis, lengths differ), or None."""
    shapes = list(shapes)
    for name, shape in shapes:
        if len(shape) == 0:
            return (f"array {name!r} is 0-d (a scalar): it has no sample axis; store samples "
                    "along the first axis, e.g. np.atleast_1d(x)")
    if len({shape[0] for _, shape in shapes}) > 1:
        listed = ", ".join(f"{name!r}: {shape[0]}" for name, shape in shapes)
        return (f"arrays differ in their first (sample) dimension ({listed}; shapes "
                f"{[tuple(s) for _, s in shapes]})")
    return None


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


def check_batchable(arrays: Any, *, what: str) -> None:
    """Raise :class:`UnbatchableShard` unless MXNet can batch every array as it is.

    ``arrays`` is a numpy array, a sequence of arrays or of :class:`ArrayInfo` (a file's
    headers), or a dict of arrays; anything with ``dtype`` and ``shape``. Each needs a dtype in
    :data:`MXNET_DTYPES` (either byte order), a sample axis, and no zero-size axis after it
    (MXNet 1.9 reads a 0 in a shape as "unknown"). The message names ``what`` (the shard or
    file), the array (its ``.npz``/dict name, else its index), the dtype and what to convert it
    to. Cheap: it looks at dtypes and shapes only. Never imports MXNet.

    Example:
        >>> check_batchable((np.zeros(3), np.zeros(3, "datetime64[D]")), what="shard 'a'")
        Traceback (most recent call last):
        ...
        gluon_stream.errors.UnbatchableShard: shard 'a': array 1 has dtype datetime64[D] ...
    """
    if hasattr(arrays, "dtype") and hasattr(arrays, "shape"):
        named: Iterable[tuple[Any, Any]] = [(0, arrays)]
    elif isinstance(arrays, Mapping):
        named = arrays.items()
    else:
        named = [(getattr(a, "name", "") or i, a) for i, a in enumerate(arrays)]
    for name, arr in named:
        dtype, shape = np.dtype(arr.dtype), tuple(arr.shape)
        fix = _dtype_fix(dtype)
        if fix is not None:
            raise UnbatchableShard(
                f"{what}: array {name!r} has dtype {dtype} (shape {shape}), which MXNet cannot "
                f"batch (it holds {_supported()}); convert it in a transform: {fix}",
                array=name, dtype=dtype, shape=shape, fix=fix)
        if not shape or 0 in shape[1:]:
            fix = ("store samples along the first axis, e.g. np.atleast_1d(a)" if not shape else
                   "drop the empty axis, or give each sample at least one value")
            why = ("is 0-d: it has no sample axis" if not shape else
                   f"has shape {shape}: MXNet 1.9 reads a 0 in a shape as unknown and cannot "
                   "batch it")
            raise UnbatchableShard(f"{what}: array {name!r} {why}; {fix}", array=name,
                                   dtype=dtype, shape=shape, fix=fix)


def _supported() -> str:
    return ", ".join(sorted(str(d) for d in MXNET_DTYPES))


def _dtype_fix(dtype: np.dtype) -> str | None:
    """What to convert an array of ``dtype`` to so MXNet can batch it (None: it can already)."""
    if dtype.names is None and dtype.subdtype is None and dtype.type in _MXNET_TYPES:
        return None
    if dtype.names is not None:
        return "return each field as its own array: tuple(a[f] for f in a.dtype.names)"
    if dtype.kind == "M":
        return ("a.astype('int64') (units since 1970), or float seconds: "
                "(a - a.min()) / np.timedelta64(1, 's')")
    if dtype.kind == "m":
        return "float seconds: a / np.timedelta64(1, 's'), or a.astype('int64')"
    if dtype.kind == "c":
        return "split real and imaginary parts: np.stack([a.real, a.imag], axis=-1).astype('float32')"
    if dtype.kind in "US":
        return "encode the strings as integer ids: np.unique(a, return_inverse=True)[1].astype('int32')"
    if dtype.kind == "V":
        return "view the bytes as uint8: a.view(np.uint8).reshape(len(a), -1)"
    if dtype.kind == "u":
        return "a.astype('int32')" if dtype.itemsize < 4 else (
            "a.astype('int64') (or 'float64' if values reach 2**63)")
    if dtype.kind == "i":
        return "a.astype('int32')" if dtype.itemsize < 4 else "a.astype('int64')"
    if dtype.kind == "f":
        return "a.astype('float64')" if dtype.itemsize > 8 else "a.astype('float32')"
    return "a.astype('float32')"


class Columns(tuple):
    """A shard's arrays (a tuple), with their names where they have some: a dict's keys, or an
    ``.npz`` file's members saved by name (``np.savez(f, x=..., y=...)``); None otherwise."""

    names: tuple[str, ...] | None

    def __new__(cls, arrays: Any, names: Any = None) -> "Columns":
        self = super().__new__(cls, arrays)
        self.names = tuple(str(n) for n in names) if names is not None else None
        return self


def names_of(arrays: Any) -> tuple[str, ...] | None:
    """The names a tuple of arrays carries (see :class:`Columns`), or None."""
    return getattr(arrays, "names", None)


def normalize_arrays(value: Any, *, what: str) -> tuple[np.ndarray, ...]:
    """Turn what a function or transform returned into a checked tuple of arrays (the columns).

    Accepted: an array; a tuple of arrays; a dict of arrays (in its key order); a list of
    arrays that differ in shape or dtype (columns); a list or tuple of samples, each a tuple
    ``(data, label, ...)`` as Gluon's list datasets hold them (``[([1, 2], 0), ([3, 4], 1)]``),
    whose fields become the columns; MXNet NDArrays anywhere an array may be (anything with
    ``asnumpy()``; MXNet is never imported here). Refused as ambiguous: a list of two or more
    arrays of one shape and dtype (rows or columns?), and a list of tuples that also reads as
    columns. A tuple that reads as columns is columns. All arrays must share their first
    dimension (the samples) and hold no Python objects. ``what`` names the shard.

    Example:
        >>> [c.tolist() for c in normalize_arrays([([1, 2], 0), ([3, 4], 1)], what="shard 0")]
        [[[1, 2], [3, 4]], [0, 1]]
    """
    if isinstance(value, (tuple, list)) and _samples_of_fields(value):
        if _columns_problem(value, what) is not None:
            return _columns_of_samples(value, what)
        if isinstance(value, list):
            raise SchemaMismatch(
                f"{what}: a list of {len(value)} tuples of {len(value[0])} values is ambiguous: "
                f"{len(value)} samples of {len(value[0])} fields, or {len(value)} columns of "
                f"{len(value[0])} samples? Return columns: a tuple of arrays with the samples "
                "along the first axis, e.g. (np.stack(data), np.array(labels))")
    return _columns(value, what)


def _samples_of_fields(value: Sequence[Any]) -> bool:
    """Whether ``value`` could be samples: tuples of one length (a Gluon list dataset)."""
    return bool(value) and all(isinstance(v, tuple) for v in value) \
        and len(value[0]) > 0 and all(len(v) == len(value[0]) for v in value)


def _columns_problem(value: Sequence[Any], what: str) -> str | None:
    """Why ``value`` cannot be read as columns (None: it can). A column whose items differ in
    shape is ragged; it is never handed to numpy, which would warn or make an object array."""
    for i, item in enumerate(value):
        if len({np.shape(field) for field in item}) > 1:
            return f"item {i} is ragged"
    try:
        _columns(value, what)
    except (SchemaMismatch, UnsafeShard) as exc:
        return str(exc)
    return None


def _columns_of_samples(samples: Sequence[tuple], what: str) -> tuple[np.ndarray, ...]:
    """The columns of samples ``(data, label, ...)``: field j of every sample, stacked."""
    columns = []
    for j in range(len(samples[0])):
        fields = [_as_numpy(sample[j]) for sample in samples]
        shapes = {f.shape for f in fields}
        if len(shapes) > 1:
            raise SchemaMismatch(
                f"{what}: field {j} of the {len(samples)} samples differs in shape "
                f"({sorted(shapes)}); every sample needs one shape per field. Return columns: "
                "a tuple of arrays with the samples along the first axis")
        column = np.stack(fields)
        if column.dtype.hasobject:
            raise UnsafeShard(f"{what}: field {j} of the samples has dtype {column.dtype} "
                              "(Python objects); only numeric arrays can be batched")
        columns.append(column)
    return Columns(columns)


def _columns(value: Any, what: str) -> tuple[np.ndarray, ...]:
    """``value`` read as columns (see :func:`normalize_arrays`), checked."""
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, (tuple, list)):
        items = list(enumerate(value))
    else:
        items = [(0, value)]
    if not items:
        raise SchemaMismatch(f"{what}: no arrays (expected an array, a tuple of arrays or a dict)")
    out = []
    for name, item in items:
        arr = _as_numpy(item)
        if arr.dtype.hasobject:
            raise UnsafeShard(f"{what}: array {name!r} has dtype {arr.dtype} (Python objects); "
                              "only numeric arrays can be batched")
        out.append(arr)
    if isinstance(value, list) and len(out) > 1 and len({(a.shape, a.dtype) for a in out}) == 1:
        raise SchemaMismatch(
            f"{what}: a list of {len(out)} arrays of one shape {out[0].shape} and dtype "
            f"{out[0].dtype} is ambiguous (rows or columns?); return a tuple of columns, e.g. "
            f"(x, y), or np.stack(rows) for one array of {len(out)} samples")
    problem = _sample_axis_problem((name, a.shape) for (name, _), a in zip(items, out))
    if problem:
        raise SchemaMismatch(f"{what}: {problem}")
    return Columns(out, [name for name, _ in items] if isinstance(value, Mapping)
                   else names_of(value))


def _as_numpy(item: Any) -> np.ndarray:
    """An array as numpy: NDArrays (duck-typed by ``asnumpy``) copied out, others as-is."""
    if isinstance(item, np.ndarray):
        return item
    if callable(getattr(item, "asnumpy", None)):
        return np.asarray(item.asnumpy())
    return np.asarray(item)


def is_disk_full(error: BaseException | str) -> bool:
    """Whether an error (or a generator's stderr text) says the disk or quota is full.

    numpy reports a short write as ``OSError('N requested and M written')`` without an errno,
    so the text counts as well as ``ENOSPC``/``EDQUOT``.
    """
    if isinstance(error, BaseException):
        if not isinstance(error, OSError):
            return False
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        error = str(error)
    return any(hint in error for hint in _DISK_FULL_TEXT) or bool(_SHORT_WRITE.search(error))


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


def remove_if_exists(path: str | os.PathLike) -> None:
    """Remove a file that may already be gone."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        logger.debug("%s already removed", os.fspath(path))


def discard_path(path: str | os.PathLike) -> None:
    """Remove whatever is at a temp path of ours: a file, FIFO or symlink (never followed), or a
    directory tree a generator made there. Gone already is fine."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(path)
    else:
        remove_if_exists(path)
