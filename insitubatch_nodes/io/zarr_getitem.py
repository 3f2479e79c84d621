"""Chains we do not decode (sharding, transpose, filters, ...): zarr's own ``getitem``.

zarr fetches and decodes the whole stripe, then one copy lands it in the stripe buffer;
``CachedGetitem`` puts a ``CachingStore`` under zarr so its gets go through a chunk cache.
"""

from __future__ import annotations

import asyncio
import contextvars
import gzip
import time
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import zarr
from zarr.abc.store import ByteRequest, Store
from zarr.core.buffer import Buffer, BufferPrototype
from zarr.storage import WrapperStore

from ..errors import ConfigTypeError
from ..metrics.counters import ReadTimes
from .async_gets import AsyncGets
from .chunk_cache import CacheScope, ChunkCache
from .partial.ranges import PartSpec
from .pool_task import OneShot
from .read_path_base import FrameCheck, Frames, Loop, ReadPath, Stripes
from .retry import DECODE_ERRORS, ChunkDecodeError


@dataclass(frozen=True, eq=False)
class ZarrGetitem(ReadPath):
    """Chains we do not decode (sharding, transpose, filters, ...): zarr fetches and decodes
    the whole stripe in ``getitem``, then one copy into the stripe buffer. Stored frames,
    if asked for, come through ``gets``."""

    arr: zarr.Array
    gets: AsyncGets
    name: ClassVar[str] = "zarr"

    async def read(self, stripes: Stripes, index: int, out: np.ndarray, loop: Loop,
                   pool: Executor, part: PartSpec | None = None) -> None:
        """The whole stripe, whatever ``part`` says: zarr decodes these chains."""
        t0 = time.perf_counter()
        try:
            data = await self.arr.async_array.getitem((stripes.rows(index),))
        except (*DECODE_ERRORS, gzip.BadGzipFile) as e:  # zarr fetched and decoded: received
            # bytes (BadGzipFile is an OSError, but only gzip's decoder raises it)
            raise ChunkDecodeError(f"zarr could not decode the stripe: {e}") from e
        stripes.times.add(time.perf_counter() - t0, 0.0)
        if not isinstance(data, np.ndarray):  # rows of an array on zarr's CPU buffers
            raise ConfigTypeError(f"zarr read a stripe as {type(data).__name__}, not an ndarray")
        rows = int(data.shape[0])
        # Pass the pooled view itself, not a slice: a slice's base is the pool's array, so
        # it would not keep the view (and its place in the pool) alive if this read were
        # cancelled while the copy still runs.
        await loop.run_in_executor(pool, OneShot(_copy_rows, stripes, out, rows, data,
                                                 time.perf_counter()))

    async def frames(self, stripes: Stripes, index: int, check: FrameCheck, loop: Loop,
                     pool: Executor) -> Frames:
        return await self.gets.frames(stripes, index, check, loop, pool)


# The bytes one ``CachedGetitem.read`` fetched from the store: cached once zarr decoded them.
_fetched: contextvars.ContextVar[list[tuple[str, bytes]] | None] = contextvars.ContextVar(
    "insitubatch_fetched", default=None)
_METADATA = ("zarr.json", ".zarray", ".zattrs", ".zgroup", ".zmetadata")


class CachingStore(WrapperStore):
    """A zarr store whose chunk gets (byte ranges too, as sharding asks) go through a
    ``ChunkCache``, for zarr's own ``getitem``. Fetched bytes are only collected here;
    ``CachedGetitem`` caches them once the stripe decoded. Metadata is never cached."""

    def __init__(self, store: Store, cache: ChunkCache, scope: CacheScope) -> None:
        super().__init__(store)
        self.cache, self.scope = cache, scope
        self.times: ReadTimes | None = None  # the reader's, set at each read

    async def get(self, key: str, prototype: BufferPrototype,
                  byte_range: ByteRequest | None = None) -> Buffer | None:
        if key.endswith(_METADATA):
            return await self._store.get(key, prototype, byte_range)
        ident = self.scope.ident(key if byte_range is None else f"{key} {byte_range!r}")
        if self.cache.has(ident):
            data = await asyncio.get_running_loop().run_in_executor(None, self.cache.get,
                                                                    ident)
            if data is not None:
                if self.times is not None:
                    self.times.cached(1, len(data))
                return prototype.buffer.from_bytes(data)
        buf = await self._store.get(key, prototype, byte_range)
        if buf is not None:
            raw = buf.to_bytes()
            if self.times is not None:
                self.times.fetched(1, len(raw))
            pending = _fetched.get()
            if pending is not None:
                pending.append((ident, raw))
        return buf


@dataclass(frozen=True, eq=False)
class CachedGetitem(ZarrGetitem):
    """``ZarrGetitem`` over a ``CachingStore``: what zarr fetched for a stripe enters the
    cache only after the whole stripe decoded, so damaged bytes are never cached."""

    store: CachingStore
    name: ClassVar[str] = "cached-zarr"

    async def read(self, stripes: Stripes, index: int, out: np.ndarray, loop: Loop,
                   pool: Executor, part: PartSpec | None = None) -> None:
        self.store.times = stripes.times
        pending: list[tuple[str, bytes]] = []
        token = _fetched.set(pending)
        try:
            await super().read(stripes, index, out, loop, pool)
        finally:
            _fetched.reset(token)
        for ident, raw in pending:
            self.store.cache.put_later(ident, raw)


def _copy_rows(stripes: Stripes, out: np.ndarray, rows: int, src: np.ndarray,
               submitted: float) -> None:
    t0 = time.perf_counter()
    np.copyto(out[:rows], src)
    stripes.times.add(0.0, time.perf_counter() - t0, t0 - submitted)
