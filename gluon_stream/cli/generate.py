"""``gluon-stream generate``: fill a shard cache ahead of training, several generators at once."""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import logging
import os
import re
import shlex
import sys
from typing import Any, Sequence

from .._cache import SUFFIXES as SHARD_SUFFIXES
from .._cache.failures import RECORDED
from .._utils.progress import make_tqdm
from ..errors import StreamError
from ..sources import CommandSource
from ..sources.base import validate_key
from ._args import (
    UsageError,
    ensure_writable_dir,
    non_negative_float,
    non_negative_int,
    positive_int,
)

__all__ = ["expand_keys", "register", "run_generate"]

logger = logging.getLogger(__name__)


def register(subparsers: Any) -> None:
    """Add the ``generate`` subcommand."""
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
    parser.add_argument("--cache-dir", required=True,
                        help="directory of finished shards, created if needed")
    parser.add_argument("--jobs", type=positive_int, default=None,
                        help="generators run at once (default: the CPU count)")
    parser.add_argument("--epoch", type=non_negative_int, default=0,
                        help="the value of {epoch} in the command")
    parser.add_argument("--timeout", type=non_negative_float, default=600.0,
                        help="seconds one run may take before its process group is killed "
                             "(0: no limit)")
    parser.add_argument("--retries", type=non_negative_int, default=2,
                        help="attempts per key after the first fails, with backoff")
    parser.add_argument("--retry-failed", action="store_true",
                        help="run again the keys whose failure is recorded in the cache (else "
                             "they fail at once with the recorded error)")
    parser.add_argument("--suffix", choices=SHARD_SUFFIXES, default=".npy",
                        help="the file type the generator writes")
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
        if first.startswith("-"):
            raise UsageError(f"key range {item!r}: keys may not start with '-' (a generator "
                             "would read them as options)")
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
    try:
        command = shlex.split(args.command)
    except ValueError as exc:
        raise UsageError(f"cannot split --command {args.command!r}: {exc}") from None
    keys = _read_keys(args)
    try:
        for key in keys:
            validate_key(key)
    except ValueError as exc:
        raise UsageError(f"--keys: {exc}") from None
    ensure_writable_dir(args.cache_dir, "--cache-dir")
    try:
        source = CommandSource(keys, command, cache_dir=args.cache_dir,
                               timeout=args.timeout or None, retries=args.retries,
                               suffix=args.suffix, mmap=True)
    except (ValueError, TypeError, OSError) as exc:
        raise UsageError(str(exc)) from None
    if args.retry_failed:
        source.retry_failures(keys, args.epoch)
    failed: list[tuple[str, BaseException]] = []
    sizes: dict[str, int] = {}  # recorded for loaders: sizes known ahead, alike on every rank
    hits = 0
    jobs = args.jobs or os.cpu_count() or 1
    with source, cf.ThreadPoolExecutor(jobs, thread_name_prefix="gluon_stream-generate") \
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
                    logger.info("shard %r failed: %s", key, exc)
                else:
                    hits += raw.cache_hit
                    sizes[key] = len(raw.arrays[0])
                    logger.info("shard %r %s: %s", key, "cached" if raw.cache_hit else
                                f"generated in {raw.generate_s:.2f} s", raw.path)
                    del raw
                bar.update(1)
        except BaseException:
            for fut in futures:
                fut.cancel()
            source.close()  # kills running generators
            raise
        source.record_sizes(sizes, args.epoch)
    done = len(keys) - len(failed)
    print(f"{done}/{len(keys)} shards in {os.path.abspath(args.cache_dir)} "
          f"({done - hits} generated, {hits} already cached, {len(failed)} failed)")
    for key, error in failed:
        print(_failure(key, error), file=sys.stderr)
    recorded = sum(1 for _, error in failed if getattr(error, RECORDED, None))
    if recorded:
        print(f"{recorded} of them failed in an earlier run and were not run again (their "
              "failure is recorded in the cache): pass --retry-failed to run them",
              file=sys.stderr)
    return 1 if failed else 0


# The library's messages name its keywords; the CLI's users know its flags.
_FLAGS = [(re.compile(r"\b(timeout|retries)=(?=[\s;,)]|$)"), r"--\1"),
          (re.compile(r"\b(timeout|retries)=(\S)"), r"--\1 \2"),
          (re.compile(r"\bcache_dir\b"), "--cache-dir"),
          (re.compile(r"\bfirst element of command\b"), "first word of --command")]
TAIL_LINES = 5


def _failure(key: str, exc: BaseException) -> str:
    """What went wrong with one key, in CLI terms: the reason (without the command, which is
    --command), how many attempts were made, then the generator's last stderr lines."""
    message = str(exc)
    reason = message.splitlines()[0] if message else type(exc).__name__
    reason = reason.replace(f"shard {key!r}: ", "", 1).split("; command: ")[0]
    gave_up = re.search(r"\(gave up after \d+ attempts[^)]*\)", message)
    text = f"failed: {key}: {reason}" + (f" {gave_up.group(0)}" if gave_up else "")
    for pattern, flag in _FLAGS:
        text = pattern.sub(flag, text)
    tail = (getattr(exc, "stderr_tail", "") or "").strip().splitlines()[-TAIL_LINES:]
    return "\n".join([text, *(f"    {line}" for line in tail)])
