"""The only door to MXNet: nothing else in gluon_stream imports ``mxnet`` or touches its privates.

MXNet is imported on first use (:func:`import_mxnet`), not when ``gluon_stream`` is imported,
so the parts that need no MXNet (sources, shard files, stats, ``gluon-stream inspect``) work
and start fast where MXNet is missing or broken. MXNet 1.9.1 needs ``numpy<1.24`` (it uses
``np.bool``), or on Python 3.12 numpy 1.26 with those aliases restored (see
:func:`restore_numpy_aliases`) and setuptools (for ``distutils``); where it cannot be imported,
whatever needs it raises an ImportError that says which extra to install.
"""
from __future__ import annotations

import builtins
import threading
import warnings
from typing import Any

__all__ = ["INSTALL_HINT", "data_iter_base", "gluon_data_loader", "mxnet_available",
           "import_mxnet", "restore_numpy_aliases"]

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
