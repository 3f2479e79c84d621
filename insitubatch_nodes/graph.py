"""The standard graph, built from a ``LoaderConfig``: the one place that wires the stages.

``resolve`` turns a config into the numbers the graph needs (rank, prefetch depth, the
resident bound, the decoder) and raises every configuration error before a thread starts;
``build_graph`` wires the stages from that. ``build_loader``, the tests and the benchmarks
all go through here, so they cannot drift apart.

    SplitNode -> ChunkPermuteNode -> ReadPlanNode -> AsyncFetchNode -> ShuffleBufferNode
    -> GatherNode -> [NormalizeNode] [StaticFieldsNode] [StackChannelsNode] [PatchNode]
    -> PinOrCudaNode
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torchdata.nodes import BaseNode

from .config import LoaderConfig, SampleConfig, SamplingConfig
from .fetch.first_batch import FirstBatch
from .io.device_decode import FrameDecoder, NvcompFrameDecoder
from .io.reader import groups_reads
from .memory.arena import BatchArena
from .memory.budget import check_budget
from .memory.layout import CHANNELS_KEY, BatchLayout, Channel, build_layout
from .memory.ledger import BufferPool, MemoryLedger
from .memory.staging import StagingSeam
from .nodes import (
    AsyncFetchNode,
    ChunkPermuteNode,
    GatherNode,
    NormalizeNode,
    PinOrCudaNode,
    ReadPlanNode,
    ShuffleBufferNode,
    SplitNode,
    TransformNode,
)
from .nodes.async_fetch import DEFAULT_PREFETCH_WINDOWS
from .nodes.channels import StackChannelsNode, resolve_channels
from .nodes.patches import PatchNode
from .nodes.pin_or_cuda import CudaOps, PinnedArrays, resolve_device
from .nodes.static import StaticFieldsNode, check_static
from .nodes.views import ChannelsLastNode
from .sampling.geometry import SampleGrid
from .sampling.permute import resolve_rank
from .sampling.quality import shuffle_quality
from .sampling.schedule import ScheduleContext, n_units
from .sampling.windows import SampleWindow, chunks_reaching, chunks_touching, default_run_chunks
from .store.source import Source
from .store.splits import SplitManifest
from .store.statistics import Stats
from .workers.engine import CREDIT
from .workers.shared_memory import SharedMemoryArena

log = logging.getLogger("insitubatch_nodes")

STAGES = ("split", "permute", "plan", "fetch", "shuffle", "gather", "pin")


@dataclass(frozen=True)
class Resolved:
    """What a config means for one source and split: the values ``build_graph`` wires."""

    config: LoaderConfig
    rank: int
    world_size: int
    prefetch_windows: int
    grid: SampleGrid  # the sample grid, or the anchor grid when samples are time windows
    n_chunks: int  # chunks of the split
    block_chunks: int  # chunks per window (sampling.block_chunks, or the default for the path)
    run_chunks: int | None  # time windows: chunks per contiguous run (a window holds several)
    resident_bound: int  # bytes of decoded data that can be resident (memory.py's ledger)
    shuffle_quality: float  # the model's score for this configuration (1.0: global shuffle)
    frame_decoder: FrameDecoder | None  # decode="gpu": the device decoder
    channels: tuple[Channel, ...] | None  # sample.channels resolved against the source
    channels_key: str  # the batch key they are stacked into
    excluded: tuple[int, ...]  # chunks left out: their samples touch the store's missing steps
    # or (time steps) another split's chunks
    layout: BatchLayout | None  # where each variable lands in a host-gathered batch
    in_place: bool  # chunks decoded straight into their batch rows (no window, no gather)
    workers: int  # decode worker processes (0: decode threads in this process)


def every_steps(source: Source, every: int | str) -> tuple[int, int]:
    """``sampling.every`` as (k, phase): keep the steps ``i ≡ phase`` (mod k). An int keeps
    every k-th step from the first; a duration (``"6h"``, ``"1D"``) keeps the steps whose
    time is a whole multiple of it, on a regular time axis (anemoi's ``frequency``)."""
    if not isinstance(every, str):
        return int(every), 0
    import pandas as pd

    times = source.sample_coord
    if times is None or not np.issubdtype(np.asarray(times).dtype, np.datetime64):
        raise ValueError(f"sampling.every={every!r} is a duration, but {source.url} has no "
                         "time coordinate on its sample axis; give a number of steps instead")
    try:
        period = pd.Timedelta(every).to_timedelta64().astype("timedelta64[ns]")
    except ValueError as e:
        raise ValueError(f"sampling.every={every!r} is not a duration such as '6h' or '1D' "
                         f"({e})") from None
    t = np.asarray(times).astype("datetime64[ns]")
    steps = np.unique(np.diff(t))
    if t.size < 2 or steps.size != 1:
        raise ValueError(f"sampling.every={every!r} needs a regular time axis; {source.url}'s "
                         f"steps are {steps[:4]} (give a number of steps instead)")
    k, rest = divmod(int(period.astype(np.int64)), int(steps[0].astype(np.int64)))
    if k < 1 or rest:
        raise ValueError(f"sampling.every={every!r} is not a whole number of the time axis' "
                         f"steps ({np.timedelta64(steps[0], 'm')})")
    aligned = np.flatnonzero(t[:k].astype(np.int64) % int(period.astype(np.int64)) == 0)
    if aligned.size == 0:
        raise ValueError(f"sampling.every={every!r}: no step among the first {k} of "
                         f"{source.url} falls on a multiple of {every} (times from {t[0]})")
    return k, int(aligned[0])


def default_prefetch_windows(source: Source) -> int:
    """2 windows ahead of the one being drawn, on every store. On object stores one would
    expose a round trip at each window edge (README "Latency"); on local disks the decode
    pool ran dry whenever the consumer was slow at a window edge (DESIGN.md "Prefetch depth
    on local disks": one window more of memory for -1 to +8% samples/s on two saturated
    cores). ``source`` is kept so the default may depend on the store again."""
    del source
    return DEFAULT_PREFETCH_WINDOWS


WORKERS_FROM_CORES = 4  # "auto" starts worker processes from this many cores per rank
MAX_WORKERS = 32


def cores_per_rank() -> int:
    """The cores this process may run on (its affinity: taskset, cgroups, Slurm), shared
    by the ranks torchrun started on this node (``LOCAL_WORLD_SIZE``)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        cores = os.cpu_count() or 1
    try:
        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        ranks = 1
    return max(1, cores // ranks)


def default_workers(in_place: bool, cores: int | None = None) -> int:
    """``workers="auto"``: a decode process per core but one (the training process keeps
    one), from ``WORKERS_FROM_CORES`` cores per rank, where decoding is in place; else 0,
    the decode threads. Threads share one GIL and stop scaling at about 4 cores (16-core
    node: 9.6k samples/s at 4 threads, 4.6k at 16), processes do not (a prototype: 58.6k
    at 15); on 2 cores 2 workers are 1.06-1.14x the threads (DESIGN.md "Worker processes"), but
    threads start at once, where workers take 0.3-0.5 s to a first batch. A free-threaded
    CPython is not measured yet: it gets the threads."""
    if not in_place or not getattr(sys, "_is_gil_enabled", lambda: True)():
        return 0
    cores = cores_per_rank() if cores is None else cores
    if cores < WORKERS_FROM_CORES:
        return 0
    return min(MAX_WORKERS, cores - 1)


def _unsendable(source: Source) -> str | None:
    """Why the source's arrays cannot reach a worker process (each worker opens its own
    readers from the pickled arrays: store and path), or ``None``."""
    try:
        pickle.dumps(tuple(source.arrays))
    except Exception as e:
        return (f"the arrays of {source.url} cannot be sent to a worker process "
                f"(pickling their store failed: {type(e).__name__}: {e})")
    return None


def workers_prefetch(workers: int, batch_size: int, window_samples: int) -> int:
    """Windows ahead that keep ``workers`` processes busy: each holds up to ``CREDIT`` jobs
    of about a batch, so at least that many batches must be planned (on 16 cores, 15
    workers want 30 batches in flight; two windows of 256 one-sample chunks ahead hold 24).
    The resident bound counts the windows ahead, so it grows with them."""
    want = CREDIT * workers * batch_size
    return -(-want // max(1, window_samples))


def resolve_decode(decode: str | FrameDecoder, device: str | torch.device | None,
                   ) -> FrameDecoder | None:
    """``"cpu"`` -> None; ``"gpu"`` -> nvCOMP on ``device`` (which must be CUDA); a
    ``FrameDecoder`` object is used as given (tests pass ``HostFrameDecoder``)."""
    if not isinstance(decode, str):
        if not isinstance(decode, FrameDecoder):
            raise TypeError(f"decode must be 'cpu', 'gpu' or a FrameDecoder, got {decode!r}")
        return decode
    if decode == "cpu":
        return None
    if decode != "gpu":
        raise ValueError(f"decode must be 'cpu' or 'gpu', got {decode!r}")
    dev = resolve_device(device)
    if dev is None or dev.type != "cuda":
        raise ValueError(f"decode='gpu' needs device='cuda' (got device={device!r}): the "
                         "batches are decoded and gathered on that GPU")
    return NvcompFrameDecoder(dev)


def _fraction(manifest: SplitManifest, split: str) -> str:
    if manifest.fractions and len(manifest.fractions) == len(manifest.names):
        return str(manifest.fractions[manifest.names.index(split)])
    return "unknown"


def resolve(source: Source, manifest: SplitManifest, split: str,
            config: LoaderConfig) -> Resolved:
    """Check ``config`` against the source and split and size the graph; every error a
    configuration can have is raised here, naming the value and what would be valid."""
    s, f = config.sampling, config.fetch
    if split not in manifest.names:
        raise KeyError(f"unknown split {split!r}; the manifest has splits {list(manifest.names)}")
    manifest.check_source(source, config.checkpoint.allow_snapshot_change)
    steps = config.sample.time_steps
    grid = source.grid if steps is None else steps.grid(source.grid)
    if s.every is not None:
        grid = grid.with_every(*every_steps(source, s.every))
    if steps is not None and grid.end <= grid.first:
        raise ValueError(f"the time window {steps} spans {steps.span} steps, more than the "
                         f"{source.grid.n_samples} steps of {source.url}: no sample has "
                         "all its steps; shorten history, leads or stride")
    chunk_ids = manifest.chunk_ids(split)
    excluded = chunks_touching(source.missing, source.grid, steps)
    anchorless = np.empty(0, dtype=np.int64)
    if steps is not None or grid.every > 1:
        # Chunks at the ends of the axis may hold no anchor (every step's window would run
        # off the axis), nor, with ``every``, chunks between kept steps: they serve nothing,
        # so dealt to a rank they would leave it empty.
        ids = np.asarray(chunk_ids, dtype=np.int64)
        anchorless = ids[grid.n_samples_each(ids) == 0]
        excluded = np.union1d(excluded, anchorless)
    if steps is not None:
        others = [manifest.chunk_ids(n) for n in manifest.names if n != split]
        others_ids = np.concatenate(others) if others else np.empty(0, dtype=np.int64)
        across = chunks_reaching(chunk_ids, others_ids, grid, steps)
        if across.size:
            log.info("split %r: chunks %s left out: their samples' time steps reach another "
                     "split's chunks (split_by_coordinate(gap=) keeps steps free between "
                     "splits instead)", split, across[:8].tolist())
            excluded = np.union1d(excluded, across)
    if excluded.size:
        had = len(chunk_ids)
        chunk_ids = np.setdiff1d(chunk_ids, excluded)
        if had and len(chunk_ids) == 0:
            if anchorless.size == had and steps is None:
                raise ValueError(f"split {split!r} holds no step kept by every={s.every!r}: "
                                 "give it more of the axis or keep more steps")
            if anchorless.size == had:
                raise ValueError(
                    f"split {split!r} holds no sample of the time window {steps}: its "
                    f"chunks {anchorless[:8].tolist()} lie outside the steps "
                    f"{grid.first}..{grid.end - 1} whose window fits the axis; give it "
                    "more of the axis or shorten the window")
            raise ValueError(
                f"every chunk of split {split!r} ({had}) is left out: its samples touch the "
                f"store's missing steps {list(source.missing)[:8]} or, with time steps "
                f"{steps}, reach another split's chunks (split_by_chunk(mode='random') "
                "interleaves the splits; use contiguous splits or split_by_coordinate(gap=))")
    if len(chunk_ids) == 0:
        raise ValueError(
            f"split {split!r} has no chunks (its fraction is {_fraction(manifest, split)}); "
            f"splits with chunks: {[n for n in manifest.names if len(manifest.chunk_ids(n))]}"
        )
    rank, world_size = resolve_rank(s.rank, s.world_size)
    prefetch = (default_prefetch_windows(source) if f.prefetch_windows is None
                else f.prefetch_windows)
    decoder = resolve_decode(f.decode, config.device.device)
    sm = config.sample
    channels, channels_key = _stacking(source, sm)
    # Host gathers write channels straight into their slice of "channels"; batches gathered
    # on a GPU (decode="gpu") are stacked afterwards.
    layout = (build_layout(source.variables, channels, channels_key) if decoder is None
              else None)
    why_not = _not_in_place(source, steps, decoder, layout)
    if f.in_place and why_not:
        raise ValueError(f"fetch.in_place=True, but this loader cannot decode into its "
                         f"batches: {why_not}. Leave in_place=None to decide per store.")
    asked = f.workers if f.workers != "auto" else 0
    if asked and (why_not or f.in_place is False):
        raise ValueError(f"fetch.workers={asked} decode straight into batches in shared memory, "
                         f"which this loader cannot: {why_not or 'fetch.in_place=False'}. Use "
                         "workers=0 (decode threads) or workers='auto'.")
    in_place = f.in_place is not False and why_not is None and (
        bool(f.in_place) or bool(asked) or _in_place_by_default(source))
    workers = asked if f.workers != "auto" else default_workers(in_place)
    if workers:
        unsendable = _unsendable(source)
        if unsendable is not None and f.workers != "auto":
            raise ValueError(f"fetch.workers={workers}: {unsendable}. Use workers=0 (decode "
                             "threads in this process).")
        if unsendable is not None:
            log.info("insitubatch: decode threads, not worker processes: %s", unsendable)
            workers = 0
    contiguous = steps is not None
    block_chunks, run_chunks = _window_size(source, s, steps, in_place)
    if workers and f.prefetch_windows is None:
        prefetch = max(prefetch, workers_prefetch(workers, s.batch_size,
                                                  block_chunks * grid.chunk_size))
    ctx = ScheduleContext(chunk_ids, grid, s.seed, block_chunks, s.uneven, contiguous,
                          run_chunks)
    units = n_units(ctx)
    if world_size > units:
        raise ValueError(
            f"world_size={world_size} exceeds the {units} "
            f"{'blocks' if contiguous else 'chunks'} of split {split!r}: a chunk "
            "is served by one rank, so some ranks would get nothing. Use at most "
            f"{units} ranks, or a split with more chunks."
        )
    bound = check_budget(source.grid, source.variables, f.memory_budget, block_chunks,
                         prefetch, s.batch_size, steps, in_place, run_chunks)
    if contiguous:
        # mixing is over runs: samples of one run are neighbours in time, so a batch of
        # them is as correlated as a batch of one chunk
        quality = shuffle_quality(units, ctx.run_length * source.grid.chunk_size,
                                  ctx.runs_per_window, s.batch_size)
    else:
        quality = shuffle_quality(len(chunk_ids), source.grid.chunk_size, block_chunks,
                                  s.batch_size)
    return Resolved(
        config=config, rank=rank, world_size=world_size, prefetch_windows=prefetch, grid=grid,
        n_chunks=len(chunk_ids), block_chunks=block_chunks, run_chunks=run_chunks,
        resident_bound=bound, shuffle_quality=quality,
        frame_decoder=decoder, channels=channels, channels_key=channels_key, layout=layout,
        excluded=tuple(int(c) for c in excluded),
        in_place=in_place, workers=workers,
    )


def _stacking(source: Source, sm: SampleConfig) -> tuple[tuple[Channel, ...] | None, str]:
    """The channels stacked and the batch key they go to: ``channels=`` into "channels", or
    an anemoi dataset's ``variables=`` selection into "data" (one or the other)."""
    channels = tuple(resolve_channels(source, sm.channels)) if sm.channels else None
    key = CHANNELS_KEY
    if source.selection is not None:
        if channels:
            raise ValueError(
                f"the anemoi dataset {source.url!r} was opened with variables="
                f"{list(source.selection)} and the loader was given channels="
                f"{list(sm.channels or ())}: choose the variables in one of the two")
        # an anemoi selection: the chosen variables, in order, as batch["data"]
        channels = tuple(resolve_channels(source, source.selection))
    if source.format == "anemoi" and (source.selection is not None or not channels):
        key = source.variables[0].name  # "data": the selection, or all of it
    if (sm.channels_last or sm.drop_ensemble) and not channels and source.format != "anemoi":
        raise ValueError("sample.channels_last / drop_ensemble apply to stacked channels "
                         "(channels=[...]) or an anemoi dataset's data; this loader has "
                         f"neither (variables {list(source.names)})")
    if sm.drop_ensemble and source.format != "anemoi":
        raise ValueError(f"sample.drop_ensemble: {source.url!r} is not an anemoi dataset, so "
                         "it has no ensemble axis")
    return channels, key


