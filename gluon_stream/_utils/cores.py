"""How many CPU cores this process may really use: its affinity, and its cgroup's CPU quota.

``os.cpu_count()`` counts the machine's cores; a container's cpuset, ``taskset`` and a cgroup
quota (``docker --cpus``, Kubernetes CPU limits) allow fewer. Sizing thread pools by it
oversubscribes exactly the machines that are already short of cores.
"""
from __future__ import annotations

import logging
import math
import os

__all__ = ["usable_cores"]

logger = logging.getLogger(__name__)

CGROUP_ROOT = "/sys/fs/cgroup"


def usable_cores(cgroup_root: str = CGROUP_ROOT) -> int:
    """The cores this process may run on (affinity), bounded by its cgroup's CPU quota; >= 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    quota = cgroup_quota(cgroup_root)
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return max(1, cores)


def cgroup_quota(root: str = CGROUP_ROOT) -> float | None:
    """The CPU quota in cores (cgroup v2 ``cpu.max``, or v1 ``cpu.cfs_quota_us`` over
    ``cpu.cfs_period_us``), or None when there is none or it cannot be read."""
    text = _read(os.path.join(root, "cpu.max"))
    if text is not None:
        parts = text.split()
        if len(parts) == 2 and parts[0] != "max":
            return _ratio(parts[0], parts[1])
        return None
    quota = _read(os.path.join(root, "cpu", "cpu.cfs_quota_us"))
    period = _read(os.path.join(root, "cpu", "cpu.cfs_period_us"))
    if quota is None or period is None or quota.strip() == "-1":
        return None
    return _ratio(quota, period)


def _ratio(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        logger.debug("unreadable CPU quota %r / %r", quota, period)
        return None
    return q / p if q > 0 and p > 0 else None


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None
