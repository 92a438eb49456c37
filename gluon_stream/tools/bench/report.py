"""The bench's targets and its human-readable tables."""
from __future__ import annotations

from ..._utils.validate import every_nth
from ...diagnosis import Diagnosis
from .features import features_lines
from .growth import growth_lines
from .onerow import one_row_lines
from .pipeline import PIPELINE_SCENARIOS
from .provenance import provenance_lines
from .timeseries import timeseries_lines
from .tuning import tuning_lines

__all__ = ["DIAGNOSED", "UNBOUNDED", "fmt", "format_results", "targets"]

DIAGNOSED = "gluon_stream"  # the contender whose bottleneck verdict ends the report (defaults)

# Contenders whose epochs the ideal does not bound: it counts no per-sample work (batchify
# runs per batch, in the loop's thread or as the loop receives it), and a shuffle window
# withholds (k - 1) / 2 shards' samples at an epoch's start. Their figures are reported as
# measured, against the per-shard DataLoader.
UNBOUNDED = ("gluon_stream-batchify", "gluon_stream-batchify-nw", "gluon_stream-window4")


def targets(results: dict) -> list[dict]:
    """Each target with the measured figure and whether it is met."""
    out = []

    def add(what: str, value: float | None, limit: float, cmp: str) -> None:
        if value is None:
            return
        met = value <= limit if cmp == "<=" else value >= limit
        out.append({"target": what, "value": round(value, 4), "limit": limit, "met": met})

    limits = {"balanced": 1.05, "generation-bound": 1.10, "training-bound": 1.03}
    for scenario, limit in limits.items():
        res = results.get(scenario)
        if not res:
            continue
        for name, c in res["contenders"].items():
            if not name.startswith("gluon_stream"):
                continue
            if scenario == "balanced":
                add(f"balanced: {name} speed-up vs dataloader-per-shard",
                    c["speedup_vs_dataloader_per_shard"], 2.0, ">=")
            if name in UNBOUNDED:
                continue
            add(f"{scenario}: {name} x ideal", c["x_ideal"], limit, "<=")
            if scenario == "balanced":
                add(f"balanced: {name} stall % after first batch", c["stall_pct"], 5.0, "<=")
            if scenario == "training-bound":
                add(f"training-bound: {name} rotation ms (prefetched)", c["rotation_ms"],
                    5.0, "<=")
    for shape, res in results.get("throughput", {}).items():
        add(f"throughput {shape}: gluon_stream vs NDArrayIter",
            res["contenders"].get("gluon_stream", {}).get("vs_ndarrayiter"), 1.0, ">=")
    thr = results.get("throughput", {})
    for shape, res in thr.items():
        c = res["contenders"]
        if "gluon_stream-window4" in c and "gluon_stream" in c:
            add(f"throughput {shape}: shuffle_window=4 vs 1",
                c["gluon_stream-window4"]["samples_per_s"] / c["gluon_stream"]["samples_per_s"],
                0.9, ">=")
    per = results.get("per-sample")
    if per:
        for name, limit in (("gluon_stream-nw2", 1.3), ("gluon_stream-nw4", 1.0)):
            c = per["in_memory"].get(name)
            if c:
                add(f"per-sample in memory: {name} vs DataLoader(num_workers=2)",
                    c["vs_dataloader_nw2"], limit, ">=")
        c = per["in_memory"].get("gluon_stream-nw2")
        if c and c.get("x_two_core_limit") is not None:
            add("per-sample in memory: gluon_stream-nw2 x the 2-core limit",
                c["x_two_core_limit"], 0.85, ">=")
            add("per-sample in memory: gluon_stream-nw2 x the 2-core limit, by CPU time",
                c["cpu_x_two_core_limit"], 0.85, ">=")
        stream = per["streaming"]
        add("per-sample streaming: gluon_stream vs a DataLoader per shard",
            stream["speedup_vs_dataloader_per_shard"], 1.5, ">=")
        add("per-sample streaming: gluon_stream x ideal",
            stream["contenders"]["gluon_stream"]["x_ideal"], 1.10, "<=")
        add("per-sample: rotation ms (workers ahead)", per["rotation"]["rotation_ms"], 5.0, "<=")
    mem = results.get("memory")
    if mem:
        add("memory: peak RSS over baseline, MB (limit: (prefetch+2) shards)",
            mem["peak_over_baseline_mb"], round(mem["bound_mb"], 2), "<=")
        fn = mem.get("function_source")
        if fn:
            add("memory, FunctionSource: peak RSS over baseline, MB (limit: (prefetch+2) shards)",
                fn["peak_over_baseline_mb"], round(fn["bound_mb"], 2), "<=")
    for name, c in results.get("stragglers", {}).get("contenders", {}).items():
        if name.startswith("gluon_stream"):
            add(f"stragglers: {name} x ideal", c["x_ideal"], 1.08, "<=")
    for name, res in results.get("window-epochs", {}).get("scenarios", {}).items():
        add(f"window-epochs {name}: shuffle_window=4 vs 1 over "
            f"{results['window-epochs']['epochs']} epochs", res["window_vs_1"], 1.05, "<=")
    one_row = results.get("one-row")
    if one_row:  # issue 36: at most 100 us of the loader's own work per one-row shard
        add("one-row: the loader's own work per shard, us", one_row["own_us_per_shard"],
            100.0, "<=")
    return out


