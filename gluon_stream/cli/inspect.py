"""``gluon-stream inspect``: validate shard files without loading their data (no MXNet needed)."""
from __future__ import annotations

import argparse
import glob
import os
from typing import Any, Sequence

from ..cache import SUFFIXES as SHARD_SUFFIXES
from ..errors import StreamError
from ..shardfile import inspect_shard
from ._args import UsageError

__all__ = ["register", "run_inspect"]


def register(subparsers: Any) -> None:
    """Add the ``inspect`` subcommand."""
    parser = subparsers.add_parser(
        "inspect", help="list shard files: arrays, shapes, dtypes, sizes; flag unreadable ones",
        description="Validate shard files without loading their data and list each one's "
                    "arrays. A directory means its .npy/.npz files. Exit status 1 if any file "
                    "is unreadable (truncated, corrupt, a pickle, ...).")
    parser.add_argument("paths", nargs="+", metavar="PATH_OR_GLOB",
                        help="shard files, glob patterns (quote them) or directories")
    parser.set_defaults(func=run_inspect)


def _expand(patterns: Sequence[str]) -> list[str]:
    paths: list[str] = []
    for pattern in patterns:
        if os.path.isdir(pattern):
            found = sorted(p for p in glob.glob(os.path.join(glob.escape(pattern), "*"))
                           if p.endswith(SHARD_SUFFIXES) and os.path.isfile(p))
        elif glob.has_magic(pattern):
            found = sorted(p for p in glob.glob(pattern) if os.path.isfile(p))
        elif os.path.exists(pattern):
            found = [pattern]
        else:
            raise UsageError(f"no such file: {pattern!r}")
        if not found:
            raise UsageError(f"no shard files match {pattern!r}")
        paths.extend(found)
    return paths


def run_inspect(args: argparse.Namespace) -> int:
    """``gluon-stream inspect``: one line per array, one per unreadable file."""
    paths = _expand(args.paths)
    bad = 0
    print(f"{'key':<28} {'array':<10} {'shape':<22} {'dtype':<9} {'bytes':>12}  path")
    for path in paths:
        key = os.path.splitext(os.path.basename(path))[0]
        try:
            infos = inspect_shard(path)
        except (StreamError, OSError) as exc:
            bad += 1
            print(f"{key:<28} UNREADABLE: {exc}")
            continue
        for info in infos:
            print(f"{key:<28} {info.name:<10} {str(info.shape):<22} {str(info.dtype):<9} "
                  f"{info.nbytes:>12,}  {path}")
    print(f"{len(paths)} files, {len(paths) - bad} readable, {bad} unreadable")
    return 1 if bad else 0
