"""``SampleDataset``: any one sample of a split, by index, exactly as the loader serves it.

For evaluation and debugging, where an epoch is the wrong way in: a map-style
``torch.utils.data.Dataset`` whose ``ds[k]`` reads only the stripes that sample
``ds.sample_indices[k]`` needs (kept in a small LRU of decoded stripes, so neighbouring
indices are cheap) and runs them through the loader's own ``GatherNode`` and per-batch
stages (``graph_stages.transform_stages``) as a batch of one: the dict is the loader's row.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import pickle
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
import zarr.storage
from torch.utils.data import Dataset
from torchdata.nodes import BaseNode

from .config import FetchConfig, LoaderConfig, SamplingConfig, check_split_args
from .errors import (
    ConfigError,
    ConfigTypeError,
    LoaderUsageError,
    SampleIndexError,
    UnknownNameError,
)
from .graph import Resolved, resolve
from .graph_stages import transform_stages
from .io.loop_thread import LoopThread
from .io.retry import RetryPolicy
from .io.served import open_reader
from .memory.budget import parse_bytes
from .nodes import GatherNode
from .sampling.items import BatchDraw, GatherPart
from .store.cut_array import stored_arrays
from .store.source import Source
from .store.splits import SplitManifest

__all__ = ["CacheInfo", "KeySummary", "SampleDataset", "summarize_sample"]

T = TypeVar("T")
DEFAULT_CACHE_BYTES = 64 << 20
# stores a forked worker can read from (plain files, memory): no runtime threads behind them
_FORK_SAFE_STORES = (zarr.storage.LocalStore, zarr.storage.MemoryStore)


@dataclass(frozen=True)
class CacheInfo:
    """This process's stripe cache: stripes found there (``hits``) and read (``misses``),
    what it holds now and its bound (every ``DataLoader`` worker has its own)."""

    hits: int
    misses: int
    stripes: int
    nbytes: int
    max_bytes: int


class _OneDraw(BaseNode[BatchDraw]):
    """The gather's upstream: hands over the one draw it was given, then nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.draw: BatchDraw | None = None

    def next(self) -> BatchDraw:
        draw, self.draw = self.draw, None
        if draw is None:
            raise StopIteration
        return draw

    def get_state(self) -> dict[str, Any]:
        return {}


