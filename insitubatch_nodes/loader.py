"""``build_loader``: the standard graph in a ``torchdata.nodes.Loader`` that resumes exactly."""

from __future__ import annotations

import json
import re
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import zarr
import zarr.storage
from torchdata.nodes import BaseNode, Loader
from torchdata.nodes.loader import LoaderIterator

from .distributed import ELASTIC_KEY, SNAPSHOT_KEY
from .io.device_decode import FrameDecoder, NvcompFrameDecoder
from .io.retry import RetryPolicy
from .memory import MemoryLedger
from .metrics import ConsumerMeter, LoaderStats, collect_stats, first_node, maybe_log
from .nodes import (
    AsyncFetchNode,
    ChunkPermuteNode,
    GatherNode,
    NormalizeNode,
    PinOrCudaNode,
    ReadPlanNode,
    ShuffleBufferNode,
    SplitNode,
)
from .nodes.channels import StackChannelsNode, resolve_channels
from .nodes.patches import PatchNode
from .nodes.pin_or_cuda import DEFAULT_RING_SIZE, resolve_device
from .nodes.static import StaticFieldsNode
from .permute import resolve_rank
from .plan import max_window_nbytes
from .quality import shuffle_quality
from .schedule import Resumption, ScheduleContext, n_units
from .source import Source
from .split import SplitManifest
from .stats import Stats
from .windows import SampleWindow


class _ExactIterator(LoaderIterator):
    """torchdata 0.11's iterator counts the item it pre-fetches after a restore twice
    (upstream issue 1453); count each delivered item once."""

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        ring = self.loader._recent_states
        if ring is not None:
            # States are keyed by batches delivered *this epoch*: never answer from another.
            ring.clear()

    def next(self):  # noqa: D102
        if self._cached_item is not None:
            item = self._cached_item
            self._cached_item = None
            self._cached_state_dict = None
        else:
            meter = self.loader._meter
            t0 = time.perf_counter()
            try:
                item = next(self.root)
            except StopIteration:
                meter.epoch_end = time.perf_counter()
                raise
            finally:
                t1 = time.perf_counter()
                meter.waited(t1 - t0)
            self._num_yielded += 1
            if meter.next_log is not None:
                maybe_log(self.loader, t1)
            # Recorded when the item is pulled: a cached item (pulled by has_next) was
            # recorded then, with the same count and state.
            ring = self.loader._recent_states
            if ring is not None:
                ring.append((self._num_yielded,
                             {self.ROOT_KEY: self.root.state_dict(),
                              self.NUM_YIELDED_KEY: self._num_yielded}))
        return item


