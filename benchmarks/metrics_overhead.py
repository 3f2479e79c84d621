"""What the always-on metrics cost: the loader with them vs the package at a revision without.

Run on demand from the repository root (stores as written by ``insitubatch make-demo`` or
``insitubatch bench --sweep --keep-stores``)::

    .venv/bin/python -m benchmarks.metrics_overhead --store bench-out/era5-c8.zarr \
        --store bench-out/sweep/sweep-stores/spc1.zarr --baseline-rev 2ea12e0 --current-rev 3146b56

Both versions of the package are extracted (``git archive``) under different names
(``ib_baseline``, ``ib_current``; the package imports itself only relatively) and loaded into
**one** process, each with its own loader on the same store. Epochs then alternate between
the two (ABBA...), so both see the same process state, page cache and VM speed; the overhead
is 1 - the median over rounds of (baseline epoch time / current epoch time). Run-to-run noise
on a shared 2-core VM is tens of percent, which is why the ratio is paired epoch by epoch.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from insitubatch_nodes.bench.common import one_epoch_at_a_time, rotated


def extract_package(repo: Path, rev: str | None, dest: Path, name: str) -> None:
    """The package as of ``rev`` (``None``: the working tree) as ``dest/name``, and under its
    own name beside it: a decode worker process of that revision (``python -m
    insitubatch_nodes.workers.child``, with ``dest`` first on its path) then runs that
    revision's code, not the installed package's (whose job protocol may differ)."""
    dest.mkdir(parents=True)
    if rev is None:
        shutil.copytree(repo / "insitubatch_nodes", dest / "insitubatch_nodes")
    else:
        archive = subprocess.run(["git", "archive", rev, "insitubatch_nodes"], cwd=repo,
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    shutil.copytree(dest / "insitubatch_nodes", dest / name)


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def epoch_wall_cpu(loader: Any) -> tuple[float, float, int]:
    """(wall s, process CPU s, samples) of one epoch; only this loader is running."""
    c0, t0 = _cpu(), time.perf_counter()
    n = 0
    for b in loader:
        n += len(b["sample_index"])
    return time.perf_counter() - t0, _cpu() - c0, n


@contextlib.contextmanager
def imported_revisions(repo: Path, baseline_rev: str, current_rev: str | None,
                       ) -> Iterator[dict[str, Any]]:
    """The package at ``baseline_rev`` and at ``current_rev`` (``None``: the working tree),
    imported side by side as ``ib_baseline`` and ``ib_current``; both are forgotten on exit,
    so a second use in this process imports its own revisions afresh."""
    names = {"baseline": "ib_baseline", "current": "ib_current"}
    with tempfile.TemporaryDirectory() as tmp:
        extract_package(repo, baseline_rev, Path(tmp) / "b", names["baseline"])
        extract_package(repo, current_rev, Path(tmp) / "c", names["current"])
        added = [str(Path(tmp) / "b"), str(Path(tmp) / "c")]
        sys.path[:0] = added
        try:
            yield {k: importlib.import_module(v) for k, v in names.items()}
        finally:
            for path in added:
                sys.path.remove(path)
            for name in [m for m in sys.modules if m.split(".")[0] in names.values()]:
                del sys.modules[name]


def paired_epochs(loaders: dict[str, Any], rounds: int, order: Sequence[str],
                  ) -> tuple[dict[str, list[float]], dict[str, list[float]], int]:
    """(wall s, process CPU s per epoch of each loader, samples per epoch): two warm-up
    epochs each (threads, pools, buffers), then ``rounds`` rounds with ``order`` rotating
    (ABBA...) so both see the same process state, page cache and VM speed."""
    for loader in loaders.values():
        epoch_wall_cpu(loader)
        epoch_wall_cpu(loader)
    times: dict[str, list[float]] = {n: [] for n in order}
    cpu: dict[str, list[float]] = {n: [] for n in order}
    samples = 0
    for r in range(rounds):
        for name in rotated(order, r):
            dt, dc, samples = epoch_wall_cpu(loaders[name])
            times[name].append(dt)
            cpu[name].append(dc)
    return times, cpu, samples


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", action="append", required=True)
    p.add_argument("--baseline-rev", required=True, help="a git revision without the metrics")
    p.add_argument("--current-rev", default=None,
                   help="the revision with them (default: the working tree), so that other "
                        "changes between the two do not count")
    p.add_argument("--rounds", type=int, default=20, help="epochs per version, alternating")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--block-chunks", type=int, default=16)
    p.add_argument("--current-first", action="store_true",
                   help="build the current loader first (checks for an order bias)")
    p.add_argument("--out", type=Path, default=Path("bench-out/metrics_overhead.json"))
    args = p.parse_args(argv)
    repo = Path(__file__).resolve().parents[1]
    results = {}
    with imported_revisions(repo, args.baseline_rev, args.current_rev) as mods:
        for name, mod in mods.items():  # an A/A run (same revision twice) calibrates noise
            print(f"{name}: {'with' if hasattr(mod.InSituLoader, 'stats') else 'without'} "
                  "metrics")
        for store in args.store:
            loaders = {}
            names = ["current", "baseline"] if args.current_first else ["baseline", "current"]
            for name in names:
                ib = mods[name]
                src = ib.open_source(store)
                m = ib.split_by_chunk(src, fractions=(1.0,), seed=0)
                loaders[name] = ib.build_loader(src, m, "train", batch_size=args.batch_size,
                                                block_chunks=args.block_chunks,
                                                **one_epoch_at_a_time(ib))
            times, cpu, n = paired_epochs(loaders, args.rounds, ("baseline", "current"))
            for loader in loaders.values():
                loader.close()
            res: dict = {"samples": n, "times": times, "cpu": cpu}
            for kind, vals in (("wall", times), ("cpu", cpu)):
                ratios = np.array(vals["baseline"]) / np.array(vals["current"])
                q1, q3 = np.percentile(1 - ratios, [25, 75])
                res[kind] = {"overhead": 1 - float(np.median(ratios)),
                             "iqr": [float(q1), float(q3)]}
            med = {k: n / float(np.median(v)) for k, v in times.items()}
            res["median_rate"] = med
            def pct(kind: str, r: dict = res) -> str:
                lo, hi = r[kind]["iqr"]
                return f"{100 * r[kind]['overhead']:+.1f}% (IQR {100 * lo:+.1f}..{100 * hi:+.1f}%)"

            print(f"{store}: median samples/s baseline {med['baseline']:,.0f}, current "
                  f"{med['current']:,.0f}; paired overhead, wall {pct('wall')}, CPU {pct('cpu')} "
                  f"over {args.rounds} pairs", flush=True)
            results[store] = res
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"baseline_rev": args.baseline_rev,
                                    "current_rev": args.current_rev, "results": results},
                                   indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