class _Process:
    """What ``SampleDataset`` keeps per process: readers over its own store clients (a
    forked or unpickled copy re-opens them), the loop thread, the stripe cache and the
    gather with the per-batch stages."""

    def __init__(self, source: Source, resolved: Resolved, max_bytes: int, reopen: bool,
                 ) -> None:
        self.pid = os.getpid()
        arrays = source.arrays
        if reopen:
            try:  # fresh clients: zarr stores (obstore's, icechunk's) pickle their config
                arrays = pickle.loads(pickle.dumps(arrays))
            except Exception:
                arrays = source.arrays  # a store that cannot pickle: use it as it is
        origins = [source.origin(i) for i in range(len(source.variables))]
        self.readers = tuple(open_reader(a, g, url) for a, g, (url, _) in
                             zip(arrays, source.variables, origins, strict=True))
        fetch = resolved.config.fetch
        if fetch.cache is not None:  # the loader's local chunk cache, shared with it
            for reader, (_, snapshot) in zip(self.readers, origins, strict=True):
                reader.use_cache(fetch.cache, snapshot)
        self.retry = fetch.retry or RetryPolicy()
        self.cache: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
        self.nbytes = self.hits = self.misses = 0
        self.max_bytes = max_bytes
        self.lock = threading.Lock()
        self._lt: LoopThread | None = None
        sm = resolved.config.sample
        self.draws = _OneDraw()
        gather = GatherNode(self.draws, source.variables, steps=sm.time_steps,
                            coords=source.batch_coords(), layout=resolved.layout)
        self.root, _ = transform_stages(gather, source, resolved, None)
        self.root.reset(None)

    def _loop(self) -> LoopThread:
        if self._lt is None:
            self._lt = LoopThread(min(4, len(self.readers) + 1), "sample-loop", "sample")
            weakref.finalize(self, LoopThread.stop_soon, self._lt)
        return self._lt

    def stripes(self, wanted: Sequence[tuple[int, int]]) -> dict[tuple[int, int], np.ndarray]:
        """The decoded stripes ``(variable, stripe index)``: from the cache, the others read
        together (each with the loader's retries), then the cache trimmed to its bound."""
        found: dict[tuple[int, int], np.ndarray] = {}
        todo = []
        for key in dict.fromkeys(wanted):
            arr = self.cache.get(key)
            if arr is None:
                todo.append(key)
            else:
                self.cache.move_to_end(key)
                found[key] = arr
        self.hits += len(found)
        if todo:
            bufs = [np.empty(self.readers[v].geom.stripe_shape, self.readers[v].geom.dtype)
                    for v, _ in todo]
            lt = self._loop()

            async def read_all() -> None:
                await asyncio.gather(*(self.readers[v].read(i, buf, lt.loop, lt.pool,
                                                            self.retry)
                                       for (v, i), buf in zip(todo, bufs, strict=True)))

            lt.run(read_all())
            self.misses += len(todo)
            for key, buf in zip(todo, bufs, strict=True):
                found[key] = self.cache[key] = buf
                self.nbytes += buf.nbytes
            while self.nbytes > self.max_bytes and self.cache:
                _, old = self.cache.popitem(last=False)
                self.nbytes -= old.nbytes
        return found

    def batch_of(self, sample: int, offsets: np.ndarray) -> dict[str, torch.Tensor]:
        """The loader's batch holding only ``sample``: its stripes gathered and put through
        the same stages as every batch of the loader."""
        rows = sample + offsets
        wanted = [(v, int(r) // r_.geom.sample_chunk) for v, r_ in enumerate(self.readers)
                  for r in rows]
        with self.lock:
            got = self.stripes(wanted)
            parts = []
            for v, reader in enumerate(self.readers):
                c = reader.geom.sample_chunk
                parts.append(tuple(
                    GatherPart(got[(v, int(r) // c)], np.array([int(r) % c], dtype=np.int64),
                               0, 1, j) for j, r in enumerate(rows.tolist())))
            self.draws.draw = BatchDraw(np.array([sample], dtype=np.int64), tuple(parts))
            return next(self.root)


class SampleDataset(Dataset):
    """The samples of one split, in ascending order, by index: ``ds[k]`` is the dict the
    loader puts in a batch row for sample ``ds.sample_indices[k]``.

    ``ds.sample_indices`` holds the split's global sample indices (anchors, with time
    steps), less the chunks the loader leaves out (their samples touch an anemoi store's
    missing dates); ``len(ds)`` is its length. The options are ``build_loader``'s (a
    ``LoaderConfig`` and/or its keywords); those of the sample (``steps``, ``channels``,
    ``static``, ``stats``/``normalize``, ``dtype``, ``patch_size``/``patch_stride``,
    ``channels_last``/``drop_ensemble``) shape ``ds[k]`` exactly as the loader's batches,
    and are checked the same way; the others (batch size, shuffle, ranks, fetch, device) are
    accepted, so one config serves both, and ignored: a dataset reads one sample at a time,
    on the CPU, with the fetch retry policy and local chunk cache (``cache=``).

    ``ds[k]`` maps every batch key to the row ``batch[key][i]``: ``"sample_index"`` and a
    coordinate such as ``"time"`` are 0-d. With ``patch_size`` a loader's rows are patches:
    ``ds[k]`` is then all P patches of the sample, every key with a leading axis of P (rows
    ``i*P`` to ``(i+1)*P`` of a batch with the sample at position ``i``), ``"patch"`` their
    corners.

    Reads go through the loader's stripe readers; decoded stripes are kept in an LRU of at
    most ``cache_bytes`` per process. Works in ``DataLoader(ds, num_workers=k,
    multiprocessing_context=ds.multiprocessing_context)``: each worker opens its own store
    clients and cache. Local stores fork (the context is ``None``); obstore and icechunk
    clients hang in a forked child, so there it is ``"forkserver"`` (a forked worker says so).
    """

    def __init__(self, source: Source, manifest: SplitManifest, split: str,
                 config: LoaderConfig | None = None, *,
                 cache_bytes: int | str = DEFAULT_CACHE_BYTES, **options: Any) -> None:
        check_split_args(manifest, split, "SampleDataset")
        cfg = (config if config is not None else LoaderConfig()).replace(**options)
        if cfg.sampling.read_group != 1:
            raise ConfigError(
                f"SampleDataset(read_group={cfg.sampling.read_group}): a dataset serves every "
                "sample of the split on one process, with no ranks to share them; serve a part "
                "of the grid with source.grid_part(slice) or source.region(...) instead")
        # one sample at a time, on this process, decoded on the CPU: nothing else applies
        cfg = dataclasses.replace(cfg, sampling=SamplingConfig(
                                      batch_size=1, rank=0, world_size=1,
                                      every=cfg.sampling.every),
                                  fetch=FetchConfig(retry=cfg.fetch.retry, in_place=False,
                                                    cache=cfg.fetch.cache, workers=0))
        self.split = split
        self.config = cfg
        self.resolved = resolve(source, manifest, split, cfg)
        # the source served: with channels= over discovered variables, only theirs
        self.source = source = self.resolved.source
        self.cache_bytes = parse_bytes(cache_bytes)
        if self.cache_bytes < 0:
            raise ConfigError(f"cache_bytes must be >= 0, got {cache_bytes!r}")
        chunks = np.setdiff1d(manifest.chunk_ids(split),
                              np.asarray(self.resolved.excluded, dtype=np.int64))
        indices = self.resolved.grid.samples_of(chunks)
        indices.setflags(write=False)
        self.sample_indices: np.ndarray = indices
        steps = cfg.sample.time_steps
        self._offsets = np.zeros(1, np.int64) if steps is None else steps.offsets
        self._patches = cfg.sample.patch_size is not None
        # obstore's and icechunk's clients run on a runtime whose threads stay in the parent:
        # a forked worker hangs on its first read, even with fresh clients (measured)
        self._fork_safe = all(isinstance(a.store_path.store, _FORK_SAFE_STORES)
                              for arr in source.arrays for a in stored_arrays(arr))
        # what to give DataLoader(multiprocessing_context=...): None (fork) for local files
        self.multiprocessing_context: str | None = None if self._fork_safe else "forkserver"
        self._proc: _Process | None = _Process(source, self.resolved, self.cache_bytes,
                                               reopen=False)

    def __len__(self) -> int:
        return int(self.sample_indices.size)

    def __getitem__(self, k: int) -> dict[str, torch.Tensor]:
        n = len(self)
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
            raise ConfigTypeError(f"SampleDataset indices are integer positions 0..{n - 1}, got "
                                  f"{k!r}")
        pos = int(k) + n if k < 0 else int(k)
        if not 0 <= pos < n:
            raise SampleIndexError(f"position {k} is out of range for the {n} samples of split "
                                   f"{self.split!r} (0 to {n - 1}); ds.index_of(i) finds the "
                                   "position of global sample i")
        batch = self._process().batch_of(int(self.sample_indices[pos]), self._offsets)
        if self._patches:
            return batch
        return {key: t[0] for key, t in batch.items()}

    def index_of(self, sample_index: int) -> int:
        """The position ``k`` of global sample (anchor) ``sample_index``: ``ds[k]`` is it."""
        idx = self.sample_indices
        k = int(np.searchsorted(idx, sample_index))
        if k < idx.size and idx[k] == sample_index:
            return k
        why = ""
        if self.resolved.excluded:
            why = (f"; chunks {list(self.resolved.excluded)} are left out (their samples "
                   f"touch the store's missing steps {list(self.source.missing)}, or with "
                   "time steps another split's chunks)")
        g = self.resolved.grid
        if g.first or g.end != g.n_samples:
            why += f"; with these steps only anchors {g.first} to {g.end - 1} are samples"
        span = f"{idx[0]} to {idx[-1]}" if idx.size else "none"
        raise UnknownNameError(f"sample {sample_index} is not in split {self.split!r} (its "
                               f"samples: {span}, {idx.size} in all){why}")

    def sample(self, sample_index: int) -> dict[str, torch.Tensor]:
        """``ds[ds.index_of(sample_index)]``: a sample by its global index."""
        return self[self.index_of(sample_index)]

    def cache_info(self) -> CacheInfo:
        """This process's stripe cache counters."""
        p = self._process()
        return CacheInfo(p.hits, p.misses, len(p.cache), p.nbytes, p.max_bytes)

    def _process(self) -> _Process:
        proc = self._proc
        pid = os.getpid()
        # A worker that unpickled the dataset (spawn, forkserver) has no _proc yet; one
        # from another process here is a forked copy of the parent's.
        if proc is not None and proc.pid != pid and not self._fork_safe:
            raise LoaderUsageError(
                f"this SampleDataset reads {self.source.url} through obstore or icechunk, "
                "whose clients hang in a forked process (their runtime's threads stay in "
                "the parent, and new clients share that runtime): give the DataLoader "
                "multiprocessing_context=ds.multiprocessing_context "
                f"({self.multiprocessing_context!r}; 'spawn' works too), so each worker "
                "starts clean and opens its own clients")
        if proc is None or proc.pid != pid:
            # a DataLoader worker (forked, or this dataset unpickled): its own clients
            proc = self._proc = _Process(self.source, self.resolved, self.cache_bytes,
                                         reopen=True)
        return proc

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_proc"] = None  # threads, clients and the cache stay in their process
        return state


@dataclass(frozen=True)
class KeySummary:
    """One key of a sample: shape, dtype and the statistics ``inspect --sample`` prints
    (over the finite values; ``None`` when there are none)."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    min: float | None
    max: float | None
    mean: float | None
    nan: int

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"shape": list(self.shape)}


def summarize_sample(sample: dict[str, torch.Tensor]) -> list[KeySummary]:
    """Shape, dtype, min/max/mean and NaN count of every key of ``sample`` (``ds[k]``), in
    its key order: a wrong normalisation or a NaN-filled missing date shows at a glance."""
    out = []
    for key, t in sample.items():
        x = t.detach().cpu()
        x = x.to(torch.float64) if x.dtype.is_floating_point or x.dtype == torch.bool else x
        lo: float | None
        hi: float | None
        mean: float | None
        nan = int(torch.isnan(x).sum()) if x.dtype.is_floating_point else 0
        finite = x[torch.isfinite(x)] if x.dtype.is_floating_point else x.reshape(-1)
        if finite.numel():
            lo, hi = float(finite.min()), float(finite.max())
            mean = float(finite.to(torch.float64).mean())
        else:
            lo = hi = mean = None
        out.append(KeySummary(key, tuple(t.shape), str(t.dtype).removeprefix("torch."), lo,
                              hi, mean, nan))
    return out
