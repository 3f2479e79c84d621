"""The seven stages of the standard graph, one module each, plus the per-batch stages.

Item types live in ``sampling/items.py`` and counters in ``metrics/counters.py``; they are
re-exported here for code that imported them from the nodes.
"""

from ..metrics.counters import FetchStats, GatherStats, ShuffleStats
from ..sampling.items import BatchDraw, DecodedWindow, GatherPart, ScheduledWindow
from .async_fetch import AsyncFetchNode
from .chunk_permute import ChunkPermuteNode
from .gather import GatherNode
from .normalize import NormalizeNode
from .pin_or_cuda import PinOrCudaNode
from .read_plan import ReadPlanNode
from .shuffle_buffer import ShuffleBufferNode
from .split_node import SplitNode
from .transform import TransformNode

__all__ = [
    "AsyncFetchNode", "BatchDraw", "ChunkPermuteNode", "DecodedWindow", "FetchStats",
    "GatherNode", "GatherPart", "GatherStats", "NormalizeNode", "PinOrCudaNode", "ReadPlanNode",
    "ScheduledWindow", "ShuffleBufferNode", "ShuffleStats", "SplitNode", "TransformNode",
]
