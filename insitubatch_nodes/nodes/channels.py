"""StackChannelsNode: picks levels of variables and stacks them into one channel tensor."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torchdata.nodes import BaseNode

from ..errors import ConfigError, UnknownNameError
from ..memory.layout import Channel
from ..sampling.geometry import VariableGeometry
from ..store.channel_names import level_index, level_label, split_channel
from ..store.source import Source
from ..store.statistics import GRID_DIMS
from .transform import TransformNode


def served_by(source: Source, channels: Sequence[Channel]) -> Source:
    """The source a loader given ``channels`` serves: where ``open_source`` discovered the
    variables (none named), only the channels' variables, so no other is read; else the
    source as opened (variables named are served beside the channels)."""
    if channels and not source.variables_given:
        return source.narrowed([c.variable for c in channels])
    return source


def resolve_channels(source: Source, channels: Sequence[str | tuple[str, Any]]) -> list[Channel]:
    """``["t2m", "z", ("t", 850), "t@500"]`` -> channels: a name alone is the variable
    (every level of it, in the order of its level coordinate, when it has a level axis) or a
    label of a labelled axis (an anemoi dataset's ``2t``); ``(name, level)`` or
    ``"name@level"`` picks one level by coordinate value (the variable's second dimension,
    e.g. ``level``): 500, 500.0 and "500" all pick a stored 500, named ``"t@500"`` as
    stored. The order given is the channel order. Refused, naming the entry and what to
    write instead: a channel given twice, a variable given whole beside one of its levels,
    a static field (``static=`` serves those), a level or name the store lacks."""
    out: list[Channel] = []
    shapes = set()
    labelled = {label: (var, k) for var in source.variables for k, label in
                enumerate(var.labels or ()) if label not in source.names}
    known = set(source.names) | set(labelled)
    given: dict[tuple[str, int | None], Any] = {}  # (variable, index) -> the entry naming it
    whole: dict[str, Any] = {}  # variable with levels given whole -> the entry
    picked: dict[str, Any] = {}  # variable with a level picked -> the first such entry
    for item in channels:
        name, level = split_channel(item, known)
        if level is None and name in labelled:  # an anemoi variable: a label of "data"
            var, k = labelled[name]
            chs = [Channel(var.name, k, name)]
            shapes.add(var.sample_shape[1:][-2:])
        elif level is not None and name in labelled:
            raise ConfigError(f"channel {item!r}: {name!r} is a label of "
                             f"{labelled[name][0].name!r} (one channel already), so it takes "
                             f"no level; give it alone: {name!r}")
        else:
            _check_served(source, item, name, labelled)
            var = source.variable(name)
            chs = (_whole(source, var) if level is None else [_level(source, var, item, level)])
            shapes.add(var.sample_shape[-2:])
            if len(var.sample_shape) == 3:  # a variable with levels
                mine, theirs = (whole, picked) if level is None else (picked, whole)
                if name in theirs:
                    w, lv = (item, theirs[name]) if level is None else (theirs[name], item)
                    raise ConfigError(
                        f"channels= gives {w!r} whole (every level) and {lv!r}, one of its "
                        f"levels, which would then be two channels: give {w!r} alone for "
                        f"every level, or only the levels to keep, e.g. [{lv!r}, ...]")
                mine.setdefault(name, item)
        for ch in chs:
            key = (ch.variable, ch.index)
            if key in given:
                first = given[key]
                again = ("given twice" if first == item
                         else f"the same channel as {first!r}")
                raise ConfigError(f"channel {item!r} ({ch.label}) is {again}: give each "
                                 f"channel once")
            given[key] = item
        out += chs
    if len(shapes) > 1:
        raise ConfigError(f"channels must share their spatial shape, got {sorted(shapes)}")
    return out


def _check_served(source: Source, item: Any, name: str,
                  labelled: Mapping[str, tuple[VariableGeometry, int]]) -> None:
    """Refuse a channel naming no variable served: a static field (to give as
    ``static=``), a store's variable left out of ``variables=``, or no name there."""
    if name in source.names:
        return
    if name in source.static:
        raise ConfigError(f"channel {item!r}: {name!r} is a static field (no "
                         f"{source.sample_dim or 'sample'} axis), not a variable: serve it "
                         f"with static=ib.open_static(source, [{name!r}]) (batch key "
                         f"'static/{name}'), not in channels= (on the command line, static "
                         "fields are not channels: leave it out of --channels)")
    have = f"variables: {list(source.names)}"
    if labelled:
        have += f", named channels: {list(labelled)}"
    if source.static:
        have += f"; static fields (static=): {list(source.static)}"
    stored = any(g is not None and name in g.array_keys()
                 for g in (source.group, *(m.group for m in source.members)))
    why = (f"; {name!r} is in the store but not in open_source(variables=...): add it there"
           if stored and source.variables_given else "")
    raise UnknownNameError(f"unknown channel {item!r}: {name!r} is not a variable served by "
                           f"{source.url}; {have}{why}")


def _whole(source: Source, var: VariableGeometry) -> list[Channel]:
    """The channels of ``var`` named alone: one, or one per level."""
    name = var.name
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
                labels = source.coordinate(dim, name).tolist()
        return [Channel(name, k, level_label(name, v)) for k, v in enumerate(labels)]
    if len(var.sample_shape) != 2:  # channels stack on the axis before (y, x)
        raise ConfigError(f"stacking {name!r} into channels needs samples shaped "
                         f"(y, x) or (level, y, x); its samples are "
                         f"{var.sample_shape} (dims {var.dimension_names}); serve "
                         "it on its own (leave it out of channels=)")
    return [Channel(name, label=name)]


def _level(source: Source, var: VariableGeometry, item: Any, level: Any) -> Channel:
    """The channel of ``item``, level ``level`` of ``var``, matched by value."""
    name = var.name
    if not var.dimension_names or len(var.shape) < 3:
        raise ConfigError(f"channel {item!r}: variable {name!r} has no level dimension to "
                         f"pick {level!r} from (dims {var.dimension_names}); give it alone: "
                         f"{name!r}")
    if len(var.sample_shape) != 3:  # _stack selects the level 3 axes from the end
        raise ConfigError(f"channel {item!r}: picking level {level!r} of {name!r} needs "
                         f"samples shaped (level, y, x); its dims are {var.dimension_names}"
                         + (f": give it alone, {name!r}" if len(var.sample_shape) == 2
                            and var.dimension_names[-1] in GRID_DIMS else ""))
    dim = var.dimension_names[1]
    if dim is None:
        raise UnknownNameError(f"the level dimension of {name!r} has no name (dims "
                               f"{var.dimension_names}), so no coordinate to pick "
                               f"{level!r} from")
    values = source.coordinate(dim, name)  # this variable's levels: its store's, a region's
    k = level_index(values, level)
    if k is None:
        # "t@501" (a command line's form) shows its level as written, not as the string
        # split off it; the example follows the form the entry used.
        written = isinstance(item, str)
        pair, label = f"({name!r}, {values.tolist()[0]!r})", level_label(name, values[0])
        raise UnknownNameError(f"channel {item!r}: {dim}={level if written else repr(level)} "
                               f"is not a level of {name!r}; levels: {values.tolist()} "
                               f"(write e.g. "
                               f"{f'{label!r} or {pair}' if written else f'{pair} or {label!r}'})")
    return Channel(name, k, level_label(name, values[k]))


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
