"""The ``gluon-stream`` command line: ``demo``, ``inspect``, ``generate`` and ``bench``.

Exit status: 0 on success, 1 when some shards are unreadable (``inspect``) or failed to
generate (``generate``), 2 for bad arguments and other user errors (one line on stderr).
"""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence

from .._version import __version__
from ..errors import StreamError
from . import bench, demo, generate, inspect
from ._args import Parser, UsageError
from .generate import expand_keys

__all__ = ["build_parser", "expand_keys", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The ``gluon-stream`` parser with every subcommand registered."""
    parser = Parser(
        prog="gluon-stream",
        description="Feed an MXNet Gluon training loop from shards produced on demand.",
        epilog="Run 'gluon-stream COMMAND --help' for a command's options.")
    parser.add_argument("--version", action="version", version=f"gluon_stream {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log INFO lines")
    subparsers = parser.add_subparsers(dest="subcommand", metavar="COMMAND", required=True,
                                       parser_class=Parser)
    for command in (demo, bench, inspect, generate):
        command.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (2 for user errors, printed in one line).

    Example:
        >>> main(["inspect", "shards/*.npy"])  # doctest: +SKIP
        0
    """
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a bad argument (already printed)
        return exc.code if isinstance(exc.code, int) else 2
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from tqdm.contrib.logging import logging_redirect_tqdm

    try:
        with logging_redirect_tqdm():
            return args.func(args)
    except (StreamError, ImportError, UsageError) as exc:
        print(f"gluon-stream {args.subcommand}: error: {exc}", file=sys.stderr)
        return 2
