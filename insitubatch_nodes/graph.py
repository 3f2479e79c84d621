"""The standard graph, built from a ``LoaderConfig``: the one place that wires the stages.

``resolve`` turns a config into the numbers the graph needs (rank, prefetch depth, the
resident bound, the decoder) and raises every configuration error before a thread starts;
what an option left open becomes is ``defaults.py``'s policy. ``build_graph`` wires the
stages from that. ``build_loader``, the tests and the benchmarks
all go through here, so they cannot drift apart.

    SplitNode -> ChunkPermuteNode -> ReadPlanNode -> AsyncFetchNode -> ShuffleBufferNode
    -> GatherNode -> [NormalizeNode] [StaticFieldsNode] [StackChannelsNode] [PatchNode]
    -> PinOrCudaNode
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torchdata.nodes import BaseNode

from .config import LoaderConfig, SampleConfig
from .defaults import (
    decode_threads,
    every_steps,
    in_place_possible,
    resolve_in_place,
    resolve_keep_decoded,
    resolve_prefetch,
    resolve_workers,
    window_size,
)
from .errors import ConfigError, ConfigTypeError, UnknownNameError
from .graph_stages import transform_plan, transform_stages
from .io.device_decode import FrameDecoder, NvcompFrameDecoder
from .memory.arena import BatchArena
from .memory.budget import check_budget, parse_bytes, resident_bound, runs_in
from .memory.layout import CHANNELS_KEY, BatchLayout, Channel, build_layout
from .memory.ledger import BufferPool, MemoryLedger
from .memory.staging import StagingSeam
from .nodes import (
    AsyncFetchNode,
    ChunkPermuteNode,
    GatherNode,
    PinOrCudaNode,
    ReadPlanNode,
    ShuffleBufferNode,
    SplitNode,
)
from .nodes.channels import resolve_channels, served_by
from .nodes.pin_or_cuda import CudaOps, PinnedArrays, resolve_device
from .nodes.read_groups import cut_grid, grid_part_of, static_part
from .nodes.static import align_static, cut_static
from .sampling.deal_checks import check_batches, check_world_size, schedule_quality
from .sampling.geometry import SampleGrid
from .sampling.grid_parts import Deal, deal_of
from .sampling.permute import resolve_rank
from .sampling.schedule import ScheduleContext
from .sampling.windows import (
    SampleWindow,
    chunks_across_gaps,
    chunks_reaching,
    chunks_touching,
    unordered_at,
)
from .store.anemoi import DATA
from .store.source import Source
from .store.splits import SplitManifest
from .workers.shared_memory import SharedMemoryArena

log = logging.getLogger("insitubatch_nodes")

STAGES = ("split", "permute", "plan", "fetch", "shuffle", "gather", "pin")


@dataclass(frozen=True)
class Resolved:
    """What a config means for one source and split: the values ``build_graph`` wires."""

    config: LoaderConfig
    # the source served: the one given, or with ``channels=`` over discovered variables
    # (``open_source(url)``) only the channels' variables (``_stacking``). ``build_graph``
    # and ``SampleDataset`` read through it, so nothing else is read, decoded or served.
    source: Source
    rank: int  # this process's rank and world size
    world_size: int
    prefetch_windows: int
    grid: SampleGrid  # the sample grid, or the anchor grid when samples are time windows
    n_chunks: int  # chunks of the split
    block_chunks: int  # chunks per window (sampling.block_chunks, or the default for the path)
    run_chunks: int | None  # time windows: chunks per contiguous run (a window holds several)
    resident_bound: int  # bytes of decoded data that can be resident (memory/ledger.py's ledger)
    shuffle_quality: float  # the model's score for this configuration (1.0: global shuffle)
    frame_decoder: FrameDecoder | None  # decode="gpu": the device decoder
    channels: tuple[Channel, ...] | None  # sample.channels resolved against the source
    channels_key: str  # the batch key they are stacked into
    excluded: tuple[int, ...]  # chunks left out: their samples touch the store's missing steps
    # or (time steps) another split's chunks
    layout: BatchLayout | None  # where each variable lands in a host-gathered batch
    in_place: bool  # chunks decoded straight into their batch rows (no window, no gather)
    workers: int  # decode worker processes (0: decode threads in this process)
    keep_decoded: int  # bytes of decoded stripes kept across epochs (0: none)
    decode_threads: int  # the decode pool's threads (``defaults.decode_threads``)
    # reader groups: ranks r // G dealt samples as one rank (``deal.group`` of
    # ``deal.groups``), rank r % G reading ``grid_part`` of the grid along ``grid_axes``
    # (variable -> axis of the stored array; empty with read_group=1)
    deal: Deal
    grid_part: slice
    grid_axes: Mapping[str, int]


def resolve_decode(decode: str | FrameDecoder, device: str | torch.device | None,
                   ) -> FrameDecoder | None:
    """``"cpu"`` -> None; ``"gpu"`` -> nvCOMP on ``device`` (which must be CUDA); a
    ``FrameDecoder`` object is used as given (tests pass ``HostFrameDecoder``)."""
    if not isinstance(decode, str):
        if not isinstance(decode, FrameDecoder):
            raise ConfigTypeError(f"decode must be 'cpu', 'gpu' or a FrameDecoder, got {decode!r}")
        return decode
    if decode == "cpu":
        return None
    if decode != "gpu":
        raise ConfigError(f"decode must be 'cpu' or 'gpu', got {decode!r}")
    dev = resolve_device(device)
    if dev is None or dev.type != "cuda":
        raise ConfigError(f"decode='gpu' needs device='cuda' (got device={device!r}): the "
                         "batches are decoded and gathered on that GPU")
    return NvcompFrameDecoder(dev)


def _fraction(manifest: SplitManifest, split: str) -> str:
    if manifest.fractions and len(manifest.fractions) == len(manifest.names):
        return str(manifest.fractions[manifest.names.index(split)])
    return "unknown"


def _sample_grid(source: Source, steps: SampleWindow | None,
                 every: int | str | None) -> SampleGrid:
    """The grid samples are drawn from: the source's, or the anchors of ``steps`` (time
    windows), thinned by ``every``; a window longer than the axis is an error."""
    grid = source.grid if steps is None else steps.grid(source.grid)
    if every is not None:
        grid = grid.with_every(*every_steps(source, every))
    if steps is not None and grid.end <= grid.first:
        raise ConfigError(f"the time window {steps} spans {steps.span} steps, more than the "
                         f"{source.grid.n_samples} steps of {source.url}: no sample has "
                         "all its steps; shorten history, leads or stride")
    return grid


def _left_out(source: Source, manifest: SplitManifest, split: str, chunk_ids: np.ndarray,
              grid: SampleGrid, steps: SampleWindow | None) -> tuple[np.ndarray, np.ndarray]:
    """(chunks left out, of them those holding no anchor): chunks whose samples touch the
    store's missing steps, hold no kept anchor, or (time steps) reach another split."""
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
        at = unordered_at(source.sample_coord)
        if at is not None:
            c = source.sample_coord
            assert c is not None
            raise ConfigError(f"time steps {steps} count steps along {source.url}'s "
                              f"{source.sample_dim!r}, which does not move one way: "
                              f"{c[at]} at index {at}, then {c[at + 1]}; a step written twice "
                              "or out of order would put other times into a window")
        gaps = chunks_across_gaps(source.sample_coord, source.grid, steps)
        if gaps.size:
            log.info("split %r: chunks %s left out: their samples' time steps cross a gap in "
                     "the %r coordinate (a step missing from the store or from a member of "
                     "an inner join)", split, gaps[:8].tolist(), source.sample_dim)
            excluded = np.union1d(excluded, gaps)
        others = [manifest.chunk_ids(n) for n in manifest.names if n != split]
        others_ids = np.concatenate(others) if others else np.empty(0, dtype=np.int64)
        across = chunks_reaching(chunk_ids, others_ids, grid, steps)
        if across.size:
            log.info("split %r: chunks %s left out: their samples' time steps reach another "
                     "split's chunks (split_by_coordinate(gap=) keeps steps free between "
                     "splits instead)", split, across[:8].tolist())
            excluded = np.union1d(excluded, across)
    return excluded, anchorless


