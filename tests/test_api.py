import os
import subprocess
import sys
import types

import pytest

import gluon_stream as gs


def test_all_is_exported():
    public = {n for n in dir(gs) if not n.startswith("_")
              and not isinstance(getattr(gs, n), types.ModuleType)}
    assert set(gs.__all__) - {"__version__"} == public
    assert gs.__all__ == sorted(gs.__all__)


def test_errors_share_a_base_and_builtins():
    assert issubclass(gs.ShardTimeout, gs.ShardError)
    assert issubclass(gs.ShardTimeout, TimeoutError)
    for cls in (gs.ShardError, gs.CorruptShard, gs.UnsafeShard, gs.SchemaMismatch,
                gs.WorkerDied, gs.BatchTimeout, gs.LoaderClosed, gs.UnsafeKey, gs.InvalidState):
        assert issubclass(cls, gs.StreamError)
    for cls in (gs.CorruptShard, gs.UnsafeKey, gs.InvalidState):
        assert issubclass(cls, ValueError)  # except ValueError keeps working


def test_import_without_mxnet_names_the_extra():
    code = ("import sys; sys.modules['mxnet'] = None\n"
            "import gluon_stream as gs\n"
            "try:\n"
            "    gs.StreamLoader(gs.FunctionSource([0], lambda k: [1]), batch_size=1)\n"
            "except ImportError as e:\n"
            "    print('ERR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "ERR" in out.stdout, out.stderr
    assert "gluon_stream[cpu]" in out.stdout and "[cu112]" in out.stdout


@pytest.mark.mxnet
def test_docstring_examples_run():
    """Every module's examples run (those that need files or a loader are marked +SKIP)."""
    import doctest
    import importlib
    import pkgutil

    attempted = 0
    for info in pkgutil.walk_packages(gs.__path__, "gluon_stream."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0, info.name
        attempted += result.attempted
    assert attempted >= 20


PURE_TESTS = ["test_batching.py", "test_cache.py", "test_fuzz.py", "test_inspect.py",
              "test_keys.py", "test_retry.py", "test_shardfile.py", "test_sources.py",
              "test_state.py", "test_stats.py", "test_validate.py"]


def test_the_pure_python_parts_are_tested_without_mxnet(tmp_path):
    """With ``import mxnet`` failing, the tests of every module that needs no MXNet pass
    (the ones marked ``mxnet`` are deselected)."""
    blocker = tmp_path / "mxnet"
    blocker.mkdir()
    (blocker / "__init__.py").write_text("raise ImportError('mxnet blocked by the test')\n")
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path)] + sys.path))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-n", "0",  # in that one process: this test has its core already
                          "-m", "not mxnet", *PURE_TESTS], cwd=here, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and "error" not in out.stdout.splitlines()[-1]


@pytest.mark.mxnet
def test_import_mxnet_is_the_mxnet_module():
    import mxnet

    assert gs.import_mxnet() is mxnet


def test_the_version_is_read_before_numpy_is_installed(tmp_path):
    """pip asks an old setuptools (Python 3.9's) for the metadata before the dependencies are
    installed; it reads ``version = attr: gluon_stream._version.__version__`` by importing the
    package, which fails on numpy, then takes the submodule imported before the failure. So
    ``_version`` is the package's first import (the 3.9 smoke run failed when an import sorted
    before it needed numpy)."""
    import os
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import importlib, sys
        sys.modules["numpy"] = None  # not installed yet
        try:
            importlib.import_module("gluon_stream")
        except ImportError:
            pass
        print(importlib.import_module("gluon_stream._version").__version__)
    """)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=root, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == gs.__version__
