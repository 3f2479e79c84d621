"""Core benchmark: the insitubatch loader against a naive DataLoader and the read floor.

``insitubatch bench URL`` (``python -m benchmarks.bench_core`` runs it on its own synthetic
store). Everything runs in one process on one store, with a warm page cache for local
stores, so the numbers compare as ratios: the loader should approach the
*read floor* (every stripe of the split fetched and decoded once, concurrently, unshuffled,
on the library's best path) and beat the per-sample ``DataLoader`` people write today by an
order of magnitude. Also measured: peak RSS, time to first batch (fresh and after resume),
and the loader's own metrics (``loader.stats()``) per epoch. Run one epoch after each of the
loader's, and reported as ratios ours/path paired per epoch: the loader stacking channels
(``channels``) and the peers (``peers.py``: zarr-beluga, tensorstore; local stores).

This module runs them in order; each path is timed in its own module (``floors``,
``loader_epochs``, ``first_batch``, ``naive``, ``peers``) and ``core_report`` and
``core_summary`` make the report. Their names stay importable from here.
"""


from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

import insitubatch_nodes as ib

from .common import OtherLoad, bench_manifest, local_path, print_machine, warm_page_cache
from .core_config import CHANNELS_LABEL, RSS_SLACK, SPLIT, CoreConfig
from .core_report import (
    CoreRuns,
    core_result,
    format_markdown,
    format_stacking,
    format_table,
    naive_target,
    stacking_summary,
    steady_state,
    table_row,
    write_outputs,
)
from .core_summary import print_loader_details, print_summary
from .first_batch import alternating_first_batches, time_first_batch
from .floors import GatherFloor, StripeFloor, time_zarr_floor
from .loader_epochs import (
    Follower,
    LoaderEpochs,
    loader_block_chunks,
    probe_loader_rss,
    time_loader,
)
from .naive import PerSampleZarr, time_naive
from .peers import PeerEpochs, open_peers, peer_results

__all__ = ["CHANNELS_LABEL", "RSS_SLACK", "SPLIT", "CoreConfig", "CoreRuns", "Follower",
           "GatherFloor", "LoaderEpochs", "PerSampleZarr", "StripeFloor",
           "alternating_first_batches", "core_result", "format_markdown", "format_stacking",
           "format_table", "loader_block_chunks", "naive_target", "open_store",
           "probe_loader_rss", "run_core", "stacking_summary", "steady_state", "table_row",
           "time_first_batch", "time_loader", "time_naive", "time_paths", "time_zarr_floor",
           "write_outputs"]


def open_store(cfg: CoreConfig) -> tuple[ib.Source, Path | None, dict[str, Any]]:
    """The store to measure, its local folder (``None``: remote) and what the report says
    of it; a local store's page cache is warmed first, so every path reads it alike."""
    source = ib.open_source(cfg.url, variables=cfg.variables)
    root = local_path(cfg.url)
    store_info: dict[str, Any] = {"url": source.url}
    if root is not None:
        nbytes, secs = warm_page_cache(root)
        store_info["disk_bytes"] = nbytes
        print(f"store {source.url}: {nbytes / 1e6:,.0f} MB on disk; page cache warmed in "
              f"{secs:.2f} s")
    store_info["decoded_bytes"] = source.n_samples * source.sample_nbytes
    return source, root, store_info


def _warm_floors(source: ib.Source, manifest: ib.SplitManifest,
                 cfg: CoreConfig) -> list[StripeFloor | GatherFloor]:
    """The read floor, and on local stores the floor plus one gather copy (in windows of
    the loader's ``block_chunks``), each past two warm-up passes."""
    chunk_ids = manifest.chunk_ids(SPLIT)
    floor_ring = StripeFloor(source, chunk_ids, cfg.floor_threads, cfg.max_inflight)
    floors: list[StripeFloor | GatherFloor] = [floor_ring]
    if floor_ring.local:
        block_chunks = cfg.block_chunks or loader_block_chunks(source, manifest, cfg)
        floors.append(GatherFloor(source, chunk_ids, cfg.floor_threads, block_chunks,
                                  cfg.batch_size, cfg.seed))
    for _ in range(2):  # warm-up passes: thread start, first-touch of code and caches
        for fl in floors:
            fl.run_pass()
    return floors


