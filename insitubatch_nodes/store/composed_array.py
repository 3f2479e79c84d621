"""One variable served from several stored arrays: a concat's periods, a join's member at
its own dates, a period or frequency cut from one store.

It stands where a ``zarr.Array`` stands in a ``Source`` (``shape``, ``chunks``, ``dtype``,
``arr[rows]``), so statistics, inspection and tests read it as they read an array; the
loader reads it stripe by stripe through ``io.served.composed``, each member with its own
read path, chunk keys and cache scope.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import zarr

from ..errors import UsageTypeError
from ..sampling.geometry import VariableGeometry
from ..sampling.rowmap import RowMap
from .axis_array import AxisArray


@dataclass(frozen=True, eq=False)
class ComposedArray:
    """Samples of ``rows`` read from ``arrays[m]`` (served as ``geoms[m]``: a stored array,
    or one sampled along another of its axes; in the store ``urls[m]``, icechunk snapshot
    ``snapshots[m]``), in composed stripes of ``chunk`` samples. Samples in no run (gaps)
    read as NaN (or the fill value): the source lists them as missing, so the loader never
    serves them."""

    arrays: tuple[zarr.Array | AxisArray, ...]
    geoms: tuple[VariableGeometry, ...]
    urls: tuple[str, ...]
    snapshots: tuple[str | None, ...]
    rows: RowMap
    chunk: int

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.rows.n_rows, *self.geoms[0].shape[1:])

    @property
    def chunks(self) -> tuple[int, ...]:
        """The composed stripe, then the inner chunking: whole rows where every member
        stores a sample in one chunk (then a stripe decodes straight into its rows)."""
        if all(g.chunks[1:] == g.shape[1:] for g in self.geoms):
            return (self.chunk, *self.shape[1:])
        return (self.chunk, *self.geoms[0].chunks[1:])

    @property
    def dtype(self) -> np.dtype:
        return self.geoms[0].dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def shards(self) -> None:
        return None

    @property
    def fill(self) -> Any:
        """What a gap reads as: NaN for floats, else the first member's fill value."""
        if self.dtype.kind in "fc":
            return np.nan
        fill = self.arrays[0].metadata.fill_value
        return 0 if fill is None else fill

    def member_chunks(self) -> tuple[int, ...]:
        return tuple(g.sample_chunk for g in self.geoms)

    def __getitem__(self, key: Any) -> np.ndarray:
        """``arr[rows, ...]``: rows a slice or an integer, the rest any numpy index."""
        first, rest = (key[0], key[1:]) if isinstance(key, tuple) else (key, ())
        if isinstance(first, (int, np.integer)):
            return self[(slice(int(first), int(first) + 1), *rest)][0] if first >= 0 else \
                self[(self.rows.n_rows + int(first), *rest)]
        if not isinstance(first, slice):
            raise UsageTypeError(f"a composed array is read along its sample axis by a slice or an "
                            f"integer, got {first!r}")
        g = np.arange(self.rows.n_rows, dtype=np.int64)[first]
        member, local = self.rows.locate(g)
        probe = np.empty((0, *self.shape[1:]), dtype=self.dtype)[(slice(None), *rest)]
        out = np.full((g.size, *probe.shape[1:]), self.fill, dtype=self.dtype)
        for m, arr in enumerate(self.arrays):
            at = np.flatnonzero(member == m)
            if at.size == 0:
                continue
            rows = local[at]
            lo, hi = int(rows.min()), int(rows.max()) + 1
            block = np.asarray(arr[(slice(lo, hi), *rest)])
            out[at] = block[rows - lo]
        return out


def composed_chunk(rows: RowMap, geoms: tuple[VariableGeometry, ...]) -> int:
    """The composed stripe length that reads the fewest member stripes: where every run
    starts on a member stripe edge and the members share a chunking, that chunking (each
    composed stripe is then one member stripe, read straight into place); else, of the
    members' chunkings and their gcd, the one whose stripes straddle the fewest member
    stripes (ties: the longer, fewer stripes to plan)."""
    chunks = [g.sample_chunk for g in geoms]
    g = np.arange(rows.n_rows, dtype=np.int64)
    member, local = rows.locate(g)
    served = member >= 0
    g, member, local = g[served], member[served], local[served]
    if g.size == 0:
        return max(chunks)
    stripe = local // np.asarray(chunks, dtype=np.int64)[member]

    def reads(c: int) -> int:
        """Member stripe reads to fill every composed stripe of ``c`` rows once."""
        key = np.stack([g // c, member, stripe])
        return int(1 + np.count_nonzero((key[:, 1:] != key[:, :-1]).any(axis=0)))

    candidates = sorted({*chunks, math.gcd(*chunks)}, reverse=True)
    return min(candidates, key=lambda c: (reads(c), -c))
