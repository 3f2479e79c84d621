"""Stores read with async gets on the event loop: obstore's own, or any zarr store's.

Every chunk of a stripe is requested at once (no thread per request); decoding and frame
checks run on the pool, never on the loop that drives the gets.
"""

from __future__ import annotations

import asyncio
import time
from abc import abstractmethod
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from zarr.abc.store import Store
from zarr.core.buffer import default_buffer_prototype

from .partial.ranges import ChunkPart, PartSpec, Ranges
from .partial.sparse import SparseFrame
from .pool_task import OneShot
from .read_path_base import (
    Datas,
    FrameCheck,
    Frames,
    Loop,
    Parts,
    ReadPath,
    Stripes,
    check_frames,
)

Data = bytes | memoryview


async def _none() -> None:
    """A chunk a partial read does not need."""
    return None


class AsyncGets(ReadPath):
    """Stores read with async gets: every chunk of a stripe requested at once on the event
    loop (no thread per request), then decoded or checked on the pool."""

    @abstractmethod
    async def get(self, key: str) -> bytes | memoryview | None:
        """One stored object (``None``: never written)."""

    async def get_part(self, stripes: Stripes, key: str, cp: ChunkPart,
                       known: SparseFrame | None = None) -> Data | SparseFrame | None:
        """What a partial read of chunk ``key`` needs: the whole stored chunk here (it
        decodes in part); object stores fetch only the blocks (``ObjectStoreGets``).
        ``known``: parts of it from the chunk cache."""
        return await self.get(key)

    async def get_frames(self, stripes: Stripes, index: int) -> tuple[list[str], Frames]:
        """Stripe ``index``'s stored chunks, whole."""
        keys = stripes.keys(index)
        t0 = time.perf_counter()
        frames: Frames = list(await asyncio.gather(*(self.get(k) for k in keys)))
        stripes.times.add(time.perf_counter() - t0, 0.0)
        return keys, frames

    async def get_all(self, stripes: Stripes, index: int,
                      parts: Parts | None = None) -> tuple[list[str], Datas]:
        """Stripe ``index``'s stored chunks (with ``parts``, what each wanted one needs;
        ``None`` for the others)."""
        if parts is None:
            keys, frames = await self.get_frames(stripes, index)
            return keys, list(frames)
        keys = stripes.keys(index)
        t0 = time.perf_counter()
        datas: Datas = list(await asyncio.gather(
            *(_none() if cp is None else self.get(k) if cp.whole
              else self.get_part(stripes, k, cp) for k, cp in zip(keys, parts, strict=True))))
        stripes.partial_stats.skipped(sum(cp is None for cp in parts))
        stripes.times.add(time.perf_counter() - t0, 0.0)
        return keys, datas

    async def read(self, stripes: Stripes, index: int, out: np.ndarray, loop: Loop,
                   pool: Executor, part: PartSpec | None = None) -> None:
        parts = stripes.chunk_parts(part)
        _, datas = await self.get_all(stripes, index, parts)
        await loop.run_in_executor(pool, OneShot(stripes.place_all, datas, out,
                                                 time.perf_counter(), parts))

    async def frames(self, stripes: Stripes, index: int, check: FrameCheck, loop: Loop,
                     pool: Executor) -> Frames:
        keys, datas = await self.get_frames(stripes, index)
        # The checks walk frames in Python: on the pool, not on the loop driving the GETs.
        await loop.run_in_executor(pool, check_frames, check, keys, datas)
        return datas


@dataclass(frozen=True, eq=False)
class ObjectStoreGets(AsyncGets):
    """zarr ``ObjectStore``s: obstore's own async get, without zarr's store layer."""

    store: Any  # the obstore store under zarr's ObjectStore
    name: ClassVar[str] = "object"

    async def get(self, key: str) -> bytes | memoryview | None:
        import obstore

        try:
            resp = await obstore.get_async(self.store, key)
        except FileNotFoundError:
            return None
        return memoryview(await resp.bytes_async())

    async def get_range(self, key: str, start: int, end: int) -> Data | None:
        """Bytes ``[start, end)`` of ``key`` (fewer where it ends sooner; ``None``: never
        written)."""
        import obstore

        try:
            return memoryview(await obstore.get_range_async(self.store, key, start=start,
                                                            end=end))
        except FileNotFoundError:
            return None

    async def get_ranges(self, key: str, ranges: Ranges) -> list[Data]:
        """These byte ranges of ``key``, one ranged GET each, at once (not coalesced:
        ``partial.blocks.coalesce`` chose them)."""
        import obstore

        got = await obstore.get_ranges_async(self.store, key, starts=[s for s, _ in ranges],
                                             ends=[e for _, e in ranges], coalesce=0)
        return [memoryview(b) for b in got]

    async def get_part(self, stripes: Stripes, key: str, cp: ChunkPart,
                       known: SparseFrame | None = None) -> Data | SparseFrame | None:
        """The header and offsets, then only the blocks ``cp`` needs (``partial.fetch``),
        where the chunks are lone blosc frames; else the whole chunk."""
        if not stripes.blocks_ok:
            return await self.get(key)
        return await stripes.partial.fetch(self, key, stripes.chunk_nbytes, cp.byte_ranges,
                                           known)


@dataclass(frozen=True, eq=False)
class ZarrStoreGets(AsyncGets):
    """Any other zarr store (memory, fsspec, ...): zarr's async ``Store.get``."""

    store: Store
    name: ClassVar[str] = "zarr-store"

    async def get(self, key: str) -> bytes | memoryview | None:
        buf = await self.store.get(key, prototype=default_buffer_prototype())
        return None if buf is None else buf.as_numpy_array().data