def _served_chunks(source: Source, manifest: SplitManifest, split: str, grid: SampleGrid,
                   steps: SampleWindow | None, every: int | str | None,
                   ) -> tuple[np.ndarray, np.ndarray]:
    """(the split's chunks served, those left out); a split left with none is an error
    saying why (no kept step, no whole time window, missing steps, no chunks at all)."""
    chunk_ids = manifest.chunk_ids(split)
    excluded, anchorless = _left_out(source, manifest, split, chunk_ids, grid, steps)
    if excluded.size:
        had = len(chunk_ids)
        chunk_ids = np.setdiff1d(chunk_ids, excluded)
        if had and len(chunk_ids) == 0:
            if anchorless.size == had and steps is None:
                raise ConfigError(f"split {split!r} holds no step kept by every={every!r}: "
                                 "give it more of the axis or keep more steps")
            if anchorless.size == had:
                raise ConfigError(
                    f"split {split!r} holds no sample of the time window {steps}: its "
                    f"chunks {anchorless[:8].tolist()} lie outside the steps "
                    f"{grid.first}..{grid.end - 1} whose window fits the axis; give it "
                    "more of the axis or shorten the window")
            raise ConfigError(
                f"every chunk of split {split!r} ({had}) is left out: its samples touch the "
                f"store's missing steps {list(source.missing)[:8]} or, with time steps "
                f"{steps}, cross a gap in the sample coordinate or reach another split's "
                "chunks (split_by_chunk(mode='random') "
                "interleaves the splits; use contiguous splits or split_by_coordinate(gap=))")
    if len(chunk_ids) == 0:
        raise ConfigError(
            f"split {split!r} has no chunks (its fraction is {_fraction(manifest, split)}); "
            f"splits with chunks: {[n for n in manifest.names if len(manifest.chunk_ids(n))]}"
        )
    return chunk_ids, excluded


