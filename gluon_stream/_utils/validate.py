"""Argument checks shared by every public constructor: one rule per kind of value.

* Integers: ``int`` or a numpy integer, never ``bool`` (``prefetch=True`` is a mistake, not 1).
* Durations: a real number of seconds (not ``bool``, not NaN); ``None`` where "no limit" is allowed.
* Messages name the argument, the value and what to pass instead.
"""
from __future__ import annotations

import math
import numbers
import re
from typing import Any, Callable, Iterable, Literal, overload

__all__ = ["byte_size", "callable_or_none", "choice", "every_nth", "format_bytes", "integer",
           "is_int", "ordinal", "seconds"]


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


_UNITS = {"b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*")


def byte_size(name: str, value: Any) -> int:
    """``value`` as a positive number of bytes: an int, or a string with a unit (``"4GiB"``,
    ``"512 MB"``; B, kB, MB, GB, TB by 1000, KiB, MiB, GiB, TiB by 1024); a ValueError naming
    ``name`` otherwise.

    Example:
        >>> byte_size("memory_budget", "1.5 KiB")
        1536
    """
    rule = "a positive number of bytes, or a string such as '4GiB' or '512MB'"
    if is_int(value) and value >= 1:
        return int(value)
    match = _SIZE.fullmatch(value) if isinstance(value, str) else None
    unit = match.group(2).lower() if match else ""
    if match is None or (unit and unit not in _UNITS):
        raise ValueError(_message(name, value, rule, f"units: {', '.join(_sorted_units())}"))
    size = int(float(match.group(1)) * _UNITS[unit or "b"])
    if size < 1:
        raise ValueError(_message(name, value, rule, ""))
    return size


def _sorted_units() -> list[str]:
    return ["B", "kB", "MB", "GB", "TB", "KiB", "MiB", "GiB", "TiB"]


def format_bytes(size: float) -> str:
    """``size`` bytes in binary units, for messages (``'38.0 MiB'``).

    Example:
        >>> format_bytes(3 * 2 ** 20)
        '3.0 MiB'
    """
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            return f"{size:.0f} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"  # not reached


def ordinal(n: int) -> str:
    """``n`` as an English ordinal, for messages.

    Example:
        >>> [ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 22, 102, 111)]
        ['1st', '2nd', '3rd', '4th', '11th', '12th', '13th', '21st', '22nd', '102nd', '111th']
    """
    suffix = "th" if n % 100 in (11, 12, 13) else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def every_nth(n: int, what: str) -> str:
    """``'every 2nd date'``, for messages (``'every date'`` for 1).

    Example:
        >>> every_nth(2, "key"), every_nth(1, "key")
        ('every 2nd key', 'every key')
    """
    return f"every {what}" if n == 1 else f"every {ordinal(n)} {what}"


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
