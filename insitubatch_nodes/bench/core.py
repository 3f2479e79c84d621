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
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import queue
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

import insitubatch_nodes as ib
from insitubatch_nodes.io.reader import StripeReader
from insitubatch_nodes.metrics.collect import LoaderStats

from . import BELUGA_MODES, PEER_NAMES
from .common import (
    LoaderSettings,
    OtherLoad,
    RssSampler,
    Run,
    bench_manifest,
    consume,
    fmt,
    local_path,
    one_epoch_at_a_time,
    print_machine,
    rotated,
    usage,
    usage_extra,
    warm_page_cache,
)
from .peers import (
    PeerEpochs,
    format_peers,
    format_peers_markdown,
    open_peers,
    paired_ratio,
    peer_results,
    peer_runs,
    warm_epochs,
)

SPLIT = "train"
CHANNELS_LABEL = "insitubatch loader, channels"
RSS_SLACK = 400 * 10**6  # target: peak RSS <= resident bound + this


@dataclass(frozen=True)
class CoreConfig(LoaderSettings):
    """What ``run_core`` measures; the CLI fills it from its options."""

    epochs: int = 5
    naive_samples: int = 1500
    naive_workers: tuple[int, ...] = (0, 2)
    floor_threads: int = field(default_factory=lambda: min(4, os.cpu_count() or 2))
    repeats: int = 3
    split_fraction: float = 1.0
    resume_after: int = 10
    out_dir: Path = Path("bench-out")
    json_name: str = "core.json"
    plots: bool = True
    progress: bool = True
    channels: tuple[str, ...] = ()  # also run the loader stacking these into "channels"
    peers: tuple[str, ...] = PEER_NAMES
    beluga_modes: tuple[str, ...] = BELUGA_MODES


