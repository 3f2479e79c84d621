"""ChunkPermuteNode: this epoch's chunk order, this rank's share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from ..permute import epoch_chunk_order, rank_share


@dataclass(frozen=True)
class EpochChunk:
    """A chunk id tagged with the epoch it was drawn for, so plans can key on the epoch."""

    epoch: int
    chunk: int


class ChunkPermuteNode(BaseNode[EpochChunk]):
    """Permutes the upstream chunk ids by (seed, epoch) and keeps this rank's share.

    The epoch advances on each ``reset(None)`` once this epoch has started (torchdata's
    ``Loader`` resets on every ``iter()``). State: epoch and position, nothing else.
    """

    def __init__(self, source: BaseNode[int], seed: int = 0, rank: int = 0,
                 world_size: int = 1, *, epoch: int = 0) -> None:
        super().__init__()
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, "
                             f"world_size={world_size}")
        self.source = source
        self.seed = int(seed)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.epoch = int(epoch)
        self._started = False
        self._order: list[int] = []
        self._pos = 0

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is not None:
            self.epoch = int(initial_state["epoch"])
            self._pos = int(initial_state["position"])
            # A restored run counts as started: the next reset(None) is the next epoch.
            self._started = True
        else:
            if self._started:
                self.epoch += 1
            self._pos = 0
            self._started = False
        # The upstream split is small (chunk ids): read it whole, then deal.
        self.source.reset(None)
        ids = np.fromiter(self.source, dtype=np.int64)
        order = epoch_chunk_order(ids, self.seed, self.epoch)
        self._order = [int(i) for i in rank_share(order, self.rank, self.world_size)]

    def __len__(self) -> int:
        return len(self._order)

    def next(self) -> EpochChunk:
        self._started = True
        if self._pos >= len(self._order):
            raise StopIteration
        self._pos += 1
        return EpochChunk(self.epoch, self._order[self._pos - 1])

    def get_state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self._pos}