def _window_size(source: Source, s: SamplingConfig, steps: SampleWindow | None,
                 in_place: bool) -> tuple[int, int | None]:
    """(block_chunks, run_chunks): the configured values or the defaults for the path; with
    time windows a window holds whole runs."""
    run_chunks = None
    if steps is not None:
        run_chunks = (s.run_chunks if s.run_chunks is not None
                      else default_run_chunks(steps, source.grid.chunk_size))
    block_chunks = (s.block_chunks if s.block_chunks is not None
                    else default_block_chunks(source, in_place and steps is None, run_chunks))
    if run_chunks is not None:
        if s.run_chunks is not None and s.run_chunks > block_chunks:
            raise ValueError(f"sampling.run_chunks={s.run_chunks} exceeds block_chunks="
                             f"{block_chunks}: a window holds whole runs")
        run_chunks = min(run_chunks, block_chunks)
    return block_chunks, run_chunks


DEFAULT_BLOCK_CHUNKS = 16
IN_PLACE_WINDOW_BYTES = 64 << 20


WINDOW_RUNS = (4, 8)  # runs per window with time steps: at least, at most
WINDOW_BYTES = 256 << 20  # decoded bytes of a window with time steps, by default


def default_block_chunks(source: Source, in_place: bool, run_chunks: int | None = None) -> int:
    """16 chunks per window; decoding in place without time steps (one sample per chunk,
    where the window's size does not change the shuffle: every chunk is one sample of a
    global permutation; with time steps windows are runs of adjacent chunks, and size does),
    windows of about 64 MB, at most 256 chunks, so the per-window planning is spread over
    enough chunks to keep the decode threads fed; batches go out as their rows land, so a
    larger window does not delay the first batch. With time steps (``run_chunks``), 4 to 8
    runs per window, as many as ~256 MB allow."""
    sample_bytes = sum(v.stripe_nbytes for v in source.variables)
    if run_chunks is not None:
        # time windows: several runs from scattered places mix a batch across the split;
        # as many as ~256 MB allow, between 4 and 8
        runs = WINDOW_BYTES // max(1, run_chunks * sample_bytes)
        return run_chunks * int(min(max(runs, WINDOW_RUNS[0]), WINDOW_RUNS[1]))
    if not in_place or not _one_sample_per_chunk(source):
        return DEFAULT_BLOCK_CHUNKS  # several samples per chunk: window size is mixing
    return max(DEFAULT_BLOCK_CHUNKS, min(256, IN_PLACE_WINDOW_BYTES // max(1, sample_bytes)))


def decodes_in_place(source: Source) -> bool:
    """Whether ``build_loader`` with its defaults decodes ``source`` straight into batches
    (one sample per chunk, as ARCO-ERA5 / WeatherBench2 / anemoi stores, or several on
    local files), with or without time steps: ``inspection.recommend`` sizes windows for
    that path."""
    return (_not_in_place(source, None, None, build_layout(source.variables)) is None
            and _in_place_by_default(source))


def _one_sample_per_chunk(source: Source) -> bool:
    return all(v.sample_chunk == 1 for v in source.variables)


def _in_place_by_default(source: Source) -> bool:
    """Where ``in_place=None`` decodes into batches: one sample per chunk on any store;
    several samples per chunk on local files, where the scatter copy runs on the decode
    threads (measured: README "Speed"); a remote store's reads await on the event loop,
    which would make the copies there, so its windows are gathered as before."""
    return _one_sample_per_chunk(source) or all(groups_reads(a) for a in source.arrays)


def _not_in_place(source: Source, steps: SampleWindow | None, decoder: FrameDecoder | None,
                  layout: BatchLayout | None) -> str | None:
    """Why the chunks cannot be decoded straight into batch rows (``None``: they can)."""
    if decoder is not None:
        return "decode='gpu' decodes on the device"
    if layout is None:
        return "the channels differ in dtype (stacked after the gather)"
    split = [v.name for i, v in enumerate(source.variables) if layout.direct(i) is None]
    if split:
        return (f"channels take only some levels of {split} (a chunk is split across "
                "channels); stack all their levels or none")
    return None


@dataclass(frozen=True)
class Graph:
    """A built graph: its last node (hand it to a ``Loader``), the named stages, and the
    ledger counting its resident decoded bytes."""

    root: BaseNode
    stages: dict[str, BaseNode]
    ledger: MemoryLedger


def connect_staging(gather: GatherNode, between: Sequence[BaseNode]) -> StagingSeam | None:
    """A staging seam for ``gather`` and the ``PinOrCudaNode`` after ``between``, if every
    stage between keeps the batch's tensors (else the gather would fill pinned buffers
    that a cast or stacking then leaves unused). Sets ``gather.staging``."""
    if not all(isinstance(n, TransformNode) and n.keeps_batch_memory for n in between):
        return None
    seam = StagingSeam()
    gather.staging = seam
    return seam


def transform_stages(node: BaseNode, source: Source, resolved: Resolved,
                     device: torch.device | None = None) -> tuple[BaseNode, list[BaseNode]]:
    """The per-batch stages after the gather (normalise and cast, static fields, channels
    stacked after a device gather, patches, channels last) over ``node``, as ``resolved``
    asks: (the last stage, the stages added). ``SampleDataset`` runs the same stages over
    batches of one sample, so a sample read by index is the loader's row."""
    sm = resolved.config.sample
    layout, channels = resolved.layout, resolved.channels
    between: list[BaseNode] = []
    if (sm.stats is not None or sm.dtype is not None or sm.fill_nan is not None
            or sm.mask):
        node = NormalizeNode(node, sm.stats if sm.stats is not None else Stats("", ()),
                             source.variables, dtype=sm.dtype, layout=layout,
                             schemes=sm.normalize, selection=source.selection,
                             fill_nan=sm.fill_nan, mask=sm.mask)
        between.append(node)
    if sm.static:
        check_static(sm.static, {v.name: v.sample_shape for v in source.variables},
                     len(sm.patch_size) if sm.patch_size is not None else 0)
        node = StaticFieldsNode(node, sm.static, device=device, dtype=sm.dtype)
        between.append(node)
    if channels and layout is None:
        node = StackChannelsNode(node, channels, key=resolved.channels_key)
        between.append(node)
    if sm.patch_size is not None:
        k = len(sm.patch_size)
        short = {v.name: v.sample_shape for v in source.variables if len(v.sample_shape) < k}
        if short:
            raise ValueError(f"patch_size={tuple(sm.patch_size)} cuts the last {k} dims of "
                             f"each sample, but these samples have fewer: {short}")
        shapes = {v.name: tuple(v.sample_shape[-k:]) for v in source.variables}
        if len(set(shapes.values())) > 1:  # one grid of patches cuts one grid of points
            raise ValueError(f"patch_size={tuple(sm.patch_size)} cuts every variable on one "
                             f"grid, but their last {k} dims differ: {shapes}; open the "
                             "variables of one grid (open_source(variables=...))")
        spatial = next(iter(shapes.values()))
        # given the shape, PatchNode checks the size now (not mid-epoch) and computes the
        # patch corners once
        node = PatchNode(node, sm.patch_size, sm.patch_stride, spatial_shape=spatial)
        between.append(node)
    if sm.channels_last or sm.drop_ensemble:
        node = ChannelsLastNode(node, (resolved.channels_key,),
                                -3 if sm.channels_last else None,
                                (-2,) if sm.drop_ensemble else ())
        between.append(node)
    return node, between


def build_graph(source: Source, manifest: SplitManifest, split: str, resolved: Resolved, *,
                upto: str | None = None, ops: Any = None) -> Graph:
    """Wire the standard graph for ``resolved`` (from ``resolve``). ``upto`` stops after a
    stage of ``STAGES`` (tests drive single stages); ``ops`` replaces the CUDA calls of
    ``PinOrCudaNode`` (tests run the CUDA path on CPU with fakes)."""
    if upto is not None and upto not in STAGES:
        raise ValueError(f"upto must be one of {STAGES}, got {upto!r}")
    cfg = resolved.config
    s, f, sm, d = cfg.sampling, cfg.fetch, cfg.sample, cfg.device
    steps = sm.time_steps
    ledger = MemoryLedger()
    stages: dict[str, BaseNode] = {}

    def done(name: str, node: BaseNode) -> bool:
        stages[name] = node
        return name == upto

    node: BaseNode = SplitNode(manifest, split, exclude=resolved.excluded)
    if done("split", node):
        return Graph(node, stages, ledger)
    node = ChunkPermuteNode(node, resolved.grid, seed=s.seed, rank=resolved.rank,
                            world_size=resolved.world_size, block_chunks=resolved.block_chunks,
                            uneven=s.uneven, contiguous=steps is not None,
                            run_chunks=resolved.run_chunks)
    if done("permute", node):
        return Graph(node, stages, ledger)
    node = ReadPlanNode(node, source.variables, offsets=None if steps is None else steps.offsets,
                        batch_size=s.batch_size if resolved.in_place else None,
                        drop_last=s.drop_last)
    if done("plan", node):
        return Graph(node, stages, ledger)
    layout = resolved.layout
    # Decode workers write into batches in memory shared with them (workers/).
    shared = SharedMemoryArena() if resolved.workers else None
    pool = BufferPool(ledger, allocate=shared.allocate if shared is not None else None)
    arena = (BatchArena(layout, pool, steps) if resolved.in_place and layout is not None
             else None)
    first = FirstBatch()  # the shuffle buffer tells the fetch what its first batch needs
    fetch = AsyncFetchNode(node, source, max_inflight=f.max_inflight,
                           prefetch_windows=resolved.prefetch_windows,
                           decode_threads=f.decode_threads, ledger=ledger, pool=pool,
                           retry=f.retry, device_decode=resolved.frame_decoder, arena=arena,
                           first=first, prefetch_next_epoch=f.prefetch_next_epoch,
                           workers=resolved.workers, shared=shared, cache=f.cache)
    if fetch.workers:
        # Worker processes import (0.3-0.5 s) while the training script builds its model,
        # instead of before the first batch.
        fetch.start()
    node = fetch
    if done("fetch", node):
        return Graph(node, stages, ledger)
    node = ShuffleBufferNode(node, source.variables, s.batch_size, drop_last=s.drop_last,
                             arena=arena, first=first)
    if done("shuffle", node):
        return Graph(node, stages, ledger)
    gather = GatherNode(node, source.variables, steps=steps, coords=source.batch_coords(),
                        layout=layout)
    if done("gather", gather):
        return Graph(gather, stages, ledger)
    node, between = transform_stages(gather, source, resolved, resolve_device(d.device))
    dev = ops.device if ops is not None else resolve_device(d.device)
    seam = connect_staging(gather, between) if dev is not None and dev.type == "cuda" else None
    if seam is not None:
        ops = ops if ops is not None else CudaOps(dev)
        if shared is not None:
            # Decode workers' shared batch memory, page-locked a segment at a time.
            shared.on_segment = ops.register_host
        elif arena is not None:
            # Decoded in place into pinned memory: the stager copies those batches to the
            # GPU from where they were decoded. Set before the first batch is allocated.
            arena.pool = BufferPool(ledger, allocate=PinnedArrays(ops))
    node = PinOrCudaNode(node, device=d.device, ring_size=d.ring_size, ops=ops, staging=seam)
    stages["pin"] = node
    return Graph(node, stages, ledger)
