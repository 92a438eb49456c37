"""producers='auto' counts the cores this process may use: affinity and cgroup quotas."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from gluon_stream._utils.lifecycle import cgroup_quota, usable_cores


def write(root, name, text):
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.mark.parametrize("files, quota", [
    ({"cpu.max": "150000 100000\n"}, 1.5),  # cgroup v2: --cpus=1.5
    ({"cpu.max": "max 100000\n"}, None),
    ({"cpu/cpu.cfs_quota_us": "50000", "cpu/cpu.cfs_period_us": "100000"}, 0.5),  # v1
    ({"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}, None),
    ({"cpu.max": "garbage"}, None),
    ({}, None),
])
def test_cgroup_quotas_are_read_in_both_versions(tmp_path, files, quota):
    for name, text in files.items():
        write(tmp_path, name, text)
    assert cgroup_quota(str(tmp_path)) == quota


def test_a_quota_bounds_the_cores_and_never_below_one(tmp_path):
    write(tmp_path, "cpu.max", "50000 100000")
    assert usable_cores(str(tmp_path)) == 1
    write(tmp_path, "cpu.max", "10000000 100000")  # 100 cores of quota: affinity bounds it
    assert usable_cores(str(tmp_path)) == len(os.sched_getaffinity(0))


@pytest.mark.mxnet
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux affinity")
def test_auto_producers_do_not_grow_past_the_cores_this_process_may_use():
    """Restricted to one core (taskset), a generation-bound stream stays at one producer."""
    code = textwrap.dedent("""
        import os, time
        import numpy as np
        import gluon_stream as gs
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        def slow(key):
            time.sleep(0.05)
            return np.zeros((4, 2), "float32")
        with gs.StreamLoader(gs.FunctionSource(range(8), slow), batch_size=4,
                             prefetch=4) as loader:
            for batch in loader:
                pass
            print(loader.stream.producers)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "1"
