"""Everything is declared in setup.cfg; this file only installs ``gluon_stream-mxnet-hook.pth``.

That .pth file makes a script's own ``import mxnet`` work before gluon_stream's, on numpy >= 1.24
(see ``_gluon_stream_mxnet_hook.py``). site.py reads .pth files only in site-packages itself,
and setuptools has no setting that puts a file there, so each way of installing gets it here:

* ``pip install .`` builds a wheel from ``build_lib``, whose top level is site-packages once
  installed: :class:`build_py` writes the .pth there (``setup.py install`` copies it too).
* ``pip install -e .`` (PEP 660, setuptools >= 64) builds an editable wheel that takes nothing
  from ``build_lib`` (a finder or a path entry points at the source): :class:`editable_wheel`
  adds the .pth to the top of the wheel it built, with the file's line in its RECORD.
* pip's legacy ``-e`` (``wheel`` installed, no pyproject.toml) runs ``setup.py develop``; before
  setuptools 80 that links the source with an egg-link, and :class:`develop` writes the .pth
  into site-packages. (From setuptools 80, develop runs ``pip install -e``: the case above.)

pip records the file in the first two cases, so ``pip uninstall`` removes it; the .pth's line
quietly skips a hook module that is gone (a deleted checkout, an uninstalled egg-link). The name
sorts after ``__editable__.*.pth`` and ``easy-install.pth``, which must run first for an editable
install's hook module to be importable.
"""
from __future__ import annotations

import base64
import hashlib
import os
import zipfile
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py as _build_py
from setuptools.command.develop import develop as _develop

PTH_NAME = "gluon_stream-mxnet-hook.pth"
PTH_LINE = ("import sys; exec('try:\\n import _gluon_stream_mxnet_hook as hook\\n"
            "except ImportError:\\n hook = None\\nif hook:\\n hook.install()')\n")


def write_pth(directory: str) -> str:
    """Write the .pth file into ``directory``; return its path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, PTH_NAME)
    with open(path, "w", encoding="utf-8") as fp:
        fp.write(PTH_LINE)
    return path


def add_to_wheel(wheel: Path, name: str, data: bytes) -> None:
    """Add a file at the top of a built wheel, with its line in the wheel's RECORD."""
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    record_line = f"{name},sha256={digest},{len(data)}\n".encode()
    rewritten = wheel.with_name(wheel.name + ".part")
    with zipfile.ZipFile(wheel) as src, \
            zipfile.ZipFile(rewritten, "w", zipfile.ZIP_DEFLATED) as dst:
        dst.writestr(name, data)
        for info in src.infolist():
            content = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                content += record_line
            dst.writestr(info, content)
    os.replace(rewritten, wheel)


class build_py(_build_py):
    """Also write the .pth at the top of ``build_lib`` (the root of a wheel)."""

    def run(self) -> None:
        super().run()
        if not getattr(self, "editable_mode", False):
            write_pth(self.build_lib)

    def get_outputs(self, *args, **kwargs) -> list:
        outputs = super().get_outputs(*args, **kwargs)
        if getattr(self, "editable_mode", False):
            return outputs
        return [*outputs, os.path.join(self.build_lib, PTH_NAME)]


class develop(_develop):
    """setuptools < 80's develop (an egg-link): also write the .pth into site-packages."""

    def run(self) -> None:
        super().run()
        if hasattr(self, "egg_link") and not getattr(self, "uninstall", False):
            write_pth(self.install_dir)


cmdclass = {"build_py": build_py, "develop": develop}
try:
    from setuptools.command.editable_wheel import editable_wheel as _editable_wheel
except ImportError:  # setuptools < 64: no PEP 660, pip runs develop
    _editable_wheel = None
if _editable_wheel is not None:
    class editable_wheel(_editable_wheel):
        """Also add the .pth to the top of the editable wheel."""

        def run(self) -> None:
            super().run()
            wheel = max(Path(self.dist_dir).glob("*.editable-*.whl"), key=os.path.getmtime)
            add_to_wheel(wheel, PTH_NAME, PTH_LINE.encode())

    cmdclass["editable_wheel"] = editable_wheel

setup(cmdclass=cmdclass)
