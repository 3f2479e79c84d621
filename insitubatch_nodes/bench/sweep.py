"""Sweeps (``insitubatch bench URL --sweep``): throughput, shuffle quality and peak memory
against samples per chunk, ``block_chunks`` and ``max_inflight``.

- **samples per chunk** (1, 8, 24, 96 by default) on synthetic single-variable stores written
  for the purpose (``synthetic.write_store``: ``spc_samples`` samples of ``t2m``,
  ``spc_sample_shape`` float32, blosc-zstd): the
  same data cut into ever smaller chunks, so what changes is the per-chunk and per-batch
  cost. Windows hold at least ``window_samples`` samples (``block_chunks`` is raised for
  small chunks), as a user of one-sample chunks would configure them. Reported per point:
  loader and read-floor throughput, wall microseconds per chunk end to end, and the
  consumer thread's own (Python) time per batch, i.e. time inside ``next()`` minus the time
  it waited for windows to be fetched (from ``loader.stats()``).
- **block_chunks** and **max_inflight** on the store at ``url``.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

import insitubatch_nodes as ib

from ..synthetic import DemoSpec, write_store
from .common import (
    LoaderSettings,
    OtherLoad,
    RssSampler,
    consume,
    local_path,
    print_machine,
    warm_page_cache,
)
from .floors import StripeFloor

SPLIT = "train"


@dataclass(frozen=True)
class SweepConfig(LoaderSettings):
    block_chunks: int = 16  # the sweep's windows grow from it: a number, never auto
    samples_per_chunk: tuple[int, ...] = (1, 8, 24, 96)
    block_chunks_values: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    max_inflight_values: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    spc_samples: int = 4000
    spc_sample_shape: tuple[int, int] = (64, 64)
    window_samples: int = 256
    epochs: int = 3
    out_dir: Path = Path("bench-out")
    keep_stores: bool = False
    plots: bool = True
    progress: bool = True


def _trim() -> None:
    """Give freed heap back to the OS between points, so RSS growth is per point."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _epochs(loader: ib.InSituLoader, n_batches: int, epochs: int, desc: str,
            key: str, progress: bool, keep_index: bool = False) -> dict[str, Any]:
    """Run ``epochs`` epochs; the best one after the first (or the only one) is reported,
    with its share of the loader's metrics and, if asked, the last epoch's sample_index."""
    best: dict[str, Any] | None = None
    last_index: list[np.ndarray] = []
    ledger = loader.ledger
    assert ledger is not None  # build_loader's loaders have one
    ledger.reset_peak()
    # Polled 4 times a second, not 100: the floor it is compared with runs without a sampler,
    # and each poll takes the GIL from the training thread (the peak is coarser for it).
    with RssSampler(interval_s=0.25) as rss:
        for e in range(epochs):
            before = loader.stats()
            if keep_index and e == epochs - 1:
                t0 = time.perf_counter()
                samples = 0
                for b in loader:
                    last_index.append(b["sample_index"].numpy().copy())
                    samples += len(b["sample_index"])
                secs = time.perf_counter() - t0
            else:
                samples, secs, _, _ = consume(loader, n_batches, f"{desc} epoch {e + 1}", key,
                                              progress)
            s = loader.stats()
            point = {
                "samples": samples, "seconds": secs, "samples_per_s": samples / secs,
                "batches": s.epoch_batches, "starvation": s.starvation,
                "stripes": s.stripes_fetched - before.stripes_fetched,
                "chunks": s.chunks_fetched - before.chunks_fetched,
                "wait_fetch_s": s.wait_fetch_s - before.wait_fetch_s,
                "consumer_s": s.epoch_wait_s,
                "schedule_s": s.schedule_s - before.schedule_s,
                "shuffle_s": s.shuffle_s - before.shuffle_s,
                "gather_s": s.gather_s - before.gather_s,
                "deliver_s": s.deliver_s - before.deliver_s,
            }
            if (e >= 1 or epochs == 1) and (best is None or secs < best["seconds"]):
                best = point
    assert best is not None
    best["python_s"] = max(0.0, best["consumer_s"] - best["wait_fetch_s"])
    best["rss_growth_bytes"] = rss.growth
    best["rss_peak_bytes"] = rss.peak
    best["ledger_peak_bytes"] = ledger.peak
    best["resident_bound_bytes"] = loader.resident_bound
    best["shuffle_quality"] = loader.shuffle_quality
    best["last_epoch_index"] = last_index
    return best


