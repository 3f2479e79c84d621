"""The seven stages of the standard graph, one module each."""

from .async_fetch import AsyncFetchNode, DecodedWindow, FetchStats
from .chunk_permute import ChunkPermuteNode, EpochChunk
from .gather import GatherNode
from .normalize import NormalizeNode
from .pin_or_cuda import PinOrCudaNode
from .read_plan import ReadPlanNode
from .shuffle_buffer import BatchDraw, GatherPart, ShuffleBufferNode
from .split_node import SplitNode

__all__ = [
    "AsyncFetchNode", "BatchDraw", "ChunkPermuteNode", "DecodedWindow", "EpochChunk",
    "FetchStats", "GatherNode", "GatherPart", "NormalizeNode", "PinOrCudaNode", "ReadPlanNode",
    "ShuffleBufferNode", "SplitNode",
]
