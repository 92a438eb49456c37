"""The rule for what MXNet can batch: dtypes an NDArray holds, a sample axis, no zero-size axis.

It looks at dtypes and shapes only, so it runs on numpy arrays and on a file's headers
(:class:`~gluon_stream.shardfile.ArrayInfo`) alike, and never imports MXNet.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

import numpy as np

from ..errors import UnbatchableShard

__all__ = ["MXNET_DTYPES", "check_batchable"]

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
