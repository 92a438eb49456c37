"""The bench's targets and its human-readable tables."""
from __future__ import annotations

from .pipeline import PIPELINE_SCENARIOS

__all__ = ["fmt", "format_results", "targets"]


def targets(results: dict) -> list[dict]:
    """Each target of issue 4 with the measured figure and whether it is met."""
    out = []

    def add(what: str, value: float | None, limit: float, cmp: str) -> None:
        if value is None:
            return
        met = value <= limit if cmp == "<=" else value >= limit
        out.append({"target": what, "value": round(value, 4), "limit": limit, "met": met})

    limits = {"balanced": 1.05, "generation-bound": 1.08, "training-bound": 1.03}
    for scenario, limit in limits.items():
        res = results.get(scenario)
        if not res:
            continue
        producers = res["workload"]["producers"]
        for name, c in res["contenders"].items():
            if not name.startswith("gluon_stream"):
                continue
            if scenario == "generation-bound" and c["options"].get("producers", 1) != producers:
                continue  # the ideal assumes the workload's producers; defaults have one
            add(f"{scenario}: {name} x ideal", c["x_ideal"], limit, "<=")
            if scenario == "balanced":
                add(f"balanced: {name} speed-up vs dataloader-per-shard",
                    c["speedup_vs_dataloader_per_shard"], 2.0, ">=")
                add(f"balanced: {name} stall % after first batch", c["stall_pct"], 5.0, "<=")
            if scenario == "training-bound":
                add(f"training-bound: {name} rotation ms (prefetched)", c["rotation_ms"],
                    5.0, "<=")
    for shape, res in results.get("throughput", {}).items():
        add(f"throughput {shape}: gluon_stream vs NDArrayIter",
            res["contenders"].get("gluon_stream", {}).get("vs_ndarrayiter"), 1.0, ">=")
    mem = results.get("memory")
    if mem:
        add("memory: peak RSS over baseline, MB (limit: (prefetch+2) shards)",
            mem["peak_over_baseline_mb"], round(mem["bound_mb"], 2), "<=")
    return out


def fmt(value: float | None, spec: str) -> str:
    if value is None:
        width = spec.split(".")[0]
        return format("-", f">{width}") if width else "-"
    return format(value, spec)


def format_results(results: dict) -> str:
    """The human-readable tables of a bench run."""
    lines = []
    for scenario in PIPELINE_SCENARIOS:
        res = results.get(scenario)
        if not res:
            continue
        w = res["workload"]
        comp = res["components"]
        lines.append(
            f"\n{scenario}: {w['shards']} shards x {w['rows'] - w['time_steps']} samples "
            f"({w['time_steps']}x{w['inputs']}), batch {w['batch_size']}, step "
            f"{w['step_ms'] if w['step'] == 'sleep' else 'cpu'} ms, generator delay "
            f"{w['delay']:.3f} s (generate {fmt(comp['generate_s'], '.3f')} s, load "
            f"{fmt(comp['load_s'], '.4f')} s, transform {fmt(comp['transform_s'], '.4f')} s "
            f"per shard), producers {w['producers']}, num_workers {w['num_workers']}; "
            f"medians of {len(res['ideal']['rounds'])} rounds")
        lines.append(f"  {'contender':<26}{'epoch s':>8}{'x ideal':>8}{'x wave':>7}{'vs dl':>7}"
                     f"{'1st batch s':>12}{'stall %':>8}{'rot ms':>8}{'+RSS MB':>8}{'batches':>8}")
        lines.append(f"  {'ideal':<26}{fmt(res['ideal']['wall_s'], '8.2f')}{1.0:>8.2f}")
        lines.append(f"  {'wave bound':<26}{fmt(res['ideal']['wave_bound_s'], '8.2f')}"
                     f"{'':>8}{1.0:>7.2f}")
        for name, c in res["contenders"].items():
            lines.append(
                f"  {name:<26}{fmt(c['wall_s'], '8.2f')}{fmt(c['x_ideal'], '8.2f')}"
                f"{fmt(c['x_wave_bound'], '7.2f')}"
                f"{fmt(c['speedup_vs_dataloader_per_shard'], '7.2f')}"
                f"{fmt(c['first_batch_s'], '12.3f')}{fmt(c['stall_pct'], '8.1f')}"
                f"{fmt(c['rotation_ms'], '8.1f')}{fmt(c['peak_rss_mb'], '8.1f')}"
                f"{fmt(c['batches'], '8.0f')}")
    thr = results.get("throughput")
    if thr:
        lines.append("\nthroughput (in-memory arrays, no-op step), M samples/s and ratio to "
                     "NDArrayIter:")
        shapes = list(thr)
        lines.append(f"  {'contender':<26}" + "".join(f"{s + ' M/s':>12}{'ratio':>8}"
                                                      for s in shapes))
        for name in thr[shapes[0]]["contenders"]:
            row = f"  {name:<26}"
            for s in shapes:
                c = thr[s]["contenders"][name]
                row += (f"{fmt(c['samples_per_s'] / 1e6, '12.3f')}"
                        f"{fmt(c['vs_ndarrayiter'], '8.2f')}")
            lines.append(row)
    mem = results.get("memory")
    if mem:
        lines.append(
            f"\nmemory ({mem['epochs']} epochs, shard {mem['shard_mb']:.1f} MB): peak RSS "
            f"baseline + {mem['peak_over_baseline_mb']:.1f} MB (bound {mem['bound_mb']:.1f} MB: "
            f"{'within' if mem['within_bound'] else 'OVER'}), RSS slope "
            f"{mem['rss_slope_mb_per_epoch']:+.3f} MB/epoch (second half "
            f"{mem['rss_slope_second_half_mb_per_epoch']:+.3f})")
    targets = results.get("targets")
    if targets:
        lines.append("\ntargets:")
        for t in targets:
            lines.append(f"  [{'met ' if t['met'] else 'MISS'}] {t['target']}: {t['value']:.3f} "
                         f"(limit {t['limit']})")
    return "\n".join(lines)
