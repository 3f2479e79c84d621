"""Reading a cut variable's stripe (a part of the grid): the stored stripe is read for the
box alone, then the part copied into place.

The box goes to the stored array's reader as a ``PartSpec``: inner chunks outside it are
not read, blosc chunks decode (and object stores fetch) only the blocks holding it. The
stripe is decoded into a per-thread buffer of the stored stripe's shape (only the box's
bytes are valid there) and the served indices copied from it: one copy of the part.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Executor
from typing import Any

import numpy as np

from ...sampling.geometry import VariableGeometry
from ...store.cut_array import CutArray, runs
from ..partial.ranges import PartSpec, merge
from ..retry import NO_RETRY, RetryPolicy
from ..thread_buffer import ThreadBuffer
from .wrapped import WrappedReader

_BASE = ThreadBuffer()  # the stored stripe, per pool thread


class CutReader(WrappedReader):
    """Fills ``out`` (the cut variable's ``geom.stripe_shape``) with stripe ``index``,
    reading the stored stripe through ``base`` (its own reader) for the box alone."""

    KIND = "served in part (a read group's part of the grid, a region)"

    def __init__(self, arr: CutArray, geom: VariableGeometry, source_url: str,
                 base: Any) -> None:
        super().__init__([base], geom, source_url)
        self.arr = arr
        self.base = base
        self._index = {a: arr.index(a) for a in range(1, len(geom.shape))}
        self._parts: dict[PartSpec | None, tuple[PartSpec, tuple[Any, ...]]] = {}

    def describe(self, index: int) -> str:
        return f"{self.base.describe(index)}, cut to {self.arr.cuts}"

    def _part(self, part: PartSpec | None) -> tuple[PartSpec, tuple[Any, ...]]:
        """The stored array's part to read (the cut's box, narrowed to ``part`` along axis
        1) and what of its stripe to copy, per axis after the first (computed once)."""
        got = self._parts.get(part)
        if got is None:
            take = dict(self._index)
            if part is not None:  # levels wanted, counted in the served axis 1
                take[1] = np.concatenate([take[1][lo:hi] for lo, hi in part.ranges])
            box = tuple((a, merge(runs(np.sort(take[a])))) for a in sorted(take) if a >= 2
                        and take[a].size < self.arr.base_geom.shape[a])
            spec = PartSpec(merge(runs(np.sort(take[1]))), box)
            served = [np.arange(len(self._index[a])) for a in sorted(take)]
            if part is not None:
                served[0] = np.concatenate([np.arange(lo, hi) for lo, hi in part.ranges])
            picks = [take[a] for a in sorted(take)]
            got = self._parts[part] = (spec, (_index(served), _index(picks)))
        return got

    def _copy(self, stored: np.ndarray, out: np.ndarray, part: PartSpec | None) -> None:
        t0 = time.perf_counter()
        dst, src = self._part(part)[1]
        out[(slice(None), *dst)] = stored[(slice(None), *src)]
        self.times.add(0.0, time.perf_counter() - t0)

    def _stored(self, pooled: bool) -> np.ndarray:
        g = self.arr.base_geom
        return (_BASE.array(g.stripe_shape, g.dtype) if pooled
                else np.empty(g.stripe_shape, dtype=g.dtype))

    # -- local stores, on the calling (pool) thread ----------------------------------------
    def read_local_retrying(self, indices: list[int], outs: list[np.ndarray],
                            retry: RetryPolicy = NO_RETRY,
                            submitted: float | None = None, *,
                            part: PartSpec | None = None) -> int:
        spec = self._part(part)[0]
        attempts = 0
        for index, out in zip(indices, outs, strict=True):
            stored = self._stored(pooled=True)
            attempts += self.base.read_local_retrying([index], [stored], retry, submitted,
                                                      part=spec)
            self._copy(stored, out, part)
            submitted = None
        return attempts

    # -- the chunk cache -----------------------------------------------------------------
    def is_cached(self, index: int, *, part: PartSpec | None = None) -> bool:
        return bool(self.base.is_cached(index, part=self._part(part)[0]))

    def read_cached(self, indices: list[int], outs: list[np.ndarray],
                    submitted: float | None = None, *,
                    part: PartSpec | None = None) -> list[int]:
        spec = self._part(part)[0]
        missed = []
        for index, out in zip(indices, outs, strict=True):
            stored = self._stored(pooled=True)
            if self.base.read_cached([index], [stored], submitted, part=spec):
                missed.append(index)
            else:
                self._copy(stored, out, part)
            submitted = None
        return missed

    # -- the event loop ------------------------------------------------------------------
    async def read(self, index: int, out: np.ndarray, loop: asyncio.AbstractEventLoop,
                   pool: Executor, retry: RetryPolicy = NO_RETRY, *,
                   part: PartSpec | None = None) -> int:
        stored = self._stored(pooled=False)  # awaited reads interleave on one thread
        attempts: int = await self.base.read(index, stored, loop, pool, retry,
                                             part=self._part(part)[0])
        self._copy(stored, out, part)
        return attempts



def _index(per_axis: list[np.ndarray]) -> tuple[Any, ...]:
    """An index of the axes after the first taking ``per_axis[k]`` along axis ``k + 1``:
    slices where every axis is one run (a copy numpy does by strides: a grid part, a box
    not across the antimeridian), else an open mesh (a gather)."""
    spans = [runs(idx) for idx in per_axis]
    if all(len(r) == 1 for r in spans):
        return tuple(slice(r[0][0], r[0][1]) for r in spans)
    return np.ix_(*per_axis)
