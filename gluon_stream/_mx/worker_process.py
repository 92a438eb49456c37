"""What runs in a worker process of :class:`~gluon_stream._mx.workers.ProcessWorkers`.

:func:`worker_main` is a worker's whole life after the fork: it ignores SIGINT, exits with the
loader's process (:func:`~gluon_stream._mx.parent_pipe.exit_with_parent`), attaches shards
sent as shared memory, makes batches into its slots and sends them back, one short message
each. An exception a batch raised travels as bytes (:func:`pickle_error`), its traceback as a
note, and the loader's process rebuilds it (:func:`unpickle_error`).
"""
from __future__ import annotations

import multiprocessing.connection as mp_connection
import pickle
import signal
import socket
import traceback

from ..errors import add_note
from .parent_pipe import close_fd, exit_with_parent
from .samples import BatchMaker, seed_mxnet_lazily
from .shm import SlotWriter, attach, recv_fds, send_fds

__all__ = ["pickle_error", "unpickle_error", "worker_main"]


def pickle_error(exc: BaseException) -> bytes:
    """The exception as bytes, keeping its type where it pickles; its traceback as a note."""
    add_note(exc, "gluon_stream: traceback in the worker process:\n"
                  + "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    try:
        return pickle.dumps(exc)
    except Exception as why:  # an exception type pickle cannot rebuild
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return pickle.dumps(RuntimeError(f"{type(exc).__name__}: {exc} (not picklable: {why})"
                                         f"\n{text}"))


def unpickle_error(data: bytes) -> BaseException:
    try:
        return pickle.loads(data)
    except Exception as exc:  # e.g. a class the loader's process cannot import
        return RuntimeError(f"a worker raised an exception that cannot be rebuilt here: {exc}")


def worker_main(sock: socket.socket, maker: BatchMaker, inherited: list[int],
                parent_fd: int) -> None:
    """A worker's life: attach sources, make batches into its slots, send them back, until
    told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the training loop
    exit_with_parent(parent_fd)
    for fd in inherited:  # the other workers' sockets and the loader's shard files
        close_fd(fd)
    conn = mp_connection.Connection(sock.detach())
    sources: dict[int, tuple] = {}
    slots = SlotWriter()
    seed_mxnet_lazily()
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        kind = message[0]
        if kind == "attach":
            sources[message[1]] = attach(recv_fds(conn, 1)[0], message[2])
        elif kind == "detach":
            sources.pop(message[1], None)
        elif kind == "task":
            tid, refs, seed, numpy = message[1], message[2], message[3], message[5]
            slots.release(message[4])  # slots whose batches the loader dropped
            try:
                payload, slot, size, retired, new_fd = slots.write(maker(sources, refs, seed,
                                                                          numpy))
            except Exception as exc:
                conn.send(("error", tid, pickle_error(exc)))
                continue
            try:
                conn.send(("done", tid, payload, slot, size, retired))
                if new_fd is not None:  # a new slot: the loader maps it once
                    send_fds(conn, [new_fd])
            finally:
                if new_fd is not None:
                    close_fd(new_fd)
        elif kind == "stop":
            return
