"""MXNet 1.9.1 on a numpy without ``np.bool`` & co. (1.24+, the only numpy Python 3.12 has):
gluon_stream's door to MXNet restores the removed aliases, and only those that are missing
(``restore_numpy_aliases``, which the import hook of ``test_import_order`` shares).

Each case runs in a fresh interpreter: MXNet is imported once per process.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy
import pytest

ALIASES = ("bool", "int", "float", "complex", "object", "str")


def run(code: str) -> None:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]


@pytest.mark.mxnet
def test_mxnet_imports_on_a_numpy_that_removed_the_aliases():
    run(f"""
        import numpy
        numpy_getattr = numpy.__getattr__

        def removed(name):  # what numpy >= 1.24 does for the aliases
            if name in {ALIASES!r}:
                raise AttributeError(f"module 'numpy' has no attribute {{name!r}}")
            return numpy_getattr(name)

        numpy.__getattr__ = removed
        from gluon_stream._mx import import_mxnet

        mx = import_mxnet()
        assert (numpy.bool, numpy.int, numpy.object, numpy.str) == (bool, int, object, str)
        assert (mx.nd.ones((2,)) + 1).asnumpy().tolist() == [2.0, 2.0]
    """)


@pytest.mark.mxnet
@pytest.mark.skipif(numpy.lib.NumpyVersion(numpy.__version__) >= "1.24.0",
                    reason="numpy >= 1.24 has no aliases of its own (Python 3.12)")
def test_a_numpy_that_has_the_aliases_keeps_its_own():
    run(f"""
        import numpy
        from gluon_stream._mx import import_mxnet

        import_mxnet()
        assert not set({ALIASES!r}) & set(vars(numpy)), "aliases set on a numpy that had them"
    """)
