"""ChunkPermuteNode: this epoch's chunk order, this rank's share, cut into windows."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from ..geometry import SampleGrid
from ..schedule import RankSchedule, Resumption, ScheduleContext, WindowSpec, rank_schedule


@dataclass(frozen=True)
class EpochChunk:
    """A chunk id with the window it was scheduled into (which knows its epoch).

    ``last`` marks the window's last chunk, so the planner knows when a window is complete
    without reading ahead.
    """

    chunk: int
    window: WindowSpec
    last: bool

    @property
    def epoch(self) -> int:
        return self.window.epoch


class ChunkPermuteNode(BaseNode[EpochChunk]):
    """Permutes the split's chunks by (seed, epoch), deals this rank's share, keeps ranks at
    equal sample counts (``uneven``), and tags each chunk with its window.

    The epoch advances on each ``reset(None)`` once this epoch has started (torchdata's
    ``Loader`` resets on every ``iter()``). State: epoch, position, and the elastic-resume
    history of the current epoch (empty unless the world size changed mid-epoch).
    """

    def __init__(self, source: BaseNode[int], grid: SampleGrid, *, seed: int = 0, rank: int = 0,
                 world_size: int = 1, block_chunks: int = 16, uneven: str = "pad",
                 contiguous: bool = False, epoch: int = 0) -> None:
        super().__init__()
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, "
                             f"world_size={world_size}")
        self.source = source
        self.grid = grid
        self.seed = int(seed)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.block_chunks = int(block_chunks)
        self.uneven = uneven
        self.contiguous = bool(contiguous)
        ScheduleContext(np.empty(0, np.int64), grid, self.seed, self.block_chunks, uneven)
        self.epoch = int(epoch)
        self.history: tuple[Resumption, ...] = ()
        self.schedule: RankSchedule | None = None
        self._armed: tuple[int, tuple[Resumption, ...]] | None = None
        self._ctx: ScheduleContext | None = None
        self._started = False
        self._starts = np.zeros(1, dtype=np.int64)
        self._pos = 0

    def arm_elastic(self, epoch: int, history: Sequence[Resumption]) -> None:
        """Make the next ``reset(None)`` continue ``epoch`` after the given resumptions."""
        self._armed = (int(epoch), tuple(history))

    def _context(self) -> ScheduleContext:
        self.source.reset(None)
        ids = np.fromiter(self.source, dtype=np.int64)
        if self._ctx is None or not np.array_equal(self._ctx.chunk_ids, ids):
            self._ctx = ScheduleContext(ids, self.grid, self.seed, self.block_chunks, self.uneven,
                                        self.contiguous)
        return self._ctx

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is not None:
            self.epoch = int(initial_state["epoch"])
            self._pos = int(initial_state["position"])
            self.history = tuple(Resumption.from_json(h)
                                 for h in initial_state.get("history", ()))
            # A restored run counts as started: the next reset(None) is the next epoch.
            self._started = True
        elif self._armed is not None:
            self.epoch, self.history = self._armed
            self._armed = None
            self._pos = 0
            self._started = True
        else:
            if self._started:
                self.epoch += 1
            self.history = ()
            self._pos = 0
            self._started = False
        self.schedule = rank_schedule(self._context(), self.epoch, self.rank, self.world_size,
                                      self.history)
        sizes = [w.chunk_ids.size for w in self.schedule.windows]
        self._starts = np.concatenate(([0], np.cumsum(sizes, dtype=np.int64)))
        self._total = int(self._starts[-1])
        self._cursor: tuple[int, list[int]] | None = None  # (window, its chunk ids)

    def __len__(self) -> int:
        return int(self._starts[-1])

    def next(self) -> EpochChunk:
        self._started = True
        if self._pos >= self._total:
            raise StopIteration
        cur = self._cursor
        if cur is None or self._pos >= int(self._starts[cur[0] + 1]):
            # Entering a window (or restoring mid-schedule): look it up once, not per chunk.
            w = int(np.searchsorted(self._starts, self._pos, side="right")) - 1
            cur = self._cursor = (w, self.schedule.windows[w].chunk_ids.tolist())
        w, ids = cur
        j = self._pos - int(self._starts[w])
        self._pos += 1
        return EpochChunk(ids[j], self.schedule.windows[w], last=j == len(ids) - 1)

    def get_state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self._pos,
                "history": [h.to_json() for h in self.history]}