class InSituLoader(Loader):
    """A ``Loader`` that fixes two torchdata 0.11 resume defects and can be closed.

    A state loaded with ``load_state_dict`` always applies at the next ``iter()``, even when
    ``state_dict()`` was called on the fresh loader first (upstream PR 1548); states are
    copied in and out, so a caller mutating one cannot corrupt the loader.
    """

    def __init__(self, root: BaseNode, restart_on_stop_iteration: bool = True,
                 keep_states: int = 0, log_every_s: float | None = None) -> None:
        super().__init__(root, restart_on_stop_iteration)
        self._recent_states: deque | None = deque(maxlen=keep_states) if keep_states else None
        self._meter = ConsumerMeter()
        if log_every_s is not None:
            self.log_stats_every(log_every_s)

    def state_dict_at(self, num_yielded: int) -> dict[str, Any]:
        """The state as it was right after batch ``num_yielded`` of the current epoch.

        For trainers that fetch ahead of the step they checkpoint (Lightning prefetches one
        batch): build with ``keep_states=k`` and ask for the batches actually consumed.
        """
        if self._recent_states is None:
            raise ValueError("state_dict_at needs the loader built with keep_states >= 1")
        if self._it is not None and self._it._num_yielded == num_yielded:
            return self.state_dict()
        for n, state in reversed(self._recent_states):
            if n == num_yielded:
                return self._tag(json.loads(json.dumps(state)))
        kept = [n for n, _ in self._recent_states]
        raise ValueError(f"no state kept for num_yielded={num_yielded}; kept: {kept} "
                         "(raise keep_states)")

    def __iter__(self):
        if self._it is None:
            self._it = _ExactIterator(self)
        if not self._iter_for_state_dict:  # else iter() only hands back the pre-built one
            gather = self._stats_gather()
            self._meter.start_epoch(time.perf_counter(), (gather.stats.batches,
                                                          gather.stats.samples)
                                    if gather is not None else (0, 0))
        it = super().__iter__()
        self._meter.epoch_end = None  # a restored, finished epoch rolled on to the next one
        return it

    # -- metrics ----------------------------------------------------------------------
    def _stats_gather(self) -> GatherNode | None:
        return first_node(self._nodes(), GatherNode)

    def stats(self) -> LoaderStats:
        """A snapshot of the per-stage counters (``metrics.LoaderStats``), at any time."""
        return collect_stats(self)

    def log_stats_every(self, seconds: float | None, logger: Any = None,
                        level: int | None = None) -> None:
        """Log ``stats().summary()`` at most every ``seconds``, from the training thread as
        batches are delivered (``None`` turns it off). Default logger ``insitubatch_nodes``,
        level INFO."""
        if seconds is not None and not seconds > 0:
            raise ValueError(f"log_stats_every wants seconds > 0 (or None), got {seconds!r}")
        meter = self._meter
        meter.log_every_s = seconds
        meter.next_log = None if seconds is None else time.perf_counter() + seconds
        if logger is not None:
            meter.logger = logger
        if level is not None:
            meter.level = level

    snapshot_id: str | None = None  # icechunk snapshot being read, checked on load
    allow_snapshot_change: bool = False

    def state_dict(self) -> dict[str, Any]:
        if self._it is None:
            self._it = _ExactIterator(self)
        return self._tag(json.loads(json.dumps(super().state_dict())))

    def _tag(self, state: dict[str, Any]) -> dict[str, Any]:
        if self.snapshot_id is not None:
            state[SNAPSHOT_KEY] = self.snapshot_id
        return state

    def _check_snapshot(self, state: dict[str, Any]) -> None:
        saved = state.pop(SNAPSHOT_KEY, None)
        if (saved is not None and self.snapshot_id is not None and saved != self.snapshot_id
                and not self.allow_snapshot_change):
            raise ValueError(
                f"this loader state was saved while reading icechunk snapshot {saved}, but the "
                f"source now resolves to snapshot {self.snapshot_id} (the branch moved since). "
                "Resume on the saved snapshot (open_icechunk(..., snapshot_id=...)) or build "
                "the loader with allow_snapshot_change=True to continue on the new data."
            )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Apply a state at the next ``iter()``: one rank's own state, or the output of
        ``merge_rank_states`` (any world size)."""
        state_dict = json.loads(json.dumps(state_dict))
        self._check_snapshot(state_dict)
        # Without this, a state_dict() taken on the fresh loader makes the next iter()
        # reuse that pre-built iterator and silently ignore the loaded state.
        self._iter_for_state_dict = False
        if ELASTIC_KEY in state_dict:
            el = state_dict[ELASTIC_KEY]
            history = [Resumption.from_json(h) for h in el["history"]]
            self.node(ChunkPermuteNode).arm_elastic(int(el["epoch"]), history)
            self._next_iter_state_dict = None
            return
        super().load_state_dict(state_dict)

    # -- conveniences -----------------------------------------------------------------
    def _nodes(self) -> list[BaseNode]:
        out, node = [], self.root
        while node is not None:
            out.append(node)
            node = getattr(node, "source", None)
            if not isinstance(node, BaseNode):
                break
        return out

    def node(self, kind: type) -> Any:
        """The first node of type ``kind`` in the graph (e.g. ``AsyncFetchNode``)."""
        found = first_node(self._nodes(), kind)
        if found is None:
            raise LookupError(f"no {kind.__name__} in this loader's graph")
        return found

    @property
    def epoch(self) -> int:
        """The epoch the current (or, before ``iter``, the next) pass belongs to."""
        return self.node(ChunkPermuteNode).epoch

    def close(self) -> None:
        """Stop background threads now instead of at garbage collection."""
        for n in self._nodes():
            close = getattr(n, "close", None)
            if callable(close):
                close()

    def __enter__(self) -> InSituLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(value: int | str) -> int:
    """``4_000_000``, ``"4GB"``, ``"512MiB"`` -> bytes."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", str(value))
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"cannot read a byte size from {value!r}; write e.g. 4GB or 512MiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def build_loader(
    source: Source,
    manifest: SplitManifest,
    split: str,
    *,
    batch_size: int = 32,
    block_chunks: int = 16,
    seed: int = 0,
    max_inflight: int = 32,
    rank: int | None = None,
    world_size: int | None = None,
    device: str | torch.device | None = None,
    drop_last: bool = False,
    prefetch_windows: int | None = None,
    decode_threads: int | None = None,
    memory_budget: int | str | None = None,
    uneven: str = "pad",
    keep_states: int = 0,
    retry: RetryPolicy | None = None,
    allow_snapshot_change: bool = False,
    log_every_s: float | None = None,
    window: SampleWindow | None = None,
    stats: Stats | None = None,
    dtype: torch.dtype | None = None,
    channels: Sequence[str | tuple[str, Any]] | None = None,
    static: Mapping[str, Any] | None = None,
    patch_size: Sequence[int] | None = None,
    patch_stride: Sequence[int] | None = None,
    ring_size: int = DEFAULT_RING_SIZE,
    decode: str | FrameDecoder = "cpu",
) -> InSituLoader:
    """Compose Split -> ChunkPermute -> ReadPlan -> AsyncFetch -> ShuffleBuffer -> Gather ->
    PinOrCuda and wrap it in a loader; each ``iter(loader)`` is one epoch.

    ``memory_budget`` caps resident decoded data (windows held plus prefetched); a budget
    too small for ``block_chunks`` is an error that names the largest value that fits.
    ``rank``/``world_size`` default to the initialised ``torch.distributed`` group (else 0/1);
    ``uneven`` keeps ranks at equal step counts: ``"pad"`` (default: repeats a few samples of
    the rank's own last window), ``"drop"`` (cuts every rank to the smallest share) or
    ``"none"`` (unequal; never with DDP, whose last all-reduce would hang).
    ``window=SampleWindow(history, lead, stride)`` makes each sample a time window: the batch
    holds ``name`` (batch, history, ...) inputs and ``"target/name"`` (batch, n_leads, ...)
    targets, and windows are runs of adjacent chunks so that neighbours are resident.
    ``stats`` (from ``compute_stats``) standardises every variable it covers and ``dtype``
    (e.g. ``torch.bfloat16``) casts every variable, in a ``NormalizeNode`` before the device
    copy.
    ``channels=["t2m", ("z", 500)]`` stacks variables and chosen levels into ``"channels"``
    (and ``"target/channels"``), in that order, on the axis before the spatial ones.
    ``static={"lsm": array}`` (see ``open_static``) adds fields without a sample axis to every
    batch as ``"static/lsm"``; ``patch_size=(64, 64)`` (``patch_stride``) cuts every sample
    into spatial patches, each (sample, patch) pair once, with ``"patch"`` their corners.
    ``ring_size`` is the number of reused pinned host buffers on the CUDA path.
    ``decode="gpu"`` (with ``device="cuda"``; extra ``gpu-cu12`` or ``gpu-cu13``) decodes each
    window's zstd / LZ4 / gzip / blosc (lz4 or zstd streams) / uncompressed chunks in one
    nvCOMP batch per codec on the GPU and gathers the batches there; other chains (sharding,
    filters, blosclz) stay on the CPU, logged once per variable.
    ``prefetch_windows`` (windows fetched ahead of the one being drawn) defaults to 1 for
    local stores and 2 for object stores, where a window boundary would otherwise expose the
    request latency (measured: 0.73x vs 0.91x of the no-latency throughput at +50 ms).
    ``loader.stats()`` reads the per-stage metrics at any time; ``log_every_s`` logs their
    summary (logger ``insitubatch_nodes``, INFO) at most that often.
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    if not isinstance(block_chunks, int) or block_chunks < 1:
        raise ValueError(f"block_chunks must be an integer >= 1, got {block_chunks!r}")
    if split not in manifest.names:
        raise KeyError(f"unknown split {split!r}; the manifest has splits {list(manifest.names)}")
    manifest.check_source(source, allow_snapshot_change)
    if window is not None and window.is_single_step:
        window = None
    grid = source.grid if window is None else window.grid(source.grid)
    n_chunks = len(manifest.chunk_ids(split))
    if n_chunks == 0:
        raise ValueError(
            f"split {split!r} has no chunks (its fraction is {_fraction(manifest, split)}); "
            f"splits with chunks: {[n for n in manifest.names if len(manifest.chunk_ids(n))]}"
        )
    rank, world_size = resolve_rank(rank, world_size)
    if prefetch_windows is None:
        prefetch_windows = default_prefetch_windows(source)
    contiguous = window is not None
    units = n_units(ScheduleContext(manifest.chunk_ids(split), grid, seed, block_chunks, uneven,
                                    contiguous))
    if world_size > units:
        raise ValueError(
            f"world_size={world_size} exceeds the {units} "
            f"{'blocks' if contiguous else 'chunks'} of split {split!r}: a chunk "
            "is served by one rank, so some ranks would get nothing. Use at most "
            f"{units} ranks, or a split with more chunks."
        )
    need = _resident_bound(source, block_chunks, prefetch_windows, batch_size, window)
    if memory_budget is not None:
        budget = parse_bytes(memory_budget)
        if need > budget:
            fits = largest_block_chunks(source, budget, prefetch_windows, batch_size,
                                        block_chunks - 1, window)
            hint = (f"block_chunks={fits} fits" if fits else
                    "even block_chunks=1 does not fit; lower prefetch_windows or raise the budget")
            raise ValueError(
                f"memory_budget={memory_budget!r} ({budget:,} B) is below the {need:,} B that "
                f"block_chunks={block_chunks} with prefetch_windows={prefetch_windows} can hold "
                f"resident; {hint}"
            )

    frame_decoder = resolve_decode(decode, device)
    ledger = MemoryLedger()
    node: BaseNode = SplitNode(manifest, split)
    offsets = None if window is None else window.offsets
    node = ChunkPermuteNode(node, grid, seed=seed, rank=rank, world_size=world_size,
                            contiguous=contiguous,
                            block_chunks=block_chunks, uneven=uneven)
    node = ReadPlanNode(node, source.variables, offsets=offsets)
    node = AsyncFetchNode(node, source, max_inflight=max_inflight,
                          prefetch_windows=prefetch_windows, decode_threads=decode_threads,
                          ledger=ledger, retry=retry, device_decode=frame_decoder)
    node = ShuffleBufferNode(node, source.variables, batch_size, drop_last=drop_last)
    node = GatherNode(node, source.variables, window=window, coords=source.batch_coords())
    if stats is not None or dtype is not None:
        node = NormalizeNode(node, stats if stats is not None else Stats("", ()),
                             source.variables, dtype=dtype)
    if static:
        node = StaticFieldsNode(node, static, device=resolve_device(device))
    if channels:
        node = StackChannelsNode(node, resolve_channels(source, channels))
    if patch_size is not None:
        spatial = source.variables[0].sample_shape[-len(patch_size):]
        # given the shape, PatchNode checks the size now (not mid-epoch) and computes the
        # patch corners once
        node = PatchNode(node, patch_size, patch_stride, spatial_shape=spatial)
    node = PinOrCudaNode(node, device=device, ring_size=ring_size)
    loader = InSituLoader(node, keep_states=keep_states, log_every_s=log_every_s)
    loader.snapshot_id = source.snapshot_id
    loader.allow_snapshot_change = allow_snapshot_change
    loader.ledger = ledger
    loader.shuffle_quality = shuffle_quality(n_chunks, source.grid.chunk_size, block_chunks,
                                             batch_size)
    loader.resident_bound = need
    return loader


def resolve_decode(decode: str | FrameDecoder, device: str | torch.device | None,
                   ) -> FrameDecoder | None:
    """``"cpu"`` -> None; ``"gpu"`` -> nvCOMP on ``device`` (which must be CUDA); a
    ``FrameDecoder`` object is used as given (tests pass ``HostFrameDecoder``)."""
    if not isinstance(decode, str):
        if not hasattr(decode, "decode") or not hasattr(decode, "device"):
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


def default_prefetch_windows(source: Source) -> int:
    """1 window ahead on local disks; 2 on object stores, where a window edge would otherwise
    expose a round trip (README "Latency")."""
    remote = any(not isinstance(a.store_path.store, zarr.storage.LocalStore)
                 for a in source.arrays)
    return 2 if remote else 1


def largest_block_chunks(source: Source, budget: int, prefetch_windows: int, batch_size: int,
                         hi: int, window: SampleWindow | None = None) -> int | None:
    """Largest ``block_chunks`` in ``[1, hi]`` whose resident bound fits ``budget``. A scan,
    not a bisection: the bound is not monotone where batches span several windows."""
    fits = [b for b in range(1, hi + 1)
            if _resident_bound(source, b, prefetch_windows, batch_size, window) <= budget]
    return fits[-1] if fits else None


def _resident_bound(source: Source, block_chunks: int, prefetch_windows: int,
                    batch_size: int, window: SampleWindow | None = None) -> int:
    """Decoded bytes that can be resident: the window being drawn, the prefetched ones, and
    the stripes of the previous window that a batch straddling the edge still needs (each
    with its halo of neighbouring chunks when samples are time windows)."""
    halo = 0 if window is None else -(-max(window.before, window.after) // source.grid.chunk_size)
    window_bytes = max_window_nbytes(source.grid, source.variables, block_chunks + 2 * halo)
    window_samples = block_chunks * source.grid.chunk_size
    if batch_size > window_samples:
        # A batch spans whole windows: all of them (and the one it starts in) stay resident
        # until the batch is gathered, besides the prefetched ones.
        spans = -(-batch_size // window_samples) + 1
        return (spans + prefetch_windows) * window_bytes
    straddle = max_window_nbytes(source.grid, source.variables,
                                 min(batch_size, block_chunks) + 2 * halo)
    return (1 + prefetch_windows) * window_bytes + straddle


def _fraction(manifest: SplitManifest, split: str) -> str:
    if manifest.fractions and len(manifest.fractions) == len(manifest.names):
        return str(manifest.fractions[manifest.names.index(split)])
    return "unknown"
