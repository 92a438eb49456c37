"""Running one generator program: argv only, stdin closed, its own process group, a bounded
stderr tail, a timeout, and the whole process group killed on the way out.

The group is made with ``setpgid`` (``process_group=0``, Python 3.11+), not ``setsid``: a new
session is a new scheduling autogroup on Linux, and two generators started together each in
its own ran about 40 % longer (0.14 s against 0.10 s for a 0.1 s program, medians of 8 pairs),
which a loader waiting for its first shard pays. Python 3.9 and 3.10 have no
``process_group``: there the program gets its own session, as before.

The program dies with the loader. ``close()``, a ``with`` block, interpreter exit and SIGINT
kill its group; a loader killed outright (SIGKILL, or SIGTERM with its default disposition, as
``kill``, ``timeout`` and most preemption send it) runs no code at all, so on Linux the program
is given a parent-death signal: ``prctl(PR_SET_PDEATHSIG, SIGKILL)``, set in the child before
``exec`` (it survives ``exec``) by a ``preexec_fn`` (:func:`_dying_with_parent`). That hook runs
between ``fork`` and ``exec`` in a copy of a threaded process, where a lock another thread held
stays held for ever; so it is two system calls and nothing else: a ``prctl`` resolved and
typed in the parent (:func:`~gluon_stream._utils.libc.libc`), no import, no allocation beyond
the call's arguments, no lock, and ``getppid`` against the pid noted in the parent, which
catches a loader that died before the ``prctl`` (the child then kills itself). CPython takes
the import lock around the ``fork`` and resets its own state in the child. The cost: with a
``preexec_fn``, ``subprocess`` forks instead of using ``vfork``: 3 to 4.5 ms more per program
started (``/bin/true`` through :class:`ProgramRunner`: 4.0 to 5.1 ms against 0.6 to 1.8 ms,
medians of 40 runs with 0 and 2 GiB resident, on a shared 2-core machine), small beside a
generator's run.

The signal fires when the *thread* that started the program ends, not only the process: the
thread that calls :meth:`ProgramRunner.run` waits for the program in that same call and reaps
it (its ``finally`` kills the group) before it returns, so the thread cannot end first.

Limits: only the program itself gets the signal. Programs it starts get none (their parent is
the program): a wrapper script should ``exec`` its last command, or they outlive a killed loader
as before. Platforms without ``prctl`` (macOS, the BSDs) have no parent-death signal: there the
program outlives a loader killed outright, and the next loader on the cache removes its temp
files once it has exited.

Waiting sleeps in ``select`` (no busy-waiting), waking at least every ``WAIT_SLICE_S`` to
honour ``close()``.
"""
from __future__ import annotations

import logging
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from .._utils.closing import WAIT_SLICE_S
from .._utils.libc import libc

__all__ = ["ProgramRunner", "RunResult", "STDERR_TAIL_BYTES"]

logger = logging.getLogger(__name__)

STDERR_TAIL_BYTES = 4096
#: a process group of the program's own (see the module doc)
_OWN_GROUP: dict = ({"process_group": 0} if sys.version_info >= (3, 11)
                    else {"start_new_session": True})
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@dataclass(frozen=True)
class RunResult:
    """How one run ended."""

    returncode: int
    stderr_tail: str
    timed_out: bool
    closed: bool


class ProgramRunner:
    """Starts generator programs and kills every one still running on :meth:`kill_all`.

    Picklable (a source is sent to remote executors): running processes stay with this process.
    """

    def __init__(self) -> None:
        self._procs: set[subprocess.Popen] = set()
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        ProgramRunner.__init__(self)

    def run(self, argv: Sequence[str], *, timeout: float | None, env: Mapping[str, str] | None,
            closed: threading.Event) -> RunResult:
        """Run ``argv`` to its end (or ``timeout``, or ``closed``); OSError if it cannot start."""
        read_fd, write_fd = os.pipe()
        try:
            proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=write_fd,
                                    close_fds=True, env=env, preexec_fn=_dying_with_parent(),
                                    **_OWN_GROUP)
        except OSError:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        with self._lock:
            self._procs.add(proc)
        tail = _TailBuffer(STDERR_TAIL_BYTES)
        try:
            timed_out = _wait(proc, read_fd, tail, timeout, closed)
        finally:
            kill_group(proc)
            with self._lock:
                self._procs.discard(proc)
            _drain(read_fd, tail)
            os.close(read_fd)
        return RunResult(proc.returncode, tail.text(), timed_out, closed.is_set())

    def kill_all(self) -> None:
        """Kill every running program with its process group (grandchildren too)."""
        with self._lock:
            procs = list(self._procs)
        for proc in procs:
            kill_group(proc)


def _dying_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that gives the program SIGKILL when the thread starting it ends (see
    the module doc); None where the platform has no parent-death signal."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = libc().prctl  # resolved and typed here, in the parent
    parent, kill = os.getpid(), int(signal.SIGKILL)

    def set_parent_death_signal() -> None:  # runs in the child between fork and exec
        prctl(_PR_SET_PDEATHSIG, kill, 0, 0, 0)
        if os.getppid() != parent:  # the loader died before the prctl: nobody will signal
            os.kill(os.getpid(), kill)

    return set_parent_death_signal


def _wait(proc: subprocess.Popen, fd: int, tail: "_TailBuffer", timeout: float | None,
          closed: threading.Event) -> bool:
    """Sleep until the program exits, collecting stderr; True if it ran past ``timeout``.

    Returns as soon as the program itself exits, even if a grandchild still holds its stderr
    open (the caller then kills the whole group).
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        open_pipe = True
        while True:
            if closed.is_set():
                return False
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return True
            slice_s = WAIT_SLICE_S if remaining is None else min(WAIT_SLICE_S, remaining)
            if open_pipe:
                if sel.select(slice_s):
                    data = os.read(fd, 65536)
                    if data:
                        tail.feed(data)
                    else:
                        sel.unregister(fd)
                        open_pipe = False
                if proc.poll() is not None:
                    return False
            else:
                try:
                    proc.wait(timeout=slice_s)
                    return False
                except subprocess.TimeoutExpired:
                    continue


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group of a program started in a group of its own, then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        logger.debug("process group %d already gone", proc.pid)
    except PermissionError:
        logger.debug("process group %d is no longer ours", proc.pid)
    proc.wait()


class _TailBuffer:
    """The last ``limit`` bytes written to a pipe: bounded however much the program writes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._buf = bytearray()

    def feed(self, data: bytes) -> None:
        self._buf += data
        if len(self._buf) > 2 * self.limit:
            del self._buf[:-self.limit]

    def text(self) -> str:
        return bytes(self._buf[-self.limit:]).decode("utf-8", errors="replace").strip()


def _drain(fd: int, tail: _TailBuffer, limit: int = 1 << 20) -> None:
    """Read what is left in a pipe whose writers are dead, without blocking."""
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        read = 0
        while read < limit and sel.select(0):
            data = os.read(fd, 65536)
            if not data:
                return
            tail.feed(data)
            read += len(data)
