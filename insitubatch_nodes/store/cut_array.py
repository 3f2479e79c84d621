"""A served variable's part of the grid: a reader group's share of the latitude rows or
cells, a region (a box in coordinate values, across the antimeridian too).

Like ``ComposedArray`` it stands where a ``zarr.Array`` stands in a ``Source``; the loader
reads it through ``io.served.cut``, which asks the stored array for the box alone (only the
blosc blocks holding it are fetched and decoded) and copies the part into place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import zarr

from ..errors import ConfigError, UsageTypeError
from ..sampling.geometry import VariableGeometry
from .axis_array import AxisArray
from .composed_array import ComposedArray

Ranges = tuple[tuple[int, int], ...]


def runs(index: np.ndarray) -> Ranges:
    """``index`` as the fewest ranges of consecutive increasing indices, in its order."""
    index = np.asarray(index, dtype=np.int64)
    if index.size == 0:
        return ()
    breaks = np.flatnonzero(np.diff(index) != 1) + 1
    starts = np.concatenate([[0], breaks])
    stops = np.concatenate([breaks, [index.size]])
    return tuple((int(index[a]), int(index[b - 1]) + 1)
                 for a, b in zip(starts, stops, strict=True))


@dataclass(frozen=True, eq=False)
class CutArray:
    """``base`` (stored as ``base_geom``) served with only ``cuts``: per axis after the
    sample axis, the ranges of its indices kept, in the order served (a region across the
    antimeridian: the eastern end, then the western start)."""

    base: zarr.Array | ComposedArray | AxisArray
    base_geom: VariableGeometry
    cuts: tuple[tuple[int, Ranges], ...]

    def __post_init__(self) -> None:
        for axis, rs in self.cuts:
            if not 1 <= axis < len(self.base_geom.shape) or not rs:
                raise ConfigError(f"a cut of variable {self.base_geom.name!r} of shape "
                                  f"{self.base_geom.shape} along axis {axis} to {rs}: the "
                                  "axis must be after the sample axis, the ranges not empty")
            if any(not 0 <= lo < hi <= self.base_geom.shape[axis] for lo, hi in rs):
                raise ConfigError(f"a cut of variable {self.base_geom.name!r} along axis "
                                  f"{axis} to {rs} is outside its {self.base_geom.shape[axis]} "
                                  "indices")

    def index(self, axis: int) -> np.ndarray:
        """The base indices served along ``axis``, in order."""
        for a, rs in self.cuts:
            if a == axis:
                return np.concatenate([np.arange(lo, hi) for lo, hi in rs])
        return np.arange(self.base_geom.shape[axis])

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(len(self.index(a)) if a else n
                     for a, n in enumerate(self.base_geom.shape))

    @property
    def chunks(self) -> tuple[int, ...]:
        return tuple(min(c, n) for c, n in zip(self.base_geom.chunks, self.shape, strict=True))

    @property
    def dtype(self) -> np.dtype:
        return self.base_geom.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def shards(self) -> None:
        return None

    def picks(self) -> tuple[Any, ...]:
        """What of a base stripe is served, as an index per axis after the first (an open
        mesh where several axes are cut)."""
        axes = range(1, len(self.base_geom.shape))
        index = [self.index(a) for a in axes]
        return np.ix_(*index) if len(index) > 1 else (index[0],)

    def __getitem__(self, key: Any) -> np.ndarray:
        """``arr[rows, ...]``: rows a slice or an integer, the rest any numpy index."""
        first, rest = (key[0], key[1:]) if isinstance(key, tuple) else (key, ())
        if not isinstance(first, (slice, int, np.integer)):
            raise UsageTypeError(f"a cut array is read along its sample axis by a slice or an "
                                 f"integer, got {first!r}")
        rows = np.asarray(self.base[int(first) if isinstance(first, np.integer) else first])
        if isinstance(first, (int, np.integer)):
            return np.asarray(rows[self.picks()])[rest]
        return np.asarray(rows[(slice(None), *self.picks())])[(slice(None), *rest)]


def cut(arr: zarr.Array | ComposedArray | CutArray | AxisArray, geom: VariableGeometry,
        cuts: Sequence[tuple[int, Ranges]]) -> CutArray:
    """``arr`` (served as ``geom``) cut further: the ranges of a cut array's own served
    indices map back onto its base, so a cut of a cut reads the base once."""
    if isinstance(arr, CutArray):
        mine = dict(arr.cuts)
        for axis, rs in cuts:
            served = arr.index(axis)
            mine[axis] = runs(np.concatenate([served[lo:hi] for lo, hi in rs]))
        return CutArray(arr.base, arr.base_geom, tuple(sorted(mine.items())))
    return CutArray(arr, geom, tuple(sorted(cuts)))


LONGITUDES = ("longitude", "lon")  # cyclic: a region may cross the antimeridian


def same_point(values: np.ndarray, alone: float = 1e-9) -> float:
    """How close two coordinate values must be to name one point: 0.1 % of the smallest
    spacing of ``values``, so a grid stored in float32 matches its float64 twin, and no
    two points of the grid are taken for one (``alone`` where there is no spacing)."""
    spacing = np.abs(np.diff(np.asarray(values, dtype=np.float64)))
    spacing = spacing[spacing > 0]
    return 1e-3 * float(spacing.min()) if spacing.size else alone


def coordinate_index(values: np.ndarray, bound: Any, dim: str) -> np.ndarray:
    """The indices of a 1-D coordinate within ``bound``: a ``(low, high)`` pair of values
    (both included, in either order; longitudes west to east across the antimeridian, in
    that order) or a ``slice`` of indices."""
    n = values.size
    if isinstance(bound, slice):
        index = np.arange(n)[bound]
    elif isinstance(bound, (tuple, list)) and len(bound) == 2:
        lo, hi = (float(b) for b in bound)
        v = np.asarray(values, dtype=np.float64)
        if dim.lower() in LONGITUDES:
            span = (hi - lo) % 360 if hi - lo < 360 else 360.0
            east = (v - lo) % 360
            keep = np.flatnonzero(east <= span + 1e-9)
            index = keep[np.argsort(east[keep], kind="stable")]
        else:
            index = np.flatnonzero((v >= min(lo, hi)) & (v <= max(lo, hi)))
    else:
        raise ConfigError(f"region {dim}={bound!r}: give (low, high) coordinate values or a "
                          "slice of indices")
    if index.size == 0:
        raise ConfigError(f"region {dim}={bound!r} holds no {dim} value; the {dim} "
                          f"coordinate spans {values.min()} .. {values.max()}")
    return index


def stored_arrays(arr: zarr.Array | ComposedArray | CutArray | AxisArray,
                  ) -> tuple[zarr.Array, ...]:
    """The stored arrays a served variable reads (a composed one: each member's)."""
    if isinstance(arr, CutArray):
        return stored_arrays(arr.base)
    if isinstance(arr, AxisArray):
        return (arr.base,)
    if isinstance(arr, ComposedArray):
        return tuple(a.base if isinstance(a, AxisArray) else a for a in arr.arrays)
    return (arr,)