def sweep_samples_per_chunk(cfg: SweepConfig) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from tqdm import tqdm

    work = cfg.out_dir / "sweep-stores"
    work.mkdir(parents=True, exist_ok=True)
    height, width = cfg.spc_sample_shape
    points = []
    for spc in tqdm(cfg.samples_per_chunk, desc="sweep: samples per chunk", file=sys.stderr,
                    disable=not cfg.progress):
        path = work / f"spc{spc}.zarr"
        write_store(path, DemoSpec(n_times=cfg.spc_samples, n_lat=height, n_lon=width,
                                   time_chunk=spc, seed=cfg.seed, variables=("t2m",),
                                   coords=False), progress=False)
        warm_page_cache(path)
        _trim()
        source = ib.open_source(path)
        manifest = ib.split_by_chunk(source, fractions=(1.0,), seed=cfg.seed)
        n_chunks = source.grid.n_chunks
        bc = max(cfg.block_chunks, math.ceil(cfg.window_samples / spc))
        floor = StripeFloor(source, manifest.chunk_ids(SPLIT), min(4, _cores()),
                            cfg.max_inflight)
        floor_s = min(floor.run_pass() for _ in range(3))
        floor.close()
        n_batches = -(-source.n_samples // cfg.batch_size)
        with ib.build_loader(source, manifest, SPLIT,
                             **{**cfg.loader_kwargs(), "block_chunks": bc}) as loader:
            p = _epochs(loader, n_batches, cfg.epochs, f"spc {spc}", source.names[0],
                        cfg.progress)
        p.pop("last_epoch_index")
        p.update({
            "samples_per_chunk": spc, "block_chunks": bc, "n_chunks": n_chunks,
            "floor_seconds": floor_s, "floor_samples_per_s": source.n_samples / floor_s,
            "ratio_to_floor": floor_s / p["seconds"],
            "us_per_chunk": 1e6 * p["seconds"] / n_chunks,
            "floor_us_per_chunk": 1e6 * floor_s / n_chunks,
            "python_us_per_batch": 1e6 * p["python_s"] / p["batches"],
            "python_us_per_stripe": 1e6 * p["python_s"] / max(1, p["stripes"]),
        })
        points.append(p)
        if not cfg.keep_stores:
            import shutil

            shutil.rmtree(path, ignore_errors=True)
    info = {"n_samples": cfg.spc_samples, "sample_shape": "x".join(map(str, cfg.spc_sample_shape)),
            "window_samples": cfg.window_samples, "dir": str(work)}
    return points, info


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0))


