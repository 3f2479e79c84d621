"""ReadPlanNode: groups chunks into windows and plans each window's reads and draws."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torchdata.nodes import BaseNode

from ..geometry import SampleGrid, VariableGeometry
from ..plan import ReadPlan, make_read_plan
from .chunk_permute import EpochChunk


class ReadPlanNode(BaseNode[ReadPlan]):
    """Takes ``block_chunks`` chunks at a time and yields one ``ReadPlan`` per window.

    State: the window counter and the upstream state, which are enough to recompute every
    plan (plans are pure functions of geometry, seed, epoch and window).
    """

    def __init__(self, source: BaseNode[EpochChunk], grid: SampleGrid,
                 variables: Sequence[VariableGeometry], block_chunks: int, seed: int = 0,
                 rank: int = 0, world_size: int = 1) -> None:
        super().__init__()
        if block_chunks < 1:
            raise ValueError(f"block_chunks must be >= 1, got {block_chunks}")
        self.source = source
        self.grid = grid
        self.variables = tuple(variables)
        self.block_chunks = int(block_chunks)
        self.seed = int(seed)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self._window = 0

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is not None:
            self._window = int(initial_state["window"])
            self.source.reset(initial_state["source"])
        else:
            self._window = 0
            self.source.reset(None)

    def next(self) -> ReadPlan:
        chunks: list[int] = []
        epoch = None
        for _ in range(self.block_chunks):
            try:
                item = next(self.source)
            except StopIteration:
                break
            epoch = item.epoch
            chunks.append(item.chunk)
        if not chunks:
            raise StopIteration
        plan = make_read_plan(self.grid, self.variables, chunks, seed=self.seed, epoch=epoch,
                              window=self._window, rank=self.rank, world_size=self.world_size)
        self._window += 1
        return plan

    def get_state(self) -> dict[str, Any]:
        return {"window": self._window, "source": self.source.state_dict()}
