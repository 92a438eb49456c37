"""``gluon-stream inspect``: validate shard files without loading their data (no MXNet needed).

Each file is checked as the loader checks it: :func:`~gluon_stream.inspect_shard` (a regular
file, magic, header, sizes, one sample axis) and then
``_batchable.check_batchable`` (dtypes and shapes MXNet can batch), so a file
the loader would refuse is flagged here with the same reason. Arguments are read as
``FileSource`` reads them (:func:`~gluon_stream.sources.files.expand_paths`): a directory means
its ``.npy``/``.npz`` files.

Exit status: 0 if every file can be batched as stored; 1 if any is unreadable or *not
batchable* (e.g. datetime64 labels): the loader refuses such a file unless a ``transform``
converts its arrays, so a check before training should fail on it; 2 for bad arguments.
"""
from __future__ import annotations

import argparse
import glob
import os
from typing import Any, Sequence

from .._utils.columns import check_batchable
from ..errors import StreamError, UnbatchableShard
from ..shardfile import inspect_shard
from ..sources.files import expand_paths
from ._args import UsageError

__all__ = ["register", "run_inspect"]


def register(subparsers: Any) -> None:
    """Add the ``inspect`` subcommand."""
    parser = subparsers.add_parser(
        "inspect", help="list shard files: arrays, shapes, dtypes, sizes; flag unreadable ones",
        description="Validate shard files without loading their data and list each one's "
                    "arrays. A directory means its .npy/.npz files. Exit status 1 if any file "
                    "is unreadable (truncated, corrupt, a pickle, ...) or holds arrays MXNet "
                    "cannot batch as stored (datetime64, str, uint16, ...: convert them in a "
                    "transform).")
    parser.add_argument("paths", nargs="+", metavar="PATH_OR_GLOB",
                        help="shard files, glob patterns (quote them) or directories")
    parser.set_defaults(func=run_inspect)


def _expand(patterns: Sequence[str]) -> list[str]:
    paths: list[str] = []
    for pattern in patterns:
        found = expand_paths(pattern)
        if not found:
            if not (glob.has_magic(pattern) or os.path.isdir(pattern)):
                raise UsageError(f"no such file: {pattern!r}")
            raise UsageError(f"no shard files match {pattern!r}")
        paths.extend(found)
    return paths


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def run_inspect(args: argparse.Namespace) -> int:
    """``gluon-stream inspect``: one line per array, one per unreadable or unbatchable file."""
    paths = _expand(args.paths)
    bad = unbatchable = 0
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
        try:
            check_batchable(infos, what=f"shard file {path!r}")
        except UnbatchableShard as exc:
            unbatchable += 1
            print(f"{key:<28} NOT BATCHABLE: {exc}")
    summary = (f"{_plural(len(paths), 'file')}, {len(paths) - bad - unbatchable} readable, "
               f"{bad} unreadable")
    if unbatchable:
        summary += f", {unbatchable} not batchable as stored"
    print(summary)
    return 1 if bad or unbatchable else 0
