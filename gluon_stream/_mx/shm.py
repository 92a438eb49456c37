"""Shared memory between the loader and its worker processes: shard arrays in, batches out.

Shards reach the workers as anonymous memory files (``memfd_create``, or an unlinked temp
file where that is missing): the loader copies a shard's rows, in their shuffled order, into
one such file in a producer thread, and passes its file descriptor over a Unix socket.
Nothing is ever named in ``/dev/shm``, so a crash cannot leave a file behind.

Batches come back through slots: memory files a worker writes batches into, each mapped once
by the loader (its descriptor travels with the first batch written into it) and reused for
the worker's later batches once the loader has dropped the batch it held. The loader wraps a
slot's arrays as NDArrays without a copy, so a batch costs the loader's process a short message
and two small wrappers, not a memory file made, passed, mapped and unmapped per batch as
MXNet's ``cpu_shared`` arrays are (see :class:`SlotTable` for why a batch held by the training
loop is never overwritten). The worker stacks samples straight into the slot
(:func:`stack_batchify`). Large numpy arrays in a batch travel in the slot too; small ones and
everything else are pickled.
"""
from __future__ import annotations

import collections
import ctypes
import glob
import io
import itertools
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

from .._utils.columns import ShapedArrays
from .._utils.libc import libc
from . import ZERO_COPY_DTYPES, copy_into, import_mxnet, row_chunks, row_index, wrap_numpy
from .consumed import consume_into

__all__ = ["KEEP_FREE", "SharedArrays", "SlotTable", "SlotWriter", "Stacked", "attach",
           "recv_fds", "remove_worker_shm", "send_fds", "stack_batchify"]

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


class SharedArrays(ShapedArrays):
    """Arrays that live in one anonymous shared-memory file, which this process does not map.

    :meth:`take` reads rows, and a worker maps the file with :func:`attach`. Keeping no mapping
    costs this process one file descriptor per shard and nothing else (a Python ``mmap`` holds a
    duplicate descriptor while it lives). The descriptor is closed when the object is garbage
    collected, or by :meth:`close`.
    """

    layout: tuple
    _file: _MemoryFile

    def __new__(cls, layout: tuple, fd: int) -> "SharedArrays":
        self = super().__new__(cls, [(d, shape) for d, shape, _ in layout])
        self.layout, self._file = layout, _MemoryFile(fd)
        return self

    @property
    def fd(self) -> int:
        return self._file.fd

    @property
    def memory_owner(self) -> object:
        """An object whose end frees this memory (every copy of these arrays shares it): a
        ``memory_budget`` counts the memory until it ends, however long workers keep it."""
        return self._file

    @classmethod
    def copy_of(cls, arrays: Sequence[np.ndarray], order: np.ndarray | None = None,
                consume: Sequence[bool] = ()) -> "SharedArrays":
        """Copy ``arrays`` (their rows in ``order``, if given) into a new memory file;
        ``consume[i]``: array ``i`` is given back to the OS as it is copied
        (:mod:`~gluon_stream._mx.consumed`)."""
        layout, offset = [], 0
        for a in arrays:
            n = len(order) if order is not None else a.shape[0]
            shape = (n,) + tuple(a.shape[1:])
            layout.append((np.dtype(a.dtype).str, shape, offset))
            offset += -(-_nbytes(np.dtype(a.dtype), shape) // _ALIGN) * _ALIGN
        fd = _memory_file(offset)
        shared = cls(tuple(layout), fd)
        with _mapped(fd, tuple(layout)) as views:
            _fill(views, arrays, order, consume)
        return shared

    def take(self, rows: Any) -> tuple[np.ndarray, ...]:
        """Copies of some rows (a range or indices) of every array."""
        index = row_index(rows)
        with _mapped(self.fd, self.layout) as views:
            return tuple(v[index] for v in views)

    @property
    def closed(self) -> bool:
        """Whether the file descriptor is closed (by :meth:`close` or garbage collection)."""
        return not self._file.close.alive

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


def _fill(views: list[np.ndarray], arrays: Sequence[np.ndarray], order: np.ndarray | None,
          consume: Sequence[bool] = ()) -> None:
    """Write ``arrays`` (rows in ``order``) into ``views`` (a function: no view outlives it)."""
    for i, (src, dst) in enumerate(zip(arrays, views)):
        if i < len(consume) and consume[i] and consume_into(dst, src, order):
            continue
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


# -- mappings that hold no file descriptor ------------------------------------------------------
_MAP_FAILED = ctypes.c_void_p(-1).value


class _Mapping:
    """A shared mapping of a memory file that keeps no file descriptor (Python's ``mmap`` keeps a
    duplicate: one per batch held would run into the fd limit), unmapped when garbage collected.

    ``inherit=False``: children forked later do not get it (``MADV_DONTFORK``), so a worker
    forked to replace a dead one does not keep the loader's batches' memory alive.
    """

    def __init__(self, fd: int, size: int, inherit: bool = True) -> None:
        addr = libc().mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == _MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of {size} bytes of shared memory failed: "
                               f"{os.strerror(err)}")
        dontfork = getattr(mmap, "MADV_DONTFORK", None)
        if not inherit and dontfork is not None:
            libc().madvise(addr, size, dontfork)
        self.addr, self.size = addr, size
        self.unmap = weakref.finalize(self, _munmap, os.getpid(), addr, size)
        self.unmap.atexit = False  # batches may still be read at exit; the OS unmaps it then

    def region(self) -> Any:
        """A buffer over the whole mapping that keeps the mapping alive while it lives."""
        region = (ctypes.c_char * self.size).from_address(self.addr)
        region.mapping = self  # type: ignore[attr-defined]
        return region


