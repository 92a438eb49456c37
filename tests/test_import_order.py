"""``import mxnet`` works before ``import gluon_stream``, in an environment where gluon_stream is
installed: ``gluon_stream-mxnet-hook.pth`` in site-packages puts a finder on ``sys.meta_path``
at interpreter start, and that finder restores numpy's removed aliases only when ``mxnet`` is
first imported (see ``_gluon_stream_mxnet_hook.py`` and setup.py).

Each case is a fresh interpreter started outside the source tree, so what it sees is what the
installation (``pip install .`` or ``pip install -e .``) put in site-packages.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

PTH_NAME = "gluon_stream-mxnet-hook.pth"
ALIASES = ("bool", "int", "float", "complex", "object", "str")

# What a fresh interpreter has done before the first line of a script.
STARTED = """
    import json, os, site, sys
    state = {
        "numpy": "numpy" in sys.modules,
        "gluon_stream": "gluon_stream" in sys.modules,
        "first_finder": getattr(sys.meta_path[0], "__qualname__", repr(sys.meta_path[0])),
        "pth": [d for d in [*site.getsitepackages(), site.getusersitepackages()]
                if os.path.isfile(os.path.join(d, %r))],
    }
""" % PTH_NAME


def run(code: str, cwd) -> dict:
    """Run ``code`` in a fresh interpreter in ``cwd``; it prints one JSON line last."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


def test_the_hook_is_installed_in_site_packages_and_imports_nothing_at_start(tmp_path):
    state = run(STARTED + "    print(json.dumps(state))", tmp_path)
    assert state["pth"], f"no {PTH_NAME} in site-packages: reinstall gluon_stream (pip install)"
    assert state["first_finder"] == "MXNetAliasFinder"
    assert not state["numpy"] and not state["gluon_stream"]


def test_import_mxnet_first_restores_the_aliases_then_and_only_then(tmp_path):
    """numpy is made to lack the aliases, as numpy >= 1.24 does; they appear at ``import mxnet``."""
    state = run(STARTED + f"""
    import numpy
    numpy_getattr = numpy.__getattr__

    def removed(name):  # what numpy >= 1.24 does for the aliases
        if name in {ALIASES!r}:
            raise AttributeError(f"module 'numpy' has no attribute {{name!r}}")
        return numpy_getattr(name)

    numpy.__getattr__ = removed
    for name in {ALIASES!r}:
        numpy.__dict__.pop(name, None)
    import json as _json, collections  # other imports pass the finder by
    state["before"] = [name for name in {ALIASES!r} if hasattr(numpy, name)]
    state["still_installed"] = sys.meta_path[0].__qualname__ == "MXNetAliasFinder"

    import mxnet as mx

    state["after"] = [name for name in {ALIASES!r} if getattr(numpy, name, None) is
                      getattr(__import__("builtins"), name)]
    state["finder_left"] = any(getattr(f, "__qualname__", "") == "MXNetAliasFinder"
                               for f in sys.meta_path)
    state["sum"] = (mx.nd.ones((2,)) + 1).asnumpy().tolist()
    import gluon_stream as gs
    with gs.StreamLoader(gs.FunctionSource(range(2), lambda k: numpy.ones((6, 2), "float32")),
                         batch_size=4) as loader:
        state["batches"] = [b.shape[0] for b in loader]
    print(json.dumps(state))
    """, tmp_path)
    assert not state["numpy"]
    assert state["before"] == [] and state["still_installed"]
    assert state["after"] == list(ALIASES) and not state["finder_left"]
    assert state["sum"] == [2.0, 2.0] and state["batches"] == [4, 4, 4]


def test_a_gluon_stream_that_cannot_be_imported_only_warns_at_import_mxnet(tmp_path):
    state = run(STARTED + """
    import warnings
    sys.modules["gluon_stream"] = None  # as if the package were broken
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            import mxnet
        except AttributeError as exc:  # numpy >= 1.24 without the aliases: MXNet's own error
            state["error"] = str(exc)
    state["warnings"] = [str(w.message) for w in caught if w.category is RuntimeWarning]
    print(json.dumps(state))
    """, tmp_path)
    assert any("could not restore numpy's aliases" in w for w in state["warnings"]), state
