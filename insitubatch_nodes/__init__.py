"""insitubatch-nodes: train PyTorch models in place on Zarr arrays.

The standard graph is Split -> ChunkPermute -> ReadPlan -> AsyncFetch -> ShuffleBuffer ->
Gather -> PinOrCuda; ``build_loader`` composes it, and every node can be used on its own.
"""

from .budget import parse_bytes
from .config import (
    CheckpointConfig,
    DeviceConfig,
    FetchConfig,
    LoaderConfig,
    SampleConfig,
    SamplingConfig,
)
from .dataset import SampleDataset
from .distributed import merge_rank_states
from .fingerprint import StateFingerprint
from .first_batch import FirstBatch
from .geometry import SampleGrid, VariableGeometry
from .io.chunk_cache import ChunkCache
from .io.retry import ChunkReadError, CorruptChunkError, RetryPolicy
from .loader import InSituLoader, build_loader
from .memory import MemoryLedger
from .metrics import LoaderStats
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
from .nodes.static import StaticFieldsNode, open_static
from .plan import ReadPlan
from .quality import measured_shuffle_quality, recommend_block_chunks, shuffle_quality
from .source import Discovery, Source, discover, open_icechunk, open_source
from .split import SplitManifest, split_by_chunk, split_by_coordinate
from .staging import StagingSeam
from .stats import Stats, VariableStats, compute_stats, dataset_stats
from .windows import SampleWindow

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
    "CorruptChunkError", "StateFingerprint", "FirstBatch", "StackChannelsNode",
    "resolve_channels",
]