def resolve(source: Source, manifest: SplitManifest, split: str,
            config: LoaderConfig) -> Resolved:
    """Check ``config`` against the source and split and size the graph; every error a
    configuration can have is raised here, naming the value and what would be valid."""
    s, f = config.sampling, config.fetch
    if split not in manifest.names:
        raise UnknownNameError(f"unknown split {split!r}; the manifest has splits "
                               f"{list(manifest.names)}")
    manifest.check_source(source, config.checkpoint.allow_snapshot_change)
    channels, channels_key, served = _stacking(source, config.sample)
    if served is not source:
        config = _names_served(config, source, served)
        source = served
    if config.sample.static:  # DataArrays on the data's points; whole-grid fields cut
        config = dataclasses.replace(config, sample=dataclasses.replace(
            config.sample, static=cut_static(align_static(config.sample.static, source),
                                             source)))
    rank, world_size = resolve_rank(s.rank, s.world_size)
    deal = deal_of(rank, world_size, s.read_group)
    part, axes = grid_part_of(source, deal)
    if axes:  # read_group > 1: this rank reads and serves its part of the grid only
        if config.sample.static:
            config = dataclasses.replace(config, sample=dataclasses.replace(
                config.sample, static=static_part(config.sample.static, source, part, axes)))
        source = cut_grid(source, part, axes)
    steps = config.sample.time_steps
    grid = _sample_grid(source, steps, s.every)
    chunk_ids, excluded = _served_chunks(source, manifest, split, grid, steps, s.every)
    decoder = resolve_decode(f.decode, config.device.device)
    # Host gathers write channels straight into their slice of "channels"; batches gathered
    # on a GPU (decode="gpu") are stacked afterwards.
    layout = (build_layout(source.variables, channels, channels_key) if decoder is None
              else None)
    in_place = resolve_in_place(source, f, decoder)
    workers = resolve_workers(source, f, in_place_possible(f, decoder),
                              decode_threads(f, source, in_place))
    in_place = in_place or workers > 0  # "auto" workers decode in place
    block_chunks, run_chunks, prefetch = _window(source, config, grid, steps, in_place,
                                                 workers)
    ctx = ScheduleContext(chunk_ids, grid, s.seed, block_chunks, s.uneven, steps is not None,
                          run_chunks)
    units = check_world_size(ctx, deal, split)
    check_batches(ctx, deal, split, s.batch_size, s.drop_last)
    keep, kept_bound, in_place = resolve_keep_decoded(
        source, f, in_place, workers, decoder is not None, len(chunk_ids), block_chunks, steps,
        run_chunks)
    bound = check_budget(source.grid, source.variables, f.memory_budget, block_chunks,
                         prefetch, s.batch_size, steps, in_place, run_chunks, kept_bound)
    return Resolved(
        config=config, source=source, rank=rank, world_size=world_size,
        prefetch_windows=prefetch, grid=grid,
        n_chunks=len(chunk_ids), block_chunks=block_chunks, run_chunks=run_chunks,
        resident_bound=bound,
        shuffle_quality=schedule_quality(ctx, source.grid.chunk_size, units, s.batch_size),
        frame_decoder=decoder, channels=channels, channels_key=channels_key, layout=layout,
        excluded=tuple(int(c) for c in excluded),
        in_place=in_place, workers=workers, keep_decoded=keep,
        decode_threads=decode_threads(f, source, in_place),
        deal=deal, grid_part=part, grid_axes=axes,
    )




