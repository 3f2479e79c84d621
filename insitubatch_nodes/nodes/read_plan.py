"""ReadPlanNode: turns each scheduled window into a read plan (stripes to read, draw order)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from ..geometry import VariableGeometry
from ..plan import ReadPlan
from ..schedule import plan_window
from .chunk_permute import EpochChunk


class ReadPlanNode(BaseNode[ReadPlan]):
    """Collects one window's chunks and yields its ``ReadPlan``: the deduplicated stripe reads
    of every variable and the seeded draw order.

    State: windows planned so far and the upstream state; plans are pure functions of the
    schedule, so nothing else is needed to rebuild them.
    """

    def __init__(self, source: BaseNode[EpochChunk], variables: Sequence[VariableGeometry],
                 offsets: Sequence[int] | np.ndarray | None = None) -> None:
        super().__init__()
        self.source = source
        self.variables = tuple(variables)
        # Steps each sample reads relative to its index (time windows): reads cover them all.
        self.offsets = None if offsets is None else np.asarray(offsets, dtype=np.int64)
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
        item = next(self.source)
        while not item.last:
            item = next(self.source)
        plan = plan_window(item.window, self.variables, self._window, self.offsets)
        self._window += 1
        return plan

    def get_state(self) -> dict[str, Any]:
        return {"window": self._window, "source": self.source.state_dict()}
