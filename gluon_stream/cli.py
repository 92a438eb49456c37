"""The ``gluon-stream`` command line: ``demo`` and the other subcommands."""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence

from . import bench, demo
from ._version import __version__
from .errors import StreamError

__all__ = ["main"]


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gluon-stream",
        description="Feed an MXNet Gluon training loop from shards produced on demand.")
    parser.add_argument("--version", action="version", version=f"gluon_stream {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log INFO lines")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    demo.register(subparsers)
    bench.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (2 for user errors, printed in one line)."""
    args = _build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return args.func(args)
    except (StreamError, ImportError) as exc:
        print(f"gluon-stream: error: {exc}", file=sys.stderr)
        return 2
