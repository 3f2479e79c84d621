"""Async gets through a local ``ChunkCache``: cached stripes decode in one pool task.

Chunks enter the cache only after they decoded (or passed their check), so damaged bytes
are never cached; the reader's retries see the store's own failures unchanged.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .async_gets import AsyncGets
from .chunk_cache import CacheScope, ChunkCache
from .pool_task import OneShot
from .read_path_base import FrameCheck, Frames, Loop, Stripes, check_frames

_MISS = b""  # never stored in a cache entry's place: a stored chunk is never empty


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
        hits = [d for d in datas if d is not _MISS]
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

    def all_cached(self, stripes: Stripes, index: int) -> bool:
        """Every chunk of stripe ``index`` has an entry (a ``stat`` each)."""
        return self._all_cached(stripes.keys(index))

    def read_cached_blocking(self, stripes: Stripes, index: int, out: np.ndarray,
                             submitted: float | None = None) -> bool:
        """Decode stripe ``index`` into ``out`` from the cache on this (pool) thread: True,
        or False (``out`` untouched) when an entry went missing or was damaged meanwhile."""
        return self._cached_read(stripes, stripes.keys(index), out,
                                 time.perf_counter() if submitted is None else submitted) is None

    async def read(self, stripes: Stripes, index: int, out: np.ndarray, loop: Loop,
                   pool: Executor) -> None:
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
