"""ChannelsLastNode: a stacked key's channel axis moved last, as views (no copy)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torchdata.nodes import BaseNode

from ..errors import ConfigError
from .transform import TransformNode


class ChannelsLastNode(TransformNode[dict[str, torch.Tensor]]):
    """``(batch, [steps], C, *rest)`` -> ``(batch, [steps], *rest, C)`` for ``keys`` (and
    their ``target/`` keys), optionally dropping axes of size one first (``drop``: axis
    positions counted from the end of the sample, e.g. anemoi's ensemble axis). Views of
    the gathered batch: the layout anemoi-training asks for, without a pass over it;
    ``.contiguous()`` if a model needs it dense. Stateless."""

    keeps_batch_memory = True  # views of the same storage

    def __init__(self, source: BaseNode[dict[str, torch.Tensor]], keys: Sequence[str],
                 channel_axis_from_end: int | None, drop_from_end: Sequence[int] = ()) -> None:
        super().__init__(source)
        self.keys = tuple(keys)
        # negative, e.g. -3 for (C, E, N); None: only drop axes
        self.channel_axis = None if channel_axis_from_end is None else int(channel_axis_from_end)
        self.drop = tuple(sorted(int(a) for a in drop_from_end))
        # where the channel axis is once the dropped axes are gone
        self._moved = (None if self.channel_axis is None else
                       self.channel_axis + sum(1 for a in self.drop if a > self.channel_axis))

    def _view(self, key: str, t: torch.Tensor) -> torch.Tensor:
        for axis in self.drop:  # ascending negatives: the farthest axis first
            if t.shape[axis] != 1:
                raise ConfigError(f"batch key {key!r} has {t.shape[axis]} along axis {axis} "
                                 f"(shape {tuple(t.shape)}); only an axis of size 1 can be "
                                 "dropped (drop_ensemble needs a single ensemble member)")
        dropped = t.squeeze(self.drop) if self.drop else t
        return dropped if self._moved is None else dropped.movedim(self._moved, -1)

    def next(self) -> dict[str, Any]:
        batch = next(self.source)
        for key in self.keys:
            for k in (key, f"target/{key}"):
                if k in batch:
                    batch[k] = self._view(k, batch[k])
        return batch
