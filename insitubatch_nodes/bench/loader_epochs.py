"""The benchmark's loader, timed an epoch at a time, with the paths run beside it.

Each loader epoch comes right after a pass of the floors and right before an epoch of each
follower (the channel-stacking loader, the peers), so their ratios survive a drifting VM.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from typing import Any, Protocol

import insitubatch_nodes as ib
from insitubatch_nodes.metrics.loader_stats import LoaderStats

from .common import OtherLoad, RssSampler, Run, consume, one_epoch_at_a_time, usage_extra
from .core_config import SPLIT, CoreConfig
from .floors import GatherFloor, StripeFloor


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
        ledger = loader.ledger
        assert ledger is not None  # build_loader's loaders have one
        ledger.reset_peak()
        # No polling thread in a timed epoch (floors and peers have none); the loader's
        # memory is measured alone in a fresh process (rss_probe).
        with RssSampler(poll=False) as rss, OtherLoad() as other:
            samples, secs, first, used = consume(loader, self.n_batches,
                                                 f"{self.label} epoch {epoch}", self.key,
                                                 self.cfg.progress)
        stats = loader.stats()
        run = Run(f"{self.label}, epoch {epoch}", samples, secs, self.sample_nbytes, first,
                  float(used[0]), rss.peak, rss.growth,
                  extra={**usage_extra(used), "ledger_peak_bytes": ledger.peak,
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