def _munmap(owner: int, addr: int, size: int) -> None:
    if os.getpid() == owner:  # a fork's copy of the object does not own the mapping
        libc().munmap(addr, size)


# -- batches back from a worker: slots ------------------------------------------------------------
KEEP_FREE = 2  # free slots a worker keeps for its next batches; more are retired (memory returned)


class Stacked:
    """One field of a batch's samples, to become an NDArray stacked straight into the batch's
    slot: what ``default_batchify_fn`` makes with ``nd.array(np.asarray(samples))``, with one
    copy instead of two and no MXNet allocation in the worker."""

    __slots__ = ("items", "array", "shape", "dtype")

    def __init__(self, items: Sequence[Any]) -> None:
        first = items[0]
        kind = type(first)
        if issubclass(kind, (np.ndarray, np.generic)) and all(
                type(x) is kind and x.shape == first.shape and x.dtype == first.dtype
                for x in items):
            self.items, self.array = items, None
            self.shape, self.dtype = (len(items),) + tuple(first.shape), first.dtype
        else:  # mixed types, Python numbers: numpy decides the dtype, as for Gluon's default
            self.items, self.array = (), np.asarray(items)
            self.shape, self.dtype = self.array.shape, self.array.dtype

    def write(self, out: np.ndarray) -> None:
        # one shape and dtype: what np.stack makes, in half its time (a third for scalars)
        out[...] = self.items if self.array is None else self.array


def stack_batchify(data: Sequence[Any]) -> Any:
    """Gluon's ``default_batchify_fn`` for a worker process: numpy samples become
    :class:`Stacked` fields (NDArrays once in the loader's process), NDArray samples are
    stacked by MXNet; either way the batch travels through the worker's slots."""
    first = data[0]
    nd = import_mxnet().nd
    if isinstance(first, nd.NDArray):
        return nd.stack(*data)
    if isinstance(first, tuple):
        return [stack_batchify(field) for field in zip(*data)]
    stacked = Stacked(data)
    if stacked.dtype not in ZERO_COPY_DTYPES:  # Gluon's own result (or its error), made here
        array = np.asarray(data) if stacked.array is None else stacked.array
        return nd.array(array, dtype=array.dtype)
    return stacked


