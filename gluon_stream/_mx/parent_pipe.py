"""Worker processes that die with the loader's process, whichever of its threads forked them.

A :class:`ParentPipe` is a pipe whose write end only the loader's process holds; a worker
watches its read end (:func:`exit_with_parent`) and exits on EOF. This module registers, once,
the at-fork hook that makes every child forked here drop the write ends it inherited.
"""
from __future__ import annotations

import logging
import os
import threading
import weakref

__all__ = ["ParentPipe", "close_fd", "exit_with_parent"]

logger = logging.getLogger(__name__)

_PARENT_ENDS: set[int] = set()  # write ends of the pipes workers watch: this process's only


class ParentPipe:
    """A pipe whose write end only the loader's process holds: its workers exit on EOF.

    Why a pipe, not ``PR_SET_PDEATHSIG``: Linux sends that signal when the *thread* that forked
    exits, so the workers of a loader built in a helper thread (a data thread, a notebook
    kernel's thread) died with that thread. A pipe's write end closes when the last process
    holding it is gone; this process is made the only one: every child forked here closes it
    at once (an at-fork hook: the pool's other workers, and a user's own ``multiprocessing``
    children, which would otherwise keep orphaned workers alive), and ``exec`` closes it
    (``os.pipe`` fds are close-on-exec). multiprocessing's own parent sentinel has no such
    hook: later forks, the pool's next workers included, inherit its write end. Forking from
    one long-lived thread would keep PDEATHSIG but costs a thread per loader and a hand-off
    per fork, and stays Linux-only; this works on any POSIX system.
    """

    def __init__(self) -> None:
        self.read_fd, write_fd = os.pipe()
        _PARENT_ENDS.add(write_fd)
        self.close = weakref.finalize(self, _close_pipe, os.getpid(), self.read_fd, write_fd)


def _close_pipe(owner: int, read_fd: int, write_fd: int) -> None:
    if os.getpid() != owner:  # a fork's copy: the at-fork hook closed its write end already
        return
    _PARENT_ENDS.discard(write_fd)
    for fd in (read_fd, write_fd):
        close_fd(fd)


def _close_parent_ends() -> None:
    """In a child forked from this process: hold no write end (see :class:`ParentPipe`)."""
    for fd in list(_PARENT_ENDS):
        close_fd(fd)
    _PARENT_ENDS.clear()


def close_fd(fd: int) -> None:
    """Close ``fd``; one not open in this process is logged at DEBUG, not raised."""
    try:
        os.close(fd)
    except OSError as exc:  # not open in this process
        logger.debug("fd %d already closed: %s", fd, exc)


os.register_at_fork(after_in_child=_close_parent_ends)


def exit_with_parent(read_fd: int) -> None:
    """In a worker: a daemon thread that ends the process when the pipe reads EOF (the
    loader's process is gone), even while the main thread runs per-sample code."""
    def watch() -> None:
        try:
            while os.read(read_fd, 1):  # nothing is ever written: only EOF returns
                continue
        except OSError as exc:  # the fd was closed under it (by per-sample code?)
            logger.warning("worker %d cannot watch the loader's process (%s): it will not exit "
                           "by itself if that process dies", os.getpid(), exc)
            return
        os._exit(0)

    threading.Thread(target=watch, name="gluon_stream-parent-watch", daemon=True).start()
