"""Argument checks shared by every public constructor: one rule per kind of value.

* Integers: ``int`` or a numpy integer, never ``bool`` (``prefetch=True`` is a mistake, not 1).
* Durations: a real number of seconds (not ``bool``, not NaN); ``None`` where "no limit" is allowed.
* Messages name the argument, the value and what to pass instead.

:data:`UNSET` marks an argument the caller did not give, where "given" matters (options that
must be set on a :class:`~gluon_stream.ShardStream` instead of the loader).
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Iterable, Literal, overload

__all__ = ["UNSET", "callable_or_none", "choice", "integer", "is_int", "is_set", "seconds"]


class _Unset:
    """The type of :data:`UNSET`: a default that means "not given"."""

    _instance: "_Unset | None" = None

    def __new__(cls) -> "_Unset":
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "<unset>"

    def __bool__(self) -> bool:
        return False

    def __reduce__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()


def is_set(value: Any) -> bool:
    """True unless ``value`` is :data:`UNSET`."""
    return value is not UNSET


def is_int(value: Any) -> bool:
    """Whether ``value`` is an integer by :func:`integer`'s rule (bools are not)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def integer(name: str, value: Any, *, minimum: int | None = None,
            hint: str = "") -> int:
    """``value`` as an int, or a ValueError naming ``name``; bools are refused.

    Example:
        >>> integer("prefetch", 2, minimum=0)
        2
    """
    if not is_int(value):
        raise ValueError(_message(name, value, _int_rule(minimum), hint))
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(_message(name, value, _int_rule(minimum), hint))
    return value


@overload
def seconds(name: str, value: Any, *, allow_none: Literal[False] = ..., positive: bool = ...,
            hint: str = ...) -> float: ...
@overload
def seconds(name: str, value: Any, *, allow_none: bool, positive: bool = ...,
            hint: str = ...) -> float | None: ...
def seconds(name: str, value: Any, *, allow_none: bool = False, positive: bool = True,
            hint: str = "") -> float | None:
    """``value`` as float seconds (finite or ``inf``), or a ValueError naming ``name``.

    Example:
        >>> seconds("timeout", 120)
        120.0
    """
    if value is None and allow_none:
        return None
    rule = ("positive seconds" if positive else "seconds >= 0") + (" or None" if allow_none
                                                                    else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
        raise ValueError(_message(name, value, rule, hint))
    value = float(value)
    if value < 0 or (positive and value == 0):
        raise ValueError(_message(name, value, rule, hint))
    return value


def choice(name: str, value: Any, options: Iterable[Any], hint: str = "") -> Any:
    """``value`` if it is one of ``options``, else a ValueError listing them."""
    options = tuple(options)
    if isinstance(value, str) and value in options:
        return value
    raise ValueError(_message(name, value, f"one of {', '.join(map(repr, options))}", hint))


def callable_or_none(name: str, value: Any, what: str = "a callable") -> Callable | None:
    """``value`` if it is callable or None, else a TypeError naming ``name``."""
    if value is not None and not callable(value):
        raise TypeError(f"{name} must be {what} or None, got {type(value).__name__} {value!r}")
    return value


def _int_rule(minimum: int | None) -> str:
    if minimum is None:
        return "an integer"
    if minimum == 1:
        return "a positive integer"
    return f"an integer >= {minimum}"


def _message(name: str, value: Any, rule: str, hint: str) -> str:
    kind = " (a bool)" if isinstance(value, bool) else ""
    return f"{name} must be {rule}, got {value!r}{kind}" + (f"; {hint}" if hint else "")