def fmt(value: float | None, spec: str) -> str:
    if value is None:
        width = spec.split(".")[0]
        return format("-", f">{width}") if width else "-"
    return format(value, spec)


def format_results(results: dict) -> str:
    """The human-readable tables of a bench run."""
    lines = []
    ref = results.get("reference")
    if ref:
        lines.append(f"reference rate (this machine today; {ref['workload']}): "
                     f"{ref['images_per_s']:.0f} images/s, {ref['images_per_cpu_s']:.0f} per CPU "
                     f"second ({100 * ref['cpu_share']:.0f} % of a core); divide a figure by it "
                     "to compare runs on different days")
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
    mix = results.get("mixing")
    if mix:
        per = mix["distinct_shards_per_batch"]
        lines.append(f"\nshuffle_window: mean distinct shards per full batch ({mix['shards']} "
                     f"shards of {mix['samples']}, batch {mix['batch_size']}): "
                     + ", ".join(f"k={k}: {v:.2f}" for k, v in per.items()))
    per = results.get("per-sample")
    if per:
        lines.append(f"\nper-sample ({per['shards']} shards x {per['images']} 32x32x3 images, "
                     f"numpy augmentation, batch {per['batch_size']}, no-op step), in memory:")
        lines.append(f"  {'contender':<28}{'samples/s':>10}{'vs DataLoader(2 proc)':>23}"
                     f"{'x 2-core limit':>16}{'CPU ms/batch loop+workers':>27}"
                     f"{'x limit by CPU':>16}")
        for name, c in per["in_memory"].items():
            ms = c.get("cpu_ms_per_batch") or {}
            lines.append(f"  {name:<28}{fmt(c['samples_per_s'], '10.0f')}"
                         f"{fmt(c['vs_dataloader_nw2'], '23.2f')}"
                         f"{fmt(c.get('x_two_core_limit'), '16.2f')}"
                         f"{fmt(ms.get('loop'), '19.2f')} +{fmt(ms.get('workers'), '6.2f')}"
                         f"{fmt(c.get('cpu_x_two_core_limit'), '16.2f')}")
        st = per["streaming"]
        lines.append(f"  streaming (shards made on demand, {st['delay_s']:.2f} s each): ideal "
                     f"{st['ideal_s']:.2f} s; " + "; ".join(
                         f"{n} {c['wall_s']:.2f} s ({c['x_ideal']:.2f} x ideal)"
                         for n, c in st["contenders"].items())
                     + f"; gluon_stream {st['speedup_vs_dataloader_per_shard']:.2f}x the "
                     f"DataLoader per shard, first-batch wait at a boundary "
                     f"{fmt(st['rotation_ms'], '.1f')} ms")
        rot = per["rotation"]
        lines.append(f"  rotation with a {rot['step_ms']:.1f} ms step (the workers ahead): "
                     f"{fmt(rot['rotation_ms'], '.2f')} ms median over {rot['boundaries']} "
                     "shard boundaries")
    place = results.get("placement")
    if place:
        ms = place["ms_per_batch"]
        lines.append(f"\nplacement ({place['batch_mb']:.1f} MB batches to {place['context']}, "
                     f"{place['step_ms']:g} ms step): the loop spends "
                     + ", ".join(f"{v:.2f} ms per batch with {n}" for n, v in ms.items()))
    mem = results.get("memory")
    if mem:
        lines.append(
            f"\nmemory ({mem['epochs']} epochs, shard {mem['shard_mb']:.1f} MB): peak RSS "
            f"baseline + {mem['peak_over_baseline_mb']:.1f} MB (bound {mem['bound_mb']:.1f} MB: "
            f"{'within' if mem['within_bound'] else 'OVER'}), RSS slope "
            f"{mem['rss_slope_mb_per_epoch']:+.3f} MB/epoch (second half "
            f"{mem['rss_slope_second_half_mb_per_epoch']:+.3f}); the loader's own memory "
            f"(near-empty shards, in the baseline) {fmt(mem.get('overhead_mb'), '.1f')} MB, "
            "peak over the baseline after import "
            f"{fmt(mem.get('peak_over_import_baseline_mb'), '.1f')} MB")
        fn = mem.get("function_source")
        if fn:
            lines.append(
                f"  FunctionSource allocating each shard ({fn['rows']} rows of 30x16, shard "
                f"{fn['shard_mb']:.1f} MB, batch {fn['batch_size']}): peak baseline + "
                f"{fn['peak_over_baseline_mb']:.1f} MB (bound {fn['bound_mb']:.1f} MB: "
                f"{'within' if fn['within_bound'] else 'OVER'}), after import "
                f"{fmt(fn.get('peak_over_import_baseline_mb'), '.1f')} MB")
    lines.extend(_stragglers_lines(results.get("stragglers")))
    lines.extend(_window_epochs_lines(results.get("window-epochs")))
    lines.extend(features_lines(results.get("features")))
    lines.extend(tuning_lines(results.get("tuning")))
    lines.extend(one_row_lines(results.get("one-row")))
    lines.extend(growth_lines(results.get("growth")))
    lines.extend(provenance_lines(results.get("provenance")))
    lines.extend(timeseries_lines(results.get("timeseries")))
    targets = results.get("targets")
    if targets:
        lines.append("\ntargets:")
        for t in targets:
            lines.append(f"  [{'met ' if t['met'] else 'MISS'}] {t['target']}: {t['value']:.3f} "
                         f"(limit {t['limit']})")
    verdicts = [(scenario, verdict) for scenario in PIPELINE_SCENARIOS
                if (verdict := results.get(scenario, {}).get("contenders", {})
                    .get(DIAGNOSED, {}).get("diagnosis"))]
    if verdicts:
        lines.append(f"\nstats.diagnose() of {DIAGNOSED} (the library's defaults), last round:")
        lines.extend(f"  {scenario}: {Diagnosis(**verdict).headline}"
                     for scenario, verdict in verdicts)
    return "\n".join(lines)


