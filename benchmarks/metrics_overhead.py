"""What the always-on metrics cost: the loader now vs the package at a revision without them.

Run on demand from the repository root (stores as written by ``insitubatch make-demo`` or
``benchmarks.bench_core``)::

    .venv/bin/python -m benchmarks.metrics_overhead --store bench-out/bench.zarr \
        --store bench-out/spc1.zarr --baseline-rev 2ea12e0

The baseline package is extracted with ``git archive`` into a temporary folder. Each round
runs the baseline and the current package in fresh processes, alternating which goes first,
on the same store with a warm page cache; each process does one warm-up epoch and then
``--epochs`` timed ones and reports its best. The overhead is 1 - (median current rate /
median baseline rate) over the rounds; the spread of each side is printed too, since the
difference is smaller than this VM's run-to-run noise.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

WORKER = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import insitubatch_nodes as ib
assert ib.__file__.startswith(sys.argv[1]), ib.__file__
src = ib.open_source(sys.argv[2])
m = ib.split_by_chunk(src, fractions=(1.0,), seed=0)
kw = json.loads(sys.argv[4])
best = None
with ib.build_loader(src, m, "train", **kw) as loader:
    for e in range(1 + int(sys.argv[3])):
        t0 = time.perf_counter()
        n = 0
        for b in loader:
            n += len(b["sample_index"])
        dt = time.perf_counter() - t0
        if e and (best is None or dt < best):
            best = dt
print(json.dumps({"samples_per_s": n / best, "file": ib.__file__}))
"""


def run_one(pkg_root: str, store: str, epochs: int, kw: dict) -> float:
    out = subprocess.run([sys.executable, "-c", WORKER, pkg_root, store, str(epochs),
                          json.dumps(kw)], check=True, capture_output=True, text=True)
    return float(json.loads(out.stdout.strip().splitlines()[-1])["samples_per_s"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", action="append", required=True)
    p.add_argument("--baseline-rev", required=True, help="a git revision without the metrics")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--block-chunks", type=int, default=16)
    p.add_argument("--out", type=Path, default=Path("bench-out/metrics_overhead.json"))
    args = p.parse_args(argv)
    repo = Path(__file__).resolve().parents[1]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "archive", args.baseline_rev, "insitubatch_nodes"],
                                 cwd=repo, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        roots = {"baseline": tmp, "current": str(repo)}
        for store in args.store:
            kw = {"batch_size": args.batch_size, "block_chunks": args.block_chunks}
            rates: dict[str, list[float]] = {"baseline": [], "current": []}
            for r in range(args.rounds):
                order = ["baseline", "current"] if r % 2 == 0 else ["current", "baseline"]
                for name in order:
                    rates[name].append(run_one(roots[name], store, args.epochs, kw))
                print(f"{store} round {r + 1}: " + ", ".join(
                    f"{k} {v[-1]:,.0f}" for k, v in rates.items()), flush=True)
            med = {k: float(np.median(v)) for k, v in rates.items()}
            overhead = 1 - med["current"] / med["baseline"]
            spread = {k: float((max(v) - min(v)) / np.median(v)) for k, v in rates.items()}
            print(f"{store}: median samples/s baseline {med['baseline']:,.0f}, current "
                  f"{med['current']:,.0f} -> overhead {100 * overhead:+.1f}% (spread of runs: "
                  f"baseline {100 * spread['baseline']:.0f}%, current "
                  f"{100 * spread['current']:.0f}%)")
            results[store] = {"rates": rates, "median": med, "overhead": overhead,
                              "spread": spread}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"baseline_rev": args.baseline_rev, "results": results},
                                   indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
