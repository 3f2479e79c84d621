"""The naive per-sample ``DataLoader`` people write today, timed on a subset of the split.

It is what the loader must beat by an order of magnitude: one zarr ``getitem`` (a whole
chunk decoded) per sample and variable.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.utils.data as tud

import insitubatch_nodes as ib

from .common import OtherLoad, RssSampler, Run, consume, local_path, usage_extra


class PerSampleZarr(tud.Dataset[dict[str, Any]]):
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
        if self._arrays is None:
            self._arrays = ib.open_source(self.url, variables=self.variables).arrays
        return {name: torch.from_numpy(np.asarray(arr[int(i)]))
                for name, arr in zip(self.variables, self._arrays, strict=True)}


def time_naive(source: ib.Source, url: str, indices: np.ndarray, batch_size: int,
               workers: int, progress: bool = True) -> Run:
    """Shuffled per-sample DataLoader over a random subset of the split (bounded time); the
    rate per sample is what matters, and it does not depend on the subset's size."""
    local = local_path(url) is not None
    ds = PerSampleZarr(url, source.names, source.n_samples)
    subset = tud.Subset(ds, indices.tolist())
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
