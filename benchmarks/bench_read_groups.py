"""A rank of a read group of 4 against a rank reading the whole grid, at 0.25 degree: the
stored bytes read per sample, samples/s and the training process's own CPU per sample, on
the decode threads and on 2 worker processes, in one run, paired round by round.

Each rank of a read group of 4 serves every sample of its model group with a quarter of the
latitude rows (``build_loader(read_group=4, rank=r, world_size=4)``: one model group); the
reference is ``read_group=1`` on one rank. The store is one 0.25-degree variable a step per
chunk, blosc-zstd with byte shuffle, a smooth field plus noise. Run on demand::

    .venv/bin/python -m benchmarks.bench_read_groups --out bench-out/read-groups
    .venv/bin/python -m benchmarks.bench_read_groups --small --out /tmp/rg   # smoke run

Bytes read are ``/proc/<pid>/io`` ``rchar`` of the training process and its workers
(``benchmarks.bench_levels.epoch``), so the page cache being warm does not hide them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from statistics import median
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import insitubatch_nodes as ib  # noqa: E402
from benchmarks.bench_levels import Epoch, epoch  # noqa: E402

GROUP = 4


def write_store(path: Path, n_times: int, lat: int, lon: int) -> Path:
    """``t2m (time, latitude, longitude)`` float32, a step a chunk, blosc-zstd + shuffle."""
    import zarr
    from zarr.codecs import BloscCodec

    g = zarr.open_group(path, mode="w", zarr_format=3)
    arr = g.create_array("t2m", shape=(n_times, lat, lon), chunks=(1, lat, lon),
                         dtype="float32", dimension_names=("time", "latitude", "longitude"),
                         compressors=BloscCodec(cname="zstd", clevel=3, shuffle="shuffle"))
    y = np.linspace(90, -90, lat, dtype=np.float32)[:, None]
    x = np.linspace(0, 360, lon, endpoint=False, dtype=np.float32)[None, :]
    rng = np.random.default_rng(0)
    for t in range(n_times):
        field = 250 + 30 * np.cos(np.deg2rad(y)) + 5 * np.sin(np.deg2rad(x) + t / 10)
        arr[t] = field + rng.standard_normal((lat, lon), dtype=np.float32) * 0.5
    return path


def variants(workers: list[int]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for w in workers:
        out[f"whole grid, workers={w}"] = {"workers": w}
        for rank in range(GROUP):
            out[f"read group {GROUP} rank {rank}, workers={w}"] = {
                "workers": w, "read_group": GROUP, "rank": rank, "world_size": GROUP}
    return out


def run(store: Path, workers: list[int], rounds: int, batch_size: int) -> dict[str, Any]:
    source = ib.open_source(store)
    manifest = ib.split_by_chunk(source, (1.0,), names=["train"])
    runs: dict[str, list[Epoch]] = {}
    loaders = {name: ib.build_loader(source, manifest, "train", batch_size=batch_size,
                                     prefetch_next_epoch=False, **kw)
               for name, kw in variants(workers).items()}
    try:
        for loader in loaders.values():
            epoch(loader)  # warm: page cache, worker start, imports
        for r in range(rounds):
            order = list(loaders)
            order = order[r % len(order):] + order[:r % len(order)]  # rotate: no fixed lead
            for name in order:
                runs.setdefault(name, []).append(epoch(loaders[name]))
    finally:
        for loader in loaders.values():
            loader.shutdown()
    rows = {}
    for name, eps in runs.items():
        n = eps[0].samples
        rows[name] = {
            "samples_per_s": median(e.samples / e.wall for e in eps),
            "bytes_read_per_sample": median(e.bytes_read for e in eps) / n,
            "cpu_us_per_sample": median(e.cpu for e in eps) / n * 1e6,
            "cores": median(e.cores for e in eps), "others": median(e.others for e in eps)}
    for w in workers:
        ref = rows[f"whole grid, workers={w}"]
        for name, row in rows.items():
            if name.endswith(f"workers={w}"):
                row["bytes_vs_whole"] = row["bytes_read_per_sample"] / ref["bytes_read_per_sample"]
                row["speed_vs_whole"] = row["samples_per_s"] / ref["samples_per_s"]
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--times", type=int, default=24)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    p.add_argument("--small", action="store_true", help="a 1-degree grid, 8 steps, 1 round")
    args = p.parse_args(argv)
    lat, lon = (181, 360) if args.small else (721, 1440)
    times, rounds = (8, 1) if args.small else (args.times, args.rounds)
    args.out.mkdir(parents=True, exist_ok=True)
    store = args.out / f"t2m-{lat}x{lon}.zarr"
    if not (store / "zarr.json").exists():
        write_store(store, times, lat, lon)
    rows = run(store, args.workers, rounds, args.batch_size)
    result = {"grid": [lat, lon], "times": times, "rounds": rounds, "rows": rows,
              "command": "python -m benchmarks.bench_read_groups " + " ".join(argv or sys.argv[1:])}
    (args.out / "read_groups.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'variant':<34} {'samples/s':>10} {'MB read/sample':>15} {'x whole':>8} "
          f"{'speed x whole':>13} {'CPU us/sample':>14}")
    for name, row in rows.items():
        print(f"{name:<34} {row['samples_per_s']:>10.1f} "
              f"{row['bytes_read_per_sample'] / 1e6:>15.3f} {row['bytes_vs_whole']:>8.3f} "
              f"{row['speed_vs_whole']:>13.3f} {row['cpu_us_per_sample']:>14.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
