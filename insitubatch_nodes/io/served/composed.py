"""Reading a composed variable's stripe from its members' stripes.

Each member keeps its own ``StripeReader`` (its read path, chunk keys, partial reads, cache
scope and error messages naming its store). A composed stripe that is exactly one member
stripe is read straight into place (periods of equal chunking, joins on equal dates: the
usual case); otherwise each member stripe it touches is read into a buffer and its rows
copied (members chunked differently, a run starting off a stripe edge, a frequency cut).
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Executor

import numpy as np

from ...sampling.geometry import VariableGeometry
from ...sampling.rowmap import StripePiece
from ...store.axis_array import AxisArray
from ...store.composed_array import ComposedArray
from ..chunk_cache import ChunkCache
from ..partial.ranges import PartSpec
from ..reader import StripeReader
from ..retry import NO_RETRY, RetryPolicy
from .axis import AxisStripeReader
from .wrapped import WrappedReader


class ComposedReader(WrappedReader):
    """Fills ``out`` (shape ``geom.stripe_shape``) with composed stripe ``index``; the
    calls a ``StripeReader`` answers for the fetch paths and decode workers."""

    KIND = "composed of several stored arrays (a join, concat or period)"

    def __init__(self, arr: ComposedArray, geom: VariableGeometry, source_url: str) -> None:
        self.arr = arr
        # each member as it is stored: sampled along its first axis or another one
        self.members = [AxisStripeReader(a, g, u) if isinstance(a, AxisArray)
                        else StripeReader(a, g, u)
                        for a, g, u in zip(arr.arrays, arr.geoms, arr.urls, strict=True)]
        super().__init__(list(self.members), geom, source_url)
        self.fill_value = np.asarray(arr.fill).astype(geom.dtype)
        self._chunks = arr.member_chunks()
        self._pieces: dict[int, list[StripePiece]] = {}
        member, stripe = _straight_stripes(arr, geom.sample_chunk)
        # per composed stripe: the member whose one stripe it is exactly (-1: pieces), and
        # that stripe; lists, as read once per stripe on the hot path
        self._member: list[int] = member.tolist()
        self._stripe: list[int] = stripe.tolist()

    def use_cache(self, cache: ChunkCache, snapshot_id: str | None = None) -> None:
        """Each member's chunks cached under its own store and snapshot."""
        for m, snap in zip(self.members, self.arr.snapshots, strict=True):
            m.use_cache(cache, snap)

    def describe(self, index: int) -> str:
        got = [f"{self.members[p.member].describe(p.stripe)}" for p in self.pieces(index)]
        return (f"composed stripe {index} of variable {self.geom.name!r} of {self.source_url}"
                f" ({'; '.join(got) or 'a gap'})")

    def pieces(self, index: int) -> list[StripePiece]:
        """The member stripes composed stripe ``index`` is made of (computed once)."""
        got = self._pieces.get(index)
        if got is None:
            start = index * self.geom.sample_chunk
            stop = min(start + self.geom.sample_chunk, self.geom.shape[0])
            got = self._pieces[index] = self.arr.rows.pieces(start, stop, self._chunks)
        return got

    def _straight(self, index: int) -> StripePiece | None:
        """The one member stripe that is exactly composed stripe ``index``, if it is."""
        m = self._member[index]
        if m < 0:
            return None
        rows = slice(0, self.geom.sample_chunk)
        return StripePiece(m, self._stripe[index], rows, rows)

    def _buffer(self, p: StripePiece) -> np.ndarray:
        g = self.members[p.member].geom
        return np.empty(g.stripe_shape, dtype=g.dtype)

    def _gaps(self, index: int, out: np.ndarray) -> None:
        """Rows of ``out`` no piece fills (gaps, the short last stripe) read as the fill."""
        covered = np.zeros(out.shape[0], dtype=bool)
        for p in self.pieces(index):
            covered[p.dst] = True
        if not covered.all():
            out[~covered] = self.fill_value

    # -- local stores, on the calling (pool) thread ----------------------------------------
    def read_local(self, index: int, out: np.ndarray, submitted: float | None = None, *,
                   part: PartSpec | None = None) -> None:
        m = self._member[index]
        if m >= 0:  # one member stripe: that member reads it into place
            self.members[m].read_local(self._stripe[index], out, submitted, part=part)
        else:
            self.read_local_retrying([index], [out], NO_RETRY, submitted, part=part)

    def read_local_retrying(self, indices: list[int], outs: list[np.ndarray],
                            retry: RetryPolicy = NO_RETRY,
                            submitted: float | None = None, *,
                            part: PartSpec | None = None) -> int:
        if len(indices) == 1 and self._member[indices[0]] >= 0:  # a worker's one stripe
            return self.members[self._member[indices[0]]].read_local_retrying(
                [self._stripe[indices[0]]], outs, retry, submitted, part=part)
        attempts = 0
        straight: dict[int, tuple[list[int], list[np.ndarray]]] = {}
        for index, out in zip(indices, outs, strict=True):
            m = self._member[index]
            if m >= 0:  # grouped per member below: one grouped read each
                got = straight.setdefault(m, ([], []))
                got[0].append(self._stripe[index])
                got[1].append(out)
            else:
                for p in self.pieces(index):
                    buf = self._buffer(p)
                    attempts += self.members[p.member].read_local_retrying(
                        [p.stripe], [buf], retry, submitted, part=part)
                    self._copy(p, buf, out)
                self._gaps(index, out)
                submitted = None
        for m, (stripes, bufs) in straight.items():
            attempts += self.members[m].read_local_retrying(stripes, bufs, retry, submitted,
                                                            part=part)
            submitted = None
        return attempts

    def _copy(self, p: StripePiece, buf: np.ndarray, out: np.ndarray) -> None:
        t0 = time.perf_counter()
        out[p.dst] = buf[p.src]
        self.times.add(0.0, time.perf_counter() - t0)

    # -- the chunk cache -----------------------------------------------------------------
    def is_cached(self, index: int, *, part: PartSpec | None = None) -> bool:
        return all(self.members[p.member].is_cached(p.stripe, part=part)
                   for p in self.pieces(index))

    def read_cached(self, indices: list[int], outs: list[np.ndarray],
                    submitted: float | None = None, *,
                    part: PartSpec | None = None) -> list[int]:
        missed = []
        for index, out in zip(indices, outs, strict=True):
            straight = self._straight(index)
            ok = True
            for p in self.pieces(index):
                buf = out if straight is not None else self._buffer(p)
                if self.members[p.member].read_cached([p.stripe], [buf], submitted,
                                                      part=part):
                    ok = False
                    break
                if straight is None:
                    self._copy(p, buf, out)
            if not ok:
                missed.append(index)
            elif straight is None:
                self._gaps(index, out)
            submitted = None
        return missed

    # -- the event loop ------------------------------------------------------------------
    async def read(self, index: int, out: np.ndarray, loop: asyncio.AbstractEventLoop,
                   pool: Executor, retry: RetryPolicy = NO_RETRY, *,
                   part: PartSpec | None = None) -> int:
        p = self._straight(index)
        if p is not None:
            return await self.members[p.member].read(p.stripe, out, loop, pool, retry,
                                                     part=part)
        attempts = 0
        for p in self.pieces(index):
            buf = self._buffer(p)
            attempts += await self.members[p.member].read(p.stripe, buf, loop, pool, retry,
                                                          part=part)
            self._copy(p, buf, out)
        self._gaps(index, out)
        return attempts



def _straight_stripes(arr: ComposedArray, chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """Per composed stripe of ``chunk`` rows, the member whose one stripe it is exactly
    (whole, same length, same rows in order; else -1) and that stripe's index."""
    n = arr.rows.n_rows
    n_stripes = -(-n // chunk)
    member = np.full(n_stripes, -1, dtype=np.int64)
    stripe = np.zeros(n_stripes, dtype=np.int64)
    full = n // chunk  # the short last stripe, if any, is read piece by piece
    if full == 0:
        return member, stripe
    g = np.arange(full * chunk, dtype=np.int64)
    m, local = arr.rows.locate(g)
    first_m, first_local = m[::chunk], local[::chunk]
    chunks = np.asarray(arr.member_chunks() + (0,), dtype=np.int64)  # index -1: a gap
    ok = ((m == np.repeat(first_m, chunk)) & (m >= 0)
          & (local == np.repeat(first_local, chunk) + g % chunk))
    ok = ok.reshape(full, chunk).all(axis=1)
    ok &= (chunks[first_m] == chunk) & (first_local % chunk == 0)
    member[:full] = np.where(ok, first_m, -1)
    stripe[:full] = np.where(ok, first_local // chunk, 0)
    return member, stripe
