"""``with`` support for everything in gluon_stream that owns resources and has ``close()``,
and the one way a thread pool running user code is ended."""
from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from typing import Any, TypeVar

_T = TypeVar("_T", bound="Closing")

WAIT_SLICE_S = 0.5  # how often a blocking wait re-checks whether its owner was closed
CLOSE_WAIT_S = 2.0  # how long close() gives threads running user code to finish


class Closing:
    """Mixin: ``with obj:`` calls ``obj.close()`` on the way out (close() is idempotent)."""

    def close(self) -> None:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def __enter__(self: _T) -> _T:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def end_thread_pool(pool: cf.ThreadPoolExecutor, wait_s: float) -> list[threading.Thread]:
    """Cancel what ``pool`` has not started and give its threads ``wait_s`` seconds in all to
    finish what they run; the threads still running after that (stuck in Python code, which
    cannot be interrupted from outside), for the caller to name in a WARNING."""
    pool.shutdown(wait=False, cancel_futures=True)
    deadline = time.monotonic() + wait_s
    alive = []
    for thread in list(getattr(pool, "_threads", ())):  # the stdlib keeps no public list
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            alive.append(thread)
    return alive
