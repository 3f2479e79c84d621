"""Reader groups on the loader's side and the trainer's: the part of the grid a rank serves,
the process groups of ``read_group`` consecutive ranks, and the whole grid gathered back.

``build_loader(..., read_group=G)`` deals samples to model groups of ``G`` ranks (the schedule
sees rank ``r // G`` of ``W // G``: ``sampling/grid_parts.py``) and cuts the source to this
rank's part of the grid (``grid_part_of``, ``cut_grid``); static fields are cut the same
way. On the trainer's side ``read_groups(G)`` makes the groups' process groups and
``gather_grid`` all-gathers the parts into the whole grid on every rank of a group.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..errors import ConfigError, LoaderUsageError
from ..sampling.grid_parts import Deal, balanced_part, deal_of, grid_axis
from ..store.source import Source

__all__ = ["axis_from_end", "cut_grid", "gather_grid", "grid_part_of", "read_groups", "static_part"]


def _dims_text(source: Source, name: str) -> str:
    v = source.variable(name)
    dims = v.dimension_names
    return (f"{name} {tuple(v.shape)}" if dims is None else
            f"{name} {dict(zip(dims, v.shape, strict=True))}")


def grid_part_of(source: Source, deal: Deal) -> tuple[slice, dict[str, int]]:
    """(this rank's part of the grid, each variable's grid axis): ``slice(None)`` and no
    axes with ``read_group=1``. The grid axis (``grid_parts.grid_axis``) is an anemoi
    dataset's cells, else by dimension name (latitude, lat, y, cell, values...) or the
    latitude of trailing (lat, lon) axes; variables without one, or on grids of other
    lengths, are refused naming each variable and its dims."""
    if deal.read_group == 1:
        return slice(None), {}
    anemoi = source.format == "anemoi"
    found = {v.name: grid_axis(v.dimension_names, len(v.shape), last=anemoi)
             for v in source.variables}
    hint = ("reader groups cut every served variable along its grid; serve the variables "
            "of one grid (open_source(variables=[...]) or channels=), or read_group=1")
    lacking = [n for n, a in found.items() if a is None]
    if lacking:
        raise ConfigError(f"read_group={deal.read_group}: variables "
                          f"{[_dims_text(source, n) for n in lacking]} have no grid axis to "
                          f"cut (only the sample axis, or no latitude/cell-like dim); {hint}")
    axes = {n: int(a) for n, a in found.items() if a is not None}
    lengths = {n: source.variable(n).shape[a] for n, a in axes.items()}
    if len(set(lengths.values())) > 1:
        each = [f"{_dims_text(source, n)}: axis {axes[n]} of {lengths[n]}" for n in axes]
        raise ConfigError(f"read_group={deal.read_group}: the variables disagree on the grid "
                          f"({'; '.join(each)}); {hint}")
    n = next(iter(lengths.values()))
    if n < deal.read_group:
        raise ConfigError(f"read_group={deal.read_group} exceeds the {n} rows (cells) of the "
                          f"grid ({_dims_text(source, next(iter(axes)))}): a rank would read "
                          f"nothing; use read_group <= {n}")
    return balanced_part(n, deal.read_group, deal.member), axes


def axis_from_end(source: Source, axes: Mapping[str, int],
                  channels_last: bool = False) -> int | None:
    """The grid axis of the batch tensors counted from the end (-2: latitude rows of
    (..., lat, lon); -1: an anemoi dataset's cells) where every variable has it there, one
    further with ``channels_last`` (the channels, before the grid as stored, go last);
    ``None`` without reader groups (no ``axes``) or where variables differ."""
    found = {a - len(source.variable(n).shape) - int(channels_last) for n, a in axes.items()}
    return found.pop() if len(found) == 1 else None


def cut_grid(source: Source, part: slice, axes: Mapping[str, int]) -> Source:
    """``source`` cut to ``part`` along each variable's grid axis (``axes``): it reads and
    serves only that part (``Source.grid_part``)."""
    return source.grid_part(part, axes)


def static_part(static: Mapping[str, Any], source: Source, part: slice,
                axes: Mapping[str, int]) -> dict[str, Any]:
    """The static fields cut to ``part`` along the grid axis: a static field's dims are the
    last dims of a sample, so its grid axis is the variables' counted from the end (a field
    that does not reach it is served whole)."""
    from_end = {axes[v.name] - len(v.shape) for v in source.variables}
    if len(from_end) > 1:
        raise ConfigError(f"static fields {list(static)} with read_group > 1: the variables' "
                          f"grid axes lie at different places from the end "
                          f"({[_dims_text(source, n) for n in axes]}), so a static field's "
                          "part is not defined; serve variables of one layout")
    k = from_end.pop()
    first = next(iter(axes))
    n = source.variable(first).shape[axes[first]]
    out = {}
    for name, value in static.items():
        shape = tuple(value.shape)
        axis = len(shape) + k
        if axis < 0:  # the field does not span the grid axis: served whole
            out[name] = value
            continue
        if shape[axis] != n:
            raise ConfigError(f"static field {name!r} has shape {shape}: its axis {axis} "
                              f"({shape[axis]}) is not the grid's {n} rows (cells) of "
                              f"{_dims_text(source, first)}, so its part of the grid is not "
                              "defined")
        out[name] = value[(slice(None),) * axis + (part,)]
    return out


def _dist() -> Any:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise LoaderUsageError("reader groups need an initialised torch.distributed process "
                               "group (torch.distributed.init_process_group, as torchrun "
                               "sets up)")
    return dist


def read_groups(read_group: int) -> Any:
    """This rank's process group among the model groups of ``read_group`` consecutive ranks
    (ranks ``r // read_group`` together, as ``build_loader(read_group=)`` deals them).

    Every rank must call it, in the same order relative to its other ``new_group`` calls:
    it calls ``torch.distributed.new_group`` once for every group, as anemoi-core does.
    A world size ``read_group`` does not divide is a ``ConfigError`` naming both."""
    dist = _dist()
    deal = deal_of(dist.get_rank(), dist.get_world_size(), read_group)
    mine = None
    for g in range(deal.groups):
        group = dist.new_group(list(range(g * read_group, (g + 1) * read_group)))
        if g == deal.group:
            mine = group
    return mine


def gather_grid(tensor: torch.Tensor, group: Any = None, axis: int = -1,
                sizes: Sequence[int] | None = None) -> torch.Tensor:
    """The whole grid on every rank of ``group`` (a process group from ``read_groups``;
    ``None``: the default group): each rank's part, ``tensor``, all-gathered along ``axis``
    and joined in the group's rank order. The parts may differ in length along ``axis``
    (balanced parts: the first ``n % G`` one longer); ``sizes`` (each rank's length, in
    group rank order, e.g. ``grid_parts.balanced_sizes(n, G)``) saves the collective that
    finds them. Every other dim must agree. Not differentiable (a loader's batch needs no
    gradient)."""
    dist = _dist()
    world = dist.get_world_size(group)
    if world == 1:
        return tensor
    ndim = tensor.dim()
    if not -ndim <= axis < ndim:
        raise ConfigError(f"gather_grid: axis={axis} is not an axis of a tensor of shape "
                          f"{tuple(tensor.shape)}")
    axis %= ndim
    if sizes is None:
        mine = torch.tensor([tensor.shape[axis]], dtype=torch.int64, device=tensor.device)
        found = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(found, mine, group=group)
        sizes = [int(s.item()) for s in found]
    sizes = [int(s) for s in sizes]
    rank = dist.get_rank(group)
    if len(sizes) != world or sizes[rank] != tensor.shape[axis]:
        raise ConfigError(f"gather_grid: sizes={sizes} must give each of the group's {world} "
                          f"ranks its part's length along axis {axis} (this rank, {rank} of the "
                          f"group, holds {tensor.shape[axis]})")
    part = tensor.to(torch.uint8) if tensor.dtype == torch.bool else tensor  # gloo: no bool
    longest = max(sizes)
    if part.shape[axis] < longest:
        pad = list(part.shape)
        pad[axis] = longest - part.shape[axis]
        part = torch.cat([part, part.new_zeros(pad)], dim=axis)
    part = part.contiguous()
    parts = [torch.empty_like(part) for _ in range(world)]
    dist.all_gather(parts, part, group=group)
    whole = torch.cat([p.narrow(axis, 0, n) for p, n in zip(parts, sizes, strict=True)],
                      dim=axis)
    return whole.to(torch.bool) if tensor.dtype == torch.bool else whole
