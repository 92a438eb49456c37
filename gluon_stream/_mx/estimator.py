"""What an ``Estimator.fit`` running now was given: MXNet keeps no list of its event handlers.

``Estimator.fit`` (MXNet 1.9.1) builds the full list of handlers (the user's and its defaults)
in its local ``event_handlers`` and hands each handler only the estimator. A handler that must
know its siblings (:class:`~gluon_stream.StreamCheckpoint` refuses a second checkpoint handler)
reads that local from the ``fit`` frame it is called from: a private of MXNet's, kept here.
"""
from __future__ import annotations

import sys
from types import FrameType
from typing import Any

__all__ = ["fit_handlers"]

_MAX_DEPTH = 8  # frames between Estimator.fit and a handler's train_begin (subclasses, super())


def fit_handlers(estimator: Any) -> list | None:
    """The event handlers of ``estimator``'s ``fit`` that is calling us, or None when none is
    found (the handler was called some other way, or MXNet's ``fit`` changed)."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(_MAX_DEPTH):
        if frame is None:
            return None
        local = frame.f_locals
        if frame.f_code.co_name == "fit" and local.get("self") is estimator:
            handlers = local.get("event_handlers")
            return list(handlers) if isinstance(handlers, (list, tuple)) else None
        frame = frame.f_back
    return None
