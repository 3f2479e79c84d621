"""A variable sampled along an axis that is not its first: an OME-Zarr volume's z-planes,
a satellite stack's (band, y, x, time) times.

It serves the array with the sample axis moved first and the others in their stored order
(``order[i]``: the stored axis of served axis ``i``), so splits, plans, slots and workers
work as on any variable; ``io.served.axis`` reads its stored chunks and copies each one
transposed into the stripe. ``arr[rows]`` reads the same way for statistics and tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import zarr

from ..errors import UsageTypeError


def sample_first(ndim: int, axis: int) -> tuple[int, ...]:
    """The served order of an array of ``ndim`` axes sampled along stored ``axis``."""
    return (axis, *(i for i in range(ndim) if i != axis))


@dataclass(frozen=True, eq=False)
class AxisArray:
    """The stored ``base`` served in ``order`` (the sample axis first)."""

    base: zarr.Array
    order: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(self.base.shape[k]) for k in self.order)

    @property
    def chunks(self) -> tuple[int, ...]:
        return tuple(int(self.base.chunks[k]) for k in self.order)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.base.dtype)

    @property
    def ndim(self) -> int:
        return len(self.order)

    @property
    def shards(self) -> None:
        return None

    @property
    def metadata(self) -> Any:
        return self.base.metadata

    def __getitem__(self, key: Any) -> np.ndarray:
        """``arr[rows, ...]`` in the served order: rows a slice or an integer."""
        first, rest = (key[0], key[1:]) if isinstance(key, tuple) else (key, ())
        if not isinstance(first, (slice, int, np.integer)):
            raise UsageTypeError(f"an array sampled along its axis {self.order[0]} is read "
                                 f"by a slice or an integer of samples, got {first!r}")
        at: list[Any] = [slice(None)] * self.ndim
        at[self.order[0]] = int(first) if isinstance(first, np.integer) else first
        data = np.asarray(self.base[tuple(at)])
        if isinstance(first, (int, np.integer)):  # the sample axis is gone
            rest_order = [k - (k > self.order[0]) for k in self.order[1:]]
            return np.transpose(data, rest_order)[rest]
        return np.transpose(data, self.order)[(slice(None), *rest)]
