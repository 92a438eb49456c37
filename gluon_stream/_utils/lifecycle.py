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
"""
from __future__ import annotations

import concurrent.futures.thread  # noqa: F401  (its exit hook first, so ours runs before it)
import logging
import os
import threading
import weakref
from typing import Any, Callable

from ..errors import LoaderClosed

__all__ = ["check_owner", "track"]

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
