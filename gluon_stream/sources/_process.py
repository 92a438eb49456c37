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
is given a parent-death signal, ``prctl(PR_SET_PDEATHSIG, SIGKILL)``, which survives ``exec``.
It is set by a small first image (:data:`_WRAPPER`, run by this Python with ``-I -S``): the
prctl, a ``getppid`` check against the loader's pid (a loader that died before the prctl: the
wrapper kills itself), then ``execvp`` of the program, with the environment it was given
(``LC_CTYPE`` as it was: Python's locale coercion may set it). A program that cannot be started
makes the wrapper exit 126 with the ``errno``, raised here as the ``OSError`` ``Popen`` would
raise. The cost is one short Python start per program: about 9 ms (``/bin/true`` through
:class:`ProgramRunner` in a process with MXNet imported: 11.2 ms against 1.8 ms, medians of 40
runs on a shared 2-core machine), small beside a generator's run.

Not a ``preexec_fn``: with one, ``subprocess`` forks with ``fork()`` instead of ``vfork``, and
``fork()`` runs the ``pthread_atfork`` handlers of the loader's process. MXNet's stops its
engine and waits for every pending operation: a producer thread forking while the training
thread waited in ``asnumpy()`` deadlocked (seen in the suite). ``vfork`` runs no handlers.

The signal fires when the *thread* that started the program ends, not only the process: the
thread that calls :meth:`ProgramRunner.run` waits for the program in that same call and reaps
it (its ``finally`` kills the group) before it returns, so the thread cannot end first.

Limits: only the program itself gets the signal. Programs it starts get none (their parent is
the program): a wrapper script should ``exec`` its last command, or they outlive a killed loader
as before. Platforms without ``prctl`` (macOS, the BSDs) have no parent-death signal: there the
program is started directly and outlives a loader killed outright, and the next loader on the
cache removes its temp files once it has exited.

Waiting sleeps in ``select`` (no busy-waiting), waking at least every ``WAIT_SLICE_S`` to
honour ``close()``.
"""
from __future__ import annotations

import logging
import os
import re
import selectors
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

from .._utils.closing import WAIT_SLICE_S

__all__ = ["ProgramRunner", "RunResult", "STDERR_TAIL_BYTES"]

logger = logging.getLogger(__name__)

STDERR_TAIL_BYTES = 4096
#: a process group of the program's own (see the module doc)
_OWN_GROUP: dict = ({"process_group": 0} if sys.version_info >= (3, 11)
                    else {"start_new_session": True})
#: The program's first image on Linux (see the module doc): argv is the loader's pid, LC_CTYPE
#: as the program should see it ('-': unset, else '=' and the value), then the program's argv.
_WRAPPER = """\
import ctypes, os, sys
parent, ctype, argv = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
ctypes.CDLL(None).prctl(1, ctypes.c_ulong(9), ctypes.c_ulong(0), ctypes.c_ulong(0),
                        ctypes.c_ulong(0))  # PR_SET_PDEATHSIG, SIGKILL
if os.getppid() != parent:  # the loader died before the prctl: nobody will signal
    os.kill(os.getpid(), 9)
if ctype == "-":
    os.environ.pop("LC_CTYPE", None)
else:
    os.environ["LC_CTYPE"] = ctype[1:]
try:
    os.execvp(argv[0], argv)
except OSError as exc:
    sys.stderr.write(f"gluon_stream-exec-failed {exc.errno} {exc.strerror}\\n")
    os._exit(126)
"""
_EXEC_FAILED = re.compile(r"^gluon_stream-exec-failed (\d+) (.*)$", re.MULTILINE)


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
            proc = subprocess.Popen(_dying_with_parent(argv, env), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=write_fd,
                                    close_fds=True, env=env, **_OWN_GROUP)
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
        _raise_if_not_started(proc.returncode, tail.text(), argv)
        return RunResult(proc.returncode, tail.text(), timed_out, closed.is_set())

    def kill_all(self) -> None:
        """Kill every running program with its process group (grandchildren too)."""
        with self._lock:
            procs = list(self._procs)
        for proc in procs:
            kill_group(proc)


def _dying_with_parent(argv: Sequence[str], env: Mapping[str, str] | None) -> list[str]:
    """``argv`` started through :data:`_WRAPPER`, which gives it SIGKILL when the thread
    starting it ends (see the module doc); ``argv`` itself where the platform has no
    parent-death signal."""
    if not sys.platform.startswith("linux") or not sys.executable:
        return list(argv)
    ctype = (os.environ if env is None else env).get("LC_CTYPE")
    return [sys.executable, "-I", "-S", "-c", _WRAPPER, str(os.getpid()),
            "-" if ctype is None else "=" + ctype, *argv]


def _raise_if_not_started(returncode: int | None, tail: str, argv: Sequence[str]) -> None:
    """The OSError ``Popen`` raises for a program it cannot start, where the wrapper met it."""
    found = _EXEC_FAILED.search(tail) if returncode == 126 else None
    if found:
        code = int(found.group(1))
        raise OSError(code, found.group(2), argv[0])


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
