"""A shard's columns: what a function or transform may return, normalised to a tuple of arrays.

An array, a tuple or dict of arrays, a list of columns, or Gluon-style samples ``(data, label)``
become :class:`Columns` (a tuple that keeps the arrays' names where they have some), checked:
one sample axis, no Python objects, nothing ambiguous.

The rule for what MXNet can batch (:func:`check_batchable`: dtypes an NDArray holds, a sample
axis, no zero-size axis) lives here too: it is checked of the same columns.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence, TypeVar

import numpy as np

from ..errors import SchemaMismatch, UnbatchableShard, UnsafeShard

__all__ = ["Columns", "MXNET_DTYPES", "ShapedArrays", "check_batchable", "names_of",
           "normalize_arrays", "sample_axis_problem"]

_S = TypeVar("_S", bound="ShapedArrays")


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
    problem = sample_axis_problem((name, a.shape) for (name, _), a in zip(items, out))
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


def sample_axis_problem(shapes: Iterable[tuple[Any, tuple]]) -> str | None:
    """Why ``(name, shape)`` pairs cannot form a shard (no sample axis, lengths differ), or None."""
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


class ShapedArrays(tuple):
    """A shard's arrays known by shape and dtype only, their data elsewhere: in a memory file
    the workers map (``SharedArrays``), or in the arrays as made, read in a shuffled order
    later (``Ordered``). The items are zero-strided placeholders of the arrays' shapes and
    dtypes, so ``len()``, schema checks and sizes work as on real arrays; reading data goes
    through the subclass."""

    def __new__(cls: type[_S], specs: Iterable[tuple[Any, tuple]]) -> _S:
        """``specs``: ``(dtype, shape)`` of each array."""
        return super().__new__(cls, [np.broadcast_to(np.zeros((), np.dtype(d)), tuple(shape))
                                     for d, shape in specs])


# -- batchable ---------------------------------------------------------------------------------
#: What MXNet 1.9 can hold in an NDArray (``mxnet.ndarray.ndarray._DTYPE_NP_TO_MX``, less its
#: structured bfloat16 stand-in), either byte order. ``tests/test_shardfile.py`` checks this
#: against the installed MXNet. bool is held, but ``nd.concat`` has no bool kernel.
MXNET_DTYPES = frozenset(np.dtype(t) for t in (np.float16, np.float32, np.float64, np.uint8,
                                                np.int8, np.int32, np.int64, np.bool_))
_MXNET_TYPES = frozenset(d.type for d in MXNET_DTYPES)


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
        return ("split real and imaginary parts: "
                "np.stack([a.real, a.imag], axis=-1).astype('float32')")
    if dtype.kind in "US":
        return ("encode the strings as integer ids: "
                "np.unique(a, return_inverse=True)[1].astype('int32')")
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
