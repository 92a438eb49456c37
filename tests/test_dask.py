"""Shards made on a real dask cluster (``LocalCluster(processes=True)``, two worker processes)
through ``producers=client.get_executor()``: every sample exactly once, retries included."""
from __future__ import annotations

import os

import numpy as np
import pytest

import gluon_stream as gs
from _helpers import batch_ids
from _servers import dask_cluster  # noqa: F401, F811  (fixture)

# dask keeps an offload thread and multiprocessing's resource tracker for the process: the
# leak check cannot tell them from ours, so the fixture checks what the cluster leaves
pytestmark = [pytest.mark.mxnet, pytest.mark.no_leak_check, pytest.mark.timeout(120)]


def failing_once(log: str, bad_key: int):
    """A shard function that fails the first time it is called for ``bad_key`` (in whichever
    process), and logs every call as 'key pid'."""
    def fn(key):
        with open(log, "a") as fp:
            fp.write(f"{key} {os.getpid()}\n")
        with open(log) as fp:
            calls = sum(1 for line in fp if line.split()[0] == str(key))
        if key == bad_key and calls == 1:
            raise RuntimeError(f"the first attempt at shard {key} fails")
        return np.arange(3, dtype=np.int64) + 10 * key
    return fn


@pytest.mark.parametrize("cached", [False, True], ids=["in-memory", "cache_dir"])
def test_a_retried_shard_runs_again_on_a_dask_cluster(dask_cluster, tmp_path, cached):
    """on_error=('retry', 2) logged 'retry 1/2', 'retry 2/2' but dask handed back the failed
    result of the identical (pure) task: the shard never ran again and the epoch failed."""
    log = str(tmp_path / "calls.log")
    src = gs.FunctionSource(range(4), failing_once(log, bad_key=2),
                            cache_dir=tmp_path / "cache" if cached else None)
    with gs.StreamLoader(src, batch_size=3, producers=dask_cluster.client.get_executor(),
                         on_error=("retry", 2), num_epochs=1) as loader:
        ids = [i for batch in loader for i in batch_ids(batch)]
    assert ids == [10 * k + i for k in range(4) for i in range(3)]  # each sample once, in order
    with open(log) as fp:
        calls = [line.split() for line in fp]
    assert sorted(key for key, _ in calls) == ["0", "1", "2", "2", "3"]  # shard 2 ran again
    assert {int(pid) for _, pid in calls} <= dask_cluster.worker_pids  # all on the workers
    if cached:
        assert sorted(os.listdir(tmp_path / "cache")) == [f"{k}.npy" for k in range(4)]
