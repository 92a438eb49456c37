"""Worker processes live as long as the loader's process, not the thread that built it: a loader
built in a helper thread keeps its workers after that thread ends, and a training process
killed with SIGKILL (built in any thread) leaves no worker and no /dev/shm file behind."""
from __future__ import annotations

import glob
import os
import subprocess
import sys
import threading

import psutil
import pytest

import gluon_stream as gs
from _helpers import JOIN_S, all_ids, batch_ids, dead, id_shards, wait_for

pytestmark = pytest.mark.mxnet  # these tests use MXNet: warm its engine first

SIZES = [8, 5, 7]


def keep(ids, half):
    return ids, half


def thread_gone(native_id):
    """Whether the OS thread has exited (Thread.join returns a little before it does)."""
    return native_id not in {t.id for t in psutil.Process().threads()}


@pytest.mark.timeout(60)
def test_a_loader_built_in_a_thread_that_ended_keeps_its_workers():
    built = []
    builder = threading.Thread(target=lambda: built.append(gs.StreamLoader(
        gs.FunctionSource(range(3), id_shards(SIZES)), batch_size=4, sample_transform=keep,
        num_workers=2)), name="gluon_stream-test-builder")
    builder.start()
    builder.join(JOIN_S)
    wait_for(lambda: thread_gone(builder.native_id), what="the builder thread to exit")
    with built[0] as loader:
        workers = loader._path.workers
        pids = list(workers.pids)
        alive = [not dead(pid) for pid in pids]
        passes = [[i for b in loader for i in batch_ids(b)] for _ in range(2)]
        forks = workers.forks
    assert alive == [True, True]  # PR_SET_PDEATHSIG used to kill them as the thread ended
    assert forks == 2
    assert [sorted(ids) for ids in passes] == [all_ids(SIZES)] * 2


_TRAINING = r"""
import os, sys, threading, time
import numpy as np
import gluon_stream as gs

def stuck_after_the_first_batch(x):
    if x >= 4:
        threading.Event().wait()  # a worker busy in per-sample code when the process dies
    return x

def build():
    return gs.StreamLoader(gs.FunctionSource([0], lambda k: np.arange(64.0)), batch_size=4,
                           sample_transform=stuck_after_the_first_batch, num_workers=2)

if sys.argv[1] == "helper thread":
    box = []
    builder = threading.Thread(target=lambda: box.append(build()))
    builder.start()
    builder.join()
    while os.path.exists(f"/proc/self/task/{builder.native_id}"):  # join returns a bit early
        time.sleep(0.01)
    loader = box[0]
else:
    loader = build()
batches = iter(loader)
next(batches)
print(*loader._path.workers.pids, flush=True)
sys.stdin.read()  # until killed
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("built_in", ["main thread", "helper thread"])
def test_a_training_process_killed_with_sigkill_leaves_no_worker_and_no_shm_file(built_in):
    proc = subprocess.Popen([sys.executable, "-c", _TRAINING, built_in], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        line = proc.stdout.readline()
        assert line, proc.communicate(timeout=JOIN_S)[1]
        pids = [int(p) for p in line.split()]
        alive = [not dead(pid) for pid in pids]
        proc.kill()  # SIGKILL: no cleanup of any kind runs in the training process
        proc.communicate(timeout=JOIN_S)
        wait_for(lambda: all(dead(pid) for pid in pids), 10, "the orphaned workers to exit")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=JOIN_S)
    assert len(pids) == 2 and alive == [True, True]
    assert [path for pid in pids for path in glob.glob(f"/dev/shm/mx_{pid:x}_*")] == []


def test_children_forked_by_the_training_process_do_not_keep_orphaned_workers_alive():
    """Every fork of the loader's process drops its end of the workers' watch pipe, so a
    user's own child (a multiprocessing worker, a os.fork()) never holds it."""
    with gs.StreamLoader(gs.FunctionSource(range(3), id_shards(SIZES)), batch_size=4,
                         sample_transform=keep, num_workers=1) as loader:
        write_end = next(iter(sys.modules["gluon_stream._mx.parent_pipe"]._PARENT_ENDS))
        reader, writer = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: is the write end still open here?
            try:
                os.fstat(write_end)
                os.write(writer, b"open")
            except OSError:
                os.write(writer, b"closed")
            os._exit(0)
        os.close(writer)
        with os.fdopen(reader, "rb") as fp:
            answer = fp.read()
        os.waitpid(pid, 0)
        ids = [i for b in loader for i in batch_ids(b)]
    assert answer == b"closed"
    assert sorted(ids) == all_ids(SIZES)