# -- the read floors ----------------------------------------------------------------------
def _split_jobs(source: ib.Source, chunk_ids: np.ndarray) -> list[tuple[int, int]]:
    """(variable, stripe) reads that cover the split's chunks, each once."""
    samples = source.grid.samples_of(chunk_ids)
    return [(v, int(i)) for v, g in enumerate(source.variables)
            for i in np.unique(samples // g.sample_chunk)]


class StripeFloor:
    """Every stripe of the split fetched and decoded once, unshuffled, on the library's best
    path: ``StripeReader.read_local`` as one thread task per stripe for local stores, else the
    reader's async path with ``max_inflight`` reads in flight.

    Stripes decode into a small pool of pre-touched buffers, so page faults of new memory
    stay out of the floor.
    """

    def __init__(self, source: ib.Source, chunk_ids: np.ndarray, threads: int,
                 max_inflight: int = 32) -> None:
        self.readers = [StripeReader(a, g, source.url)
                        for a, g in zip(source.arrays, source.variables, strict=True)]
        self.local = all(r.mode == "local" for r in self.readers)
        self.jobs = _split_jobs(source, chunk_ids)
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="floor")
        self.max_inflight = max_inflight
        n_bufs = 2 * threads if self.local else max_inflight + threads
        self._free: list[queue.SimpleQueue[np.ndarray]] = []
        for g in source.variables:
            q: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()
            for _ in range(n_bufs):  # more buffers than readers: get() never blocks
                q.put(np.ones(g.stripe_shape, g.dtype))
            self._free.append(q)
        self.seconds: list[float] = []
        self.usage: list[np.ndarray] = []

    @property
    def mode(self) -> str:
        return "/".join(sorted({r.mode for r in self.readers}))

    def _task(self, job: tuple[int, int]) -> None:
        v, idx = job
        buf = self._free[v].get()
        try:
            self.readers[v].read_local(idx, buf)
        finally:
            self._free[v].put(buf)

    async def _async_pass(self) -> None:
        loop = asyncio.get_running_loop()
        sem = asyncio.Semaphore(self.max_inflight)

        async def one(v: int, idx: int) -> None:
            async with sem:
                buf = self._free[v].get()
                try:
                    await self.readers[v].read(idx, buf, loop, self.pool)
                finally:
                    self._free[v].put(buf)

        await asyncio.gather(*(one(v, i) for v, i in self.jobs))

    def run_pass(self) -> float:
        u0, t0 = usage(), time.perf_counter()
        if self.local:
            list(self.pool.map(self._task, self.jobs))
        else:
            asyncio.run(self._async_pass())
        self.seconds.append(time.perf_counter() - t0)
        self.usage.append(usage() - u0)
        return self.seconds[-1]

    def result(self, name: str, n_samples: int, sample_nbytes: int) -> Run:
        """The best pass (least disturbed by the machine's noise), with all passes kept."""
        best = int(np.argmin(self.seconds))
        return Run(name, n_samples, self.seconds[best], sample_nbytes,
                   cpu_s=float(self.usage[best][0]),
                   extra={**usage_extra(self.usage[best]), "mode": self.mode,
                          "all_seconds": self.seconds,
                          "decoder": [r.decoder.chain if r.decoder else None
                                      for r in self.readers]})

    def close(self) -> None:
        self.pool.shutdown(wait=True)


class GatherFloor:
    """The read floor plus the one copy every shuffling loader must make: each sample copied
    once, in shuffled batches, from the decoded stripes into ``HELD`` batch buffers per
    variable, in turn (local stores only).

    Stripes decode (``read_local``, as in ``StripeFloor``) in windows of ``block_chunks`` on
    ``threads`` pool threads, two windows ahead, while the main thread gathers the current
    window: per batch, sorted draws, one ``np.take(out=, mode="clip")`` per stripe run per
    variable, as ``GatherNode`` does. Draw plans are built up front, so no Python glue is
    timed; three window slots of pre-touched stripe buffers are reused, so no page faults are.

    Batches go to ``HELD`` output buffers in turn: a training loop holds the batch it was
    given while the next one is made, so no loader can write batch k + 1 over batch k. One
    buffer reused for every batch would stay in the CPU cache (8 MB batches of the t2m
    store, 32 MB of L3 on the benchmark machine) and make the copy cheaper than any loader
    that hands out batches can make it.
    """

    AHEAD = 2  # windows decoding while one is gathered (the loader's prefetch_windows, 2)
    HELD = 2  # batches alive at once: the one the consumer holds, the one being made

    def __init__(self, source: ib.Source, chunk_ids: np.ndarray, threads: int,
                 block_chunks: int, batch_size: int, seed: int) -> None:
        self.readers = [StripeReader(a, g, source.url)
                        for a, g in zip(source.arrays, source.variables, strict=True)]
        grid, geoms = source.grid, source.variables
        rng = np.random.default_rng(seed)
        ids = rng.permutation(np.asarray(chunk_ids, dtype=np.int64))
        windows = [ids[i:i + block_chunks] for i in range(0, ids.size, block_chunks)]
        # jobs[w] = [(v, stripe, slot position)], plans[w][b][v] = [(pos, offs, start, stop)]
        self.jobs: list[list[tuple[int, int, int]]] = []
        self.plans: list[list[list[list[tuple[int, np.ndarray, int, int]]]]] = []
        most = [0] * len(geoms)
        for win in windows:
            samples = grid.samples_of(win)
            draws = samples[rng.permutation(samples.size)]
            pos: list[dict[int, int]] = []
            jobs = []
            for v, g in enumerate(geoms):
                stripes = np.unique(samples // g.sample_chunk).tolist()
                pos.append({s: j for j, s in enumerate(stripes)})
                jobs += [(v, s, j) for j, s in enumerate(stripes)]
                most[v] = max(most[v], len(stripes))
            batches = []
            for b0 in range(0, draws.size, batch_size):
                s = np.sort(draws[b0:b0 + batch_size])
                per_var = []
                for v, g in enumerate(geoms):
                    stripe = s // g.sample_chunk
                    cuts = (np.flatnonzero(np.diff(stripe)) + 1).tolist()
                    per_var.append([(pos[v][int(stripe[a])],
                                     (s[a:b] - stripe[a] * g.sample_chunk).astype(np.intp), a, b)
                                    for a, b in zip([0, *cuts], [*cuts, s.size], strict=True)])
                batches.append(per_var)
            self.jobs.append(jobs)
            self.plans.append(batches)
        self.slots = [[[np.ones(g.stripe_shape, g.dtype) for _ in range(most[v])]
                       for v, g in enumerate(geoms)] for _ in range(self.AHEAD + 1)]
        self.outs = [[np.ones((batch_size, *g.sample_shape), g.dtype) for g in geoms]
                     for _ in range(self.HELD)]
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="gfloor")
        self.seconds: list[float] = []
        self.usage: list[np.ndarray] = []

    mode = "local"

    def _submit(self, w: int) -> list[Any]:
        bufs = self.slots[w % len(self.slots)]
        return [self.pool.submit(self.readers[v].read_local, s, bufs[v][j])
                for v, s, j in self.jobs[w]]

    def run_pass(self) -> float:
        u0, t0 = usage(), time.perf_counter()
        n_win, acc, k = len(self.plans), 0.0, 0
        futs = {w: self._submit(w) for w in range(min(self.AHEAD, n_win))}
        for w in range(n_win):
            for f in futs.pop(w):
                f.result()
            if w + self.AHEAD < n_win:  # its slot held window w - 1, gathered already
                futs[w + self.AHEAD] = self._submit(w + self.AHEAD)
            bufs = self.slots[w % len(self.slots)]
            for per_var in self.plans[w]:
                outs = self.outs[k % self.HELD]
                k += 1
                for v, parts in enumerate(per_var):
                    out, src = outs[v], bufs[v]
                    for j, offs, a, b in parts:
                        np.take(src[j], offs, axis=0, out=out[a:b], mode="clip")
                acc += float(outs[0].reshape(-1)[0])
        self.seconds.append(time.perf_counter() - t0)
        self.usage.append(usage() - u0)
        return self.seconds[-1]

    result = StripeFloor.result

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def time_zarr_floor(source: ib.Source, rows: Sequence[slice], n_samples: int,
                    repeats: int) -> Run:
    """zarr's own whole-array read, for reference (it allocates its output afresh)."""
    import zarr

    times, used = [], []
    for _ in range(repeats):
        u0, t0 = usage(), time.perf_counter()
        for arr in source.arrays:
            for sl in rows:
                out = arr[sl]
                del out
        times.append(time.perf_counter() - t0)
        used.append(usage() - u0)
    best = int(np.argmin(times))
    return Run("zarr arr[:]", n_samples, times[best], source.sample_nbytes,
               cpu_s=float(used[best][0]),
               extra={**usage_extra(used[best]), "all_seconds": times,
                      "async.concurrency": zarr.config.get("async.concurrency")})


# -- the insitubatch loader ---------------------------------------------------------------
def _stats_extra(s: LoaderStats, before: LoaderStats | None) -> dict:
    """One epoch's share of the loader's metrics (consumer times are lifetime counters)."""
    def d(name: str) -> float:
        return getattr(s, name) - (getattr(before, name) if before is not None else 0)

    return {"starvation": s.starvation, "epoch_wait_s": s.epoch_wait_s,
            "consumer_wait_fetch_s": d("wait_fetch_s"), "consumer_schedule_s": d("schedule_s"),
            "consumer_shuffle_s": d("shuffle_s"), "consumer_gather_s": d("gather_s"),
            "consumer_deliver_s": d("deliver_s"), "fetch_store_s": d("store_s"),
            "fetch_decode_s": d("decode_s"), "fetch_pool_wait_s": d("pool_wait_s"),
            "fetch_slot_wait_s": d("slot_wait_s"), "bytes_fetched": d("bytes_fetched"),
            "bytes_delivered": d("bytes_delivered"), "stripes_fetched": d("stripes_fetched"),
            "batches": s.epoch_batches, "peak_stripes_in_flight": s.peak_stripes_in_flight}


class LoaderEpochs:
    """One loader run an epoch at a time (``run_epoch``), each epoch a ``Run`` with its share
    of the loader's metrics: the benchmark's loader, and the same loader stacking channels
    when the run compares the two."""

    def __init__(self, source: ib.Source, manifest: ib.SplitManifest, cfg: CoreConfig,
                 label: str = "insitubatch loader", **overrides: Any) -> None:
        self.loader = ib.build_loader(source, manifest, SPLIT,
                                      **{**cfg.loader_kwargs(), **one_epoch_at_a_time(),
                                         **overrides})
        self.label, self.cfg = label, cfg
        self.sample_nbytes = source.sample_nbytes
        self.n_batches = -(-manifest.n_samples_in(SPLIT) // cfg.batch_size)
        self.key = "channels" if overrides.get("channels") else source.names[0]
        self.runs: list[Run] = []
        self._before: LoaderStats | None = None

    @property
    def seconds(self) -> dict[int, float]:
        """Epoch number -> seconds, for pairing with the paths run beside it."""
        return {i: r.seconds for i, r in enumerate(self.runs, 1)}

    def run_epoch(self, epoch: int, paired: dict[str, Any] | None = None) -> Run:
        loader = self.loader
        fetch = loader.node(ib.AsyncFetchNode)
        loader.ledger.reset_peak()
        # No polling thread in a timed epoch (floors and peers have none); the loader's
        # memory is measured alone in a fresh process (rss_probe).
        with RssSampler(poll=False) as rss, OtherLoad() as other:
            samples, secs, first, used = consume(loader, self.n_batches,
                                                 f"{self.label} epoch {epoch}", self.key,
                                                 self.cfg.progress)
        stats = loader.stats()
        run = Run(f"{self.label}, epoch {epoch}", samples, secs, self.sample_nbytes, first,
                  float(used[0]), rss.peak, rss.growth,
                  extra={**usage_extra(used), "ledger_peak_bytes": loader.ledger.peak,
                         "resident_bound_bytes": loader.resident_bound, **(paired or {}),
                         "decode_threads": fetch.decode_threads,
                         "block_chunks": loader.node(ib.ChunkPermuteNode).block_chunks,
                         "shuffle_quality": loader.shuffle_quality,
                         "other_load_cores": other.cores,
                         **_stats_extra(stats, self._before)})
        self._before = stats
        self.runs.append(run)
        return run

    def close(self) -> None:
        self.loader.shutdown()


class Follower(Protocol):
    """A path run for one epoch right after each of the loader's (``run_epoch(epoch)``)."""

    def run_epoch(self, epoch: int) -> Any: ...


def time_loader(source: ib.Source, manifest: ib.SplitManifest, cfg: CoreConfig,
                floors: Sequence[StripeFloor | GatherFloor],
                followers: Sequence[Follower] = ()) -> list[Run]:
    """Consecutive epochs on one loader, each right after a pass of the floors and right
    before one epoch of each follower (the channel-stacking loader, the peers): epoch 1
    includes the loop/pool start-up, later ones are the steady state a training run sees,
    and running the paths back to back per epoch makes their ratios robust to a drifting
    VM speed."""
    main = LoaderEpochs(source, manifest, cfg)
    try:
        for epoch in range(1, cfg.epochs + 1):
            paired = [f.run_pass() for f in floors]
            main.run_epoch(epoch, {"paired_floor_s": paired[0] if paired else None,
                                   "paired_gather_floor_s": paired[1] if len(paired) > 1
                                   else None})
            for f in followers:
                f.run_epoch(epoch)
    finally:
        main.close()
    return main.runs


def time_first_batch(source: ib.Source, manifest: ib.SplitManifest, cfg: CoreConfig,
                     repeats: int = 3, build: Callable[..., Any] | None = None,
                     **overrides: Any) -> dict[str, Any]:
    """Seconds from building a loader to holding its first batch: fresh, and resumed from a
    state taken after ``resume_after`` batches, at most half the epoch's (build a loader,
    take k batches, save the state, build a fresh loader, load it, time the first batch).
    Best of ``repeats``.

    Each loader is collected before the next clock starts: a resumed job is a fresh process,
    and freeing the last loader's windows inside the timing (a cyclic GC and hundreds of MB
    unmapped) doubled the medians on 178 MB windows. ``overrides``: more ``build_loader``
    keywords (``benchmarks/bench_variants.py`` times its variants with them); ``build``:
    another ``build_loader`` (another version's, ``benchmarks/bench_revisions.py``)."""
    build = build if build is not None else ib.build_loader
    kw = {**cfg.loader_kwargs(), **overrides}
    # At most halfway through the full batches: the batch timed after the restore is a full
    # one, not the epoch's short last batch (which a 200-step store's 10 batches in were).
    full = manifest.n_samples_in(SPLIT) // cfg.batch_size
    k = max(1, min(cfg.resume_after, (full - 1) // 2))
    with build(source, manifest, SPLIT, **kw) as loader:
        it = iter(loader)
        for _ in range(k):
            next(it)
        state = loader.state_dict()

    def once(resume: bool) -> tuple[float, float]:
        gc.collect()  # the previous loader's memory goes now, not inside the timing
        t0 = time.perf_counter()
        with build(source, manifest, SPLIT, **kw) as fresh:
            if resume:
                fresh.load_state_dict(state)
            t1 = time.perf_counter()
            next(iter(fresh))
            t2 = time.perf_counter()
        return t2 - t0, t1 - t0

    fresh = [once(False) for _ in range(repeats)]
    resumed = [once(True) for _ in range(repeats)]
    return {"first_batch_s": min(t for t, _ in fresh),
            "first_batch_after_resume_s": min(t for t, _ in resumed),
            "build_s": min(b for _, b in fresh), "resume_after_batches": k,
            "state_json_bytes": len(json.dumps(state)),
            "all_fresh_s": [t for t, _ in fresh], "all_resumed_s": [t for t, _ in resumed]}


def alternating_first_batches(timers: Mapping[str, Callable[[], dict[str, Any]]],
                              rounds: int) -> dict[str, dict[str, list[float]]]:
    """First batches of several loaders side by side: each ``timers[name]()`` is one
    ``time_first_batch`` (``repeats=1``), called ``rounds`` times in rotating order so a
    drifting VM touches every loader alike. Name -> {"fresh": [...], "resumed": [...]}."""
    out: dict[str, dict[str, list[float]]] = {n: {"fresh": [], "resumed": []}
                                              for n in timers}
    for r in range(rounds):
        for n in rotated(list(timers), r):
            t = timers[n]()
            out[n]["fresh"].append(t["first_batch_s"])
            out[n]["resumed"].append(t["first_batch_after_resume_s"])
    return out


# -- the naive per-sample DataLoader ------------------------------------------------------
class PerSampleZarr:
    """What people write today: one zarr ``getitem`` (a whole chunk decoded) per sample and
    variable. Arrays are opened lazily, so each worker process opens its own store."""

    def __init__(self, url: str, variables: Sequence[str], n: int) -> None:
        self.url = url
        self.variables = list(variables)
        self.n = n
        self._arrays: tuple | None = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        import torch

        if self._arrays is None:
            self._arrays = ib.open_source(self.url, variables=self.variables).arrays
        return {name: torch.from_numpy(np.asarray(arr[int(i)]))
                for name, arr in zip(self.variables, self._arrays, strict=True)}


def time_naive(source: ib.Source, url: str, indices: np.ndarray, batch_size: int,
               workers: int, progress: bool = True) -> Run:
    """Shuffled per-sample DataLoader over a random subset of the split (bounded time); the
    rate per sample is what matters, and it does not depend on the subset's size."""
    import torch
    import torch.utils.data as tud

    local = local_path(url) is not None
    ds = PerSampleZarr(url, source.names, source.n_samples)
    subset = tud.Subset(ds, indices.tolist())  # type: ignore[arg-type]
    # obstore clients hang in forked children: remote stores need spawned workers.
    ctx = ("fork" if local else "spawn") if workers else None
    dl = tud.DataLoader(subset, batch_size=batch_size, shuffle=True, num_workers=workers,
                        multiprocessing_context=ctx, generator=torch.Generator().manual_seed(0))
    n_batches = -(-len(indices) // batch_size)
    with RssSampler(children=True) as rss, OtherLoad() as other:
        samples, secs, first, used = consume(dl, n_batches, f"naive {workers} workers",
                                             source.names[0], progress)
    return Run(f"naive DataLoader, {workers} workers", samples, secs, source.sample_nbytes,
               first, float(used[0]), rss.peak, rss.growth,
               extra={**usage_extra(used), "subset_samples": len(indices),
                      "start_method": ctx, "other_load_cores": other.cores})


# -- report -------------------------------------------------------------------------------
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


def _row(run: Run, floor: Run, naive2: Run | None, gfloor: Run | None) -> dict[str, Any]:
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


def probe_loader_rss(cfg: CoreConfig, variables: Sequence[str]) -> dict[str, Any]:
    """Peak RSS of the loader alone, in a fresh process (``rss_probe``)."""
    # the same split as the rest of the report
    kw = {**cfg.loader_kwargs(), "variables": list(variables),
          "split_fraction": cfg.split_fraction}
    out = subprocess.run([sys.executable, "-m", "insitubatch_nodes.bench.rss_probe", cfg.url,
                          json.dumps(kw), "2"], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def loader_block_chunks(source: ib.Source, manifest: ib.SplitManifest, cfg: CoreConfig) -> int:
    """The ``block_chunks`` the loader picks when the benchmark leaves it to it (``auto``),
    so the gather floor shuffles in windows of the same size."""
    with ib.build_loader(source, manifest, SPLIT, **cfg.loader_kwargs()) as loader:
        return int(loader.node(ib.ChunkPermuteNode).block_chunks)


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


def _naive_target(chunk_size: int) -> float | None:
    return {8: 10.0, 24: 25.0}.get(chunk_size)


def run_core(cfg: CoreConfig) -> dict[str, Any]:
    """Run every path on ``cfg.url``; print the table, write JSON (and PNG plots)."""
    t_start = time.perf_counter()
    whole = OtherLoad().__enter__()
    machine = print_machine()
    source = ib.open_source(cfg.url, variables=cfg.variables)
    root = local_path(cfg.url)
    store_info: dict[str, Any] = {"url": source.url}
    if root is not None:
        nbytes, secs = warm_page_cache(root)
        store_info["disk_bytes"] = nbytes
        print(f"store {source.url}: {nbytes / 1e6:,.0f} MB on disk; page cache warmed in "
              f"{secs:.2f} s")
    decoded = source.n_samples * source.sample_nbytes
    store_info["decoded_bytes"] = decoded
    f = cfg.split_fraction
    manifest = bench_manifest(source, f, cfg.seed)
    grid = source.grid
    chunk_ids = manifest.chunk_ids(SPLIT)
    rows = [slice(a * grid.chunk_size, min(b * grid.chunk_size, grid.n_samples))
            for a, b in manifest.ranges(SPLIT)]
    n_split = manifest.n_samples_in(SPLIT)
    nbytes_s = source.sample_nbytes

    floor_ring = StripeFloor(source, chunk_ids, cfg.floor_threads, cfg.max_inflight)
    floors: list[StripeFloor | GatherFloor] = [floor_ring]
    if floor_ring.local:
        block_chunks = cfg.block_chunks or loader_block_chunks(source, manifest, cfg)
        floors.append(GatherFloor(source, chunk_ids, cfg.floor_threads, block_chunks,
                                  cfg.batch_size, cfg.seed))
    for _ in range(2):  # warm-up passes: thread start, first-touch of code and caches
        for fl in floors:
            fl.run_pass()
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
    stripe = floor_ring.result(f"read floor: StripeReader, {cfg.floor_threads} threads",
                               n_split, nbytes_s)
    gfloor = (floors[1].result("read floor + one gather copy", n_split, nbytes_s)
              if len(floors) > 1 else None)
    ttfb = time_first_batch(source, manifest, cfg)
    probe = probe_loader_rss(cfg, source.names)

    rng = np.random.default_rng(cfg.seed)
    pool = grid.samples_of(chunk_ids)
    subset = rng.choice(pool, size=min(cfg.naive_samples, pool.size), replace=False)
    naive = {w: time_naive(source, cfg.url, subset, cfg.batch_size, w, cfg.progress)
             for w in cfg.naive_workers}
    naive2 = naive.get(2) or (naive[max(naive)] if naive else None)
    zfloor = time_zarr_floor(source, rows, n_split, cfg.repeats)

    floor = max((stripe, zfloor), key=lambda r: r.samples_per_s)
    steady, paired = steady_state(loader_runs)
    _, paired_g = steady_state(loader_runs, "paired_gather_floor_s")
    stacked = []
    if stack is not None:
        stacked = [steady_state(stack.runs, label=CHANNELS_LABEL)[0]]
    runs = [*loader_runs[:2], steady, *stacked, *naive.values(), stripe,
            *([gfloor] if gfloor else []), zfloor, *peer_runs(peer_rows, nbytes_s)]
    table = [_row(r, floor, naive2, gfloor) for r in runs]

    r_floor = steady.samples_per_s / floor.samples_per_s
    r_naive = steady.samples_per_s / naive2.samples_per_s if naive2 else None
    r_gfloor = steady.samples_per_s / gfloor.samples_per_s if gfloor else None
    rss_peak = probe["peak_rss_bytes"]
    bound = loader_runs[0].extra["resident_bound_bytes"]
    inflight_bytes = cfg.max_inflight * max(v.stripe_nbytes for v in source.variables)
    naive_target = _naive_target(grid.chunk_size)
    result = {
        "machine": machine,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        "store": store_info,
        "split": {"chunks": len(chunk_ids), "samples": n_split, "sample_nbytes": nbytes_s,
                  "samples_per_chunk": grid.chunk_size, "variables": list(source.names)},
        "rows": table,
        "loader_epochs": [_row(r, floor, naive2, gfloor) for r in loader_runs],
        "floor": floor.name, "steady_ratio_to_floor": r_floor,
        "steady_paired_ratio_to_floor": paired, "steady_ratio_to_naive_2w": r_naive,
        "steady_ratio_to_gather_floor": r_gfloor,
        "steady_paired_ratio_to_gather_floor": paired_g,
        "first_batch": ttfb,
        "memory": {"loader_rss_peak_bytes": rss_peak, "resident_bound_bytes": bound,
                   "probe": probe,
                   "in_process_rss_peak_bytes": max(r.rss_peak or 0 for r in loader_runs),
                   "inflight_bytes_bound": inflight_bytes,
                   "rss_target_bytes": bound + RSS_SLACK,
                   "rss_within_target": rss_peak <= bound + RSS_SLACK},
        "targets": {"ratio_to_floor": 0.9, "ratio_to_naive_2w": naive_target},
        "peers": peer_rows,
        "channels": stacking_summary(cfg.channels, loader_runs, stack, source, cfg.batch_size),
    }

    print()
    print(f"split {SPLIT!r}: {len(chunk_ids)} chunks of {grid.chunk_size} samples, {n_split} "
          f"samples of {nbytes_s / 1e3:,.0f} kB ({', '.join(source.names)}); batch "
          f"{cfg.batch_size}, block_chunks {loader_runs[0].extra['block_chunks']}"
          f"{'' if cfg.block_chunks else ' (auto)'}, max_inflight {cfg.max_inflight}; "
          f"naive paths over {subset.size} random samples; floors are the best of their passes")
    print(format_table(table))
    print(f"\nread floor = {floor.name} ({floor.gb_per_s:.2f} GB/s)"
          + (f"; floor + one gather copy {gfloor.gb_per_s:.2f} GB/s = "
             f"{gfloor.samples_per_s / floor.samples_per_s:.2f}x floor" if gfloor else ""))
    print("loader epoch rates: " + ", ".join(f"{r.samples_per_s:,.0f}" for r in loader_runs)
          + " samples/s; steady state = best epoch after the first")
    ok = "OK" if r_floor >= 0.9 else "BELOW"
    line = (f"steady state: {r_floor:.2f}x floor (median paired {fmt(paired, '.2f')}x) "
            f"[{ok} target 0.9]")
    if r_naive is not None:
        tgt = (f" [{'OK' if r_naive >= naive_target else 'BELOW'} target {naive_target:g} at "
               f"{grid.chunk_size} samples/chunk]" if naive_target else "")
        line += f"; {r_naive:.1f}x naive 2 workers{tgt}"
    print(line)
    if r_gfloor is not None:
        print(f"steady state vs floor + one gather copy: {r_gfloor:.2f}x (median paired "
              f"{fmt(paired_g, '.2f')}x)")
    if result["channels"] is not None:
        print(format_stacking(result["channels"]))
    print(format_peers(peer_rows, len(loader_runs)))
    print(f"time to first batch: fresh loader {ttfb['first_batch_s']:.3f} s, after resume "
          f"(state after {ttfb['resume_after_batches']} batches, "
          f"{ttfb['state_json_bytes']} B of JSON) {ttfb['first_batch_after_resume_s']:.3f} s")
    ledger = max(r.extra["ledger_peak_bytes"] for r in loader_runs)
    print(f"loader memory, alone in a fresh process (2 epochs): peak RSS {rss_peak / 1e6:,.0f} "
          f"MB, of which {probe['import_rss_bytes'] / 1e6:,.0f} MB is python + imports (target "
          f"<= resident bound {bound / 1e6:,.0f} MB + 400 MB = {(bound + RSS_SLACK) / 1e6:,.0f} "
          f"MB: {'OK' if rss_peak <= bound + RSS_SLACK else 'ABOVE'}); decoded resident peak "
          f"{ledger / 1e6:,.0f} MB (ledger)")
    st = steady.extra
    print(f"loader metrics, steady epoch: starvation {100 * st['starvation']:.0f}% (no model: "
          f"the loop only waits) | consumer s: fetch {st['consumer_wait_fetch_s']:.3f} "
          f"schedule {st['consumer_schedule_s']:.3f} shuffle {st['consumer_shuffle_s']:.3f} "
          f"gather {st['consumer_gather_s']:.3f} deliver {st['consumer_deliver_s']:.3f} | "
          f"fetcher stripe-s: store {st['fetch_store_s']:.2f} decode {st['fetch_decode_s']:.2f}")
    total = time.perf_counter() - t_start
    whole.__exit__()
    result["total_seconds"] = total
    result["other_load_cores"] = whole.cores
    print(f"total benchmark time {total:.1f} s; other processes used {whole.cores:.2f} cores "
          "on average meanwhile"
          + (" -- the machine was busy, numbers are pessimistic; rerun when it is quiet"
             if whole.cores > 0.25 else ""))
    write_outputs(result, cfg)
    return result


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
