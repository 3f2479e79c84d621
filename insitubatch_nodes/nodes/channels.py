"""StackChannelsNode: picks levels of variables and stacks them into one channel tensor."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torchdata.nodes import BaseNode

from ..errors import ConfigError, UnknownNameError
from ..memory.layout import Channel
from ..store.source import Source
from .transform import TransformNode


def resolve_channels(source: Source, channels: Sequence[str | tuple[str, Any]]) -> list[Channel]:
    """``["t2m", "z", ("t", 850)]`` -> channels: a name alone is the variable (every level
    of it, in the order of its level coordinate, when it has a level axis) or a label of a
    labelled axis (an anemoi dataset's ``2t``), a pair picks one level by coordinate value
    (the variable's second dimension, e.g. ``level``). The order given is the channel
    order."""
    out = []
    shapes = set()
    labelled = {label: (var, k) for var in source.variables for k, label in
                enumerate(var.labels or ()) if label not in source.names}
    for item in channels:
        name, level = (item, None) if isinstance(item, str) else (item[0], item[1])
        if level is None and name in labelled:  # an anemoi variable: a label of "data"
            var, k = labelled[name]
            out.append(Channel(var.name, k, name))
            shapes.add(var.sample_shape[1:][-2:])
            continue
        if level is not None and name in labelled:
            raise ConfigError(f"channel {item!r}: {name!r} is a label of "
                             f"{labelled[name][0].name!r} (one channel already), so it takes "
                             f"no level; give it alone: {name!r}")
        if name not in source.names and labelled:
            raise UnknownNameError(f"unknown channel {name!r}; variables: {list(source.names)}, "
                                   f"named channels: {list(labelled)}")
        var = source.variable(name)
        if level is None:
            # A (level, y, x) sample gives a channel per level, a single level included
            # (as a whole channel its (1, y, x) rows did not fit the (y, x) slot).
            if len(var.sample_shape) > 2:
                if len(var.sample_shape) != 3:
                    raise ConfigError(f"stacking the levels of {name!r} needs samples shaped "
                                     f"(level, y, x); its dims are {var.dimension_names}")
                dim = var.dimension_names[1] if var.dimension_names else "level"
                labels: list[Any] = list(range(var.sample_shape[0]))  # no coordinate: indices
                if dim is not None:
                    with contextlib.suppress(KeyError, ValueError):
                        labels = source.coordinate(dim).tolist()
                out += [Channel(name, k, f"{name}@{v}") for k, v in enumerate(labels)]
                shapes.add(var.sample_shape[1:])
                continue
            if len(var.sample_shape) != 2:  # channels stack on the axis before (y, x)
                raise ConfigError(f"stacking {name!r} into channels needs samples shaped "
                                 f"(y, x) or (level, y, x); its samples are "
                                 f"{var.sample_shape} (dims {var.dimension_names}); serve "
                                 "it on its own (leave it out of channels=)")
            out.append(Channel(name, label=name))
            shapes.add(var.sample_shape[-2:])
            continue
        if not var.dimension_names or len(var.shape) < 3:
            raise ConfigError(f"variable {name!r} has no level dimension to pick {level!r} from")
        if len(var.sample_shape) != 3:  # _stack selects the level 3 axes from the end
            raise ConfigError(f"picking level {level!r} of {name!r} needs samples shaped "
                             f"(level, y, x); its dims are {var.dimension_names}")
        dim = var.dimension_names[1]
        if dim is None:
            raise UnknownNameError(f"the level dimension of {name!r} has no name (dims "
                                   f"{var.dimension_names}), so no coordinate to pick "
                                   f"{level!r} from")
        values = source.coordinate(dim)
        hits = np.flatnonzero(values == level)
        if hits.size != 1:
            raise UnknownNameError(f"{dim}={level!r} is not a level of {name!r}; levels: "
                                   f"{values.tolist()}")
        out.append(Channel(name, int(hits[0]), f"{name}@{level}"))
        shapes.add(var.sample_shape[1:][-2:])
    if len(shapes) > 1:
        raise ConfigError(f"channels must share their spatial shape, got {sorted(shapes)}")
    return out


class StackChannelsNode(TransformNode[dict[str, torch.Tensor]]):
    """Adds ``key`` (and ``"target/" + key``) holding the channels stacked, in the order given,
    on the axis just before the spatial ones: ``(batch, C, y, x)``, or with time steps
    ``(batch, steps, C, y, x)``. The per-variable tensors are dropped unless ``keep``."""

    def __init__(self, source: BaseNode[dict[str, torch.Tensor]], channels: Sequence[Channel],
                 key: str = "channels", keep: bool = False) -> None:
        super().__init__(source)
        self.channels = tuple(channels)
        self.key = key
        self.keep = keep
        self._used = {p + ch.variable for ch in self.channels for p in ("", "target/")}


    def _stack(self, batch: dict[str, torch.Tensor], prefix: str) -> torch.Tensor | None:
        parts = []
        for ch in self.channels:
            t = batch.get(prefix + ch.variable)
            if t is None:
                return None
            if ch.index is None:
                parts.append(t)
            else:  # the level axis sits 2 dims before the spatial ones' end
                parts.append(t.select(t.dim() - 3, ch.index))
        return torch.stack(parts, dim=parts[0].dim() - 2)

    def next(self) -> dict[str, torch.Tensor]:
        batch = next(self.source)
        stacked = {p + self.key: x for p in ("", "target/")
                   if (x := self._stack(batch, p)) is not None}
        if not self.keep:
            batch = {k: v for k, v in batch.items() if k not in self._used}
        batch.update(stacked)
        return batch
