"""StreamIter: the Module API's ``mx.io.DataIter`` over a :class:`~gluon_stream.StreamLoader`.

``mx.mod.Module.fit``/``score``/``predict`` and ``mx.io.PrefetchingIter`` expect a
``DataIter`` that announces its batch shapes up front (``provide_data``/``provide_label``),
yields ``DataBatch`` objects of one fixed batch size, and restarts on ``reset()``.
StreamIter adapts a loader to that contract:

* the first batch is produced when the shapes are first asked for, and then handed out
  first, so nothing is produced twice;
* a short last batch (``last_batch='keep'``) is padded to ``batch_size`` by repeating its
  own samples, and ``getpad()`` says how many are padding (as ``NDArrayIter`` does); with
  ``even_batches='pad'`` the loader's padding is marked the same way, batches that are all
  padding (``pad == batch_size``) included, so every rank runs the same number of steps
  (``padding_batches=False`` leaves them out for ``Module.predict``, which cannot merge a
  batch trimmed to no rows in MXNet 1.x; ``Module.score`` reads no ``pad`` at all and counts
  padding rows, as with ``NDArrayIter``);
* the batches are the loader's own NDArrays: each shard is a new NDArray and batches are
  slices of it, never overwritten later, so holding on to a batch (as ``PrefetchingIter``
  does) is safe;
* ``reset()`` ends the current pass (its producers are cancelled) and the next call starts
  the loader's next epoch; a ``reset()`` before any batch was taken changes nothing;
  ``set_epoch(e)`` makes the next pass epoch ``e`` (``Module.fit(begin_epoch=e)`` needs it);
* ``provide_data``/``provide_label`` come from the batch in hand when ``next()`` is called
  first (``Module.score`` and ``predict`` do), so a pass of exactly one batch works.
* its batches are legacy ``mx.nd.NDArray`` even under ``npx.set_np()``, as with MXNet's own
  ``NDArrayIter``: the Module API binds legacy executors only (``StreamLoader`` hands out
  ``mx.np.ndarray`` in numpy mode, for Gluon).
"""
from __future__ import annotations

import logging
from typing import Any, Generator, Mapping, Sequence

import numpy as np

from ._mx import data_iter_base, import_mxnet
from ._mx.padding import pad_rows
from ._utils.closing import Closing
from .loader import StreamLoader

__all__ = ["StreamIter"]

logger = logging.getLogger(__name__)

DEFAULT_LAYOUTS = {1: "N", 2: "NC", 3: "NTC", 4: "NCHW", 5: "NCDHW"}


