"""What ``run_core`` reports: the rows of its table, its JSON result, Markdown and files.

Kept apart from the timing so the numbers a run measured (``CoreRuns``) turn into its
report in one place, the same whichever paths it ran.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

import insitubatch_nodes as ib

from .common import Run, fmt
from .core_config import CHANNELS_LABEL, RSS_SLACK, SPLIT, CoreConfig
from .loader_epochs import LoaderEpochs
from .peers import format_peers_markdown, paired_ratio, peer_runs, warm_epochs


@dataclass(frozen=True)
class CoreRuns:
    """Every path one ``run_core`` timed, and what it measured beside them: its result and
    its printed summary are made of these alone."""

    loader: list[Run]  # the loader's epochs
    stack: LoaderEpochs | None  # the loader stacking channels, epoch by epoch
    stripe: Run  # the read floor
    gather: Run | None  # the read floor plus one gather copy (local stores)
    zarr: Run  # zarr's own whole-array read
    naive: dict[int, Run]  # the per-sample DataLoader, by worker count
    naive_subset: int  # samples the naive DataLoaders read
    peer_rows: list[dict[str, Any]]
    first_batch: dict[str, Any]  # ``time_first_batch``
    probe: dict[str, Any]  # ``probe_loader_rss``

    @property
    def floor(self) -> Run:
        """The faster of the two read floors: the one the ratios are taken to."""
        return max((self.stripe, self.zarr), key=lambda r: r.samples_per_s)

    @property
    def naive2(self) -> Run | None:
        """The naive DataLoader with 2 workers (else the most workers run), or None."""
        return self.naive.get(2) or (self.naive[max(self.naive)] if self.naive else None)


def steady_state(epochs: list[Run], key: str = "paired_floor_s",
                 label: str = "insitubatch loader") -> tuple[Run, float | None]:
    """The best epoch after the first (the steady state), and the median over those epochs of
    (epoch rate / rate of the floor pass ``key`` run just before it), which drift cannot
    bias."""
    warm = epochs[1:] or epochs
    best = min(warm, key=lambda r: r.seconds)
    first = len(epochs) - len(warm) + 1
    steady = Run(f"{label}, steady (best of epochs {first}-{len(epochs)})",
                 best.samples, best.seconds, best.sample_nbytes, best.first_batch_s,
                 best.cpu_s, best.rss_peak, best.rss_growth,
                 extra={"epoch": best.name, **best.extra})
    pairs = [r.extra[key] / r.seconds for r in warm if r.extra.get(key)]
    return steady, float(np.median(pairs)) if pairs else None


def table_row(run: Run, floor: Run, naive2: Run | None, gfloor: Run | None) -> dict[str, Any]:
    return {"name": run.name, "samples": run.samples, "seconds": run.seconds,
            "samples_per_s": run.samples_per_s, "gb_per_s": run.gb_per_s,
            "ratio_to_floor": run.samples_per_s / floor.samples_per_s,
            "ratio_to_gather_floor": run.samples_per_s / gfloor.samples_per_s if gfloor else None,
            "ratio_to_naive_2w": run.samples_per_s / naive2.samples_per_s if naive2 else None,
            "first_batch_s": run.first_batch_s, "cpu_cores": run.cores,
            "rss_peak_bytes": run.rss_peak, "rss_growth_bytes": run.rss_growth, **run.extra}


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'path':<46} {'samples/s':>9} {'GB/s':>5} {'x floor':>7} {'x f+copy':>8} "
            f"{'x naive2w':>9} {'1st batch':>9} {'+RSS MB':>7} {'cores':>5} {'others':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        grow = None if r["rss_growth_bytes"] is None else r["rss_growth_bytes"] / 1e6
        lines.append(
            f"{r['name'][:46]:<46} {r['samples_per_s']:>9,.0f} {r['gb_per_s']:>5.2f} "
            f"{r['ratio_to_floor']:>7.2f} {fmt(r['ratio_to_gather_floor'], '.2f'):>8} "
            f"{fmt(r['ratio_to_naive_2w'], '.1f'):>9} {fmt(r['first_batch_s'], '.3f'):>9} "
            f"{fmt(grow, ',.0f'):>7} {fmt(r['cpu_cores'], '.2f'):>5} "
            f"{fmt(r.get('other_load_cores'), '.2f'):>6}")
    return "\n".join(lines)


def format_markdown(result: dict[str, Any]) -> str:
    """The table as Markdown, for the README."""
    lines = ["| path | samples/s | GB/s | × floor | × floor+copy | × naive 2w | 1st batch s "
             "| RSS growth MB |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        rss = "-" if r["rss_growth_bytes"] is None else f"{r['rss_growth_bytes'] / 1e6:,.0f}"
        lines.append(
            f"| {r['name']} | {r['samples_per_s']:,.0f} | {r['gb_per_s']:.2f} | "
            f"{r['ratio_to_floor']:.2f} | {fmt(r['ratio_to_gather_floor'], '.2f')} | "
            f"{fmt(r['ratio_to_naive_2w'], '.1f')} | {fmt(r['first_batch_s'], '.3f')} | {rss} |")
    return "\n".join(lines)


def stacking_summary(channels: Sequence[str], per_variable: list[Run],
                     stack: LoaderEpochs | None, source: ib.Source,
                     batch_size: int) -> dict[str, Any] | None:
    """What stacking the channels costs: the loader with ``channels=`` against the same
    loader serving each variable, epoch by epoch back to back (median of the warm epochs)."""
    if stack is None:
        return None
    ours = {i: r.seconds for i, r in enumerate(per_variable, 1)}
    warm = warm_epochs(len(per_variable))
    ratio = paired_ratio(stack.seconds, ours, warm)  # channels rate / per-variable rate
    stacked = [v for v in source.variables if v.name in channels]
    n = sum(int(np.prod(v.sample_shape[:-2], dtype=np.int64)) for v in stacked)
    shape = [batch_size, n, *stacked[0].sample_shape[-2:]]
    return {"channels": list(channels), "epochs": warm, "batch_shape": shape,
            "ratio_channels_over_per_variable": ratio,
            "stacking_cost": None if ratio is None else 1 / ratio - 1,
            "all_seconds": [r.seconds for r in stack.runs]}


def format_stacking(s: dict[str, Any]) -> str:
    ratio = s["ratio_channels_over_per_variable"]
    shape = "x".join(str(d) for d in s["batch_shape"])
    return (f"channels stacked ({len(s['channels'])} variables into one {shape} tensor): "
            f"{fmt(ratio, '.2f')}x the per-variable loader's rate (median of epochs "
            f"{s['epochs'][0]}-{s['epochs'][-1]}, back to back), i.e. epoch time "
            f"{fmt(None if ratio is None else 100 * s['stacking_cost'], '+.1f')}% with channels")


def naive_target(chunk_size: int) -> float | None:
    return {8: 10.0, 24: 25.0}.get(chunk_size)


def core_result(cfg: CoreConfig, machine: dict[str, Any], source: ib.Source,
                manifest: ib.SplitManifest, store_info: dict[str, Any],
                runs: CoreRuns) -> dict[str, Any]:
    """The run's JSON result: every row, the steady state's ratios, memory and targets."""
    grid, floor, naive2, gfloor = source.grid, runs.floor, runs.naive2, runs.gather
    chunk_ids, n_split = manifest.chunk_ids(SPLIT), manifest.n_samples_in(SPLIT)
    nbytes_s = source.sample_nbytes
    steady, paired = steady_state(runs.loader)
    _, paired_g = steady_state(runs.loader, "paired_gather_floor_s")
    stacked = []
    if runs.stack is not None:
        stacked = [steady_state(runs.stack.runs, label=CHANNELS_LABEL)[0]]
    every = [*runs.loader[:2], steady, *stacked, *runs.naive.values(), runs.stripe,
             *([gfloor] if gfloor else []), runs.zarr, *peer_runs(runs.peer_rows, nbytes_s)]
    r_naive = steady.samples_per_s / naive2.samples_per_s if naive2 else None
    r_gfloor = steady.samples_per_s / gfloor.samples_per_s if gfloor else None
    rss_peak = runs.probe["peak_rss_bytes"]
    bound = runs.loader[0].extra["resident_bound_bytes"]
    return {
        "machine": machine,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        "store": store_info,
        "split": {"chunks": len(chunk_ids), "samples": n_split, "sample_nbytes": nbytes_s,
                  "samples_per_chunk": grid.chunk_size, "variables": list(source.names)},
        "rows": [table_row(r, floor, naive2, gfloor) for r in every],
        "loader_epochs": [table_row(r, floor, naive2, gfloor) for r in runs.loader],
        "floor": floor.name, "steady_ratio_to_floor": steady.samples_per_s / floor.samples_per_s,
        "steady_paired_ratio_to_floor": paired, "steady_ratio_to_naive_2w": r_naive,
        "steady_ratio_to_gather_floor": r_gfloor,
        "steady_paired_ratio_to_gather_floor": paired_g,
        "first_batch": runs.first_batch,
        "memory": {"loader_rss_peak_bytes": rss_peak, "resident_bound_bytes": bound,
                   "probe": runs.probe,
                   "in_process_rss_peak_bytes": max(r.rss_peak or 0 for r in runs.loader),
                   "inflight_bytes_bound":
                       cfg.max_inflight * max(v.stripe_nbytes for v in source.variables),
                   "rss_target_bytes": bound + RSS_SLACK,
                   "rss_within_target": rss_peak <= bound + RSS_SLACK},
        "targets": {"ratio_to_floor": 0.9, "ratio_to_naive_2w": naive_target(grid.chunk_size)},
        "peers": runs.peer_rows,
        "channels": stacking_summary(cfg.channels, runs.loader, runs.stack, source,
                                     cfg.batch_size),
    }


def write_outputs(result: dict[str, Any], cfg: CoreConfig) -> None:
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    path = cfg.out_dir / cfg.json_name
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    md = format_markdown(result)
    if result.get("peers"):
        md += "\n\n" + format_peers_markdown(result["peers"])
    (cfg.out_dir / (Path(cfg.json_name).stem + ".md")).write_text(md + "\n")
    print(f"wrote {path}")
    if cfg.plots:
        from .plots import plot_core

        png = cfg.out_dir / (Path(cfg.json_name).stem + ".png")
        plot_core(result, png)
        print(f"wrote {png}")
