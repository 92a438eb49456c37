"""Shared memory between the loader and its worker processes: shard arrays in, batches out.

Shards reach the workers as anonymous memory files (``memfd_create``, or an unlinked temp
file where that is missing): the loader copies a shard's rows, in their shuffled order, into
one such file in a producer thread, and passes its file descriptor over a Unix socket.
Nothing is ever named in ``/dev/shm``, so a crash cannot leave a file behind.

Batches come back the way MXNet's own DataLoader sends them: NDArrays in MXNet's
``cpu_shared`` memory, whose descriptors travel with the message, so the loader wraps them
without a copy. numpy arrays in a batch travel the same way through a memory file; small ones
and everything else are pickled.
"""
from __future__ import annotations

import glob
import io
import logging
import mmap
import os
import pickle
import socket
import tempfile
import weakref
from multiprocessing import reduction
from typing import Any, Sequence

import numpy as np

from . import require_mxnet
from .arrays import row_chunks, row_index

__all__ = ["SharedArrays", "attach", "dump_batch", "load_batch", "recv_fds", "remove_worker_shm",
           "send_fds"]

logger = logging.getLogger(__name__)

INLINE_BYTES = 64 << 10  # numpy arrays smaller than this are pickled with the message
_ALIGN = 64


def _memory_file(size: int) -> int:
    """A file descriptor of ``size`` bytes of anonymous, shareable memory."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("gluon_stream", os.MFD_CLOEXEC)
    else:  # pragma: no cover - non-Linux
        with tempfile.TemporaryFile(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as fp:
            fd = os.dup(fp.fileno())
    try:
        os.ftruncate(fd, max(1, size))
    except BaseException:
        os.close(fd)
        raise
    return fd


class _MemoryFile:
    """Owns a memory file's descriptor: closed when the last holder lets go (or :meth:`close`)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.close = weakref.finalize(self, _close_fd, fd)


