"""Gluon's numpy interface: batches as ``mx.np.ndarray`` when numpy array semantics are on.

``npx.set_np()`` (MXNet 1.9's tutorials, *Dive into Deep Learning*, newer GluonCV) turns on
two flags that are **thread-local** in MXNet 1.9.1: numpy shape semantics and numpy array
semantics (:func:`mxnet.util.is_np_array`). Numpy-mode blocks take ``mx.np.ndarray`` only, so
Gluon's ``DataLoader`` then yields those. gluon_stream does the same:

* inside the pipeline (producer threads, slices, joins, padding, placement) every array is a
  legacy ``NDArray``, whatever the mode;
* the loader checks the mode of the thread that iterates it, at each batch it hands out (as
  Gluon's ``default_batchify_fn`` checks it where it runs), and hands out ``mx.np.ndarray``
  views of the same memory (:func:`as_numpy_batch`: ``as_np_ndarray()``, no copy) when it is on;
* per-sample code (``sample_transform``, ``batchify_fn``) runs in the mode of the thread that
  submitted its batch (:func:`mode_scope`), in threads and worker processes too, as Gluon's
  ``DataLoader`` initialises its thread and process pools with the mode it was built in; what
  it returns is taken back as legacy ``NDArray`` views (:func:`as_legacy_batch`).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

from . import import_mxnet

__all__ = ["as_legacy_batch", "as_numpy_batch", "mode_scope", "numpy_mode"]


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
