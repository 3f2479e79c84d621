"""Decode worker processes against the decode threads: samples/s and, what decides a big
node, the training process's own CPU time per sample.

Every variant is one loader kept across rounds (its workers started once, as in training);
each round runs one epoch of each variant in rotating order and measures its wall time and
``time.process_time()`` of this process (every thread of it, the training thread, the
engine thread and the decode threads alike; the workers' CPU is theirs). Medians over
rounds; ratios are paired per round. First: each variant's fresh loader timed from its
build to its first batch (the workers' start included), median of 3. Run on demand, never
as a test::

    .venv/bin/python -m benchmarks.bench_workers --store S/t2m-c1.zarr --workers 0,1,2,auto
    .venv/bin/python -m benchmarks.bench_workers --small --out /tmp/bw   # smoke run

``--store`` is written (t2m 2000x181x360 float32, blosc-zstd, one step per chunk, as
bench_peers' ``t2m-c1``) when it does not exist.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import insitubatch_nodes as ib  # noqa: E402
from insitubatch_nodes.synthetic import DemoSpec, write_store  # noqa: E402


def _variant(text: str) -> int | str:
    return text if text == "auto" else int(text)


def epoch(loader: Any) -> tuple[float, float, int]:
    """One epoch: (wall seconds, this process's CPU seconds, samples)."""
    n = 0
    w0, c0 = time.perf_counter(), time.process_time()
    for batch in loader:
        n += int(batch["sample_index"].shape[0])
    return time.perf_counter() - w0, time.process_time() - c0, n


def run(store: Path, variants: list[int | str], rounds: int, batch_size: int,
        block_chunks: int | None, stack: bool = False) -> dict[str, Any]:
    src = ib.open_source(str(store))
    manifest = ib.split_by_chunk(src, fractions=(1.0, 0.0, 0.0))
    options: dict[Any, dict[str, Any]] = {}
    for v in variants:
        kw: dict[str, Any] = {"workers": v, "batch_size": batch_size, "seed": 0}
        if block_chunks is not None:
            kw["block_chunks"] = block_chunks
        if stack:
            kw["channels"] = list(src.names)
        options[v] = kw
    # a fresh loader's first batch, its build (and the workers' start) included
    first: dict[Any, list[float]] = {v: [] for v in variants}
    for _ in range(3):
        for v in variants:
            t0 = time.perf_counter()
            with ib.build_loader(src, manifest, "train", **options[v]) as ld:
                next(iter(ld))
                first[v].append(time.perf_counter() - t0)
            ld.shutdown()
    loaders = {}
    for v in variants:
        loaders[v] = ib.build_loader(src, manifest, "train", **options[v])
        epoch(loaders[v])  # warm: workers started, page cache, pools
    res: dict[Any, list[tuple[float, float, int]]] = {v: [] for v in variants}
    for r in range(rounds):
        for k in range(len(variants)):
            v = variants[(r + k) % len(variants)]
            res[v].append(epoch(loaders[v]))
    for ld in loaders.values():
        ld.shutdown()
    base = variants[0]
    rows = []
    for v in variants:
        walls = [w for w, _, _ in res[v]]
        n = res[v][0][2]
        rows.append({
            "workers": v,
            "resolved": loaders[v].workers,
            "samples_per_s": n / median(walls),
            "main_cpu_us_per_sample": 1e6 * median(c for _, c, _ in res[v]) / n,
            "first_batch_s": median(first[v]),
            f"epoch_ratio_vs_{base}": median(b[0] / w for (w, _, _), b
                                              in zip(res[v], res[base], strict=True)),
        })
    return {"store": str(store), "rounds": rounds, "batch_size": batch_size,
            "cores": os.cpu_count(), "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", type=Path, default=Path("bench-out/workers/t2m-c1.zarr"))
    ap.add_argument("--workers", default="0,1,2,auto",
                    help="comma-separated variants; the first is the paired baseline")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--block-chunks", type=int, default=None)
    ap.add_argument("--stack", action="store_true",
                    help="stack every variable into 'channels' (the WB2 store: 83 channels)")
    ap.add_argument("--small", action="store_true", help="a tiny store, 2 rounds (smoke)")
    ap.add_argument("--out", type=Path, default=None, help="folder for results.json")
    a = ap.parse_args(argv)
    shape = (96, 18, 36) if a.small else (2000, 181, 360)
    store = (a.out or Path("/tmp")) / "bw-small.zarr" if a.small else a.store
    if not store.exists():
        write_store(store, DemoSpec(n_times=shape[0], n_lat=shape[1], n_lon=shape[2],
                                    time_chunk=1, seed=0, variables=("t2m",)), zarr_format=2)
    variants = [_variant(x) for x in a.workers.split(",")]
    result = run(store, variants, 2 if a.small else a.rounds, 8 if a.small else a.batch_size,
                 a.block_chunks, a.stack)
    base = variants[0]
    print(f"{result['store']}: {result['cores']} cores, {result['rounds']} rounds, "
          f"batch {result['batch_size']}")
    print(f"{'workers':>8} {'resolved':>8} {'samples/s':>10} {'main CPU us/sample':>19} "
          f"{'x ' + str(base):>8} {'1st batch s':>11}")
    for row in result["rows"]:
        print(f"{row['workers']!s:>8} {row['resolved']:>8} {row['samples_per_s']:>10.0f} "
              f"{row['main_cpu_us_per_sample']:>19.2f} "
              f"{row[f'epoch_ratio_vs_{base}']:>8.3f} {row['first_batch_s']:>11.3f}")
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "results.json").write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