def _time_naive_paths(source: ib.Source, manifest: ib.SplitManifest,
                      cfg: CoreConfig) -> tuple[dict[int, Any], int]:
    """The naive DataLoader per worker count, over one random subset of the split (bounded
    time: its rate per sample does not depend on the subset's size); and that size."""
    rng = np.random.default_rng(cfg.seed)
    pool = source.grid.samples_of(manifest.chunk_ids(SPLIT))
    subset = rng.choice(pool, size=min(cfg.naive_samples, pool.size), replace=False)
    naive = {w: time_naive(source, cfg.url, subset, cfg.batch_size, w, cfg.progress)
             for w in cfg.naive_workers}
    return naive, int(subset.size)


def time_paths(source: ib.Source, manifest: ib.SplitManifest, root: Path | None,
               cfg: CoreConfig) -> CoreRuns:
    """Every path, in the order that keeps them fair: the loader's epochs, each between a
    floor pass and the followers' epochs; then first batches, the loader's memory alone,
    the naive DataLoaders and zarr's read."""
    grid, chunk_ids = source.grid, manifest.chunk_ids(SPLIT)
    n_split, nbytes_s = manifest.n_samples_in(SPLIT), source.sample_nbytes
    floors = _warm_floors(source, manifest, cfg)
    followers: list[Follower] = []
    stack = None
    if cfg.channels:
        stack = LoaderEpochs(source, manifest, cfg, CHANNELS_LABEL, channels=list(cfg.channels))
        followers.append(stack)
    passes, missing = open_peers(root, source, cfg.peers, cfg.beluga_modes, cfg.batch_size)
    peers = PeerEpochs(passes, grid.samples_of(chunk_ids), cfg.seed)
    followers.append(peers)
    try:
        loader_runs = time_loader(source, manifest, cfg, floors, followers)
    finally:
        for fl in floors:
            fl.close()
        peers.close()
        if stack is not None:
            stack.close()
    ours = {"per_variable": {i: r.seconds for i, r in enumerate(loader_runs, 1)}}
    if stack is not None:
        ours["channels"] = stack.seconds
    peer_rows = peer_results(peers, missing, n_split, nbytes_s, ours)
    stripe = floors[0].result(f"read floor: StripeReader, {cfg.floor_threads} threads",
                              n_split, nbytes_s)
    gfloor = (floors[1].result("read floor + one gather copy", n_split, nbytes_s)
              if len(floors) > 1 else None)
    ttfb = time_first_batch(source, manifest, cfg)
    probe = probe_loader_rss(cfg, source.names)
    naive, subset = _time_naive_paths(source, manifest, cfg)
    rows = [slice(a * grid.chunk_size, min(b * grid.chunk_size, grid.n_samples))
            for a, b in manifest.ranges(SPLIT)]
    zfloor = time_zarr_floor(source, rows, n_split, cfg.repeats)
    return CoreRuns(loader=loader_runs, stack=stack, stripe=stripe, gather=gfloor, zarr=zfloor,
                    naive=naive, naive_subset=subset, peer_rows=peer_rows, first_batch=ttfb,
                    probe=probe)


def run_core(cfg: CoreConfig) -> dict[str, Any]:
    """Run every path on ``cfg.url``; print the table, write JSON (and PNG plots)."""
    t_start = time.perf_counter()
    whole = OtherLoad().__enter__()
    machine = print_machine()
    source, root, store_info = open_store(cfg)
    manifest = bench_manifest(source, cfg.split_fraction, cfg.seed)
    runs = time_paths(source, manifest, root, cfg)
    result = core_result(cfg, machine, source, manifest, store_info, runs)
    print_summary(result, runs, cfg)
    print_loader_details(result, runs)
    total = time.perf_counter() - t_start
    cores = whole.stop()
    result["total_seconds"] = total
    result["other_load_cores"] = cores
    print(f"total benchmark time {total:.1f} s; other processes used {cores:.2f} cores "
          "on average meanwhile"
          + (" -- the machine was busy, numbers are pessimistic; rerun when it is quiet"
             if cores > 0.25 else ""))
    write_outputs(result, cfg)
    return result
