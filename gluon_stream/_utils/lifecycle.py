"""Who may close what, and when: interpreter exit and fork.

* **Exit.** Python joins the threads of every ``concurrent.futures`` executor before it runs
  ``atexit`` handlers (and so ``weakref.finalize``), so a producer thread waiting on a generator
  would hold up the exit of a script that crashed, or simply forgot ``close()``, for as long
  as the generator runs. Owners registered here are closed first (their generators killed,
  workers stopped, temp files removed), in the same hook ``concurrent.futures`` uses.
* **Fork.** A forked child (a user's ``multiprocessing`` worker, a ``os.fork()``) inherits the
  loader's objects but none of its threads: using them would hang, and closing them at the
  child's exit would kill the parent's generators and workers. In the child every registered
  owner is marked as foreign: its finalizer is detached and :func:`check_owner` raises a clear
  error instead of hanging.

:class:`ThreadPool` is the executor whose threads such a close can always find: a Ctrl-C
cannot make it lose one.

How many threads the machine can run: :func:`usable_cores` (affinity and the cgroup's CPU
quota, not ``os.cpu_count()``) sizes the producers and workers.
"""
from __future__ import annotations

import concurrent.futures as cf
import concurrent.futures.thread  # noqa: F401  (its exit hook first, so ours runs before it)
import concurrent.futures.thread as cf_thread
import logging
import math
import os
import threading
import weakref
from typing import Any, Callable, cast

from ..errors import LoaderClosed

__all__ = ["ThreadPool", "check_owner", "track", "usable_cores"]

logger = logging.getLogger(__name__)

_owners: "weakref.WeakKeyDictionary[Any, tuple[int, weakref.finalize]]" = \
    weakref.WeakKeyDictionary()
_lock = threading.Lock()


def track(owner: Any, finalizer: weakref.finalize) -> None:
    """Close ``owner`` (through ``finalizer``) before executor threads are joined at exit."""
    with _lock:
        _owners[owner] = (os.getpid(), finalizer)


def check_owner(owner: Any, what: str) -> None:
    """Raise LoaderClosed if ``owner`` was made in another process (this one is a fork)."""
    entry = _owners.get(owner)
    if entry is not None and entry[0] != os.getpid():
        raise LoaderClosed(
            f"this {what} was created in process {entry[0]}; this process ({os.getpid()}) is a "
            "fork of it and has none of its threads, worker processes or generators: create a "
            "new one here")


def _close_all() -> None:
    with _lock:
        entries = [(pid, fin) for pid, fin in _owners.values()]
    for pid, finalizer in entries:
        if pid == os.getpid() and finalizer.alive:
            finalizer()


def _forget_in_child() -> None:
    """In a forked child: nothing inherited is ours to close."""
    with _lock:
        entries = list(_owners.values())
    for _, finalizer in entries:
        finalizer.detach()


def _register(hook: Callable[[], None]) -> None:
    register = getattr(threading, "_register_atexit", None)
    if register is not None:  # runs before concurrent.futures joins its threads (3.9+)
        register(hook)
    else:  # pragma: no cover
        import atexit

        atexit.register(hook)


_register(_close_all)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


# -- thread_pool -------------------------------------------------------------------------------
#: how long an interrupted start waits to learn whether its thread began; it begins within
#: microseconds when all is well, so this is reached only if it never will
START_WAIT_S = 10.0


class ThreadPool(cf.ThreadPoolExecutor):
    """``concurrent.futures.ThreadPoolExecutor`` whose every thread is in ``_threads`` (joined
    on shutdown and at exit) from before it starts, so at most ``max_workers`` ever run."""

    def _adjust_thread_count(self) -> None:  # the stdlib's (3.9-3.12), recorded first
        if self._idle_semaphore.acquire(timeout=0):
            return
        if len(self._threads) >= self._max_workers:
            return

        def weakref_cb(_: Any, q: Any = self._work_queue) -> None:
            q.put(None)

        began = threading.Event()
        thread = threading.Thread(
            name=f"{self._thread_name_prefix or self}_{len(self._threads)}",
            target=_work, args=(began, weakref.ref(self, weakref_cb), self._work_queue,
                                self._initializer, self._initargs))
        threads = cast("set[threading.Thread]", self._threads)  # typeshed: read-only views
        queues = cast("dict[threading.Thread, Any]", cf_thread._threads_queues)
        threads.add(thread)
        queues[thread] = self._work_queue  # joined at exit, as the stdlib's threads
        try:
            thread.start()
        except BaseException:  # KeyboardInterrupt: keep it if it began, as it then runs
            if not began.wait(START_WAIT_S):
                threads.discard(thread)
                queues.pop(thread, None)
            raise


def _work(began: threading.Event, *args: Any) -> None:
    began.set()
    cf_thread._worker(*args)


# -- how many CPU cores this process may really use ------------------------------------------------
# How many CPU cores this process may really use: its affinity, and its cgroup's CPU quota.
#
# ``os.cpu_count()`` counts the machine's cores; a container's cpuset, ``taskset`` and a cgroup
# quota (``docker --cpus``, Kubernetes CPU limits) allow fewer. Sizing thread pools by it
# oversubscribes exactly the machines that are already short of cores.
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
