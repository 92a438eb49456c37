"""The ``gluon-stream`` command line: ``demo``, ``inspect``, ``generate`` and the other subcommands.

Exit status: 0 on success, 1 when some shards are unreadable (``inspect``) or failed to
generate (``generate``), 2 for bad arguments and other user errors (one line on stderr).
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import glob
import logging
import os
import shlex
import sys
from typing import Any, NoReturn, Sequence

from . import bench, demo
from ._version import __version__
from .errors import StreamError

__all__ = ["main"]

logger = logging.getLogger(__name__)

SHARD_SUFFIXES = (".npy", ".npz")


class UsageError(Exception):
    """A bad argument found after parsing; reported in one line with exit status 2."""


class _Parser(argparse.ArgumentParser):
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


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="gluon-stream",
        description="Feed an MXNet Gluon training loop from shards produced on demand.",
        epilog="Run 'gluon-stream COMMAND --help' for a command's options.")
    parser.add_argument("--version", action="version", version=f"gluon_stream {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log INFO lines")
    subparsers = parser.add_subparsers(dest="subcommand", metavar="COMMAND", required=True,
                                       parser_class=_Parser)
    demo.register(subparsers)
    bench.register(subparsers)
    _register_inspect(subparsers)
    _register_generate(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (2 for user errors, printed in one line).

    Example:
        >>> main(["inspect", "shards/*.npy"])  # doctest: +SKIP
        0
    """
    try:
        args = _build_parser().parse_args(argv)
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


# -- inspect --------------------------------------------------------------------------------
def _register_inspect(subparsers: Any) -> None:
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
    from .shardfile import inspect_shard

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


# -- generate -------------------------------------------------------------------------------
def _register_generate(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "generate", help="fill a shard cache ahead of training, in parallel",
        description="Run a generator command once per key, in parallel, and keep the shards "
                    "in a cache directory that CommandSource(..., cache_dir=...) reads later. "
                    "Keys already cached are skipped. Exit status 1 if any key failed.",
        epilog="example: gluon-stream generate --command './gen --date {key} --out {path}' "
               "--keys 2024-01-01..2024-01-31 --cache-dir shards/ --jobs 4")
    parser.add_argument("--command", required=True,
                        help="the generator's command line, split like a shell would but never "
                             "run through one; {key}, {path} and {epoch} are replaced")
    keys = parser.add_mutually_exclusive_group(required=True)
    keys.add_argument("--keys", nargs="+", metavar="KEY",
                      help="keys; FIRST..LAST expands a range of ISO dates or integers")
    keys.add_argument("--keys-file", metavar="FILE", help="a file with one key per line")
    parser.add_argument("--cache-dir", required=True, help="directory of finished shards")
    parser.add_argument("--jobs", type=positive_int, default=os.cpu_count() or 1,
                        help="generators run at once (default: CPU count)")
    parser.add_argument("--epoch", type=int, default=0, help="value of {epoch} (default 0)")
    parser.add_argument("--timeout", type=non_negative_float, default=600.0,
                        help="seconds per run before its process group is killed (0: none)")
    parser.add_argument("--retries", type=int, default=2, help="extra attempts per key")
    parser.add_argument("--suffix", choices=SHARD_SUFFIXES, default=".npy",
                        help="what the generator writes")
    parser.add_argument("--no-progress", dest="progress", action="store_false",
                        help="no progress bar")
    parser.set_defaults(func=run_generate)


def expand_keys(items: Sequence[str]) -> list[str]:
    """Expand ``FIRST..LAST`` ranges of ISO dates or integers (inclusive) in a key list.

    Example:
        >>> expand_keys(["2024-02-28..2024-03-01", "x", "7..9"])
        ['2024-02-28', '2024-02-29', '2024-03-01', 'x', '7', '8', '9']
    """
    out: list[str] = []
    for item in items:
        first, sep, last = item.partition("..")
        if not (sep and first and last):  # not a range; validate_key judges it
            out.append(item)
            continue
        try:
            if first.isdigit() and last.isdigit():
                lo, hi = int(first), int(last)
                values = [str(i) for i in range(lo, hi + 1)]
            else:
                lo_d, hi_d = datetime.date.fromisoformat(first), datetime.date.fromisoformat(last)
                values = [(lo_d + datetime.timedelta(days=i)).isoformat()
                          for i in range((hi_d - lo_d).days + 1)]
        except ValueError:
            raise UsageError(f"key range {item!r} must be FIRST..LAST of ISO dates "
                             "(2024-01-01..2024-01-31) or integers (0..99)") from None
        if not values:
            raise UsageError(f"key range {item!r} is empty (LAST is before FIRST)")
        out.extend(values)
    return out


def _read_keys(args: argparse.Namespace) -> list[str]:
    if args.keys_file is not None:
        try:
            with open(args.keys_file, encoding="utf-8") as fp:
                items = [line.strip() for line in fp if line.strip()]
        except OSError as exc:
            raise UsageError(f"cannot read --keys-file {args.keys_file!r}: {exc}") from None
    else:
        items = args.keys
    keys = expand_keys(items)
    if not keys:
        raise UsageError("no keys given")
    return list(dict.fromkeys(keys))  # drop repeats, keep order


def run_generate(args: argparse.Namespace) -> int:
    """``gluon-stream generate``: produce every key's shard into the cache, in parallel."""
    from .sources import CommandSource, validate_key
    from .stats import make_tqdm

    try:
        command = shlex.split(args.command)
    except ValueError as exc:
        raise UsageError(f"cannot split --command {args.command!r}: {exc}") from None
    keys = _read_keys(args)
    try:
        for key in keys:
            validate_key(key)
        source = CommandSource(keys, command, cache_dir=args.cache_dir,
                               timeout=args.timeout or None, retries=args.retries,
                               suffix=args.suffix, mmap=True)
    except (ValueError, TypeError, OSError) as exc:
        raise UsageError(str(exc)) from None
    failed: list[tuple[str, BaseException]] = []
    hits = 0
    with source, cf.ThreadPoolExecutor(args.jobs, thread_name_prefix="gluon_stream-generate") \
            as pool, make_tqdm(total=len(keys), unit="shard", desc="generate",
                               disable=None if args.progress else True) as bar:
        futures = {pool.submit(source.produce, key, args.epoch): key for key in keys}
        try:
            for fut in cf.as_completed(futures):
                key = futures[fut]
                try:
                    raw = fut.result()
                except StreamError as exc:
                    failed.append((key, exc))
                    logger.warning("shard %r failed: %s", key, exc)
                else:
                    hits += raw.cache_hit
                    logger.info("shard %r %s: %s", key, "cached" if raw.cache_hit else
                                f"generated in {raw.generate_s:.2f} s", raw.path)
                    del raw
                bar.update(1)
        except BaseException:
            for fut in futures:
                fut.cancel()
            source.close()  # kills running generators
            raise
    done = len(keys) - len(failed)
    print(f"{done}/{len(keys)} shards in {os.path.abspath(args.cache_dir)} "
          f"({done - hits} generated, {hits} already cached, {len(failed)} failed)")
    for key, exc in failed:
        print(f"failed: {key}: {str(exc).splitlines()[0]}", file=sys.stderr)
    return 1 if failed else 0
