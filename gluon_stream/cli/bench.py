"""``gluon-stream bench``: run the benchmarks of :mod:`gluon_stream.tools.bench`, print the tables.

``tools.bench`` imports MXNet, so it is imported only when ``bench`` runs or shows its help:
the other subcommands start without it.
"""
from __future__ import annotations

import argparse
import json
from typing import Any

from ._args import (
    UsageError,
    csv_list,
    non_negative_float,
    non_negative_int,
    output_path,
    plain_text,
    positive_int,
)

__all__ = ["register", "run_bench"]


def register(subparsers: Any) -> None:
    """Add the ``bench`` subcommand to the CLI's subparsers."""
    parser = subparsers.add_parser(
        "bench", help="benchmark gluon_stream against MXNet's own ways, interleaved",
        describe=_description)
    parser.add_argument("--scenarios", type=csv_list, default=None,
                        help="comma-separated scenarios, named above (default: all)")
    parser.add_argument("--contenders", type=csv_list, default=None,
                        help="comma-separated contenders, named above (default: all; naive and "
                             "ndarrayiter always run: they are the references)")
    parser.add_argument("--rounds", type=positive_int, default=3,
                        help="interleaved rounds; tables show their medians")
    parser.add_argument("--shards", type=positive_int, default=6, help="shards per epoch")
    parser.add_argument("--rows", type=positive_int, default=2576,
                        help="raw rows per shard (samples = rows - time steps)")
    parser.add_argument("--inputs", type=positive_int, default=8,
                        help="input columns of the series")
    parser.add_argument("--time-steps", type=positive_int, default=16, help="window length")
    parser.add_argument("--batch-size", type=positive_int, default=64, help="samples per batch")
    parser.add_argument("--step", choices=("sleep", "cpu"), default="sleep",
                        help="training step: sleep (an accelerator) or a small Gluon net")
    parser.add_argument("--step-ms", type=non_negative_float, default=8.0,
                        help="sleep per batch, in ms")
    parser.add_argument("--delay", type=non_negative_float, default=None,
                        help="generator seconds per shard for every scenario (default: set per "
                             "scenario from the generation/training ratio)")
    parser.add_argument("--num-workers", type=non_negative_int, default=2,
                        help="DataLoader workers of the contenders that use them")
    parser.add_argument("--producers", type=positive_int, default=2,
                        help="shards generated at once, for every contender but the defaults")
    parser.add_argument("--prefetch", type=non_negative_int, default=2,
                        help="shards produced ahead of the one in use")
    parser.add_argument("--seed", type=int, default=0, help="seed of the shuffles and the data")
    parser.add_argument("--throughput-samples", type=positive_int, default=20000,
                        help="samples of the 30x16 throughput array (the 8-float one gets 5x)")
    parser.add_argument("--throughput-batch-size", type=positive_int, default=256,
                        help="batch size of the throughput scenario")
    parser.add_argument("--memory-rows", type=positive_int, default=78000,
                        help="raw rows per shard of the memory scenario (78000: 38.4 MB shards)")
    parser.add_argument("--memory-epochs", type=positive_int, default=20,
                        help="epochs of the memory scenario")
    parser.add_argument("--persample-images", type=positive_int, default=1500,
                        help="images per shard in the per-sample scenario (6 shards; default "
                             "1500)")
    parser.add_argument("--one-row-keys", type=positive_int, default=3000,
                        help="one-row shards per epoch in the one-row scenario")
    parser.add_argument("--growth-keys", type=_sizes, default="1000,10000,100000,1000000",
                        help="growth: comma-separated key counts (construction, len(), first "
                             "batch, state, an epoch's start)")
    parser.add_argument("--growth-shards", type=_sizes, default="100,1000,10000",
                        help="growth: comma-separated shards per epoch (per-shard cost)")
    parser.add_argument("--growth-ranks", type=_sizes, default="8,64,256,1024",
                        help="growth: comma-separated rank counts whose states are merged")
    parser.add_argument("--growth-epochs", type=_sizes, default="1,10,100",
                        help="growth: comma-separated epoch counts after which the state is "
                             "measured")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false",
                        help="skip the untimed warm-up pass")
    parser.add_argument("--json", metavar="PATH", type=output_path, default=None,
                        help="write every raw figure here (default: none)")
    parser.set_defaults(func=run_bench)


def _sizes(text: str) -> tuple[int, ...]:
    """A comma-separated list of positive integers (``1000,10000``)."""
    sizes = tuple(positive_int(item) for item in csv_list(text))
    if not sizes:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got "
                                         f"{text!r}")
    return sizes


def _description() -> str:
    from ..tools import bench

    return (f"{plain_text(bench.__doc__)}\nscenarios: {', '.join(bench.SCENARIOS)}\n"
            f"contenders: {', '.join(_contenders())}\n")


def _contenders() -> list[str]:
    """Every contender's name, once (some run in the pipeline and the throughput scenarios)."""
    from ..tools import bench

    return list(dict.fromkeys(bench.PIPELINE_CONTENDERS + bench.THROUGHPUT_CONTENDERS
                              + bench.PERSAMPLE_CONTENDERS))


def _config(args: argparse.Namespace) -> Any:
    """The bench configuration from parsed arguments; UsageError for what argparse cannot check."""
    from ..tools import bench

    scenarios = args.scenarios or list(bench.SCENARIOS)
    unknown = set(scenarios) - set(bench.SCENARIOS)
    if unknown:
        raise UsageError(f"--scenarios: unknown {sorted(unknown)}; choose from "
                         f"{', '.join(bench.SCENARIOS)}")
    if args.contenders is not None:
        known = _contenders()
        unknown = set(args.contenders) - set(known)
        if unknown:
            raise UsageError(f"--contenders: unknown {sorted(unknown)}; choose from "
                             f"{', '.join(known)}")
    if args.rows <= args.time_steps:
        raise UsageError(f"--rows must exceed --time-steps ({args.time_steps}), got {args.rows}")
    workload = bench.Workload(
        shards=args.shards, rows=args.rows, inputs=args.inputs, time_steps=args.time_steps,
        batch_size=args.batch_size, step=args.step, step_ms=args.step_ms,
        num_workers=args.num_workers, producers=args.producers, prefetch=args.prefetch,
        seed=args.seed)
    return bench.BenchConfig(
        workload=workload, scenarios=scenarios, contenders=args.contenders,
        rounds=args.rounds, delay=args.delay, throughput_samples=args.throughput_samples,
        throughput_batch_size=args.throughput_batch_size, memory_rows=args.memory_rows,
        memory_epochs=args.memory_epochs, persample_images=args.persample_images,
        warmup=args.warmup, one_row_keys=args.one_row_keys,
        growth=bench.GrowthSizes(keys=args.growth_keys, shards=args.growth_shards,
                                 ranks=args.growth_ranks, epochs=args.growth_epochs),
        argv={k: v for k, v in vars(args).items() if k != "func"})


def run_bench(args: argparse.Namespace) -> int:
    """Run the chosen scenarios, print the tables, write ``--json``; returns 0."""
    from ..tools import bench

    results = bench.run_bench(_config(args))
    print(bench.format_results(results))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fp:
            json.dump(results, fp, indent=1, default=str)
    return 0
