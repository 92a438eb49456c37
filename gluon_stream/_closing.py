"""``with`` support for everything in gluon_stream that owns resources and has ``close()``."""
from __future__ import annotations

from typing import Any, TypeVar

_T = TypeVar("_T", bound="Closing")


class Closing:
    """Mixin: ``with obj:`` calls ``obj.close()`` on the way out (close() is idempotent)."""

    def close(self) -> None:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def __enter__(self: _T) -> _T:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
