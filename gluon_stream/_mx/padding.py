"""Padding a short batch to ``batch_size`` rows with its own rows repeated (as NDArrayIter does:
the rows after the real ones are padding, and ``DataBatch.pad`` says how many)."""
from __future__ import annotations

from typing import Any

import numpy as np

from . import _each_ndarray, import_mxnet

__all__ = ["pad_rows"]


def pad_rows(data: Any, batch_size: int) -> Any:
    """Every NDArray of a batch (any nesting) grown to ``batch_size`` rows: its rows, then its
    rows again from the first, as many as are missing. A full batch comes back as it is."""
    mx = import_mxnet()

    def pad(array: Any) -> Any:
        n = int(array.shape[0])
        if n >= batch_size or n == 0:
            return array
        index = mx.nd.array(np.arange(batch_size) % n, ctx=array.context, dtype="int64")
        return mx.nd.take(array, index, axis=0)

    return _each_ndarray(data, pad)