class SharedArrays(tuple):
    """Arrays that live in one anonymous shared-memory file, which this process does not map.

    The items are placeholders with the arrays' shapes and dtypes (for ``len()`` and schema
    checks; they hold no data); :meth:`rows` reads real rows, and a worker maps the file with
    :func:`attach`. Keeping no mapping costs this process one file descriptor per shard and
    nothing else (a Python ``mmap`` holds a duplicate descriptor while it lives). The
    descriptor is closed when the object is garbage collected, or by :meth:`close`.
    """

    layout: tuple

    def __new__(cls, layout: tuple, fd: int) -> "SharedArrays":
        shadows = [np.broadcast_to(np.zeros((), np.dtype(d)), shape) for d, shape, _ in layout]
        self = super().__new__(cls, shadows)
        self.layout, self._file = layout, _MemoryFile(fd)
        return self

    @property
    def fd(self) -> int:
        return self._file.fd

    @classmethod
    def copy_of(cls, arrays: Sequence[np.ndarray], order: np.ndarray | None = None
                ) -> "SharedArrays":
        """Copy ``arrays`` (their rows in ``order``, if given) into a new memory file."""
        layout, offset = [], 0
        for a in arrays:
            n = len(order) if order is not None else a.shape[0]
            shape = (n,) + tuple(a.shape[1:])
            layout.append((np.dtype(a.dtype).str, shape, offset))
            offset += -(-_nbytes(np.dtype(a.dtype), shape) // _ALIGN) * _ALIGN
        fd = _memory_file(offset)
        shared = cls(tuple(layout), fd)
        with _mapped(fd, tuple(layout)) as views:
            _fill(views, arrays, order)
        return shared

    def rows(self, start: int, stop: int) -> tuple[np.ndarray, ...]:
        """Copies of rows ``start .. stop - 1`` of every array."""
        return self.take(range(start, stop))

    def take(self, rows: Any) -> tuple[np.ndarray, ...]:
        """Copies of some rows (a range or indices) of every array."""
        index = row_index(rows)
        with _mapped(self.fd, self.layout) as views:
            return tuple(v[index] for v in views)

    def close(self) -> None:
        """Close the file descriptor now."""
        self._file.close()


def attach(fd: int, layout: tuple) -> tuple[np.ndarray, ...]:
    """Map memory another process shared: arrays backed by it (this closes ``fd``; the
    mapping lives as long as the arrays)."""
    try:
        memory = mmap.mmap(fd, _size(layout))
    finally:
        _close_fd(fd)
    return tuple(_views(memory, layout))


class _mapped:
    """A short-lived mapping of a memory file, unmapped on exit (its views must not escape)."""

    def __init__(self, fd: int, layout: tuple) -> None:
        self.memory = mmap.mmap(fd, _size(layout))
        self.views = _views(self.memory, layout)

    def __enter__(self) -> list[np.ndarray]:
        return self.views

    def __exit__(self, *exc: Any) -> None:
        self.views.clear()
        self.memory.close()


def _fill(views: list[np.ndarray], arrays: Sequence[np.ndarray], order: np.ndarray | None
          ) -> None:
    """Write ``arrays`` (rows in ``order``) into ``views`` (a function: no view outlives it)."""
    for src, dst in zip(arrays, views):
        if order is None:
            dst[...] = src
        else:
            for begin, rows in row_chunks(src, order):
                dst[begin:begin + len(rows)] = rows


def _nbytes(dtype: np.dtype, shape: tuple) -> int:
    return max(1, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)


def _size(layout: Sequence[tuple]) -> int:
    return max([off + _nbytes(np.dtype(d), shape) for d, shape, off in layout] + [1])


def _views(memory: mmap.mmap, layout: Sequence[tuple]) -> list[np.ndarray]:
    return [np.ndarray(shape, dtype=np.dtype(dtype), buffer=memory, offset=offset)
            for dtype, shape, offset in layout]


def _close_fd(fd: int) -> None:
    try:
        os.close(fd)
    except OSError as exc:  # already closed by its owner
        logger.debug("fd %d already closed: %s", fd, exc)


# -- batches back from a worker ------------------------------------------------------------------
class _BatchPickler(pickle.Pickler):
    """Pickles a batch, taking its arrays out of band: NDArrays as cpu_shared descriptors,
    large numpy arrays as memory files."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.fds: list[int] = []
        self.keep: list[Any] = []  # the worker's own references, alive until the fds are sent
        self._nd = require_mxnet().nd

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, self._nd.NDArray):
            mx = require_mxnet()
            shared = obj if obj.context.device_type == "cpu_shared" \
                else obj.as_in_context(mx.Context("cpu_shared", 0))
            shared.wait_to_read()
            pid, fd, shape, dtype = shared._to_shared_mem()
            self.keep.append(shared)
            self.fds.append(fd)
            return ("nd", len(self.fds) - 1, pid, tuple(shape), np.dtype(dtype).str)
        if isinstance(obj, np.ndarray) and obj.nbytes >= INLINE_BYTES and not obj.dtype.hasobject:
            shared = SharedArrays.copy_of([obj[np.newaxis]])
            self.keep.append(shared)
            self.fds.append(shared.fd)
            return ("np", len(self.fds) - 1, obj.shape, obj.dtype.str)
        return None


def dump_batch(batch: Any) -> tuple[bytes, list[int], list[Any]]:
    """(payload, file descriptors to send with it, objects to keep alive until they are sent)."""
    buf = io.BytesIO()
    pickler = _BatchPickler(buf)
    pickler.dump(batch)
    return buf.getvalue(), pickler.fds, pickler.keep


class _BatchUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, fds: Sequence[int]) -> None:
        super().__init__(io.BytesIO(data))
        self.fds = list(fds)

    def persistent_load(self, pid: Any) -> Any:
        kind = pid[0]
        if kind == "nd":
            _, index, owner, shape, dtype = pid
            nd = require_mxnet().nd
            fd, self.fds[index] = self.fds[index], -1
            return nd.NDArray(nd.ndarray._new_from_shared_mem(owner, fd, shape, np.dtype(dtype)))
        if kind == "np":
            _, index, shape, dtype = pid
            fd, self.fds[index] = self.fds[index], -1
            return attach(fd, ((dtype, (1,) + tuple(shape), 0),))[0][0]
        raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")


def load_batch(data: bytes, fds: Sequence[int]) -> Any:
    """The batch :func:`dump_batch` made, its arrays mapped from the received descriptors."""
    unpickler = _BatchUnpickler(data, fds)
    try:
        return unpickler.load()
    finally:
        for fd in unpickler.fds:  # any the payload did not claim
            if fd >= 0:
                _close_fd(fd)


# -- descriptors over a Unix socket --------------------------------------------------------------
def send_fds(conn: Any, fds: Sequence[int]) -> None:
    """Send file descriptors over a multiprocessing Connection backed by a Unix socket."""
    if not fds:
        return
    with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        reduction.sendfds(sock, list(fds))


def recv_fds(conn: Any, count: int) -> list[int]:
    """Receive ``count`` file descriptors sent with :func:`send_fds`."""
    if not count:
        return []
    with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        return list(reduction.recvfds(sock, count))


def remove_worker_shm(pid: int) -> list[str]:
    """Remove /dev/shm files a dead worker created but never unlinked.

    MXNet names them ``/dev/shm/mx_<pid in hex>_<id>`` and unlinks each right after creating
    it (the fd travels to the parent), so only a worker killed inside that window leaves one.
    """
    removed = []
    for path in glob.glob(f"/dev/shm/mx_{pid:x}_*"):
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            logger.debug("%s already removed", path)
    if removed:
        logger.info("removed %d shared-memory file(s) left by dead DataLoader worker %d",
                    len(removed), pid)
    return removed