def _window(source: Source, config: LoaderConfig, grid: SampleGrid,
            steps: SampleWindow | None, in_place: bool, workers: int,
            ) -> tuple[int, int | None, int]:
    """(block_chunks, run_chunks, prefetch_windows). The window is part of the plan, so it
    is chosen without the executor: the default, or under a ``memory_budget`` that does not
    hold it (at the default prefetch) the smaller default. Decode workers then go as many
    windows deeper as keep them busy and the budget holds (never fewer than the default)."""
    s, f = config.sampling, config.fetch
    budget = None if f.memory_budget is None else parse_bytes(f.memory_budget)
    base = resolve_prefetch(f, 0, s.batch_size, 0)  # the executor's share comes below

    def bound(block_chunks: int, run_chunks: int | None, prefetch: int) -> int:
        return resident_bound(source.grid, source.variables, block_chunks, prefetch,
                              s.batch_size, steps, in_place, runs_in(block_chunks, run_chunks))

    for smaller in (False, True):
        block_chunks, run_chunks = window_size(source, s, steps, in_place, smaller)
        if (s.block_chunks is not None or budget is None
                or bound(block_chunks, run_chunks, base) <= budget):
            break
    prefetch = resolve_prefetch(f, workers, s.batch_size, block_chunks * grid.chunk_size)
    while budget is not None and prefetch > base and bound(
            block_chunks, run_chunks, prefetch) > budget:
        prefetch -= 1
    return block_chunks, run_chunks, prefetch


def _stacking(source: Source, sm: SampleConfig,
              ) -> tuple[tuple[Channel, ...] | None, str, Source]:
    """The channels stacked, the batch key they go to (``channels=`` into "channels", or
    an anemoi dataset's ``variables=`` selection into "data": one or the other) and the
    source served: with ``channels=`` over variables ``open_source`` discovered (none named),
    only the channels' variables, so the others are neither read nor in the batch;
    variables named in ``open_source(variables=)`` are all served, beside the channels."""
    channels = tuple(resolve_channels(source, sm.channels)) if sm.channels else None
    source = served_by(source, channels or ())
    key = CHANNELS_KEY
    if source.selection is not None:
        if channels:
            raise ConfigError(
                f"the anemoi dataset {source.url!r} was opened with variables="
                f"{list(source.selection)} and the loader was given channels="
                f"{list(sm.channels or ())}: choose the variables in one of the two")
        # an anemoi selection: the chosen variables, in order, as batch["data"]
        channels = tuple(resolve_channels(source, source.selection))
    if source.format == "anemoi" and (source.selection is not None or not channels):
        key = DATA  # "data": the selection, or all of it (of every member of a join)
    if (sm.channels_last or sm.drop_ensemble) and not channels and source.format != "anemoi":
        raise ConfigError("sample.channels_last / drop_ensemble apply to stacked channels "
                         "(channels=[...]) or an anemoi dataset's data; this loader has "
                         f"neither (variables {list(source.names)})")
    if sm.drop_ensemble and source.format != "anemoi":
        raise ConfigError(f"sample.drop_ensemble: {source.url!r} is not an anemoi dataset, so "
                         "it has no ensemble axis")
    return channels, key, source


def _names_served(config: LoaderConfig, source: Source, served: Source) -> LoaderConfig:
    """``config`` with the names in ``normalize=`` and ``mask=`` of variables the store has
    but ``channels=`` left out (so not served) dropped: like statistics over more variables
    than are served, they apply to nothing. Names the store lacks stay, to be refused."""
    sm = config.sample
    gone = set(source.names) - set(served.names)
    normalize = ({k: v for k, v in sm.normalize.items() if k not in gone}
                 if sm.normalize is not None else None)
    mask = sm.mask if isinstance(sm.mask, bool) else tuple(n for n in sm.mask if n not in gone)
    if normalize == sm.normalize and mask == sm.mask:
        return config
    return dataclasses.replace(config, sample=dataclasses.replace(
        sm, normalize=normalize, mask=mask))


