"""ReadPlanNode: turns each scheduled window into a read plan (stripes to read, draw order)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from ..sampling.geometry import VariableGeometry
from ..sampling.items import ScheduledWindow
from ..sampling.plan import BatchSlots, ReadPlan
from ..sampling.schedule import batch_slots, plan_window
from .state import require, shutdown_source


class ReadPlanNode(BaseNode[ReadPlan]):
    """Turns each scheduled window into its ``ReadPlan``: the deduplicated stripe reads of
    every variable and the seeded draw order.

    Stateless beyond its upstream: a plan is a pure function of the scheduled window, so
    the scheduler's position is all a restore needs.
    """

    SOURCE_KEY = "source"

    def __init__(self, source: BaseNode[ScheduledWindow], variables: Sequence[VariableGeometry],
                 offsets: Sequence[int] | np.ndarray | None = None, *,
                 batch_size: int | None = None, drop_last: bool = False) -> None:
        super().__init__()
        self.source = source
        self.variables = tuple(variables)
        # Steps each sample reads relative to its index (time steps): reads cover them all.
        self.offsets = None if offsets is None else np.asarray(offsets, dtype=np.int64)
        # Given a batch size, plans also say which batch row each draw lands in, so the
        # fetch can decode straight into the batches (one sample per chunk).
        self.batch_size = batch_size
        self.drop_last = drop_last

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.source.reset(None if initial_state is None
                          else require(initial_state, self.SOURCE_KEY, self))

    def next(self) -> ReadPlan:
        item = next(self.source)
        slots = None
        if self.batch_size is not None:
            batch, row = batch_slots(item.schedule, item.index, self.batch_size, self.drop_last)
            starts = item.schedule.draw_starts
            slots = BatchSlots(batch, row, self.batch_size, int(starts[-1]),
                               int(starts[item.index]))
        # the plan made once, slots included (no dataclasses.replace a window)
        return plan_window(item.spec, self.variables, item.index, self.offsets,
                           draws=item.schedule.draws_of(item.index), slots=slots)

    def get_state(self) -> dict[str, Any]:
        return {self.SOURCE_KEY: self.source.state_dict()}

    def start_state(self, upstream: dict[str, Any]) -> dict[str, Any]:
        """The state of this node before its first plan, over ``upstream``'s state."""
        return {self.SOURCE_KEY: upstream}

    def shutdown(self) -> None:
        """Nothing of its own to stop: pass it upstream (torchdata's protocol)."""
        shutdown_source(self.source)
