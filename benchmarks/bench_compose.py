"""Composed sources against one store holding the same data: ``ib.join`` and ``ib.concat``
(issue 42), paired epochs in one process.

Two comparisons, each with decode threads (``workers=0``) and decode worker processes
(``workers=2``):

- **join**: three stores holding one variable each (A, B, C: t2m, u10, v10), joined with
  ``ib.join([a, b, c], align="exact")``, against one store holding all three;
- **concat**: two periods of N/2 steps each (the first Zarr v2, the second Zarr v3, same
  chunking) concatenated with ``ib.concat([p1, p2])``, against one store of all N steps.

The one store is written by ``insitubatch_nodes.synthetic`` (float32, one step a chunk,
blosc-zstd level 5 + shuffle, Zarr v2 consolidated); the join members and periods are copied
from it with the same codec (``derive``), so composed and one-store decode byte-identical
chunks. For each
comparison and executor both loaders (``build_loader(..., batch_size, seed, workers)`` on
``split_by_chunk(source, [1.0], names=["train"])``, next epoch not fetched ahead) are built
side by side, warmed by two epochs each, then timed epoch by epoch in alternating pairs
(ABBA...: ``metrics_overhead.paired_epochs``), so both see the same page cache, process
state and VM speed. Figures: the median and IQR over pairs of composed rate / one-store
rate (one-store epoch seconds / composed epoch seconds; >= 0.95 is the issue's bar), the
median samples/s of each, and the training process's CPU per sample (``getrusage`` of this
process: the decode threads with ``workers=0``; the workers' own CPU not counted with
``workers=2``, as ``profile_workers`` counts it). ``--profile`` adds a cProfile of every
thread of this process over composed and one-store epochs (``workers=0``) and the cost of
``ComposedReader`` against the member's ``StripeReader`` per stripe, read directly. Run on
demand, never as a test, from the repository root::

    .venv/bin/python -m benchmarks.bench_compose --out bench-out/compose      # ~5 min
    .venv/bin/python -m benchmarks.bench_compose --out bench-out/compose --reuse \\
        --grid 64x128 --samples 4000 --profile          # the small ERA5-like grid as well
    .venv/bin/python -m benchmarks.bench_compose --small --out /tmp/compose   # smoke, seconds
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import insitubatch_nodes as ib  # noqa: E402
from benchmarks.metrics_overhead import epoch_wall_cpu, paired_epochs  # noqa: E402
from insitubatch_nodes.bench.common import (  # noqa: E402
    OtherLoad,
    one_epoch_at_a_time,
    print_machine,
    warm_page_cache,
    write_json,
)
from insitubatch_nodes.synthetic import DemoSpec, clear_store, write_store  # noqa: E402

VARS = ("t2m", "u10", "v10")  # A, B, C
NAMES = ("one", "composed")  # paired_epochs' order of the first round


# -- the stores ------------------------------------------------------------------------------
def _matches(path: Path, n: int, lat: int, lon: int, variables: tuple[str, ...],
             fmt: int, t0: int) -> bool:
    """Whether ``--reuse`` may keep the store at ``path``: its format, variables, shape,
    one step a chunk and its first time step."""
    import zarr

    try:
        g: Any = zarr.open_group(path, mode="r")
        if g.metadata.zarr_format != fmt:
            return False
        ok = all(tuple(g[v].shape) == (n, lat, lon) and g[v].chunks == (1, lat, lon)
                 for v in variables)
        return ok and int(g["time"][0]) == t0 * 6
    except Exception:
        return False


def _compressor(fmt: int) -> Any:
    """blosc-zstd level 5 + byte shuffle, as ``synthetic.write_store`` writes, in ``fmt``."""
    if fmt == 3:
        import zarr.codecs as zc

        return zc.BloscCodec(cname="zstd", clevel=5, shuffle="shuffle")
    import numcodecs

    return numcodecs.Blosc(cname="zstd", clevel=5, shuffle=numcodecs.Blosc.SHUFFLE)


def derive(src_path: Path, path: Path, variables: tuple[str, ...], start: int, stop: int,
           fmt: int) -> None:
    """A store holding steps ``[start, stop)`` of ``variables`` of the store at ``src_path``
    (and its coordinates), in Zarr format ``fmt``, one step a chunk, blosc-zstd: the same
    decoded values, so composed and one-store decode alike bytes."""
    import zarr

    clear_store(path)
    src: Any = zarr.open_group(src_path, mode="r")
    g: Any = zarr.open_group(path, mode="w", zarr_format=fmt)  # type: ignore[arg-type]

    def create(name: str, shape: tuple[int, ...], chunks: tuple[int, ...], dtype: Any,
               dims: list[str], attrs: dict[str, Any], compressed: bool) -> Any:
        attrs = {k: v for k, v in attrs.items() if k != "_ARRAY_DIMENSIONS"}
        kw: dict[str, Any] = ({"dimension_names": dims} if fmt == 3 else
                              {"attributes": {**attrs, "_ARRAY_DIMENSIONS": dims}})
        if fmt == 3:
            kw["attributes"] = attrs
        if compressed:
            kw["compressors"] = _compressor(fmt)
        return g.create_array(name, shape=shape, chunks=chunks, dtype=dtype, **kw)

    n = stop - start
    for name, dims in (("time", ["time"]), ("lat", ["lat"]), ("lon", ["lon"])):
        a = src[name]
        vals = a[start:stop] if name == "time" else a[:]
        create(name, vals.shape, vals.shape, vals.dtype, dims, dict(a.attrs),
               False)[:] = vals
    for v in variables:
        a = src[v]
        plane = tuple(a.shape[1:])
        out = create(v, (n, *plane), (1, *plane), a.dtype, ["time", "lat", "lon"],
                     dict(a.attrs), True)
        step = max(1, (64 << 20) // (4 * int(np.prod(plane))))
        for b in range(0, n, step):
            out[b:min(b + step, n)] = a[start + b:start + min(b + step, n)]
    if fmt == 2:
        zarr.consolidate_metadata(path, zarr_format=2)


def write_stores(root: Path, n: int, lat: int, lon: int, seed: int,
                 reuse: bool) -> dict[str, Any]:
    """one.zarr (A, B, C; N steps; v2; ``synthetic.write_store``), and from it A/B/C.zarr
    (one variable each; v2), p1.zarr (steps [0, N/2); v2) and p2.zarr ([N/2, N); v3): the
    same values and codec, one step a chunk, so both sides decode the same bytes."""
    root.mkdir(parents=True, exist_ok=True)
    half = n // 2
    t0 = time.perf_counter()
    one = root / "one.zarr"
    members = [root / f"{v}.zarr" for v in VARS]
    periods = [root / "p1.zarr", root / "p2.zarr"]
    wanted = [(one, n, VARS, 2, 0),
              *((m, n, (v,), 2, 0) for m, v in zip(members, VARS, strict=True)),
              (periods[0], half, VARS, 2, 0), (periods[1], n - half, VARS, 3, half)]
    if not (reuse and all(_matches(p, k, lat, lon, vs, f, s) for p, k, vs, f, s in wanted)):
        write_store(one, DemoSpec(n_times=n, n_lat=lat, n_lon=lon, time_chunk=1, seed=seed,
                                  variables=VARS), zarr_format=2)
        for m, v in zip(members, VARS, strict=True):
            derive(one, m, (v,), 0, n, 2)
        derive(one, periods[0], VARS, 0, half, 2)
        derive(one, periods[1], VARS, half, n, 3)
    nbytes, _ = warm_page_cache(root)
    print(f"stores under {root}: {nbytes / 1e9:.2f} GB on disk, ready in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    return {"one": str(one), "members": [str(m) for m in members],
            "periods": [str(p) for p in periods]}


def sources(stores: dict[str, Any], case: str) -> dict[str, Any]:
    """The one-store source and the composed one of ``case`` ("join" or "concat")."""
    one = ib.open_source(stores["one"])
    if case == "join":
        composed = ib.join([ib.open_source(u) for u in stores["members"]], align="exact")
    else:
        composed = ib.concat([ib.open_source(u) for u in stores["periods"]])
    if composed.names != one.names or composed.n_samples != one.n_samples:
        raise SystemExit(f"{case}: composed serves {composed.names} x {composed.n_samples}, "
                         f"one store {one.names} x {one.n_samples}: not the same data")
    return {"one": one, "composed": composed}


# -- the paired epochs ---------------------------------------------------------------------
def _q(x: Any) -> dict[str, float]:
    q1, med, q3 = np.percentile(np.asarray(x, dtype=float), [25, 50, 75])
    return {"median": float(med), "q1": float(q1), "q3": float(q3)}


def compare(srcs: dict[str, Any], case: str, workers: int, pairs: int, batch_size: int,
            seed: int) -> dict[str, Any]:
    """Paired epochs of the one-store and the composed loader with ``workers``."""
    loaders: dict[str, Any] = {}
    try:
        for n in NAMES:
            man = ib.split_by_chunk(srcs[n], [1.0], names=["train"])
            loaders[n] = ib.build_loader(srcs[n], man, "train", batch_size=batch_size,
                                         seed=seed, workers=workers, **one_epoch_at_a_time())
        with OtherLoad() as other:
            times, cpu, samples = paired_epochs(loaders, pairs, NAMES)
    finally:
        for ld in loaders.values():
            ld.close()
    t = {n: np.asarray(times[n]) for n in NAMES}
    c = {n: np.asarray(cpu[n]) for n in NAMES}
    out: dict[str, Any] = {
        "case": case, "workers": workers, "pairs": pairs, "samples": samples,
        "batch_size": batch_size,
        "composed_over_one_rate": _q(t["one"] / t["composed"]),
        "composed_over_one_cpu": _q(c["composed"] / c["one"]),
        "samples_per_s": {n: float(np.median(samples / t[n])) for n in NAMES},
        "cpu_us_per_sample": {n: float(np.median(1e6 * c[n] / samples)) for n in NAMES},
        "epoch_s": {n: [float(x) for x in t[n]] for n in NAMES},
        "cpu_s": {n: [float(x) for x in c[n]] for n in NAMES},
        "other_load_cores": other.cores,
    }
    r, cr = out["composed_over_one_rate"], out["composed_over_one_cpu"]
    sps, us = out["samples_per_s"], out["cpu_us_per_sample"]
    print(f"{case:6s} workers={workers}: composed/one rate {r['median']:.3f} "
          f"(IQR {r['q1']:.3f}..{r['q3']:.3f}) over {pairs} pairs; samples/s one "
          f"{sps['one']:.0f}, composed {sps['composed']:.0f}; CPU us/sample one "
          f"{us['one']:.0f}, composed {us['composed']:.0f} (ratio {cr['median']:.3f}); "
          f"other load {other.cores:.2f} cores", flush=True)
    return out


# -- where the composed path's time goes ----------------------------------------------------
@contextlib.contextmanager
def profiled_threads(prof: cProfile.Profile) -> Any:
    """``prof`` on this thread and on every thread started meanwhile (the decode pools):
    ``threading.setprofile`` installs it in each new thread before its run."""
    def start(*_: Any) -> None:
        sys.setprofile(None)
        prof.enable()

    threading.setprofile(start)
    prof.enable()
    try:
        yield prof
    finally:
        prof.disable()
        threading.setprofile(None)


def profile_epochs(srcs: dict[str, Any], case: str, epochs: int, batch_size: int, seed: int,
                   out: Path) -> dict[str, str]:
    """cProfile (every thread: the loader is built inside the profile so its pools start
    profiled) of ``epochs`` epochs of each loader with ``workers=0``; the top functions by
    own time, written to ``out`` and returned as text."""
    got = {}
    for n in NAMES:
        prof = cProfile.Profile()
        man = ib.split_by_chunk(srcs[n], [1.0], names=["train"])
        with profiled_threads(prof), ib.build_loader(
                srcs[n], man, "train", batch_size=batch_size, seed=seed, workers=0,
                **one_epoch_at_a_time()) as loader:
            for _ in range(epochs):
                epoch_wall_cpu(loader)
        path = out / f"{case}-{n}.prof"
        prof.dump_stats(str(path))
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
        got[n] = s.getvalue()
    return got


def stripe_costs(srcs: dict[str, Any], rounds: int) -> dict[str, Any]:
    """Per stripe, in this thread: ``read_local`` of stripe ``i`` of the one store's first
    variable (``StripeReader``) and of the composed source's (``ComposedReader`` for a
    concat), one right after the other in turns (medians over stripes and ``rounds``
    passes, in microseconds; the difference a median of per-stripe differences). Then what
    the composed reader adds on its own, with the members' reads replaced by a no-op (no
    IO, no noise): its ``read_local`` whole, its ``_straight`` alone, and the member's
    ``read_local_retrying`` wrapper it goes through."""
    from insitubatch_nodes.io.retry import NO_RETRY
    from insitubatch_nodes.io.served import open_reader
    from insitubatch_nodes.io.served.composed import ComposedReader

    one_src, comp_src = srcs["one"], srcs["composed"]
    one = open_reader(one_src.arrays[0], one_src.variables[0], one_src.url)
    comp = open_reader(comp_src.arrays[0], comp_src.variables[0], comp_src.url)
    geom = one_src.variables[0]
    n = -(-geom.shape[0] // geom.sample_chunk)
    buf = np.empty(geom.stripe_shape, geom.dtype)
    readers = {"one": one, "composed": comp}
    ns = {k: np.zeros((rounds, n)) for k in readers}
    clock = time.perf_counter_ns
    for r in range(rounds):
        for i in range(n):
            for k in (NAMES if (r + i) % 2 == 0 else NAMES[::-1]):
                t0 = clock()
                readers[k].read_local(i, buf)
                ns[k][r, i] = clock() - t0
    us = {k: v / 1e3 for k, v in ns.items()}
    out: dict[str, Any] = {
        "stripes": n, "composed_reader": type(comp).__name__,
        "read_local_us": {k: float(np.median(v)) for k, v in us.items()},
        "composed_minus_one_us": float(np.median(us["composed"] - us["one"]))}
    if isinstance(comp, ComposedReader):
        reps = 7

        def per_call(f: Any) -> float:  # the quickest of ``reps`` passes over the stripes
            best = float("inf")
            for _ in range(reps):
                t0 = clock()
                for i in range(n):
                    f(i)
                best = min(best, clock() - t0)
            return best / 1e3 / n

        def noop(*_: Any, **__: Any) -> None:
            return None

        member = comp.members[0]
        for m in comp.members:  # the members' reads stubbed: only the composition is left
            m.read_local = noop  # type: ignore[method-assign]
        out["overhead_us"] = {
            "bare_call": per_call(lambda i: noop(i, buf)),
            "composed_read_local": per_call(lambda i: comp.read_local(i, buf)),
            "_straight": per_call(comp._straight),
            "pieces (cached)": per_call(comp.pieces),
            "member_read_local_retrying": per_call(
                lambda i: member.read_local_retrying([i], [buf], NO_RETRY)),
        }
    return out


def package_revision() -> dict[str, Any]:
    """Which code was measured: the imported package's folder, and its git commit with
    whether its files differ from it (others edit the working tree while benchmarks run)."""
    where = Path(ib.__file__).resolve().parent
    out: dict[str, Any] = {"package": str(where)}
    try:
        git = ["git", "-C", str(where.parent)]
        out["commit"] = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True,
                                       text=True, check=True).stdout.strip()
        out["package_modified"] = bool(subprocess.run(
            [*git, "status", "--porcelain", "--", where.name], capture_output=True, text=True,
            check=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        out["commit"] = None  # an extracted copy (git archive): say which in --note
    return out


# -- the report ----------------------------------------------------------------------------
def table(results: list[dict[str, Any]]) -> str:
    rows = ["| grid | case | workers | composed / one rate, median (IQR) | samples/s one / "
            "composed | CPU us/sample one / composed |", "|---|---|---|---|---|---|"]
    for r in results:
        q, sps, us = r["composed_over_one_rate"], r["samples_per_s"], r["cpu_us_per_sample"]
        rows.append(f"| {r['grid']} | {r['case']} | {r['workers']} | {q['median']:.3f} "
                    f"({q['q1']:.3f}..{q['q3']:.3f}) | {sps['one']:.0f} / "
                    f"{sps['composed']:.0f} | {us['one']:.0f} / {us['composed']:.0f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("bench-out/compose"),
                   help="stores (a folder per grid) and compose.json go here")
    p.add_argument("--grid", action="append", default=None, metavar="LATxLON",
                   help="grid of the stores, repeatable (default 181x360: 1-degree)")
    p.add_argument("--samples", type=int, default=1000, help="steps N of one store")
    p.add_argument("--pairs", type=int, default=7, help="timed epoch pairs, alternating")
    p.add_argument("--workers", type=int, action="append", default=None,
                   help="executors measured, repeatable (default: 0 and 2)")
    p.add_argument("--case", choices=("join", "concat"), action="append", default=None)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reuse", action="store_true", help="keep stores already written alike")
    p.add_argument("--profile", action="store_true",
                   help="also cProfile composed and one-store epochs (workers=0) and time "
                        "the readers per stripe")
    p.add_argument("--small", action="store_true", help="a smoke run: tiny stores, 3 pairs")
    p.add_argument("--note", default=None,
                   help="kept in the JSON: e.g. the commit an extracted package came from")
    a = p.parse_args(argv)
    grids = a.grid or ["181x360"]
    if a.small:
        grids, a.samples, a.pairs = ["16x32"], 64, 3
    if a.pairs < 3:
        p.error(f"--pairs {a.pairs}: a median and IQR need at least 3")
    workers = a.workers or [0, 2]
    cases = a.case or ["join", "concat"]
    machine = print_machine()
    revision = {**package_revision(), "note": a.note}
    print(f"package: {revision}")
    results, profiles = [], {}
    for grid in grids:
        lat, lon = (int(x) for x in grid.lower().split("x"))
        stores = write_stores(a.out / f"g{lat}x{lon}-n{a.samples}", a.samples, lat, lon,
                              a.seed, a.reuse)
        for case in cases:
            srcs = sources(stores, case)
            for w in workers:
                r = compare(srcs, case, w, a.pairs, a.batch_size, a.seed)
                results.append({"grid": grid, **r})
            if a.profile:
                got = profile_epochs(srcs, case, 3, a.batch_size, a.seed, a.out)
                costs = stripe_costs(srcs, 5)
                print(f"{case} per stripe (first variable, read in this thread): "
                      f"{costs}", flush=True)
                for n, text in got.items():
                    print(f"--- cProfile {case} {n}, workers=0, top by own time:\n{text}")
                profiles[f"{grid}/{case}"] = {"stripes": costs, "cprofile": got}
    print(table(results))
    write_json(a.out / "compose.json",
               {"machine": machine, "revision": revision, "argv": sys.argv[1:],
                "samples": a.samples,
                "results": results, "profiles": profiles})
    print(f"wrote {a.out / 'compose.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
