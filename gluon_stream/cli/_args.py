"""What every subcommand shares: the one-line error parser, its help format, argument types,
up-front checks of paths, and UsageError."""
from __future__ import annotations

import argparse
import math
import os
import re
import sys
import tempfile
from typing import Any, Callable, NoReturn

__all__ = ["HelpFormatter", "Parser", "UsageError", "csv_list", "ensure_writable_dir",
           "non_negative_float", "non_negative_int", "output_path", "plain_text", "positive_int"]


class UsageError(Exception):
    """A bad argument found after parsing; reported in one line with exit status 2."""


class HelpFormatter(argparse.HelpFormatter):
    """Keeps descriptions written on several lines (docstrings) as written, wraps one-line ones,
    and ends each option's help with its default.

    Flags (no value) and options whose default is ``None`` say what happens in their own words.
    """

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text.strip():
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("%(default)" in text or not action.option_strings or action.nargs == 0
                or action.default in (None, argparse.SUPPRESS)):
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (no usage dump), exit status 2.

    Args:
        describe: Makes the description when help is shown, for one that needs a slow import
            (``bench``'s needs MXNet): building the parser stays fast.
    """

    def __init__(self, *args: Any, describe: Callable[[], str] | None = None,
                 **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self._describe = describe
        self._argv: list[str] = []

    def format_help(self) -> str:
        if self._describe is not None:
            self.description, self._describe = self._describe(), None
        return super().format_help()

    def parse_known_args(self, args: Any = None,
                         namespace: Any = None) -> Any:
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {self._explain(message)} (see {self.prog} --help)\n")

    def _explain(self, message: str) -> str:
        """Say why argparse found no value: '-3..3' starts with '-', so it reads as an option."""
        missing = re.match(r"argument ([^:/\s]+)(?:/\S+)?: expected (one|at least one) argument",
                           message)
        if missing and missing.group(1) in self._argv:
            i = self._argv.index(missing.group(1))
            value = self._argv[i + 1] if i + 1 < len(self._argv) else ""
            if re.match(r"-[\d.]", value):
                return (f"argument {missing.group(1)}: {value!r} starts with '-', so it reads as "
                        f"an option; write {missing.group(1)}={value} to pass it as a value")
        return message


def plain_text(doc: str | None) -> str:
    """A docstring as plain text for ``--help``: no reStructuredText roles or backticks."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", lambda m: m.group(1).rsplit(".", 1)[-1], doc or "")
    text = re.sub(r"``([^`]+)``", r"\1", text)
    return re.sub(r"::$", ":", text, flags=re.M)


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _bounded_int(text, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _bounded_int(text, 0, "an integer >= 0")


def _bounded_int(text: str, low: int, expected: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if value < low:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a finite float >= 0 (not inf or nan)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def csv_list(text: str) -> list[str]:
    """argparse type: comma-separated names."""
    return [v.strip() for v in text.split(",") if v.strip()]


def output_path(text: str) -> str:
    """argparse type: a file to write later; its directory must exist and be writable.

    ``''`` (write nothing) passes unchanged.
    """
    if not text:
        return text
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; give a file name")
    parent = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: directory {parent!r} does "
                                         "not exist")
    problem = _cannot_write_in(parent)
    if problem:
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {problem}")
    return text


def ensure_writable_dir(path: str, flag: str) -> str:
    """Create ``path`` if needed and check a file can be written in it; UsageError naming
    ``flag`` otherwise (a file, a read-only or unwritable place). Returns ``path``."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"{flag} {path!r} is a file, not a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{flag} {path!r}: cannot create the directory: "
                         f"{exc.strerror or exc}") from None
    problem = _cannot_write_in(path)
    if problem:
        raise UsageError(f"{flag} {path!r}: {problem}")
    return path


def _cannot_write_in(directory: str) -> str:
    """Why no file can be created in ``directory`` (tried, so root and read-only mounts are
    judged right), or ``''``."""
    try:
        with tempfile.TemporaryFile(dir=directory):
            return ""
    except OSError as exc:
        return f"cannot write files in {directory!r}: {exc.strerror or exc}"
