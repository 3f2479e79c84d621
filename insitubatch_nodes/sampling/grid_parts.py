"""Reader groups: which model group a rank deals samples with, and which part of the grid it
reads. Pure functions, no IO (anemoi-core's ``get_balanced_partition_sizes`` and its groups).

Ranks ``r // G`` form a model group: the schedule deals samples to groups as it deals them to
ranks without reader groups (rank ``r // G`` of ``W // G``), so every rank of a group draws
the same samples in the same order. Rank ``r % G`` of the group serves its balanced part of
the grid along the first grid axis: ``balanced_part(n, G, r % G)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import ConfigError

# Dimension names that are the grid axis parts are cut along: latitude rows of a lat/lon
# grid, the cells (values, points) of an unstructured or reduced grid.
GRID_NAMES = frozenset({
    "latitude", "lat", "y", "rlat", "nlat", "south_north", "cell", "cells", "ncells",
    "values", "value", "grid", "grid_index", "gridpoint", "grid_point", "node",
    "nodes", "point", "points", "station", "stations", "ncol", "npoints",
})
# Dimension names that come before the grid and are never cut: levels, ensemble members,
# channels and variables.
NOT_GRID_NAMES = frozenset({
    "level", "levels", "lev", "plev", "pressure", "pressure_level", "isobaricinhpa",
    "height", "depth", "z", "altitude", "model_level", "hybrid", "ensemble", "member",
    "number", "realization", "variable", "variables", "channel", "channels", "band", "bands",
    "c", "time", "step", "lead_time", "valid_time",
})


def balanced_sizes(n: int, k: int) -> list[int]:
    """``n`` items in ``k`` contiguous parts whose sizes differ by at most one, the first
    ``n % k`` one larger (10 in 4: 3, 3, 2, 2), as anemoi's
    ``get_balanced_partition_sizes``."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ConfigError(f"balanced_sizes: n must be an integer >= 0, got {n!r}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(f"balanced_sizes: k must be an integer >= 1, got {k!r}")
    q, r = divmod(n, k)
    return [q + 1 if i < r else q for i in range(k)]


def balanced_part(n: int, k: int, i: int) -> slice:
    """Part ``i`` of ``balanced_sizes(n, k)``, as ``slice(start, stop)``."""
    sizes = balanced_sizes(n, k)
    if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < k:
        raise ConfigError(f"balanced_part: part i must be an integer in 0..{k - 1}, got {i!r}")
    start = sum(sizes[:i])
    return slice(start, start + sizes[i])


@dataclass(frozen=True)
class Deal:
    """Where one rank stands among reader groups: it is dealt samples as rank ``group`` of
    ``groups`` (the schedule's rank and world size), and reads part ``member`` of
    ``read_group`` of the grid."""

    rank: int
    world_size: int
    read_group: int

    @property
    def group(self) -> int:
        return self.rank // self.read_group

    @property
    def groups(self) -> int:
        return self.world_size // self.read_group

    @property
    def member(self) -> int:
        return self.rank % self.read_group


def deal_of(rank: int, world_size: int, read_group: int) -> Deal:
    """The ``Deal`` of ``rank`` of ``world_size`` with reader groups of ``read_group``;
    a world size ``read_group`` does not divide is a ``ConfigError`` naming both."""
    if isinstance(read_group, bool) or not isinstance(read_group, int) or read_group < 1:
        raise ConfigError(f"sampling.read_group must be an integer >= 1 (ranks per model "
                          f"group, each reading its part of the grid), got {read_group!r}")
    if world_size % read_group:
        divisors = [g for g in range(1, world_size + 1) if world_size % g == 0]
        raise ConfigError(f"sampling.read_group={read_group} does not divide world_size="
                          f"{world_size}: model groups are read_group consecutive ranks; use "
                          f"a read_group dividing it ({divisors}) or a world size that is a "
                          f"multiple of {read_group}")
    return Deal(int(rank), int(world_size), int(read_group))


def grid_axis(dims: Sequence[str | None] | None, ndim: int, *, last: bool = False) -> int | None:
    """The axis of a stored variable (axis 0 the sample axis) that parts of the grid are cut
    along, or ``None`` when it has none (only the sample axis).

    ``last``: the last axis (an anemoi dataset's cells). Else by dimension name where the
    store gives names: the first of ``GRID_NAMES`` (latitude, lat, y, cell, values, grid...),
    else the first name that is not a level, ensemble or channel axis (``NOT_GRID_NAMES``);
    without names, the latitude of trailing (lat, lon) axes: axis ``ndim - 2`` from three
    dims on ((time, lat, lon): 1; (time, level, lat, lon): 2), axis 1 of (sample, cells).
    """
    if ndim < 2:
        return None
    if last:
        return ndim - 1
    if dims is not None and len(dims) == ndim:
        names = [str(d).lower() if d is not None else None for d in dims]
        for axis in range(1, ndim):
            if names[axis] in GRID_NAMES:
                return axis
        named = [a for a in range(1, ndim) if names[a] is not None]
        if named:
            rest = [a for a in named if names[a] not in NOT_GRID_NAMES]
            if rest:
                return rest[0]
            if len(named) == ndim - 1:
                return None  # every axis named, none of them a grid
    return 1 if ndim == 2 else ndim - 2