@dataclass(frozen=True)
class Graph:
    """A built graph: its last node (hand it to a ``Loader``), the named stages, and the
    ledger counting its resident decoded bytes."""

    root: BaseNode
    stages: dict[str, BaseNode]
    ledger: MemoryLedger


def _memory(resolved: Resolved, ledger: MemoryLedger, ops: CudaOps | None,
            ) -> tuple[SharedMemoryArena | None, BufferPool, BatchArena | None]:
    """The fetch's memory: the segments shared with decode workers (``ops``: staged for
    CUDA, each segment page-locked as it is made), the pool of stripe and batch buffers,
    and the arena of batches decoded in place (staged without workers: pinned memory,
    which the stager copies to the GPU from where it was decoded)."""
    shared = (SharedMemoryArena(on_segment=ops.register_host if ops is not None else None)
              if resolved.workers else None)
    pool = BufferPool(ledger, allocate=shared.allocate if shared is not None else None)
    batch_pool = (BufferPool(ledger, allocate=PinnedArrays(ops))
                  if ops is not None and shared is None else pool)
    layout = resolved.layout
    arena = (BatchArena(layout, batch_pool, resolved.config.sample.time_steps)
             if resolved.in_place and layout is not None else None)
    return shared, pool, arena


def build_graph(source: Source, manifest: SplitManifest, split: str, resolved: Resolved, *,
                upto: str | None = None, ops: Any = None) -> Graph:
    """Wire the standard graph for ``resolved`` (from ``resolve``). ``upto`` stops after a
    stage of ``STAGES`` (tests drive single stages); ``ops`` replaces the CUDA calls of
    ``PinOrCudaNode`` (tests run the CUDA path on CPU with fakes)."""
    if upto is not None and upto not in STAGES:
        raise ConfigError(f"upto must be one of {STAGES}, got {upto!r}")
    source = resolved.source  # what resolve serves of it (channels= may narrow it)
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
    # dealt by model group (read_group): every rank of a group draws the same samples
    node = ChunkPermuteNode(node, resolved.grid, seed=s.seed, rank=resolved.deal.group,
                            world_size=resolved.deal.groups, block_chunks=resolved.block_chunks,
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
    # Decided before any stage is built (no stage is changed after): the per-batch stages,
    # and on CUDA whether the gather (or the in-place decode) writes batches straight into
    # memory PinOrCudaNode copies from, which every stage between must keep.
    device = resolve_device(d.device)
    plan = transform_plan(source, resolved, device)
    dev = ops.device if ops is not None else device
    cuda = dev if dev is not None and dev.type == "cuda" else None
    staged = cuda is not None and all(st.keeps_batch_memory for st in plan)
    if staged and ops is None:
        assert cuda is not None
        ops = CudaOps(cuda)
    shared, pool, arena = _memory(resolved, ledger, ops if staged else None)
    fetch = AsyncFetchNode(node, source, max_inflight=f.max_inflight,
                           prefetch_windows=resolved.prefetch_windows,
                           decode_threads=resolved.decode_threads, ledger=ledger, pool=pool,
                           retry=f.retry, device_decode=resolved.frame_decoder, arena=arena,
                           batch_size=s.batch_size, prefetch_next_epoch=f.prefetch_next_epoch,
                           workers=resolved.workers, shared=shared, cache=f.cache,
                           worker_timeout_s=f.worker_timeout_s,
                           keep_decoded=resolved.keep_decoded)
    if fetch.workers:
        # Worker processes import (0.3-0.5 s) while the training script builds its model,
        # instead of before the first batch.
        fetch.start()
    node = fetch
    if done("fetch", node):
        return Graph(node, stages, ledger)
    node = ShuffleBufferNode(node, source.variables, s.batch_size, drop_last=s.drop_last)
    if done("shuffle", node):
        return Graph(node, stages, ledger)
    seam = StagingSeam() if staged else None  # attached by PinOrCudaNode's first batch
    gather = GatherNode(node, source.variables, steps=steps, coords=source.batch_coords(),
                        layout=layout, staging=seam)
    if done("gather", gather):
        return Graph(gather, stages, ledger)
    node, _ = transform_stages(gather, source, resolved, device, plan)
    node = PinOrCudaNode(node, device=d.device, ring_size=d.ring_size, ops=ops, staging=seam)
    stages["pin"] = node
    return Graph(node, stages, ledger)
