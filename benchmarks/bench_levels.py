"""Some levels of a variable against all of them, on the decode threads and on worker
processes: samples/s, the training process's own CPU time per sample (what caps a big node)
and the stored bytes read per sample, in one run, paired round by round.

The store is ARCO-ERA5's layout (Zarr v2, blosc lz4 level 5 + byte shuffle as xarray writes
it, all 37 pressure levels of a variable in one chunk, one time step per chunk); the subset
is GraphCast's 13 levels. Run on demand, never as a test::

    .venv/bin/python -m benchmarks.bench_levels --grid 2.5            # 37 x 73 x 144
    .venv/bin/python -m benchmarks.bench_levels --grid 0.25 --times 24 --rounds 3
    .venv/bin/python -m benchmarks.bench_levels --small               # smoke run

Bytes read are the bytes the training process and its decode workers read from files
(``/proc/<pid>/io`` ``rchar``), per sample served. ``cores`` is what the run kept busy (the
training process and its workers), ``others`` what every other process on the machine took
meanwhile (medians over rounds): on a shared 2-core VM a run with ``others`` near 1 had about
one core, where threads and workers come out even; repeat it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any, NamedTuple

import numpy as np

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import insitubatch_nodes as ib  # noqa: E402

ARCO_LEVELS = [1, 2, 3, 5, 7, 10, 20, 30, 50, 70, 100, 125, 150, 175, 200, 225, 250, 300,
               350, 400, 450, 500, 550, 600, 650, 700, 750, 775, 800, 825, 850, 875, 900,
               925, 950, 975, 1000]
GRAPHCAST = [50, 100, 150, 200, 250, 300, 400, 500, 600, 700, 850, 925, 1000]
GRIDS = {"2.5": (73, 144), "1.0": (181, 360), "0.25": (721, 1440)}


def write_arco(path: Path, n_times: int, lat: int, lon: int) -> Path:
    """``geopotential (time, level, latitude, longitude)`` float32, smooth fields plus noise
    (compressing as reanalysis does, not as random bytes), one step per chunk."""
    import numcodecs
    import zarr

    g = zarr.open_group(path, mode="w", zarr_format=2)
    blosc = numcodecs.Blosc("lz4", 5, numcodecs.Blosc.SHUFFLE)
    dims: dict[str, Any] = {"_ARRAY_DIMENSIONS": ["time", "level", "latitude", "longitude"]}
    z = g.create_array("geopotential", shape=(n_times, 37, lat, lon),
                       chunks=(1, 37, lat, lon), dtype="float32", compressors=blosc,
                       fill_value=np.nan, attributes=dims)
    for name, values in (("time", np.arange(n_times, dtype=np.int64)),
                         ("level", np.asarray(ARCO_LEVELS, np.int64)),
                         ("latitude", np.linspace(90, -90, lat)),
                         ("longitude", np.linspace(0, 360, lon, endpoint=False))):
        g.create_array(name, shape=values.shape, dtype=values.dtype, compressors=blosc,
                       attributes={"_ARRAY_DIMENSIONS": [name]})[:] = values
    y = np.linspace(-1, 1, lat, dtype=np.float32)[:, None]
    x = np.linspace(0, 2 * np.pi, lon, dtype=np.float32)[None, :]
    p = np.asarray(ARCO_LEVELS, np.float32)[:, None, None]
    rng = np.random.default_rng(0)
    for t in range(n_times):
        base = 5e4 * np.log(1000 / p) + 800 * np.sin(x + t / 10) * np.cos(3 * y)
        noise = rng.standard_normal((37, lat, lon), dtype=np.float32) * 2
        z[t] = (base + noise).astype(np.float32)
    zarr.consolidate_metadata(path, zarr_format=2)
    return path


def _tree_io_cpu() -> tuple[int, float]:
    """Bytes this process and its children (the decode workers) read so far, and the CPU
    seconds they used."""
    import psutil

    me = psutil.Process()
    read, cpu = 0, 0.0
    for p in [me, *me.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            read += p.io_counters().read_chars
            t = p.cpu_times()
            cpu += t.user + t.system
    return read, cpu


def _busy() -> float:
    """CPU seconds the whole machine spent busy so far (every process)."""
    import psutil

    t = psutil.cpu_times()
    return t.user + t.system + getattr(t, "nice", 0.0) + getattr(t, "irq", 0.0) + getattr(
        t, "softirq", 0.0)


class Epoch(NamedTuple):
    """One timed epoch. ``cores``: the cores this process and its workers kept busy;
    ``others``: the cores everything else on the machine took meanwhile (on a shared VM,
    another session's load: the kernel shares the cores between sessions, so one busy
    process elsewhere leaves a 2-core run about one, and the workers' lead goes)."""

    wall: float
    cpu: float  # this process's own CPU seconds
    samples: int
    bytes_read: int
    cores: float
    others: float


def epoch(loader: Any) -> Epoch:
    """One epoch of ``loader``, timed."""
    n = 0
    b0, t0 = _tree_io_cpu()
    a0 = _busy()
    w0, c0 = time.perf_counter(), time.process_time()
    for batch in loader:
        n += int(batch["sample_index"].shape[0])
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    b1, t1 = _tree_io_cpu()
    tree = t1 - t0
    return Epoch(wall, cpu, n, b1 - b0, tree / wall, max(0.0, _busy() - a0 - tree) / wall)


def variants(workers: list[int]) -> dict[str, dict[str, Any]]:
    """Each variant's loader options: all 37 levels or GraphCast's 13, per worker count."""
    out = {}
    for w in workers:
        for name, levels in (("37", ARCO_LEVELS), ("13", GRAPHCAST)):
            out[f"{name} levels, workers={w}"] = {
                "workers": w, "channels": [("geopotential", lv) for lv in levels]}
    return out


def run(store: Path, workers: list[int], rounds: int, batch_size: int,
        fresh: bool = False) -> dict[str, Any]:
    """Every variant ``rounds`` times in rotating order. ``fresh``: each timed epoch on a
    loader built for it, after one warm epoch, and shut down after (big grids, where four
    loaders' pools would not fit in memory together)."""
    src = ib.open_source(str(store), variables=["geopotential"])
    manifest = ib.split_by_chunk(src, fractions=(1.0, 0.0, 0.0))
    opts = variants(workers)

    def build(name: str) -> Any:
        return ib.build_loader(src, manifest, "train", batch_size=batch_size, seed=0,
                               **opts[name])

    names = list(opts)
    loaders = {} if fresh else {k: build(k) for k in names}
    for ld in loaders.values():
        epoch(ld)  # warm: workers started, page cache, pools
    res: dict[str, list[Epoch]] = {k: [] for k in names}
    for r in range(rounds):
        for k in range(len(names)):
            name = names[(r + k) % len(names)]
            if fresh:
                with build(name) as ld:
                    epoch(ld)  # warm: its batch memory paged in, as in a training run
                    res[name].append(epoch(ld))
            else:
                res[name].append(epoch(loaders[name]))
    for ld in loaders.values():
        ld.shutdown()
    rows = []
    for name in names:
        runs = res[name]
        n = runs[0].samples
        all_levels = name.replace("13 levels", "37 levels")
        rows.append({
            "variant": name,
            "samples_per_s": n / median(e.wall for e in runs),
            "main_cpu_us_per_sample": 1e6 * median(e.cpu for e in runs) / n,
            "bytes_read_per_sample": median(e.bytes_read for e in runs) / n,
            "cores": median(e.cores for e in runs),
            "others_cores": median(e.others for e in runs),
            "speed_vs_37_levels": median(a.wall / e.wall for e, a
                                         in zip(runs, res[all_levels], strict=True)),
            "speed_vs_threads": median(t.wall / e.wall for e, t in zip(
                runs, res[name.split(",")[0] + ", workers=0"], strict=True))
            if workers[0] == 0 else None,
        })
    return {"store": str(store), "rounds": rounds, "batch_size": batch_size,
            "cores": os.cpu_count(), "rows": rows}


def run_s3(store: Path, workers: list[int], batch_size: int, folder: Path) -> dict[str, Any]:
    """One epoch per variant, reading the store from moto on loopback through a proxy that
    counts the chunk bytes the server sent (``testing.faultproxy``): what a cloud run pays
    for in transfer and egress. The loaders' chunk caches are off."""
    from insitubatch_nodes.testing.faultproxy import FaultPlan, FaultProxy
    from insitubatch_nodes.testing.s3server import serving

    rows: list[dict[str, Any]] = []
    folder.mkdir(parents=True, exist_ok=True)
    with serving(folder, "data", {store.name: store}) as server, \
            FaultProxy(server.address, FaultPlan()) as proxy:
        src = ib.open_source(f"s3://data/{store.name}", variables=["geopotential"],
                             storage_options=server.options(endpoint=proxy.endpoint))
        manifest = ib.split_by_chunk(src, fractions=(1.0, 0.0, 0.0))
        for name, opts in variants(workers).items():
            with ib.build_loader(src, manifest, "train", batch_size=batch_size, seed=0,
                                 **opts) as ld:
                b0 = proxy.stats.chunk_bytes
                wall, cpu, n, _ = epoch(ld)
                rows.append({"variant": name, "samples_per_s": n / wall,
                             "main_cpu_us_per_sample": 1e6 * cpu / n,
                             "s3_bytes_per_sample": (proxy.stats.chunk_bytes - b0) / n})
    for row in rows:
        ref = next(r for r in rows if r["variant"] == row["variant"].replace("13 l", "37 l"))
        row["s3_bytes_vs_37_levels"] = row["s3_bytes_per_sample"] / ref["s3_bytes_per_sample"]
    return {"store": str(store), "s3": True, "batch_size": batch_size, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--grid", choices=sorted(GRIDS), default="2.5")
    ap.add_argument("--times", type=int, default=None, help="time steps (default by grid)")
    ap.add_argument("--workers", default="0,2", help="comma-separated; 0 first for ratios")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--small", action="store_true", help="a tiny store, 2 rounds (smoke)")
    ap.add_argument("--dir", type=Path, default=Path("bench-out/levels"))
    ap.add_argument("--out", type=Path, default=None, help="folder for results.json")
    ap.add_argument("--s3", action="store_true",
                    help="also read it from moto on loopback, counting the bytes sent")
    a = ap.parse_args(argv)
    lat, lon = (9, 16) if a.small else GRIDS[a.grid]
    n_times = 24 if a.small else (a.times or max(24, int(2e9 // (37 * lat * lon * 4))))
    batch = a.batch_size or (4 if a.small or a.grid == "0.25" else 16)
    store = a.dir / f"arco-{'small' if a.small else a.grid}-{n_times}.zarr"
    if not store.exists():
        store.parent.mkdir(parents=True, exist_ok=True)
        write_arco(store, n_times, lat, lon)
    result = run(store, [int(w) for w in a.workers.split(",")], 2 if a.small else a.rounds,
                 batch, fresh=a.grid == "0.25" and not a.small)
    print(f"{store}: {result['cores']} cores, {result['rounds']} rounds, batch {batch}")
    print(f"{'variant':>22} {'samples/s':>10} {'main CPU us/sample':>19} {'MB read/sample':>15}"
          f" {'x 37 levels':>11} {'x threads':>10} {'cores':>6} {'others':>7}")
    for row in result["rows"]:
        vt = row["speed_vs_threads"]
        print(f"{row['variant']:>22} {row['samples_per_s']:>10.0f} "
              f"{row['main_cpu_us_per_sample']:>19.1f} "
              f"{row['bytes_read_per_sample'] / 1e6:>15.3f} {row['speed_vs_37_levels']:>11.3f} "
              f"{'-' if vt is None else f'{vt:.3f}':>10} {row['cores']:>6.2f} "
              f"{row['others_cores']:>7.2f}")
    if a.s3:
        result["s3"] = run_s3(store, [int(w) for w in a.workers.split(",")], batch,
                              a.dir / "s3")
        print(f"{'on S3 (moto)':>22} {'samples/s':>10} {'MB sent/sample':>15} {'x 37 levels':>11}")
        for row in result["s3"]["rows"]:
            print(f"{row['variant']:>22} {row['samples_per_s']:>10.1f} "
                  f"{row['s3_bytes_per_sample'] / 1e6:>15.3f} "
                  f"{row['s3_bytes_vs_37_levels']:>11.3f}")
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "results.json").write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
