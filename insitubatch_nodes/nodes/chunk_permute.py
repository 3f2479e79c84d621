"""ChunkPermuteNode: this epoch's chunk order, this rank's share, cut into windows."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from ..errors import ConfigError, StateError
from ..sampling.geometry import SampleGrid
from ..sampling.items import ScheduledWindow
from ..sampling.schedule import (
    RankSchedule,
    Resumption,
    ScheduleContext,
    rank_schedule,
    rank_schedules,
)
from .split_node import SplitNode
from .state import require_count, shutdown_source


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
                 contiguous: bool = False, epoch: int = 0,
                 run_chunks: int | None = None) -> None:
        super().__init__()
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"need 0 <= rank < world_size, got rank={rank}, "
                             f"world_size={world_size}")
        self.source = source
        self.grid = grid
        self.seed = int(seed)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.block_chunks = int(block_chunks)
        self.uneven = uneven
        self.contiguous = bool(contiguous)
        self.run_chunks = run_chunks  # contiguous mode: chunks per run (None: block_chunks)
        ScheduleContext(np.empty(0, np.int64), grid, self.seed, self.block_chunks, uneven,
                        self.contiguous, run_chunks)
        self.epoch = int(epoch)
        self.history: tuple[Resumption, ...] = ()
        self.schedule: RankSchedule | None = None
        self._ctx: ScheduleContext | None = None
        self._started = False
        self._pos = 0

    def _context(self) -> ScheduleContext:
        self.source.reset(None)
        # the standard head hands its ids over at once; any other upstream is iterated
        ids = (self.source.drain() if isinstance(self.source, SplitNode)
               else np.fromiter(self.source, dtype=np.int64))
        if self._ctx is None or not np.array_equal(self._ctx.chunk_ids, ids):
            self._ctx = ScheduleContext(ids, self.grid, self.seed, self.block_chunks, self.uneven,
                                        self.contiguous, self.run_chunks)
        return self._ctx

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is not None:
            self.epoch, self._pos, self.history = self.parse_state(initial_state)
            self.schedule = self.check_state(initial_state)
            # A restored run counts as started: the next reset(None) is the next epoch.
            self._started = True
            return
        if self._started:
            self.epoch += 1
        self.history = ()
        self._pos = 0
        self._started = False
        self.schedule = rank_schedule(self._context(), self.epoch, self.rank, self.world_size,
                                      self.history)

    def parse_state(self, state: Mapping[str, Any],
                    ) -> tuple[int, int, tuple[Resumption, ...]]:
        """(epoch, position, history) of a saved state; a field missing, retyped or
        negative is a ValueError naming it."""
        epoch = require_count(state, self.EPOCH_KEY, self)
        pos = require_count(state, self.POSITION_KEY, self)
        raw = state.get(self.HISTORY_KEY, [])
        return epoch, pos, parse_history(raw, f"{type(self).__name__} state field "
                                              f"{self.HISTORY_KEY!r}")

    def check_state(self, state: Mapping[str, Any], offset: int | None = None,
                    owner: str = "ShuffleBufferNode") -> RankSchedule:
        """The schedule ``state`` resumes, after checking its position is within that
        epoch's windows and, given ``offset`` (draws taken in the head window, from the
        ``ShuffleBufferNode`` or, decoding in place, the ``AsyncFetchNode``: ``owner``), that
        the head window has that many draws."""
        epoch, pos, history = self.parse_state(state)
        self._check_history(epoch, history)
        schedule = rank_schedule(self._context(), epoch, self.rank, self.world_size, history)
        n = len(schedule.windows)
        require_count(state, self.POSITION_KEY, self, n,
                      f"the {n} windows of epoch {epoch} on rank {self.rank} of "
                      f"{self.world_size}")
        if offset is not None:
            size = schedule.windows[pos].n_final if pos < n else 0
            if offset > size:
                raise StateError(
                    f"{owner} state field 'offset' is {offset}, past the {size} draws "
                    f"of window {pos} of epoch {epoch} on rank {self.rank} of "
                    f"{self.world_size}: the state was edited or saved by a loader built "
                    "differently")
        return schedule

    def _check_history(self, epoch: int, history: Sequence[Resumption]) -> None:
        """Each old rank's recorded progress must lie within the schedule it ran (the one
        the generation before computed for it): a record past a window's draws would make
        the re-deal skip the rest of that window silently. One schedule per old rank per
        resume (all of a generation's ranks dealt at once): paid once, on load."""
        ctx = self._context()
        for g, res in enumerate(history):
            schedules = rank_schedules(ctx, epoch, res.world_size, history[:g])
            for r, p in enumerate(res.progress):
                wins = schedules[r].windows
                size = wins[p.window].n_final if p.window < len(wins) else 0
                if p.window > len(wins) or p.offset > size:
                    raise StateError(
                        f"{type(self).__name__} state field {self.HISTORY_KEY!r}[{g}] says "
                        f"rank {r} of {res.world_size} finished {p.window} windows and took "
                        f"{p.offset} draws of the next, but it had {len(wins)} windows "
                        f"{'' if p.window >= len(wins) else f'and that one {size} draws '}"
                        "in that epoch: the state was edited (merge the ranks' own states "
                        "again with merge_rank_states)")

    def draws_in(self, epoch: int) -> int:
        """Draws (samples, or anchors with time steps) this rank yields in ``epoch``:
        the current schedule's for its epoch (a resumed one's included), else a fresh
        epoch's; after equal steps (``uneven``)."""
        if self.schedule is not None and epoch == self.epoch:
            return self.schedule.target
        ctx = self._ctx if self._ctx is not None else self._context()
        return rank_schedule(ctx, epoch, self.rank, self.world_size).target

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


def parse_history(raw: object, field: str) -> tuple[Resumption, ...]:
    """Elastic resumptions from their JSON form, checked: each is [world_size >= 1,
    [[window, offset] >= 0 for each old rank]]; else a ValueError naming ``field``."""
    def count(x: object) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= 0

    if not isinstance(raw, list):
        raise StateError(f"{field} must be a list of resumptions, got {raw!r}")
    out = []
    for i, h in enumerate(raw):
        ok = (isinstance(h, list) and len(h) == 2 and count(h[0]) and h[0] >= 1
              and isinstance(h[1], list) and len(h[1]) == h[0]
              and all(isinstance(p, list) and len(p) == 2 and count(p[0]) and count(p[1])
                      for p in h[1]))
        if not ok:
            raise StateError(f"{field}[{i}] must be [world_size, [[window, offset], ...] "
                             f"with one pair of integers >= 0 per old rank], got {h!r}")
        out.append(Resumption.from_json(h))
    return tuple(out)