def sweep_knob(cfg: SweepConfig, source: ib.Source, manifest: ib.SplitManifest, knob: str,
               values: tuple[int, ...]) -> list[dict[str, Any]]:
    from tqdm import tqdm

    n_batches = -(-manifest.n_samples_in(SPLIT) // cfg.batch_size)
    points = []
    for value in tqdm(values, desc=f"sweep: {knob}", file=sys.stderr, disable=not cfg.progress):
        kw = {"block_chunks": cfg.block_chunks, "max_inflight": cfg.max_inflight, knob: value}
        _trim()
        with ib.build_loader(source, manifest, SPLIT, **{**cfg.loader_kwargs(), **kw}) as loader:
            p = _epochs(loader, n_batches, cfg.epochs, f"{knob}={value}", source.names[0],
                        cfg.progress, keep_index=True)
        idx = p.pop("last_epoch_index")
        measured = None
        if len(idx) > 1 and len(manifest.chunk_ids(SPLIT)) > 1:
            measured = ib.measured_shuffle_quality(idx, source.grid.chunk_size,
                                                   len(manifest.chunk_ids(SPLIT)))
        p.update({knob: value, "measured_shuffle_quality": measured, **kw})
        points.append(p)
    return points


def format_sweep(result: dict[str, Any]) -> str:
    out = []
    spc = result.get("samples_per_chunk") or []
    if spc:
        out.append(f"{'samples/chunk':>13} {'chunks':>6} {'blk':>4} {'samples/s':>9} "
                   f"{'x floor':>7} {'us/chunk':>8} {'floor us/chunk':>14} {'py us/batch':>11} "
                   f"{'py us/stripe':>12} {'quality':>7}")
        for p in spc:
            out.append(f"{p['samples_per_chunk']:>13} {p['n_chunks']:>6} {p['block_chunks']:>4} "
                       f"{p['samples_per_s']:>9,.0f} {p['ratio_to_floor']:>7.2f} "
                       f"{p['us_per_chunk']:>8.0f} {p['floor_us_per_chunk']:>14.0f} "
                       f"{p['python_us_per_batch']:>11.0f} {p['python_us_per_stripe']:>12.1f} "
                       f"{p['shuffle_quality']:>7.2f}")
    for knob in ("block_chunks", "max_inflight"):
        pts = result.get(knob) or []
        if not pts:
            continue
        out.append("")
        out.append(f"{knob:>13} {'samples/s':>9} {'quality':>7} {'measured':>8} "
                   f"{'resident MB':>11} {'bound MB':>8} {'RSS+ MB':>7} {'starved':>7}")
        for p in pts:
            m = p["measured_shuffle_quality"]
            out.append(f"{p[knob]:>13} {p['samples_per_s']:>9,.0f} {p['shuffle_quality']:>7.2f} "
                       f"{'-' if m is None else format(m, '.2f'):>8} "
                       f"{p['ledger_peak_bytes'] / 1e6:>11,.0f} "
                       f"{p['resident_bound_bytes'] / 1e6:>8,.0f} "
                       f"{p['rss_growth_bytes'] / 1e6:>7,.0f} {100 * p['starvation']:>6.0f}%")
    return "\n".join(out)


def run_sweep(cfg: SweepConfig) -> dict[str, Any]:
    """Run the three sweeps, print their tables, write ``sweep.json`` and PNG plots."""
    t0 = time.perf_counter()
    other = OtherLoad().__enter__()
    machine = print_machine()
    source = ib.open_source(cfg.url, variables=cfg.variables)
    root = local_path(cfg.url)
    if root is not None:
        warm_page_cache(root)
    manifest = ib.split_by_chunk(source, fractions=(1.0,), seed=cfg.seed)
    result: dict[str, Any] = {
        "machine": machine,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        "store": {"url": source.url, "variables": list(source.names),
                  "samples_per_chunk": source.grid.chunk_size, "n_samples": source.n_samples,
                  "sample_nbytes": source.sample_nbytes},
    }
    if cfg.samples_per_chunk:
        result["samples_per_chunk"], result["spc_store"] = sweep_samples_per_chunk(cfg)
    if cfg.block_chunks_values:
        result["block_chunks"] = sweep_knob(cfg, source, manifest, "block_chunks",
                                            cfg.block_chunks_values)
    if cfg.max_inflight_values:
        result["max_inflight"] = sweep_knob(cfg, source, manifest, "max_inflight",
                                            cfg.max_inflight_values)
    result["total_seconds"] = time.perf_counter() - t0
    cores = other.stop()
    result["other_load_cores"] = cores
    print()
    print(format_sweep(result))
    print(f"\ntotal sweep time {result['total_seconds']:.1f} s; other processes used "
          f"{cores:.2f} cores on average meanwhile"
          + (" -- the machine was busy; rerun when it is quiet" if cores > 0.25 else ""))
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    path = cfg.out_dir / "sweep.json"
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {path}")
    if cfg.plots:
        from .plots import plot_sweep

        for png in plot_sweep(result, cfg.out_dir):
            print(f"wrote {png}")
    return result