class _Layout:
    """Where a batch's arrays go in its slot: NDArrays and stacked fields (back as NDArrays),
    large numpy arrays (back as numpy arrays), each at its offset."""

    def __init__(self) -> None:
        self.leaves: list[tuple[Any, int, np.dtype, tuple]] = []
        self.nbytes = 0
        self._ndarray = import_mxnet().nd.NDArray

    def kind(self, obj: Any) -> tuple[bool, np.dtype, tuple] | None:
        """(back as an NDArray, dtype, shape) of an array that goes in the slot, else None."""
        if isinstance(obj, Stacked):
            return True, obj.dtype, obj.shape
        if isinstance(obj, self._ndarray) and obj.stype == "default":
            return True, np.dtype(obj.dtype), tuple(obj.shape)
        if isinstance(obj, np.ndarray) and obj.nbytes >= INLINE_BYTES and not obj.dtype.hasobject:
            return False, obj.dtype, obj.shape
        return None

    def place(self, obj: Any, kind: tuple[bool, np.dtype, tuple]) -> tuple:
        """Lay ``obj`` out after the arrays placed so far; its reference in the payload."""
        as_nd, dtype, shape = kind
        offset = self.nbytes
        self.nbytes += -(-_nbytes(dtype, shape) // _ALIGN) * _ALIGN
        self.leaves.append((obj, offset, dtype, shape))
        return offset, dtype, shape, as_nd

    def payload(self, batch: Any) -> Any:
        """The batch with its arrays replaced by references: ``(list or tuple or None,
        references)`` for an array or a plain list/tuple of arrays (Gluon's batches: no pickling
        of its own), else pickled bytes."""
        items = batch if type(batch) in (list, tuple) else [batch]
        kinds = [self.kind(item) for item in items]
        if all(kinds):
            refs = [self.place(item, k) for item, k in zip(items, kinds)]  # type: ignore[arg-type]
            return (type(batch) if items is batch else None), refs
        buf = io.BytesIO()
        _SlotPickler(buf, self).dump(batch)
        return buf.getvalue()


class _SlotPickler(pickle.Pickler):
    """Pickles a batch whose arrays are laid out in a slot (see :class:`_Layout`)."""

    def __init__(self, file: io.BytesIO, layout: _Layout) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.layout = layout

    def persistent_id(self, obj: Any) -> Any:
        kind = self.layout.kind(obj)
        return None if kind is None else self.layout.place(obj, kind)


def _view(region: Any, offset: int, dtype: np.dtype, shape: tuple) -> np.ndarray:
    count = int(np.prod(shape, dtype=np.int64))
    if not count:
        return np.empty(shape, dtype)
    return np.frombuffer(region, dtype, count, offset).reshape(shape)


class SlotWriter:
    """A worker's side of the slots: batches are written into shared memory files that the
    loader maps once each (see :class:`SlotTable`), and reused once the loader says so."""

    def __init__(self, keep_free: int = KEEP_FREE) -> None:
        self.keep_free = keep_free
        self._slots: dict[int, _Mapping] = {}
        self._free: set[int] = set()
        self._retired: list[int] = []
        self._ids = itertools.count()

    def release(self, slots: Sequence[int]) -> None:
        """The loader dropped these slots' batches: reuse them (keeping ``keep_free`` at most)."""
        self._free.update(s for s in slots if s in self._slots)
        while len(self._free) > self.keep_free:
            self._retire(min(self._free, key=lambda s: self._slots[s].size))

    def _retire(self, slot: int) -> None:
        self._free.discard(slot)
        self._slots.pop(slot).unmap()
        self._retired.append(slot)

    def write(self, batch: Any) -> tuple[Any, int, int, list[int], int | None]:
        """(payload, slot, size of a new slot or 0, slots retired since the last write, the new
        slot's fd to send, or None). The fd is the caller's to close once sent."""
        layout = _Layout()
        payload = layout.payload(batch)
        slot, fd = (self._acquire(layout.nbytes) if layout.leaves else (-1, None))
        if slot >= 0:
            try:
                region = self._slots[slot].region()
                for value, offset, dtype, shape in layout.leaves:
                    view = _view(region, offset, dtype, shape)
                    if isinstance(value, Stacked):
                        value.write(view)
                    elif isinstance(value, np.ndarray):
                        np.copyto(view, value)
                    else:
                        copy_into(view, value)
            except BaseException:
                if fd is not None:  # the loader never heard of it
                    os.close(fd)
                    self._slots.pop(slot).unmap()
                else:
                    self._free.add(slot)
                raise
        retired, self._retired = self._retired, []
        size = self._slots[slot].size if fd is not None else 0
        return payload, slot, size, retired, fd

    def _acquire(self, nbytes: int) -> tuple[int, int | None]:
        """(slot, fd if new): the smallest free slot that fits, or a new one."""
        fits = [s for s in self._free if self._slots[s].size >= nbytes]
        if fits:
            slot = min(fits, key=lambda s: self._slots[s].size)
            self._free.discard(slot)
            return slot, None
        for small in list(self._free):  # too small for batches of this size now
            self._retire(small)
        size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        fd = _memory_file(size)
        try:
            mapping = _Mapping(fd, size)
        except BaseException:
            os.close(fd)
            raise
        slot = next(self._ids)
        self._slots[slot] = mapping
        return slot, fd


class SlotTable:
    """The loader's side of the slots: every worker's slots, mapped once each.

    A batch read from a slot is numpy views of it (NDArrays over them, without a copy, see
    :func:`~gluon_stream._mx.wrap_numpy`) that all hold one buffer object; when the last
    of them is gone (every array, slice and pending MXNet operation of the batch), the slot is
    queued to go back to its worker with its next task. A batch is therefore never overwritten
    while anything can still read it (MXNet's ``PrefetchingIter`` reuses its buffers).
    """

    def __init__(self) -> None:
        self._maps: dict[tuple[int, int], _Mapping] = {}
        self._freed: dict[int, collections.deque] = {}

    def add_worker(self, owner: int) -> None:
        self._freed[owner] = collections.deque()

    def remove_worker(self, owner: int) -> None:
        """A worker is gone: its slots are unmapped once the batches read from them are."""
        self._freed.pop(owner, None)
        for key in [k for k in self._maps if k[0] == owner]:
            del self._maps[key]

    def update(self, owner: int, slot: int, size: int, fd: int | None,
               retired: Sequence[int]) -> None:
        """Map a new slot (closing ``fd``) and forget the ones the worker retired."""
        for old in retired:
            self._maps.pop((owner, old), None)
        if fd is not None:
            try:
                self._maps[(owner, slot)] = _Mapping(fd, size, inherit=False)
            finally:
                _close_fd(fd)

    def load(self, owner: int, slot: int, payload: Any) -> Any:
        """The batch a worker wrote into ``slot`` (-1: none; see :meth:`_Layout.payload`)."""
        region = None
        if slot >= 0:
            region = self._maps[(owner, slot)].region()
            weakref.finalize(region, self.give_back, owner, slot).atexit = False
        if isinstance(payload, bytes):
            return _SlotUnpickler(payload, region).load()
        container, refs = payload
        arrays = [_from_slot(region, ref) for ref in refs]
        return arrays[0] if container is None else container(arrays)

    def give_back(self, owner: int, slot: int) -> None:
        """The slot's batch is gone (any thread: MXNet frees arrays in its engine's threads)."""
        queue = self._freed.get(owner)
        if queue is not None:
            queue.append(slot)

    def freed(self, owner: int) -> tuple[int, ...]:
        """Slots of ``owner`` given back since the last call."""
        queue = self._freed.get(owner)
        out = []
        while queue:
            out.append(queue.popleft())
        return tuple(out)

    def close(self) -> None:
        """Forget every slot (each is unmapped once the batches read from it are gone)."""
        self._freed.clear()
        self._maps.clear()


class _SlotUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, region: Any) -> None:
        super().__init__(io.BytesIO(data))
        self.region = region

    def persistent_load(self, pid: Any) -> Any:
        if self.region is None:
            raise pickle.UnpicklingError(f"an array reference {pid!r} without a slot")
        return _from_slot(self.region, pid)


def _from_slot(region: Any, ref: tuple) -> Any:
    """The array a reference of :meth:`_Layout.place` names: a view of the slot, or an NDArray
    over it."""
    offset, dtype, shape, as_nd = ref
    view = _view(region, offset, dtype, shape)
    return wrap_numpy(view) if as_nd else view


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
