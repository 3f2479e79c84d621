"""insitubatch-nodes: train PyTorch models in place on Zarr arrays.

The standard graph is Split -> ChunkPermute -> ReadPlan -> AsyncFetch -> ShuffleBuffer ->
Gather -> PinOrCuda; ``build_loader`` composes it, and every node can be used on its own.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the same names for type checkers, typed (imported lazily at run time)
    from .config import (
        CheckpointConfig,
        DeviceConfig,
        FetchConfig,
        LoaderConfig,
        SampleConfig,
        SamplingConfig,
    )
    from .dataset import SampleDataset
    from .errors import (
        ConfigError,
        ConfigTypeError,
        InsitubatchError,
        InternalError,
        LoaderUsageError,
        LocalFileError,
        MissingDependencyError,
        SampleIndexError,
        StateError,
        StoreAccessError,
        StoreConnectionError,
        StoreError,
        StoreExistsError,
        StoreNotFoundError,
        TestServerError,
        UnknownNameError,
        UsageTypeError,
    )
    from .io.chunk_cache import ChunkCache
    from .io.retry import ChunkReadError, CorruptChunkError, RetryPolicy
    from .loader import InSituLoader, build_loader
    from .memory.budget import parse_bytes
    from .memory.ledger import MemoryLedger
    from .memory.staging import StagingSeam
    from .metrics.loader_stats import LoaderStats
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
    from .nodes.read_groups import gather_grid, read_groups
    from .nodes.static import StaticFieldsNode, open_static
    from .sampling.geometry import SampleGrid, VariableGeometry
    from .sampling.grid_parts import balanced_part, balanced_sizes
    from .sampling.plan import ReadPlan
    from .sampling.quality import measured_shuffle_quality, recommend_block_chunks, shuffle_quality
    from .sampling.windows import SampleWindow
    from .state.fingerprint import StateFingerprint
    from .state.ranks import merge_rank_states
    from .store.anemoi_spec import open_anemoi
    from .store.compose import concat, join
    from .store.discovery import Discovery, discover
    from .store.ome_zarr import describe_ome_zarr, open_ome_zarr
    from .store.served import Member
    from .store.source import Source, open_icechunk, open_source
    from .store.splits import SplitManifest, split_by_chunk, split_by_coordinate
    from .store.statistics import Stats, VariableStats, compute_stats, dataset_stats
    from .workers.engine import WorkerError

# Where each public name lives, imported on first use (PEP 562): a decode worker process
# imports ``insitubatch_nodes.workers.child`` and with it only the IO layer (numpy, zarr,
# the codecs), not torch and the whole graph.
_EXPORTS = {
    "parse_bytes": ".memory.budget",
    "CheckpointConfig": ".config",
    "ConfigError": ".errors",
    "InsitubatchError": ".errors",
    "StateError": ".errors",
    "StoreError": ".errors",
    "ConfigTypeError": ".errors",
    "InternalError": ".errors",
    "LoaderUsageError": ".errors",
    "LocalFileError": ".errors",
    "MissingDependencyError": ".errors",
    "SampleIndexError": ".errors",
    "StoreAccessError": ".errors",
    "StoreConnectionError": ".errors",
    "StoreExistsError": ".errors",
    "StoreNotFoundError": ".errors",
    "UnknownNameError": ".errors",
    "UsageTypeError": ".errors",
    "TestServerError": ".errors",
    "WorkerError": ".workers.engine",
    "DeviceConfig": ".config",
    "FetchConfig": ".config",
    "LoaderConfig": ".config",
    "SampleConfig": ".config",
    "SamplingConfig": ".config",
    "SampleDataset": ".dataset",
    "merge_rank_states": ".state.ranks",
    "StateFingerprint": ".state.fingerprint",
    "SampleGrid": ".sampling.geometry",
    "VariableGeometry": ".sampling.geometry",
    "ChunkCache": ".io.chunk_cache",
    "ChunkReadError": ".io.retry",
    "CorruptChunkError": ".io.retry",
    "RetryPolicy": ".io.retry",
    "InSituLoader": ".loader",
    "build_loader": ".loader",
    "MemoryLedger": ".memory.ledger",
    "LoaderStats": ".metrics.loader_stats",
    "AsyncFetchNode": ".nodes",
    "ChunkPermuteNode": ".nodes",
    "GatherNode": ".nodes",
    "NormalizeNode": ".nodes",
    "PinOrCudaNode": ".nodes",
    "ReadPlanNode": ".nodes",
    "ShuffleBufferNode": ".nodes",
    "SplitNode": ".nodes",
    "StackChannelsNode": ".nodes.channels",
    "resolve_channels": ".nodes.channels",
    "PatchNode": ".nodes.patches",
    "gather_grid": ".nodes.read_groups",
    "read_groups": ".nodes.read_groups",
    "balanced_part": ".sampling.grid_parts",
    "balanced_sizes": ".sampling.grid_parts",
    "StaticFieldsNode": ".nodes.static",
    "open_static": ".nodes.static",
    "ReadPlan": ".sampling.plan",
    "measured_shuffle_quality": ".sampling.quality",
    "recommend_block_chunks": ".sampling.quality",
    "shuffle_quality": ".sampling.quality",
    "Discovery": ".store.discovery",
    "Source": ".store.source",
    "discover": ".store.discovery",
    "open_icechunk": ".store.source",
    "open_source": ".store.source",
    "Member": ".store.served",
    "join": ".store.compose",
    "concat": ".store.compose",
    "open_anemoi": ".store.anemoi_spec",
    "open_ome_zarr": ".store.ome_zarr",
    "describe_ome_zarr": ".store.ome_zarr",
    "SplitManifest": ".store.splits",
    "split_by_chunk": ".store.splits",
    "split_by_coordinate": ".store.splits",
    "StagingSeam": ".memory.staging",
    "Stats": ".store.statistics",
    "VariableStats": ".store.statistics",
    "compute_stats": ".store.statistics",
    "dataset_stats": ".store.statistics",
    "SampleWindow": ".sampling.windows",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'insitubatch_nodes' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__version__ = "0.1.0"

__all__ = [
    "AsyncFetchNode", "ChunkPermuteNode", "GatherNode", "InSituLoader", "MemoryLedger",
    "PinOrCudaNode", "ReadPlan", "ReadPlanNode", "RetryPolicy", "SampleGrid",
    "ShuffleBufferNode", "Source", "SplitManifest", "SplitNode", "VariableGeometry",
    "build_loader", "measured_shuffle_quality", "merge_rank_states", "open_icechunk", "open_source",
    "parse_bytes", "recommend_block_chunks", "shuffle_quality", "split_by_chunk",
    "split_by_coordinate", "SampleWindow", "Stats", "VariableStats", "compute_stats",
    "NormalizeNode", "PatchNode", "StaticFieldsNode", "open_static", "LoaderStats",
    "discover", "Discovery", "dataset_stats",
    "LoaderConfig", "SamplingConfig", "FetchConfig", "SampleConfig", "DeviceConfig",
    "CheckpointConfig", "StagingSeam", "SampleDataset", "ChunkCache", "ChunkReadError",
    "CorruptChunkError", "StateFingerprint", "StackChannelsNode",
    "resolve_channels", "InsitubatchError", "ConfigError", "StoreError", "StateError",
    "WorkerError", "ConfigTypeError", "LoaderUsageError", "LocalFileError",
    "MissingDependencyError", "SampleIndexError", "StoreAccessError", "StoreConnectionError",
    "StoreExistsError", "StoreNotFoundError", "UnknownNameError", "UsageTypeError",
    "InternalError", "TestServerError", "join", "concat", "Member", "open_anemoi",
    "open_ome_zarr", "describe_ome_zarr",
    "gather_grid", "read_groups", "balanced_part", "balanced_sizes",
]
