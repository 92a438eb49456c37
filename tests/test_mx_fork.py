"""A fork while MXNet's engine frees NDArrays made over numpy memory does not hang.

MXNet's at-fork handler joins its engine threads inside ``fork()``, where the forking thread
holds the GIL; an engine thread that frees the last reference to a zero-copy NDArray runs
gluon_stream's DLPack deleter, which waits for the GIL. Each check runs in its own process
with a deadline, so a hang fails the test instead of hanging the suite.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.mxnet

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEADLINE_S = 90

# NDArrays over numpy memory dropped while an operation that reads them still runs (the
# operation holds their last reference), then a fork: on the unfixed package the first fork
# hangs every time.
DROPPED_THEN_FORK = """
import os
import numpy as np
from gluon_stream._mx import import_mxnet
from gluon_stream._mx.arrays import wrap_numpy
mx = import_mxnet()
for _ in range({rounds}):
    outs = []
    for _ in range(64):
        a = wrap_numpy(np.ones((256, 256), dtype=np.float32))
        outs.append(mx.nd.dot(a, a))
        del a
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    del outs
print("forks done")
"""

# The shape the reference model found, as a user writes it: a loader whose worker batches
# (zero-copy NDArrays over shared memory) are dropped unread, then loaders that fork workers.
LOADERS = """
import numpy as np
import gluon_stream as gs
mx = gs.import_mxnet()
def shard(key):
    return np.full((128, 512), key, dtype=np.float32)
def same(x):
    return x
outs = []
for _ in range({rounds}):
    for b in gs.StreamLoader(gs.FunctionSource(range(2), shard), batch_size=64,
                             sample_transform=same, num_workers=2):
        outs = [mx.nd.dot(b, b, transpose_a=True) for _ in range(40)]
        break
    del b  # the batch's last references are the operations still running
print("loaders done")
"""


def _run(code: str) -> str:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                              capture_output=True, text=True, timeout=DEADLINE_S, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail(f"hung: no result in {DEADLINE_S} s (fork waits on MXNet's engine)")
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.timeout(DEADLINE_S + 30)
def test_fork_right_after_zero_copy_ndarrays_are_dropped():
    assert "forks done" in _run(DROPPED_THEN_FORK.format(rounds=30))


@pytest.mark.timeout(DEADLINE_S + 30)
def test_unreferenced_loaders_with_workers_one_after_another():
    assert "loaders done" in _run(LOADERS.format(rounds=8))
