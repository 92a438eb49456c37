"""The only door to MXNet: nothing else in gluon_stream imports ``mxnet`` or touches its privates.

MXNet is imported on first use (:func:`import_mxnet`), not when ``gluon_stream`` is imported,
so the parts that need no MXNet (sources, shard files, stats, ``gluon-stream inspect``) work
and start fast where MXNet is missing or broken. MXNet 1.9.1 needs ``numpy<1.24`` (it uses
``np.bool``), or on Python 3.12 numpy 1.26 with those aliases restored (see
:func:`restore_numpy_aliases`) and setuptools (for ``distutils``); where it cannot be imported,
whatever needs it raises an ImportError that says which extra to install.

Below the import: NDArrays from numpy arrays (contexts, the one-copy shard conversion, joins
across shards, NDArrays over numpy memory) and Gluon's numpy interface (batches handed out as
``mx.np`` views when numpy semantics are on, per-sample code run in the mode of the thread that
asked for the batch).
"""
from __future__ import annotations

import builtins
import contextlib
import ctypes
import threading
import warnings
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from .consumed import consume_into

__all__ = ["GATHER_CHUNK_BYTES", "INSTALL_HINT", "ZERO_COPY_DTYPES", "as_in_context",
           "as_legacy_batch", "as_numpy_batch", "batch_context", "concat", "copier", "copy_into",
           "data_iter_base", "gather_to_ndarray", "gluon_data_loader", "import_mxnet",
           "mode_scope", "mxnet_available", "numpy_mode", "place", "restore_numpy_aliases",
           "row_chunks", "row_index", "slice_rows", "to_ndarray", "wrap_numpy"]

INSTALL_HINT = ("gluon_stream needs MXNet 1.9.1 with numpy<1.24 (Python 3.12: numpy 1.26 and "
                "setuptools): pip install 'gluon_stream[cpu]' (or 'gluon_stream[cu112]' for "
                "CUDA 11.2; never both)")

_NUMPY_ALIASES = {name: getattr(builtins, name)
                  for name in ("bool", "int", "float", "complex", "object", "str")}
_lock = threading.Lock()
_state: dict[str, Any] = {}


def restore_numpy_aliases() -> None:
    """Set each of numpy's aliases that MXNet 1.9.1 uses and numpy 1.24 removed.

    MXNet 1.9.1 still uses ``np.bool``, ``np.int``, ``np.float``, ``np.complex``,
    ``np.object`` and ``np.str``; on Python 3.12 only numpy 1.26 has wheels. So before
    ``import mxnet`` each alias that is missing is set to the builtin it stood for (numpy <= 1.23
    keeps its own, deprecated ones). This changes numpy's namespace for the whole process, as
    the pre-1.24 aliases did: code that tests ``hasattr(np, "bool")`` sees them.

    Called by :func:`_load` and, at a script's own first ``import mxnet``, by the import hook
    that gluon_stream installs into site-packages (``_gluon_stream_mxnet_hook``). Idempotent and
    lock-free, since the hook runs inside the ``import mxnet`` that :func:`_load` makes under
    its lock.
    """
    import numpy

    with warnings.catch_warnings():  # numpy warns when asked for the aliases
        warnings.simplefilter("ignore", (DeprecationWarning, FutureWarning))
        for name, builtin in _NUMPY_ALIASES.items():
            if not hasattr(numpy, name):
                setattr(numpy, name, builtin)


def _load() -> Any:
    """Import MXNet once, numpy's aliases restored first; remember the module or the error."""
    with _lock:
        if "mx" not in _state:
            try:
                restore_numpy_aliases()
                import mxnet
                import mxnet.gluon.data.dataloader  # noqa: F401  (registers NDArray pickling)
            except (ImportError, AttributeError, OSError) as exc:  # AttributeError: numpy>=1.24
                _state["mx"], _state["error"] = None, exc
            else:
                _state["mx"], _state["error"] = mxnet, None
        return _state["mx"]


def mxnet_available() -> bool:
    """Whether MXNet can be imported (imports it if not done yet)."""
    return _load() is not None


