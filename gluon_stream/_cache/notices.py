"""The one-time log lines of one cache: what it has said already, so it says each thing once.

A cache meets some conditions on every shard (a read-only directory, a file system without
extended attributes, a full ``cache_limit``); logging each time would drown the log, so the
first occurrence of each is logged and the rest are not. Held per cache (a set and its lock,
shared by the producer threads); a pickled cache keeps what it said.
"""
from __future__ import annotations

import logging
import threading
from typing import Any

__all__ = ["Notices"]


class Notices:
    """What one cache has logged once already.

    Example:
        >>> notices = Notices(logging.getLogger("demo"))
        >>> notices.tell_once("x", logging.DEBUG, "said once"), notices.tell_once("x", 10, "")
        (True, False)
    """

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._told: set[str] = set()
        self._lock = threading.Lock()  # producer threads log through the same cache

    def __getstate__(self) -> dict:
        """Picklable: what was said comes along, the lock does not."""
        return {"_logger": self._logger, "_told": set(self._told)}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def tell_once(self, what: str, level: int, message: str, *args: Any) -> bool:
        """Log ``message`` the first time ``what`` happens; True if it was logged now."""
        with self._lock:
            if what in self._told:
                return False
            self._told.add(what)
        self._logger.log(level, message, *args)
        return True
