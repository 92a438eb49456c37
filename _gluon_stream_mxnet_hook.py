"""Make ``import mxnet`` work in any order on numpy >= 1.24 (Python 3.12), before gluon_stream.

MXNet 1.9.1 uses numpy aliases (``np.bool`` ...) that numpy 1.24 removed, and Python 3.12 only
has numpy 1.26. gluon_stream restores them before it imports MXNet
(:func:`gluon_stream._mx.restore_numpy_aliases`); this module makes a script's own
``import mxnet`` do the same, wherever it comes.

``gluon_stream-mxnet-hook.pth``, installed into site-packages beside gluon_stream (by
``pip install`` and ``pip install -e`` alike, see setup.py), calls :func:`install` at interpreter
start. That puts :class:`MXNetAliasFinder` first on ``sys.meta_path``: it finds nothing, but
when ``mxnet`` is first looked for it removes itself, restores the aliases and lets the usual
finders import MXNet. Nothing else happens at start: this module imports only ``sys``; numpy
and gluon_stream are imported when MXNet is. Where numpy still has its aliases (numpy < 1.24,
Python 3.9-3.11) restoring sets none, so nothing changes.
"""
from __future__ import annotations

import sys

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is not imported at interpreter start for an annotation
    from typing import Any, Optional, Sequence

__all__ = ["MXNetAliasFinder", "install", "installed", "uninstall"]


class MXNetAliasFinder:
    """A ``sys.meta_path`` finder that restores numpy's aliases when ``mxnet`` is first imported.

    It never finds a module: asked for ``mxnet``, it uninstalls itself (once is enough), calls
    gluon_stream's alias restorer and returns ``None``, so the next finder imports MXNet.
    """

    @classmethod
    def find_spec(cls, fullname: str, path: Optional[Sequence[str]] = None,
                  target: Any = None) -> None:
        if fullname != "mxnet":
            return None
        uninstall()
        try:
            from gluon_stream._mx import restore_numpy_aliases

            restore_numpy_aliases()
        except Exception as exc:  # a broken gluon_stream must not be what breaks `import mxnet`
            import warnings

            warnings.warn(f"gluon_stream could not restore numpy's aliases before MXNet was "
                          f"imported ({exc!r}); on numpy >= 1.24 `import mxnet` then fails",
                          RuntimeWarning, stacklevel=2)
        return None


def installed() -> bool:
    """Whether the finder is on ``sys.meta_path`` (until ``mxnet`` is first imported)."""
    return MXNetAliasFinder in sys.meta_path


def install() -> None:
    """Put the finder first on ``sys.meta_path``, unless MXNet is already imported."""
    if "mxnet" not in sys.modules and not installed():
        sys.meta_path.insert(0, MXNetAliasFinder)  # type: ignore[arg-type]


def uninstall() -> None:
    """Take the finder off ``sys.meta_path``."""
    try:
        sys.meta_path.remove(MXNetAliasFinder)  # type: ignore[arg-type]
    except ValueError:  # another thread took it off first
        pass
