import subprocess
import sys
import types

import gluon_stream as gs


def test_all_is_exported():
    public = {n for n in vars(gs) if not n.startswith("_")
              and not isinstance(getattr(gs, n), types.ModuleType)}
    assert set(gs.__all__) - {"__version__"} == public
    assert gs.__all__ == sorted(gs.__all__)


def test_errors_share_a_base_and_builtins():
    assert issubclass(gs.ShardTimeout, gs.ShardError)
    assert issubclass(gs.ShardTimeout, TimeoutError)
    for cls in (gs.ShardError, gs.CorruptShard, gs.UnsafeShard, gs.SchemaMismatch,
                gs.WorkerDied, gs.BatchTimeout, gs.LoaderClosed):
        assert issubclass(cls, gs.StreamError)
    assert issubclass(gs.CorruptShard, ValueError)


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
