"""Forking a process whose MXNet engine may still free NDArrays made over numpy memory.

MXNet's own ``pthread_atfork`` prepare handler stops its engine (waits for every operation,
then joins the engine's threads) inside ``fork()``, in the forking thread, which holds the
GIL there. An engine thread that drops the last reference to an NDArray made by
:func:`~gluon_stream._mx.arrays.wrap_numpy` runs its DLPack deleter, a ctypes callback that
must take the GIL first: the join then waits forever (a loader dropped without ``close()``,
then a loader that forks its workers). ``mx.nd.waitall()`` before the fork is not enough:
MXNet counts an operation done before it destroys the operation's closure, which holds the
last reference, so the deleter can still be on its way when ``waitall`` returns.

So before every fork :func:`install`'s hook runs that same handler itself, through ctypes,
which releases the GIL: pending deleters take it, run, and the engine's threads are joined.
From then until ``fork()`` the forking thread keeps the GIL, so no Python thread can drop a
reference; an operation another thread pushes from C meanwhile holds a reference its caller
still owns, so its deleter cannot run before the fork. MXNet's handler then finds the engine
stopped (stopping twice is harmless) and its parent handler starts it again, as at every
fork. Without the symbol (another MXNet build) the hook falls back to ``waitall``.
Left open: while the hook's call has the GIL released another Python thread may push an
operation on a zero-copy NDArray and drop its last reference; that deleter can still be due
inside ``fork()`` (a window of the time MXNet takes to finish its operations).
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable

__all__ = ["install"]

log = logging.getLogger(__name__)

_PREPARE = "_ZN5mxnet22pthread_atfork_prepareEv"  # mxnet::pthread_atfork_prepare(), MXNet 1.x
_lock = threading.Lock()
_hooks: list[Callable[[], None]] = []


def _stop_engine(mx: Any) -> Callable[[], None]:
    """MXNet's own at-fork prepare handler as a ctypes call (the GIL released during it)."""
    from mxnet import base

    try:
        prepare = getattr(base._LIB, _PREPARE)
    except AttributeError:
        log.debug("MXNet has no %s: waitall() before a fork instead", _PREPARE)
        return mx.nd.waitall
    prepare.restype, prepare.argtypes = None, []
    return prepare


def install(mx: Any) -> None:
    """Stop MXNet's engine, GIL released, before every fork of this process (once)."""
    with _lock:
        if not _hooks:
            _hooks.append(_stop_engine(mx))
            os.register_at_fork(before=_hooks[0])
