"""ChunkPermuteNode: this epoch's chunk order, this rank's share, cut into windows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from ..geometry import SampleGrid
from ..items import ScheduledWindow
from ..schedule import RankSchedule, Resumption, ScheduleContext, rank_schedule
from .state import require, shutdown_source


class ChunkPermuteNode(BaseNode[ScheduledWindow]):
    """Permutes the split's chunks by (seed, epoch), deals this rank's share, keeps ranks at
    equal sample counts (``uneven``), and yields the share cut into windows.

    The epoch advances on each ``reset(None)`` once this epoch has started (torchdata's
    ``Loader`` resets on every ``iter()``). State: epoch, windows yielded, and the
    elastic-resume history of the current epoch (empty unless the world size changed
    mid-epoch; a state with a history and position 0 is how an elastic resume starts).
    """

    EPOCH_KEY = "epoch"
    POSITION_KEY = "position"  # windows of this epoch's schedule already yielded
    HISTORY_KEY = "history"

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
        self._ctx: ScheduleContext | None = None
        self._started = False
        self._pos = 0

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
            self.epoch = int(require(initial_state, self.EPOCH_KEY, self))
            self._pos = int(require(initial_state, self.POSITION_KEY, self))
            self.history = tuple(Resumption.from_json(h)
                                 for h in initial_state.get(self.HISTORY_KEY, ()))
            # A restored run counts as started: the next reset(None) is the next epoch.
            self._started = True
        else:
            if self._started:
                self.epoch += 1
            self.history = ()
            self._pos = 0
            self._started = False
        self.schedule = rank_schedule(self._context(), self.epoch, self.rank, self.world_size,
                                      self.history)

    def __len__(self) -> int:
        return 0 if self.schedule is None else len(self.schedule.windows)

    def next(self) -> ScheduledWindow:
        self._started = True
        assert self.schedule is not None, "reset() before next()"
        if self._pos >= len(self.schedule.windows):
            raise StopIteration
        self._pos += 1
        return ScheduledWindow(self._pos - 1, self.schedule.windows[self._pos - 1],
                               self.schedule)

    @classmethod
    def start_state(cls, epoch: int, history: Sequence[Resumption] = ()) -> dict[str, Any]:
        """The state that starts ``epoch`` after the given elastic resumptions (what
        ``merge_rank_states`` leads to): restoring it re-deals what is left of the epoch."""
        return {cls.EPOCH_KEY: int(epoch), cls.POSITION_KEY: 0,
                cls.HISTORY_KEY: [h.to_json() for h in history]}

    def get_state(self) -> dict[str, Any]:
        return {self.EPOCH_KEY: self.epoch, self.POSITION_KEY: self._pos,
                self.HISTORY_KEY: [h.to_json() for h in self.history]}

    def shutdown(self) -> None:
        """Nothing of its own to stop: pass it upstream (torchdata's protocol)."""
        shutdown_source(self.source)
