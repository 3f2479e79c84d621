"""Async gets through a local ``ChunkCache``: cached stripes decode in one pool task.

Chunks enter the cache only after they decoded (or passed their check), so damaged bytes
are never cached; the reader's retries see the store's own failures unchanged. A partial
read (``PartSpec``) caches the blocks it fetched as one entry per chunk beside the whole
frame's (``SparseFrame``): a later read is served from it only if it holds every block that
read needs; a wider one fetches the blocks missing and widens the entry, never serves a
hole. A whole frame in the cache serves any part.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .async_gets import AsyncGets
from .chunk_cache import CacheScope, ChunkCache
from .partial.blocks import Whole, plan_frame
from .partial.ranges import ChunkPart, PartSpec, Ranges
from .partial.sparse import SparseFrame
from .pool_task import OneShot
from .read_path_base import Datas, FrameCheck, Frames, Loop, Parts, Stripes, check_frames

_MISS = b""  # never stored in a cache entry's place: a stored chunk is never empty
_BLOCKS = "blosc-blocks"  # a chunk's fetched blocks: its own entry, beside the whole frame


@dataclass(frozen=True, eq=False)
class CachedGets(AsyncGets):
    """``gets`` through a local ``ChunkCache``: a stripe whose chunks are all cached is read
    and decoded in one pool task; any other stripe comes whole from the store, its chunks
    entering the cache (those not already there) only after they decoded (or passed
    ``check``), so damaged bytes are never cached.
    The reader's retries and error naming see the store's own failures unchanged."""

    gets: AsyncGets
    cache: ChunkCache
    scope: CacheScope
    name: ClassVar[str] = "cached"

    async def get(self, key: str) -> bytes | memoryview | None:
        """The store's own bytes: this path reads the cache in ``read`` and ``frames`` (on
        the pool), never here on the event loop."""
        return await self.gets.get(key)

    def _lookup(self, stripes: Stripes, keys: list[str]) -> Frames:
        """The cached chunks of ``keys`` (``_MISS`` where not cached after all), counted."""
        t0 = time.perf_counter()
        datas: Frames = [self.cache.get(self.scope.ident(k)) or _MISS for k in keys]
        hits = [d for d in datas if d is not _MISS and d is not None]  # (None: made _MISS)
        stripes.times.add(time.perf_counter() - t0, 0.0)
        stripes.times.cached(len(hits), sum(len(d) for d in hits))
        return datas

    def _all_cached(self, keys: list[str]) -> bool:
        """Every chunk of the stripe has an entry (a ``stat`` each, on the loop): only then
        is the cache read, so a miss costs no pool hand-off before its GET goes out."""
        return all(self.cache.has(self.scope.ident(k)) for k in keys)

    async def _fill(self, stripes: Stripes, keys: list[str], datas: Frames) -> list[int]:
        """Fetch the missed chunks of ``datas`` from the store, in place: their indices."""
        missed = [i for i, d in enumerate(datas) if d is _MISS]
        t0 = time.perf_counter()
        got = await asyncio.gather(*(self.gets.get(keys[i]) for i in missed))
        stripes.times.add(time.perf_counter() - t0, 0.0)
        stripes.times.fetched(len(missed), sum(len(d) for d in got if d is not None))
        for i, d in zip(missed, got, strict=True):
            datas[i] = d
        return missed

    def _store(self, keys: list[str], datas: Frames, missed: list[int]) -> None:
        for i in missed:
            data, ident = datas[i], self.scope.ident(keys[i])
            # a chunk never written is not cached (asked again); one of a partly cached
            # stripe that is still there is not written again
            if data is not None and not self.cache.has(ident):
                self.cache.put_later(ident, data)

    def _cached_read(self, stripes: Stripes, keys: list[str], out: np.ndarray,
                     submitted: float) -> Frames | None:
        """On the pool: the cached chunks, decoded into ``out`` if every one was there
        (``None``), else the chunks with the misses marked."""
        datas = self._lookup(stripes, keys)
        if any(d is _MISS for d in datas):
            return datas
        stripes.place_all(datas, out, submitted)
        return None

    def _place_and_store(self, stripes: Stripes, keys: list[str], datas: Frames,
                         missed: list[int], out: np.ndarray, submitted: float) -> None:
        stripes.place_all(datas, out, submitted)
        self._store(keys, datas, missed)

    def _check_and_store(self, check: FrameCheck, keys: list[str], datas: Frames,
                         missed: list[int]) -> None:
        check_frames(check, keys, datas)
        self._store(keys, datas, missed)

    def all_cached(self, stripes: Stripes, index: int, part: PartSpec | None = None) -> bool:
        """Every chunk of stripe ``index`` (that ``part`` needs) has an entry (a ``stat``
        each; whether a part's entry holds every block it needs is known on reading)."""
        if part is None:
            return self._all_cached(stripes.keys(index))
        parts = stripes.chunk_parts(part)
        assert parts is not None
        return all(cp is None or self.cache.has(self.scope.ident(k))
                   or self.cache.has(self._blocks_ident(k))
                   for k, cp in zip(stripes.keys(index), parts, strict=True))

    def read_cached_blocking(self, stripes: Stripes, index: int, out: np.ndarray,
                             submitted: float | None = None,
                             part: PartSpec | None = None) -> bool:
        """Decode stripe ``index`` (``part`` of it) into ``out`` from the cache on this
        (pool) thread: True, or False (``out`` untouched) when an entry went missing or
        was damaged meanwhile, or holds too few blocks for ``part``."""
        submitted = time.perf_counter() if submitted is None else submitted
        if part is None:
            return self._cached_read(stripes, stripes.keys(index), out, submitted) is None
        parts = stripes.chunk_parts(part)
        assert parts is not None
        datas, _ = self._lookup_parts(stripes, stripes.keys(index), parts)
        if any(d is _MISS for d in datas):
            return False
        stripes.partial_stats.skipped(sum(cp is None for cp in parts))
        stripes.place_all(datas, out, submitted, parts)
        return True

    async def read(self, stripes: Stripes, index: int, out: np.ndarray, loop: Loop,
                   pool: Executor, part: PartSpec | None = None) -> None:
        if part is not None:
            await self._read_part(stripes, index, out, loop, pool, part)
            return
        keys = stripes.keys(index)
        datas: Frames | None = [_MISS] * len(keys)
        if self._all_cached(keys):
            datas = await loop.run_in_executor(pool, OneShot(self._cached_read, stripes, keys,
                                                             out, time.perf_counter()))
            if datas is None:
                return
        assert datas is not None
        missed = await self._fill(stripes, keys, datas)
        await loop.run_in_executor(pool, OneShot(self._place_and_store, stripes, keys, datas,
                                                 missed, out, time.perf_counter()))

    async def frames(self, stripes: Stripes, index: int, check: FrameCheck, loop: Loop,
                     pool: Executor) -> Frames:
        keys = stripes.keys(index)
        datas: Frames = [_MISS] * len(keys)
        if self._all_cached(keys):
            datas = await loop.run_in_executor(pool, self._lookup, stripes, keys)
            if not any(d is _MISS for d in datas):
                return datas  # checked before they were cached, and by their crc32c since
        missed = await self._fill(stripes, keys, datas)
        # The checks catch a damaged transfer before it is cached.
        await loop.run_in_executor(pool, self._check_and_store, check, keys, datas, missed)
        return datas

    # -- partial reads: whole entries serve any part, block entries the parts they hold ----
    def _blocks_ident(self, key: str) -> str:
        """The entry of a chunk's fetched blocks (a ``SparseFrame``), beside its whole one."""
        return self.scope.ident(f"{key} {_BLOCKS}")

    def _lookup_parts(self, stripes: Stripes, keys: list[str],
                      parts: Parts) -> tuple[Datas, dict[int, SparseFrame]]:
        """On the pool: per wanted chunk its whole cached frame, or its cached blocks if
        they hold every block the part needs, else ``_MISS`` (with those blocks, to widen,
        in the dict); ``None`` for chunks not wanted. Hits counted."""
        t0 = time.perf_counter()
        datas: Datas = []
        known: dict[int, SparseFrame] = {}
        for i, (key, cp) in enumerate(zip(keys, parts, strict=True)):
            whole = None if cp is None else self.cache.get(self.scope.ident(key))
            if cp is None or whole is not None:
                datas.append(whole)
                continue
            raw = None if cp.whole else self.cache.get(self._blocks_ident(key))
            frame = None if raw is None else SparseFrame.from_bytes(raw)
            if frame is not None and _serves(frame, stripes.chunk_nbytes, cp.byte_ranges):
                datas.append(frame)
                continue
            datas.append(_MISS)
            if frame is not None:
                known[i] = frame
        hits = [len(d) if isinstance(d, bytes) else d.nbytes for d in datas
                if d is not None and d is not _MISS]
        stripes.times.add(time.perf_counter() - t0, 0.0)
        stripes.times.cached(len(hits), sum(hits))
        return datas, known

    async def _fill_parts(self, stripes: Stripes, keys: list[str], parts: Parts, datas: Datas,
                          known: dict[int, SparseFrame]) -> list[int]:
        """Fetch what the cache did not serve, in place (widening cached blocks): their
        indices."""
        missed = [i for i, d in enumerate(datas) if d is _MISS]
        t0 = time.perf_counter()
        got = await asyncio.gather(*(self._fetch(stripes, keys[i], parts[i], known.get(i))
                                     for i in missed))
        stripes.times.add(time.perf_counter() - t0, 0.0)
        stripes.times.fetched(len(missed), sum(_new_bytes(d, known.get(i))
                                               for i, d in zip(missed, got, strict=True)))
        for i, d in zip(missed, got, strict=True):
            datas[i] = d
        return missed

    def _fetch(self, stripes: Stripes, key: str, cp: ChunkPart | None,
               known: SparseFrame | None) -> Awaitable[bytes | memoryview | SparseFrame | None]:
        """The get of one missed chunk: whole, or the blocks its part needs."""
        assert cp is not None  # a chunk not wanted is ``None`` in ``datas``, never missed
        return self.gets.get(key) if cp.whole else self.gets.get_part(stripes, key, cp, known)

    async def _read_part(self, stripes: Stripes, index: int, out: np.ndarray, loop: Loop,
                         pool: Executor, part: PartSpec) -> None:
        parts = stripes.chunk_parts(part)
        assert parts is not None
        keys = stripes.keys(index)
        stripes.partial_stats.skipped(sum(cp is None for cp in parts))
        datas: Datas = [None if cp is None else _MISS for cp in parts]
        known: dict[int, SparseFrame] = {}
        if any(cp is not None and (self.cache.has(self.scope.ident(k))
                                   or self.cache.has(self._blocks_ident(k)))
               for k, cp in zip(keys, parts, strict=True)):
            datas, known = await loop.run_in_executor(pool, OneShot(
                self._lookup_parts, stripes, keys, parts))
        missed = await self._fill_parts(stripes, keys, parts, datas, known)
        await loop.run_in_executor(pool, OneShot(self._place_parts_and_store, stripes, keys,
                                                 datas, missed, out, time.perf_counter(),
                                                 parts))

    def _place_parts_and_store(self, stripes: Stripes, keys: list[str], datas: Datas,
                               missed: list[int], out: np.ndarray, submitted: float,
                               parts: Parts) -> None:
        """Decode, then cache what was fetched: whole frames as whole entries, blocks as
        the chunk's block entry (widened: it holds what was cached before too)."""
        stripes.place_all(datas, out, submitted, parts)
        for i in missed:
            data = datas[i]
            if isinstance(data, SparseFrame):
                self.cache.put_later(self._blocks_ident(keys[i]), data.to_bytes())
            elif data is not None and not self.cache.has(self.scope.ident(keys[i])):
                self.cache.put_later(self.scope.ident(keys[i]), data)


def _serves(frame: SparseFrame, nbytes: int, wanted: Ranges) -> bool:
    """``frame`` holds every block the decoded byte ranges ``wanted`` need."""
    plan = plan_frame(frame.head(), nbytes, wanted, 1.0)
    return not isinstance(plan, Whole) and frame.covers(plan.spans)


def _new_bytes(data: bytes | memoryview | SparseFrame | None, known: SparseFrame | None) -> int:
    """Bytes a fetch added to what the cache held."""
    if data is None:
        return 0
    if isinstance(data, SparseFrame):
        return data.nbytes - (known.nbytes if known is not None else 0)
    return len(data)