def import_mxnet() -> Any:
    """Return the ``mxnet`` module or raise an ImportError that names the extra to install.

    Public as ``gluon_stream.import_mxnet()``: MXNet with numpy's removed aliases restored
    (Python 3.12, numpy 1.26). Where gluon_stream is installed a script's own ``import mxnet``
    restores them too (``_gluon_stream_mxnet_hook``); this is for where .pth files are not read
    (``python -S``, a source tree on PYTHONPATH).

    Example:
        >>> import gluon_stream as gs
        >>> mx = gs.import_mxnet()  # doctest: +SKIP
    """
    mx = _state.get("mx") or _load()
    if mx is None:
        error = _state["error"]
        raise ImportError(f"{INSTALL_HINT} (import failed: {error})") from error
    return mx


class _DataIterPlaceholder:
    """Stands in for ``mx.io.DataIter`` when MXNet cannot be imported."""

    def __init__(self, batch_size: int = 0) -> None:
        self.batch_size = batch_size


def data_iter_base() -> type:
    """``mx.io.DataIter`` (``Module.predict`` checks ``isinstance``), or a placeholder."""
    mx = _load()
    return mx.io.DataIter if mx is not None else _DataIterPlaceholder


_data_loaders: dict[type, type] = {}


def gluon_data_loader(cls: type) -> type:
    """``cls`` made a ``gluon.data.DataLoader`` as well: a subclass of both, made once per class.

    ``Estimator.fit`` and ``evaluate`` accept only ``isinstance(data, gluon.data.DataLoader)``.
    The subclass is made at first use, so importing gluon_stream still does not import MXNet.
    ``DataLoader.__init__`` is never called; ``_worker_pool = None`` is the one attribute of
    it that ``DataLoader.__del__`` reads (it then has no pool to end). ``cls``'s own methods
    (``__iter__``, ``__len__``, ``__bool__``) come first in the MRO.
    """
    mx = import_mxnet()
    with _lock:
        made = _data_loaders.get(cls)
        if made is None:
            made = type(cls.__name__, (cls, mx.gluon.data.DataLoader),
                        {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                         "__doc__": cls.__doc__, "_worker_pool": None})
            _data_loaders[cls] = made
        return made


# -- NDArrays from numpy arrays: contexts, the shard's copy, joins, placement ----------------------
# NDArrays from numpy arrays: contexts, the one-copy shard conversion, joins across shards,
# and NDArrays over memory that numpy already holds (no copy).
GATHER_CHUNK_BYTES = 1 << 20


def batch_context(pin_memory: bool, pin_device_id: int) -> Any:
    """The context batches are allocated in: pinned host memory speeds up copies to a GPU."""
    mx = import_mxnet()
    return mx.cpu_pinned(pin_device_id) if pin_memory else mx.cpu()


def row_index(rows: Any) -> np.ndarray:
    """Row numbers (a ``range`` or a sequence of ints) as an index array for fancy indexing."""
    return np.asarray(list(rows) if isinstance(rows, range) else rows, dtype=np.int64)