class StreamIter(data_iter_base(), Closing):  # type: ignore[misc]  # mx.io.DataIter, or a stand-in
    """An ``mx.io.DataIter`` over a StreamLoader, for ``mx.mod.Module`` and other legacy code.

    The loader's batches hold its arrays in order (data first, then labels); the first
    ``len(data_names)`` arrays become ``DataBatch.data``, the next ``len(label_names)``
    ``DataBatch.label``. When the shards name their arrays (``fn`` returned a dict, or an
    ``.npz`` saved by name) and every name is among them, arrays are matched by name instead:
    ``{"softmax_label": y, "data": x}`` is not swapped. The iterator does not own the loader:
    close the loader yourself (``with gs.StreamLoader(...) as loader:``). ``close()`` only ends
    the current pass.

    Args:
        loader: A :class:`~gluon_stream.StreamLoader`.
        data_names: Names of the model inputs (``provide_data``), one per data array.
        label_names: Names of the labels (``provide_label``), one per label array; several
            labels (one input, three targets) map to several names. ``()`` for none.
        layouts: Optional ``{name: layout}``, e.g. ``{"data": "NTC"}``. Default by rank:
            ``N``, ``NC``, ``NTC``, ``NCHW``, ``NCDHW``; the batch axis is always the first.
        padding_batches: With ``even_batches='pad'``, hand out the batches that are all
            padding (``pad == batch_size``) too (default True): every rank runs the same
            number of steps, as a synchronous job needs. ``False`` leaves them out, for
            ``Module.predict`` on one rank at a time (it cannot merge a batch trimmed to no
            rows in MXNet 1.x); the ranks' step counts then differ.

    Example:
        >>> import numpy as np, gluon_stream as gs
        >>> src = gs.FunctionSource(range(2), lambda k: (np.ones((9, 3), "float32"),
        ...                                              np.zeros(9, "float32")))
        >>> with gs.StreamLoader(src, batch_size=4) as loader:
        ...     it = gs.StreamIter(loader)
        ...     print(it.provide_data[0].shape, it.provide_label[0].name)
        ...     print([b.pad for b in it])
        (4, 3) softmax_label
        [0, 0, 0, 0, 2]
    """

    def __init__(self, loader: Any, data_names: Sequence[str] = ("data",),
                 label_names: Sequence[str] = ("softmax_label",), *,
                 layouts: Mapping[str, str] | None = None,
                 padding_batches: bool = True) -> None:
        mx = import_mxnet()
        if not isinstance(padding_batches, bool):
            raise TypeError(f"padding_batches must be True or False, got {padding_batches!r}")
        if not isinstance(loader, StreamLoader):
            raise TypeError(f"loader must be a gluon_stream.StreamLoader, got "
                            f"{type(loader).__name__}")
        if isinstance(getattr(loader, "ctx", None), list):
            raise ValueError("StreamIter hands Module whole batches and Module splits them across "
                             "its own contexts: build the loader with one ctx (or none)")
        super().__init__(batch_size=loader.batch_size)
        data_names = _names("data_names", data_names)
        label_names = _names("label_names", label_names)
        if not data_names:
            raise ValueError("data_names must name at least one input, got ()")
        clash = set(data_names) & set(label_names)
        if clash or len(set(data_names) | set(label_names)) != len(data_names) + len(label_names):
            raise ValueError(f"data_names {data_names} and label_names {label_names} must be "
                             "distinct names")
        layouts = dict(layouts or {})
        unknown = set(layouts) - set(data_names) - set(label_names)
        if unknown:
            raise ValueError(f"layouts names {sorted(unknown)} that are neither in data_names "
                             f"{data_names} nor label_names {label_names}")
        for name, layout in layouts.items():
            if not isinstance(layout, str) or not layout.startswith("N"):
                raise ValueError(f"layout of {name!r} must be a string starting with the batch "
                                 f"axis 'N' (e.g. 'NTC'), got {layout!r}")
        self._mx = mx
        self.loader = loader
        self.data_names = data_names
        self.label_names = label_names
        self.layouts = layouts
        self.padding_batches = padding_batches
        self._batches: Generator[Any, None, None] | None = None  # the loader's current pass
        self._taken = 0  # batches handed out in the current pass
        self._peeked: list | None = None  # arrays of a batch produced but not handed out yet
        self._peeked_pad = 0  # ... and its padding rows, as the loader marked them
        self._exhausted = False
        self._current: Any = None  # (data, label, pad) of the current batch
        self._provide: tuple[list, list] | None = None

    # -- shapes ------------------------------------------------------------------------------
    @property
    def provide_data(self) -> list:
        """``[DataDesc(name, (batch_size, ...), dtype, layout), ...]`` of the inputs."""
        return list(self._descs()[0])

    @property
    def provide_label(self) -> list:
        """``[DataDesc(name, (batch_size, ...), dtype, layout), ...]`` of the labels."""
        return list(self._descs()[1])

    def _descs(self) -> tuple[list, list]:
        if self._provide is None:
            arrays = self._peek()
            if arrays is None:
                raise ValueError("StreamIter: the loader yields no batches, so provide_data "
                                 "is unknown; check its keys and last_batch")
            self._provide = self._describe(arrays)
        return self._provide

    def _describe(self, arrays: list) -> tuple[list, list]:
        """DataDescs of the inputs and the labels, from one batch's arrays."""
        descs = []
        for name, arr in zip(self.data_names + self.label_names, arrays):
            shape = (self.batch_size,) + tuple(arr.shape[1:])
            layout = self.layouts.get(name, DEFAULT_LAYOUTS.get(len(shape), "N"))
            if len(layout) != len(shape):
                raise ValueError(f"layout {layout!r} of {name!r} does not match its "
                                 f"shape {shape}")
            descs.append(self._mx.io.DataDesc(name, shape, np.dtype(arr.dtype).type, layout))
        n = len(self.data_names)
        return descs[:n], descs[n:]

    # -- the DataIter protocol ---------------------------------------------------------------
    def reset(self) -> None:
        """Restart: the next batch comes from the loader's next pass (its next epoch).

        A reset before any batch of the current pass was handed out keeps that pass, so
        ``reset()`` at the start of ``fit``/``score`` costs nothing.
        """
        if self._taken == 0 and not self._exhausted:
            return
        self._end_pass()

    def iter_next(self) -> bool:
        """Move to the next batch; False at the end of the pass."""
        arrays = self._peek()
        self._peeked = None
        if arrays is None:
            self._current = None
            return False
        if self._provide is None:  # from the batch in hand: next() may come before provide_data
            self._provide = self._describe(arrays)
        self._taken += 1
        self._current = self._split(arrays, self._peeked_pad)
        return True

    def next(self) -> Any:
        """The next ``mx.io.DataBatch`` (with ``provide_data``/``provide_label`` set)."""
        if not self.iter_next():
            raise StopIteration
        data, label, pad = self._current
        return self._mx.io.DataBatch(data=data, label=label, pad=pad, index=None,
                                     provide_data=self.provide_data,
                                     provide_label=self.provide_label)

    def getdata(self) -> list:
        """The current batch's input NDArrays."""
        return self._current_part(0)

    def getlabel(self) -> list:
        """The current batch's label NDArrays."""
        return self._current_part(1)

    def getpad(self) -> int:
        """Samples at the end of the current batch that are padding (only a short last batch)."""
        return self._current_part(2)

    def getindex(self) -> None:
        """Sample indices are not tracked (shards are shuffled in the background): None."""
        return None

    def set_epoch(self, epoch: int) -> None:
        """Start the loader's epoch ``epoch`` at the next batch; later ``reset()``s go on from it.

        ``Module.fit(it, begin_epoch=5)`` does not tell its iterator the epoch: call
        ``it.set_epoch(5)`` before it, so that the resumed run gets epoch 5's order, not epoch 0's.
        """
        self._end_pass()
        self.loader.set_epoch(epoch)

    def close(self) -> None:
        """End the current pass (cancels its producers). The loader stays open; idempotent."""
        self._end_pass()

    # -- internals ---------------------------------------------------------------------------
    def _current_part(self, i: int) -> Any:
        if self._current is None:
            raise RuntimeError("no current batch: call iter_next() (or next()) first")
        return self._current[i]

    def _end_pass(self) -> None:
        batches, self._batches = self._batches, None
        self._peeked, self._current = None, None
        self._taken, self._exhausted = 0, False
        if batches is not None:
            batches.close()  # runs the loader's cleanup: cancels the pass's producers

    def _peek(self) -> list | None:
        """The next batch's arrays without consuming it; None at the end of the pass."""
        if self._peeked is None and not self._exhausted:
            if self._batches is None:
                self._batches = self.loader._iterate(legacy=True)  # Module takes no mx.np
            batch = next(self._batches, None)
            while batch is not None and not self.padding_batches \
                    and self.loader.pad >= self.batch_size:
                # even_batches='pad' with padding_batches=False: left out, for Module.predict
                # (by default they come, so every rank runs the same number of steps)
                batch = next(self._batches, None)
            if batch is None:
                self._exhausted = True
                self._batches = None
            else:
                self._peeked = self._check(batch)
                self._peeked_pad = self.loader.pad  # even_batches='pad': rows of padding
        return self._peeked

    def _check(self, batch: Any) -> list:
        arrays = list(batch) if isinstance(batch, (list, tuple)) else [batch]
        wanted = self.data_names + self.label_names
        names = self.loader.names
        if names is not None and len(names) == len(arrays) and set(wanted) <= set(names):
            arrays = [arrays[names.index(n)] for n in wanted]  # by name, not position
        expected = len(wanted)
        if len(arrays) != expected:
            raise ValueError(
                f"StreamIter: the loader's batches hold {len(arrays)} arrays but data_names "
                f"{self.data_names} and label_names {self.label_names} name {expected}; pass "
                "one name per array (data first, then labels)")
        if len(arrays[0]) > self.batch_size:
            raise ValueError(f"StreamIter: batch of {len(arrays[0])} samples exceeds "
                             f"batch_size={self.batch_size}")
        return arrays

    def _split(self, arrays: list, marked: int = 0) -> tuple[list, list, int]:
        """Inputs, labels and padding rows: a short batch is padded here, as NDArrayIter pads
        (its rows, then its rows again); a full one keeps the padding the loader marked."""
        pad = self.batch_size - int(arrays[0].shape[0])
        if pad:
            arrays = pad_rows(arrays, self.batch_size)
        n = len(self.data_names)
        return arrays[:n], arrays[n:], pad or marked


def _names(arg: str, names: Any) -> list[str]:
    if isinstance(names, str):
        names = [names]
    names = list(names)
    if not all(isinstance(n, str) and n for n in names):
        raise TypeError(f"{arg} must be a sequence of non-empty strings, got {names!r}")
    return names
