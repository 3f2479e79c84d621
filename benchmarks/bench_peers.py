"""Peers benchmark: this loader against zarr-beluga and tensorstore on the stores that matter,
in one process, ending in one Markdown table of ratios.

Stores (written by ``insitubatch_nodes.synthetic``, or kept with ``--reuse``):

- ``t2m-c1``: t2m (2000, 181, 360) float32, blosc-zstd level 5 + shuffle, one step per
  chunk, Zarr v2 consolidated with ``_ARRAY_DIMENSIONS`` (what zarr-beluga reads);
- ``wb2``: the WeatherBench2 ERA5 layout at 240x121 (83 channels, 9.6 MB per step,
  blosc-lz4), ``--wb2-times`` steps: ours stacking all 83 channels and per variable, against
  both peers;
- ``t2m-c8``, ``t2m-c24``: the same t2m data with 8 and 24 steps per chunk: ours against the
  read floor plus one gather copy and the naive DataLoader (and the peers).

Each store is one ``insitubatch bench`` run (``bench.core.run_core``: every peer epoch right
after a loader epoch, medians of the warm epochs). Run on demand, never as a test::

    .venv/bin/python -m benchmarks.bench_peers --out bench-out/peers     # ~9 min, ~3 GB disk
    .venv/bin/python -m benchmarks.bench_peers --small --out /tmp/peers  # smoke run, seconds
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from statistics import median
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from insitubatch_nodes.bench import BELUGA_MODES, PEER_NAMES  # noqa: E402
from insitubatch_nodes.bench.common import fmt  # noqa: E402
from insitubatch_nodes.bench.core import CoreConfig, run_core  # noqa: E402
from insitubatch_nodes.bench.peers import warm_epochs  # noqa: E402
from insitubatch_nodes.synthetic import (  # noqa: E402
    WB2_LEVEL_VARIABLES,
    WB2_LEVELS,
    WB2_VARIABLES,
    DemoSpec,
    WB2Spec,
    write_store,
    write_wb2_store,
)

VAR = "t2m"


@dataclass(frozen=True)
class Sizes:
    """How big the stores are: the real comparison, or ``--small`` for a smoke run."""

    t2m_shape: tuple[int, int, int] = (2000, 181, 360)
    wb2: WB2Spec = WB2Spec(n_times=200)
    # An epoch of the t2m stores is ~0.2 s: medians over 8 warm epochs, since single epochs
    # on the shared 2-core VM spread by +-10 % and more.
    epochs: int = 9
    naive_samples: int = 600
    batch_size: int = 32


SMALL = Sizes(t2m_shape=(96, 18, 36), wb2=WB2Spec.small(n_times=24), epochs=3, naive_samples=32,
              batch_size=8)


@dataclass(frozen=True)
class Case:
    """One store of the comparison and how it is benchmarked."""

    key: str
    title: str
    variables: tuple[str, ...]
    channels: tuple[str, ...] = ()
    naive_workers: tuple[int, ...] = ()


def t2m_spec(sizes: Sizes, time_chunk: int, seed: int) -> DemoSpec:
    n_times, n_lat, n_lon = sizes.t2m_shape
    return DemoSpec(n_times=n_times, n_lat=n_lat, n_lon=n_lon, time_chunk=time_chunk, seed=seed,
                    variables=(VAR,))


def cases() -> list[Case]:
    return [
        Case("t2m-c1", "t2m, 1 step/chunk (blosc-zstd, v2)", (VAR,)),
        Case("wb2", "WB2 ERA5 layout, 83 channels (blosc-lz4, v2)", WB2_VARIABLES,
             channels=WB2_VARIABLES),
        Case("t2m-c8", "t2m, 8 steps/chunk", (VAR,), naive_workers=(2,)),
        Case("t2m-c24", "t2m, 24 steps/chunk", (VAR,), naive_workers=(2,)),
    ]


def store_matches(path: Path, case: Case, sizes: Sizes) -> bool:
    """Whether ``--reuse`` may keep the store at ``path``: Zarr v2, consolidated, and every
    variable with the shape and chunks this run would write."""
    import zarr

    if not (path / ".zmetadata").exists():
        return False
    if case.key == "wb2":
        s = sizes.wb2
        plane = (s.n_lon, s.n_lat)
        want = {v: ((s.n_times, len(WB2_LEVELS), *plane) if v in WB2_LEVEL_VARIABLES
                    else (s.n_times, *plane)) for v in WB2_VARIABLES}
    else:
        want = {VAR: sizes.t2m_shape}
    chunk = int(case.key.rsplit("c", 1)[1]) if case.key.startswith("t2m") else 1
    try:
        g = zarr.open_group(path, mode="r")
        arrays = {v: g[v] for v in want}
        return all(isinstance(a, zarr.Array) and tuple(a.shape) == want[v]
                   and a.chunks == (chunk, *want[v][1:]) for v, a in arrays.items())
    except Exception:
        return False


def write_case(path: Path, case: Case, sizes: Sizes, seed: int) -> None:
    if case.key == "wb2":
        write_wb2_store(path, replace(sizes.wb2, seed=seed))
    else:
        chunk = int(case.key.rsplit("c", 1)[1])
        write_store(path, t2m_spec(sizes, chunk, seed), zarr_format=2)


def summary_rows(case: Case, result: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of the combined table for one store: ours (median of the warm epochs, per
    variable and stacked), the floors and naive loader (ours/path: the run's own ratios),
    and the peers (ours/path paired per epoch)."""
    epochs = result["loader_epochs"]
    warm = warm_epochs(len(epochs))
    nbytes = result["split"]["sample_nbytes"]
    n = result["split"]["samples"]
    ours_s = median(epochs[e - 1]["seconds"] for e in warm)
    rows = [{"store": case.key, "path": "insitubatch loader, per variable",
             "samples_per_s": n / ours_s, "gb_per_s": n * nbytes / ours_s / 1e9}]
    stack = result.get("channels")
    if stack:
        secs = median(stack["all_seconds"][e - 1] for e in warm)
        rows.append({"store": case.key,
                     "path": f"insitubatch loader, channels {tuple(stack['batch_shape'])}",
                     "samples_per_s": n / secs, "gb_per_s": n * nbytes / secs / 1e9,
                     "ours_over_path": 1 / stack["ratio_channels_over_per_variable"]
                     if stack["ratio_channels_over_per_variable"] else None})
    by_name = {r["name"]: r for r in result["rows"]}
    for r in result["rows"]:
        if "floor" in r["name"] or r["name"].startswith("naive"):
            paired = (result["steady_paired_ratio_to_floor"] if r["name"].startswith("read floor:")
                      else result["steady_paired_ratio_to_gather_floor"]
                      if "gather copy" in r["name"] else None)
            steady = next(v for k, v in by_name.items() if "steady" in k and "channels" not in k)
            rows.append({"store": case.key, "path": r["name"],
                         "samples_per_s": r["samples_per_s"], "gb_per_s": r["gb_per_s"],
                         "ours_over_path": paired if paired is not None
                         else steady["samples_per_s"] / r["samples_per_s"],
                         "paired": paired is not None})
    for p in result["peers"]:
        if p["status"] != "ok":
            rows.append({"store": case.key, "path": p["name"], "status": p["status"]})
            continue
        rows.append({"store": case.key, "path": p["name"] + (" (best)" if p["best"] else ""),
                     "samples_per_s": p["samples_per_s"], "gb_per_s": p["gb_per_s"],
                     "ours_over_path": p["ratios"].get("per_variable"),
                     "channels_over_path": p["ratios"].get("channels"), "paired": True})
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """One Markdown table: ``ours/path`` > 1 means this loader is faster."""
    lines = ["| store | path | samples/s | GB/s | ours / path | ours (channels) / path |",
             "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        if "status" in r:
            lines.append(f"| {r['store']} | {r['path']} | {r['status']} | | | |")
            continue
        mark = "" if r.get("paired", True) else " (unpaired)"
        lines.append(f"| {r['store']} | {r['path']} | {r['samples_per_s']:,.0f} | "
                     f"{r['gb_per_s']:.2f} | {fmt(r.get('ours_over_path'), '.2f')}{mark} | "
                     f"{fmt(r.get('channels_over_path'), '.2f')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_peers", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("bench-out/peers"),
                   help="folder for peers.json / peers.md and one JSON per store")
    p.add_argument("--stores", type=Path, default=None,
                   help="folder for the stores (default OUT/stores)")
    p.add_argument("--reuse", action="store_true", help="keep existing matching stores")
    p.add_argument("--small", action="store_true", help="tiny stores, 3 epochs: a smoke run")
    p.add_argument("--epochs", type=int, default=None, help="epochs per path (default 9; >= 3)")
    p.add_argument("--wb2-times", type=int, default=None,
                   help="time steps of the WB2 store (default 200: 1.9 GB decoded)")
    p.add_argument("--only", nargs="+", choices=[c.key for c in cases()], default=None,
                   help="run these stores only")
    p.add_argument("--peers", default=",".join(PEER_NAMES),
                   help=f"comma-separated, out of {', '.join(PEER_NAMES)} (or none)")
    p.add_argument("--beluga-modes", default=",".join(BELUGA_MODES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plots", action="store_true", help="a PNG per store (matplotlib)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    sizes = SMALL if args.small else Sizes()
    if args.epochs is not None:
        if args.epochs < 3:
            p.error(f"--epochs must be >= 3 (medians of the epochs after the first), got "
                    f"{args.epochs}")
        sizes = replace(sizes, epochs=args.epochs)
    if args.wb2_times is not None:
        if args.wb2_times < sizes.batch_size:
            p.error(f"--wb2-times must be >= the batch size {sizes.batch_size}, got "
                    f"{args.wb2_times}")
        sizes = replace(sizes, wb2=replace(sizes.wb2, n_times=args.wb2_times))
    peers = tuple(n for n in args.peers.split(",") if n and n != "none")
    unknown = [n for n in peers if n not in PEER_NAMES]
    if unknown:
        p.error(f"--peers {','.join(unknown)}: unknown; choose from {', '.join(PEER_NAMES)}")
    stores = args.stores or args.out / "stores"
    stores.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    results: dict[str, Any] = {}
    for case in cases():
        if args.only and case.key not in args.only:
            continue
        path = stores / f"{case.key}.zarr"
        if args.reuse and store_matches(path, case, sizes):
            print(f"reusing {path}")
        else:
            write_case(path, case, sizes, args.seed)
        print(f"\n=== {case.key}: {case.title} ===")
        cfg = CoreConfig(url=str(path), variables=list(case.variables),
                         batch_size=sizes.batch_size, block_chunks=None, epochs=sizes.epochs,
                         naive_samples=sizes.naive_samples, naive_workers=case.naive_workers,
                         repeats=1,  # zarr arr[:] is a reference row here, not a floor we use
                         seed=args.seed, out_dir=args.out, json_name=f"{case.key}.json",
                         plots=args.plots, progress=not args.quiet, channels=case.channels,
                         peers=peers, beluga_modes=tuple(args.beluga_modes.split(",")))
        results[case.key] = run_core(cfg)
        rows += summary_rows(case, results[case.key])
    table = format_table(rows)
    print("\n" + table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "peers.md").write_text(table + "\n")
    (args.out / "peers.json").write_text(json.dumps(
        {"rows": rows, "sizes": {"t2m_shape": sizes.t2m_shape, "wb2_times": sizes.wb2.n_times,
                                 "wb2_grid": [sizes.wb2.n_lon, sizes.wb2.n_lat],
                                 "epochs": sizes.epochs, "batch_size": sizes.batch_size},
         "stores": {k: v["store"] for k, v in results.items()}}, indent=1, default=str) + "\n")
    print(f"wrote {args.out / 'peers.md'} and {args.out / 'peers.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