def row_chunks(array: np.ndarray, order: np.ndarray | None, chunk_bytes: int = GATHER_CHUNK_BYTES
               ) -> Iterator[tuple[int, np.ndarray]]:
    """``(begin, rows)``: the rows of ``array`` (in ``order``, if given) as contiguous copies of
    about ``chunk_bytes`` each, so that no permuted or contiguous copy of the whole exists.

    Fancy indexing, not ``np.take``, which copies a strided input (sliding windows) whole.
    """
    rows = array.shape[0] if order is None else len(order)
    row_bytes = max(1, array.itemsize * int(np.prod(array.shape[1:], dtype=np.int64)))
    step = max(1, chunk_bytes // row_bytes)
    for begin in range(0, rows, step):
        end = min(rows, begin + step)
        yield begin, (np.ascontiguousarray(array[begin:end]) if order is None
                      else array[order[begin:end]])


def to_ndarray(array: np.ndarray, ctx: Any, order: np.ndarray | None = None,
               consume: bool = False) -> Any:
    """Copy a numpy array (its rows in ``order``, if given: a permutation, or a subset) into a
    new NDArray of its dtype.

    ``consume``: the loader owns ``array`` and drops it next
    (:func:`~gluon_stream._mx.consumed.consumable`): its memory is given back to the OS as its
    rows are copied (:mod:`~gluon_stream._mx.consumed`), so the shard and its copy do not
    both exist whole.

    ``nd.empty`` + ``_sync_copyfrom`` is 4-5x faster than ``nd.array`` and, unlike
    ``nd.array`` without ``dtype``, keeps int64 as int64. With ``order``, a contiguous array's
    rows are gathered straight into a host NDArray's memory; a strided view (sliding windows)
    or another context is copied a few MB at a time. No permuted or contiguous copy of the
    whole shard exists besides the NDArray.
    """
    nd = import_mxnet().nd
    rows = array.shape[0] if order is None else len(order)
    out = nd.empty((rows,) + tuple(array.shape[1:]), ctx=ctx, dtype=array.dtype)
    host = getattr(ctx, "device_type", None) in _HOST  # out is made in ctx
    if consume and host and array.flags.c_contiguous and consume_into(_host_view(out), array,
                                                                      order):
        return out
    if order is None and array.flags.c_contiguous:
        out._sync_copyfrom(array)
        return out
    if order is not None and array.flags.c_contiguous and host and _in_range(order, len(array)):
        # rows gathered straight into the NDArray's memory: one pass, no chunk in between
        # (about a third faster than chunks). 'clip' takes no bounds-checked buffer copy (the
        # 'raise' default does); the order was checked instead (out of range, the chunks below
        # raise IndexError). The NDArray is new: no pending operation of MXNet's engine can
        # touch its memory yet.
        np.take(array, order, axis=0, out=_host_view(out), mode="clip")
        return out
    for begin, chunk in row_chunks(array, order):  # a strided view is read in chunks
        out[begin:begin + len(chunk)]._sync_copyfrom(chunk)
    return out


_HOST = frozenset({"cpu", "cpu_pinned", "cpu_shared"})


def _in_range(order: np.ndarray, rows: int) -> bool:
    return not len(order) or (int(order.min()) >= 0 and int(order.max()) < rows)


def _host_view(out: Any) -> np.ndarray:
    """A writable numpy view of a new, dense NDArray in host memory (no copy)."""
    dl = _dlpack()
    pointer = ctypes.c_void_p()
    dl["check"](dl["lib"].MXNDArrayGetData(out.handle, ctypes.byref(pointer)))
    dtype = np.dtype(out.dtype)
    size = int(np.prod(out.shape, dtype=np.int64))
    if not size:
        return np.empty(out.shape, dtype=dtype)
    if pointer.value is None:
        raise ValueError(f"an NDArray {out.shape} in {out.context} has no memory yet")
    buffer = (ctypes.c_char * (size * dtype.itemsize)).from_address(pointer.value)
    return np.frombuffer(memoryview(buffer), dtype=dtype).reshape(out.shape)


def gather_to_ndarray(sources: Sequence[np.ndarray], which: np.ndarray, rows: np.ndarray,
                      ctx: Any) -> Any:
    """A new NDArray whose row ``i`` is ``sources[which[i]][rows[i]]`` (one copy, a few MB at
    a time: no gathered copy of the whole exists in numpy)."""
    nd = import_mxnet().nd
    first = sources[0]
    out = nd.empty((len(rows),) + tuple(first.shape[1:]), ctx=ctx, dtype=first.dtype)
    row_bytes = max(1, first.itemsize * int(np.prod(first.shape[1:], dtype=np.int64)))
    step = max(1, GATHER_CHUNK_BYTES // row_bytes)
    for begin in range(0, len(rows), step):
        end = min(len(rows), begin + step)
        w, r = which[begin:end], rows[begin:end]
        block = np.empty((end - begin,) + tuple(first.shape[1:]), dtype=first.dtype)
        for s, source in enumerate(sources):
            mask = w == s
            if mask.any():
                block[mask] = source[r[mask]]
        out[begin:end]._sync_copyfrom(block)
    return out


def concat(parts: Sequence[Any]) -> Any:
    """Join NDArrays along the sample axis, in the first part's context.

    ``nd.concat`` of ``cpu_pinned`` inputs returns a ``cpu`` array: pinned batches stay pinned.
    Bool arrays (masks, labels) go through uint8: MXNet's concat has no bool kernel.
    """
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    if first.dtype == np.bool_:  # MXNet's concat has no bool kernel ("Unknown type enum 7")
        return concat([p.astype(np.uint8) for p in parts]).astype(np.bool_)
    nd = import_mxnet().nd
    rows = sum(int(p.shape[0]) for p in parts)
    out = nd.empty((rows,) + tuple(first.shape[1:]), ctx=first.context, dtype=first.dtype)
    return nd.concat(*parts, dim=0, out=out)


def _each_ndarray(data: Any, fn: Callable[[Any], Any]) -> Any:
    """``data`` with ``fn`` applied to every NDArray in it (nested lists, tuples, dicts)."""
    if isinstance(data, import_mxnet().nd.NDArray):
        return fn(data)
    if isinstance(data, (list, tuple)):
        return type(data)(_each_ndarray(d, fn) for d in data)
    if isinstance(data, dict):
        return {k: _each_ndarray(v, fn) for k, v in data.items()}
    return data


def as_in_context(data: Any, ctx: Any) -> Any:
    """``data`` with every NDArray in it (nested lists, tuples, dicts) copied to ``ctx``."""
    return _each_ndarray(data, lambda array: array.as_in_context(ctx))


def place(data: Any, ctx: Any) -> Any:
    """``data`` with every NDArray in it on ``ctx`` (one context), or split across a list of
    contexts as ``gluon.utils.split_and_load(x, ctx, even_split=False)`` does: a list per
    array. The copies are queued on MXNet's engine and run while the caller goes on."""
    if not isinstance(ctx, (list, tuple)):
        return as_in_context(data, ctx)
    mx = import_mxnet()
    split_and_load = mx.gluon.utils.split_and_load
    with mx.util.np_array(False):  # legacy arrays, split by legacy operators in numpy mode too
        return _each_ndarray(data, lambda array: split_and_load(array, list(ctx), batch_axis=0,
                                                                 even_split=False))


# -- NDArrays over numpy memory -----------------------------------------------------------------
# DLPack (type code, bits) of the dtypes MXNet 1.9 takes from DLPack (DLDataTypeTransform)
_DLPACK_TYPES = {np.dtype(np.float16): (2, 16), np.dtype(np.float32): (2, 32),
                 np.dtype(np.float64): (2, 64), np.dtype(np.uint8): (1, 8),
                 np.dtype(np.int8): (0, 8), np.dtype(np.int32): (0, 32),
                 np.dtype(np.int64): (0, 64)}
ZERO_COPY_DTYPES = frozenset(_DLPACK_TYPES)  # what wrap_numpy wraps without a copy
_DLPACK: dict[str, Any] = {}


def _dlpack() -> dict[str, Any]:
    """MXNet's DLPack structures and C entry points (private in MXNet 1.9.1), and the deleter
    MXNet calls when it frees an NDArray made by :func:`wrap_numpy`, made once."""
    if not _DLPACK:
        import_mxnet()
        from mxnet import base
        from mxnet.ndarray import ndarray as nd_module

        incref = ctypes.PYFUNCTYPE(None, ctypes.py_object)(("Py_IncRef", ctypes.pythonapi))
        decref = ctypes.PYFUNCTYPE(None, ctypes.c_void_p)(("Py_DecRef", ctypes.pythonapi))

        # Everything it uses is bound now: MXNet may free an NDArray while the interpreter
        # tears its modules down (MXNet's own from_numpy deleter, a module global, is freed
        # then, and calling it crashes the process at exit).
        def release(managed: Any, _decref: Any = decref) -> None:
            _decref(managed.contents.manager_ctx)

        deleter = nd_module.DeleterFunc(release)
        incref(deleter)  # never freed, not even at exit
        _DLPACK.update(lib=base._LIB, handle=base.NDArrayHandle, check=base.check_call,
                       module=nd_module, incref=incref, decref=decref, deleter=deleter,
                       ndarray=nd_module.NDArray)
    return _DLPACK


def slice_rows(array: Any, start: int, stop: int) -> Any:
    """Rows ``start .. stop`` (``0 <= start <= stop <= len(array)``) as ``array[start:stop]``
    gives them: for a dense NDArray a view sharing its memory, made with the one C call
    ``NDArray._slice`` makes, in about 5 us. MXNet's ``__getitem__`` reads the shape through the
    C API three times first (about 25 us a slice, a third of the loop's own cost per batch on
    the slice path). Anything else (numpy, sparse NDArrays) is sliced as usual."""
    dl = _dlpack()
    ndarray = dl["ndarray"]
    if type(array) is not ndarray:
        return array[start:stop]
    handle = dl["handle"]()
    dl["check"](dl["lib"].MXNDArraySlice(array.handle, ctypes.c_uint(start),
                                          ctypes.c_uint(stop), ctypes.byref(handle)))
    return ndarray(handle=handle, writable=array.writable)


def copier(ctx: Any) -> Callable[[Any], Any]:
    """How to copy an array that lives in ``ctx``: on ``cpu``, a dense NDArray by MXNet's
    ``identity`` operator, one C call, where ``NDArray.copy()`` makes four (shape, dtype and
    context, then the copy); each C call lets go of the GIL and may wait for it behind a busy
    producer. Elsewhere ``copy()`` (``identity`` of a ``cpu_pinned`` array returns a ``cpu``
    one)."""
    if getattr(ctx, "device_type", None) != "cpu":
        return lambda array: array.copy()
    nd = import_mxnet().nd
    dense = nd.NDArray
    identity = nd.identity
    return lambda array: identity(array) if type(array) is dense else array.copy()


def wrap_numpy(array: np.ndarray) -> Any:
    """An NDArray (``cpu(0)``) over ``array``'s memory, without a copy.

    The NDArray holds a reference to ``array`` until MXNet frees it: after its last slice and
    every pending operation that reads it are gone (DLPack's deleter drops the reference), so
    whoever owns the memory can tell, from ``array``'s lifetime, when it may be reused.
    ``array`` is made read-only (write through the NDArray). A dtype MXNet does not take from
    DLPack (bool, ...), a non-contiguous or an empty array is copied instead, as ``nd.array``
    copies. About 15 us, where ``nd.array`` of a 0.8 MB batch costs about 0.2 ms.
    """
    code_bits = _DLPACK_TYPES.get(array.dtype)
    if code_bits is None or not array.flags.c_contiguous or not array.size:
        return import_mxnet().nd.array(array, dtype=array.dtype)
    dl = _dlpack()
    module = dl["module"]
    array.flags.writeable = False
    managed = module.DLManagedTensor()
    tensor = managed.dl_tensor
    tensor.data = array.ctypes.data
    tensor.ctx = module.DLContext(1, 0)  # kDLCPU, device 0
    tensor.ndim = array.ndim
    tensor.dtype = module.DLDataType(code_bits[0], code_bits[1], 1)
    tensor.shape = (ctypes.c_int64 * array.ndim)(*array.shape)  # copied by MXNet (transient)
    managed.manager_ctx = id(array)
    managed.deleter = dl["deleter"]  # Py_DecRef(manager_ctx): drops the reference taken here
    dl["incref"](array)
    handle = dl["handle"]()
    try:
        dl["check"](dl["lib"].MXNDArrayFromDLPackEx(ctypes.byref(managed), True,
                                                     ctypes.byref(handle)))
    except BaseException:
        dl["decref"](id(array))
        raise
    return import_mxnet().nd.NDArray(handle=handle)


def copy_into(out: np.ndarray, array: Any) -> None:
    """Copy a dense NDArray into the numpy array ``out`` (same shape and dtype), waiting for it:
    one copy, where ``out[...] = array.asnumpy()`` makes two."""
    dl = _dlpack()
    if tuple(out.shape) != tuple(array.shape) or out.dtype != np.dtype(array.dtype) \
            or not out.flags.c_contiguous:
        raise ValueError(f"cannot copy an NDArray {array.shape} {np.dtype(array.dtype)} into "
                         f"{out.shape} {out.dtype}")
    dl["check"](dl["lib"].MXNDArraySyncCopyToCPU(array.handle,
                                                 out.ctypes.data_as(ctypes.c_void_p),
                                                 ctypes.c_size_t(out.size)))


# -- Gluon's numpy interface: mx.np batches when numpy semantics are on ----------------------------
# Gluon's numpy interface: batches as ``mx.np.ndarray`` when numpy array semantics are on.
#
# ``npx.set_np()`` (MXNet 1.9's tutorials, *Dive into Deep Learning*, newer GluonCV) turns on
# two flags that are **thread-local** in MXNet 1.9.1: numpy shape semantics and numpy array
# semantics (:func:`mxnet.util.is_np_array`). Numpy-mode blocks take ``mx.np.ndarray`` only, so
# Gluon's ``DataLoader`` then yields those. gluon_stream does the same:
#
# * inside the pipeline (producer threads, slices, joins, padding, placement) every array is a
#   legacy ``NDArray``, whatever the mode;
# * the loader checks the mode of the thread that iterates it, at each batch it hands out (as
#   Gluon's ``default_batchify_fn`` checks it where it runs), and hands out ``mx.np.ndarray``
#   views of the same memory (:func:`as_numpy_batch`: ``as_np_ndarray()``, no copy) when it is on;
# * per-sample code (``sample_transform``, ``batchify_fn``) runs in the mode of the thread that
#   submitted its batch (:func:`mode_scope`), in threads and worker processes too, as Gluon's
#   ``DataLoader`` initialises its thread and process pools with the mode it was built in; what
#   it returns is taken back as legacy ``NDArray`` views (:func:`as_legacy_batch`).
def numpy_mode() -> bool:
    """Whether numpy array semantics are on in the calling thread (``npx.is_np_array()``)."""
    return bool(import_mxnet().util.is_np_array())


@contextlib.contextmanager
def mode_scope(numpy: bool | None) -> Iterator[None]:
    """Run the block in the mode of the thread that asked for the work: numpy shape and array
    semantics on (``numpy=True``), or numpy arrays off (False: a worker forked from a thread in
    numpy mode keeps that thread's mode); ``None``: the calling thread's own mode."""
    if numpy is None or numpy == numpy_mode():
        yield
        return
    util = import_mxnet().util
    if not numpy:
        with util.np_array(False):  # numpy shapes may stay on: legacy code runs under them
            yield
        return
    with util.np_shape(True), util.np_array(True):
        yield


def _each(data: Any, wanted: Callable[[Any], bool], convert: Callable[[Any], Any]) -> Any:
    """``data`` with ``convert`` applied to every array ``wanted`` picks (nested lists, tuples,
    dicts); everything else as it is. A container with nothing to convert is returned as it
    is, not rebuilt."""
    if wanted(data):
        return convert(data)
    if isinstance(data, (list, tuple)):
        items = [_each(d, wanted, convert) for d in data]
        if all(a is b for a, b in zip(items, data)):
            return data
        return items if isinstance(data, list) else _rebuilt(data, items)
    if isinstance(data, dict):
        return {k: _each(v, wanted, convert) for k, v in data.items()}
    return data


def _rebuilt(data: tuple, items: list) -> tuple:
    """A tuple (or a named tuple) of ``items``, of ``data``'s type."""
    if hasattr(data, "_fields"):  # a named tuple takes its fields as arguments
        return type(data)(*items)
    return type(data)(items)


def as_numpy_batch(data: Any) -> Any:
    """Every legacy NDArray in ``data`` as an ``mx.np.ndarray`` over the same memory
    (``as_np_ndarray()``: a view, no copy); arrays that are ``mx.np`` already, numpy arrays
    and anything else stay as they are."""
    mx = import_mxnet()
    legacy, numpy_type = mx.nd.NDArray, mx.np.ndarray
    return _each(data, lambda a: isinstance(a, legacy) and not isinstance(a, numpy_type),
                 lambda a: a.as_np_ndarray())


def as_legacy_batch(data: Any) -> Any:
    """Every ``mx.np.ndarray`` in ``data`` as a legacy NDArray over the same memory
    (``as_nd_ndarray()``, no copy), for the pipeline's legacy operators (padding, joins,
    ``split_and_load``)."""
    numpy_type = import_mxnet().np.ndarray
    return _each(data, lambda a: isinstance(a, numpy_type), lambda a: a.as_nd_ndarray())
