"""The only module that imports MXNet or touches its private attributes.

MXNet 1.9.1 needs ``numpy<1.24`` (it uses ``np.bool``); with a newer numpy its import
raises AttributeError. Either way gluon_stream still imports, and whatever needs
MXNet calls :func:`require_mxnet`, which says which extra to install.
"""
from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np

logger = logging.getLogger(__name__)

try:
    import mxnet as mx
    from mxnet import gluon, nd
    from mxnet.gluon.data import dataloader as _dataloader

    DataIterBase = mx.io.DataIter
    _IMPORT_ERROR: BaseException | None = None
except (ImportError, AttributeError, OSError) as exc:  # AttributeError: numpy>=1.24
    mx = gluon = nd = _dataloader = None
    _IMPORT_ERROR = exc

    class DataIterBase:  # type: ignore[no-redef]
        """Placeholder for ``mx.io.DataIter`` when MXNet is unavailable."""

INSTALL_HINT = ("gluon_stream needs MXNet 1.9.1 with numpy<1.24: pip install 'gluon_stream[cpu]' "
                "(or 'gluon_stream[cu112]' for CUDA 11.2; never both)")


def require_mxnet() -> Any:
    """Return the ``mxnet`` module or raise an ImportError that names the extra to install."""
    if mx is None:
        raise ImportError(f"{INSTALL_HINT} (import failed: {_IMPORT_ERROR})") from _IMPORT_ERROR
    return mx


def context(pin_memory: bool, pin_device_id: int) -> Any:
    """The context batches are allocated in: pinned host memory speeds up copies to a GPU."""
    require_mxnet()
    return mx.cpu_pinned(pin_device_id) if pin_memory else mx.cpu()


def to_ndarray(array: np.ndarray, ctx: Any) -> Any:
    """Copy a numpy array into a new NDArray of the same dtype.

    ``nd.empty`` + ``_sync_copyfrom`` is 4-5x faster than ``nd.array`` and, unlike
    ``nd.array`` without ``dtype``, keeps int64 as int64.
    """
    out = nd.empty(array.shape, ctx=ctx, dtype=array.dtype)
    out._sync_copyfrom(np.ascontiguousarray(array))
    return out


def concat(parts: Sequence[Any]) -> Any:
    """Join NDArrays along the sample axis."""
    return parts[0] if len(parts) == 1 else nd.concat(*parts, dim=0)


def default_batchify_fn() -> Any:
    return _dataloader.default_batchify_fn


def make_dataloader(dataset: Any, batch_sampler: Any, *, batchify_fn: Any, num_workers: int,
                    thread_pool: bool, pin_memory: bool, pin_device_id: int,
                    timeout: float) -> Any:
    """Build a ``gluon.data.DataLoader`` over our own batch sampler."""
    return gluon.data.DataLoader(dataset, batch_sampler=batch_sampler, batchify_fn=batchify_fn,
                                 num_workers=num_workers, thread_pool=thread_pool,
                                 pin_memory=pin_memory, pin_device_id=pin_device_id,
                                 timeout=max(1, int(timeout)))


def worker_pool(loader: Any) -> Any:
    """The DataLoader's worker pool (private in MXNet 1.9.1), or None."""
    return getattr(loader, "_worker_pool", None)


def release_dataloader(loader: Any) -> None:
    """End a DataLoader's worker pool now instead of in ``__del__`` (apache/mxnet#13521).

    Process pools are terminated and joined; MXNet would otherwise only do it when the
    garbage collector happens to run ``__del__``.
    """
    pool = worker_pool(loader)
    if pool is None:
        return
    loader._worker_pool = None
    pool.terminate()
    pool.join()
