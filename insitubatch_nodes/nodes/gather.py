"""GatherNode: turns batch draws into a batch, one coalesced gather per stripe per variable."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torchdata.nodes import BaseNode

from ..geometry import VariableGeometry
from .shuffle_buffer import BatchDraw


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    """The torch dtype ``torch.from_numpy`` gives for a numpy dtype (clear error if none)."""
    try:
        return torch.from_numpy(np.empty(0, dtype=dtype)).dtype
    except TypeError as e:
        raise TypeError(f"numpy dtype {dtype} has no torch equivalent: {e}") from None


class GatherNode(BaseNode[dict[str, torch.Tensor]]):
    """Copies the drawn rows into fresh CPU tensors (a batch the user may keep).

    ``np.take(..., out=, mode="clip")`` writes straight into the tensor's memory; the
    default ``mode="raise"`` buffers and runs at a third of the speed. The offsets come from
    geometry, so clipping never changes a value.
    """

    def __init__(self, source: BaseNode[BatchDraw], variables: Sequence[VariableGeometry]) -> None:
        super().__init__()
        self.source = source
        self.variables = tuple(variables)
        self._dtypes = tuple(torch_dtype(v.dtype) for v in self.variables)

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.source.reset(initial_state["source"] if initial_state is not None else None)

    def next(self) -> dict[str, torch.Tensor]:
        draw = next(self.source)
        n = int(draw.sample_index.size)
        batch: dict[str, torch.Tensor] = {}
        for var, dt, parts in zip(self.variables, self._dtypes, draw.parts, strict=True):
            t = torch.empty((n, *var.sample_shape), dtype=dt)
            out = t.numpy()
            for p in parts:
                np.take(p.array, p.offsets, axis=0, out=out[p.start : p.stop], mode="clip")
            batch[var.name] = t
        batch["sample_index"] = torch.from_numpy(draw.sample_index.astype(np.int64, copy=False))
        return batch

    def get_state(self) -> dict[str, Any]:
        return {"source": self.source.state_dict()}
