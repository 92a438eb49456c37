"""A ``ThreadPoolExecutor`` that a Ctrl-C cannot make lose one of its threads.

The stdlib's pool starts a new thread, then records it (``_threads``). ``Thread.start()``
waits for the thread to begin, and in the main thread, which submits the loader's work, that
wait is where a SIGINT lands as KeyboardInterrupt (Jupyter's interrupt, or a test's): the
thread then runs the pool's work loop unrecorded. The next ``submit`` starts another under
the same name (``<prefix>_<n>``: one thread past ``max_workers``) and ``shutdown`` and the
closers, which join ``_threads``, never wait for it: it ends whenever it next finds the
queue's end marker, after the owner said it closed. Here a thread is recorded before it
starts, and dropped again only if it provably never began.
"""
from __future__ import annotations

import concurrent.futures as cf
import concurrent.futures.thread as cf_thread
import threading
import weakref
from typing import Any, cast

__all__ = ["ThreadPool"]

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
