"""The MXNet door: DataLoader worker pools ended without CPython's terminate() hang, and the
shared-memory files a dead worker leaves behind removed."""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

import pytest

from _helpers import JOIN_S

pytestmark = pytest.mark.mxnet  # these tests use MXNet: warm its engine first


_TERMINATE_HANG = r"""
import os, signal, mxnet as mx
from gluon_stream.tools.bench import dataloader as mx_dataloader
dl = mx.gluon.data.DataLoader(mx.gluon.data.ArrayDataset(list(range(8))), batch_size=2,
                              num_workers=2)
pool = mx_dataloader.worker_pool(dl)
for proc in list(pool._pool):  # both idle: one of them holds the task queue's read lock
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
print("killed", flush=True)
{ending}
print("released", flush=True)
"""


@pytest.mark.timeout(90)
def test_ending_a_pool_whose_worker_died_holding_a_queue_lock_does_not_hang():
    """CPython gh-96995: Pool.terminate() blocks forever on the dead worker's lock (control);
    release_dataloader ends the same pool at once. Both run side by side (one MXNet start to
    wait for, not two), and the control is given 3 s to hang once its workers are killed."""
    def start(ending):
        return subprocess.Popen([sys.executable, "-c", _TERMINATE_HANG.format(ending=ending)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)

    def result(proc, timeout):
        """What it printed, "hung" added if it had not exited ``timeout`` s after "killed"."""
        ready, _, _ = select.select([proc.stdout], [], [], 60)  # MXNet's start, then the kill
        first = [proc.stdout.readline().strip()] if ready else []
        try:
            proc.wait(timeout=timeout)  # its output is two short lines: no pipe fills up
            hung = []
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=JOIN_S)
            hung = ["hung"]
        return first + proc.stdout.read().split() + hung

    control, fixed = start("pool.terminate()"), start("mx_dataloader.release_dataloader(dl)")
    try:
        assert result(control, 3) == ["killed", "hung"]  # the bug is real here
        assert result(fixed, 60) == ["killed", "released"]
    finally:
        for proc in (control, fixed):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=JOIN_S)  # reaped, its pipes closed


def test_shared_memory_files_of_a_dead_worker_are_removed(tmp_path):
    from gluon_stream._mx.shm import remove_worker_shm

    dead_pid = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                                  capture_output=True, text=True, check=True).stdout)
    leftover = f"/dev/shm/mx_{dead_pid:x}_1234abcd"
    other = f"/dev/shm/mx_{dead_pid + 1:x}_1234abcd"
    for path in (leftover, other):
        open(path, "wb").close()
    try:
        assert remove_worker_shm(dead_pid) == [leftover]
        assert not os.path.exists(leftover) and os.path.exists(other)
    finally:
        for path in (leftover, other):
            if os.path.exists(path):
                os.unlink(path)
