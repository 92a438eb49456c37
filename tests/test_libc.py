"""The C library's calls: glibc's malloc_trim gives freed memory back (what lets a loader's
resident memory track what its memory_budget gate counts)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from gluon_stream._utils.libc import _malloc_trim

PROBE = textwrap.dedent("""
    import numpy as np
    from gluon_stream._utils.libc import trim_freed

    def rss_mib():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon"):
                return int(line.split()[1]) // 1024

    big = np.ones(16 << 20, dtype=np.uint8)
    del big  # glibc raises its mmap threshold: 1 MiB blocks now come from the heap
    keep, drop = [], []
    for i in range(200):
        (keep if i % 2 else drop).append(np.ones(1 << 20, dtype=np.uint8))
    del drop  # 100 MiB freed between blocks still held: kept by the allocator
    before = rss_mib()
    trim_freed()
    print(before, rss_mib(), int(sum(k.sum() for k in keep) // (1 << 20)))
""")


@pytest.mark.skipif(_malloc_trim() is None, reason="the C library has no malloc_trim (not glibc)")
def test_trim_freed_gives_freed_heap_memory_back_and_keeps_what_is_held():
    # a new process: the allocator's state is the probe's alone (no MALLOC_* variables)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          timeout=120, env=env, check=True)
    before, after, held = map(int, done.stdout.split())
    assert before - after >= 80, (before, after)  # the 100 MiB freed went back to the OS
    assert held == 100  # every byte still held is intact