def _stragglers_lines(res: dict | None) -> list[str]:
    if not res:
        return []
    st, w = res["stragglers"], res["workload"]
    lines = [f"\nstragglers: {st['dates']} dates x {st['batches_per_date']} batches of "
             f"{w['batch_size']}, step {w['step_ms']} ms; {every_nth(st['every'], 'date')}'s "
             f"generator sleeps {st['sleep_factor']:g}x {w['delay']:.3f} s (generate "
             f"{fmt(st['generate_s'], '.3f')} s, stragglers "
             f"{fmt(st['straggler_generate_s'], '.3f')} s; mean generation / "
             f"{st['producers']} producers = "
             f"{fmt(st['keeps_up'], '.2f')} x a date's training); medians of "
             f"{len(res['ideal']['rounds'])} rounds",
             f"  {'contender':<26}{'epoch s':>8}{'x ideal':>8}{'vs dl':>7}{'stall %':>8}",
             f"  {'ideal (2 producers)':<26}{fmt(res['ideal']['wall_s'], '8.2f')}{1.0:>8.2f}"]
    for name, c in res["contenders"].items():
        lines.append(f"  {name:<26}{fmt(c['wall_s'], '8.2f')}{fmt(c['x_ideal'], '8.2f')}"
                     f"{fmt(c['speedup_vs_dataloader_per_shard'], '7.2f')}"
                     f"{fmt(c['stall_pct'], '8.1f')}")
    return lines


def _window_epochs_lines(res: dict | None) -> list[str]:
    if not res:
        return []
    lines = [f"\nshuffle_window={res['window']} against 1 over {res['epochs']} epochs "
             "(producers 2, prefetch 2, new data every epoch), seconds per epoch:"]
    for name, r in res["scenarios"].items():
        c = r["contenders"]
        lines.append(f"  {name:<18}" + "; ".join(
            f"window {v['shuffle_window']}: {fmt(v['per_epoch_s'], '.2f')}" for v in c.values())
            + f"; ratio {fmt(r['window_vs_1'], '.3f')}")
    return lines
