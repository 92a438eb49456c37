"""What every subcommand shares: the one-line error parser, argument types and UsageError."""
from __future__ import annotations

import argparse
from typing import NoReturn

__all__ = ["Parser", "UsageError", "csv_list", "non_negative_float", "positive_int"]


class UsageError(Exception):
    """A bad argument found after parsing; reported in one line with exit status 2."""


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (no usage dump), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a float >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def csv_list(text: str) -> list[str]:
    """argparse type: comma-separated names."""
    return [v.strip() for v in text.split(",") if v.strip()]
