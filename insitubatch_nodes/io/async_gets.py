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

from .pool_task import OneShot
from .read_path_base import FrameCheck, Frames, Loop, ReadPath, Stripes, check_frames


class AsyncGets(ReadPath):
    """Stores read with async gets: every chunk of a stripe requested at once on the event
    loop (no thread per request), then decoded or checked on the pool."""

    @abstractmethod
    async def get(self, key: str) -> bytes | memoryview | None:
        """One stored object (``None``: never written)."""

    async def get_all(self, stripes: Stripes, index: int) -> tuple[list[str], Frames]:
        keys = stripes.keys(index)
        t0 = time.perf_counter()
        datas = await asyncio.gather(*(self.get(k) for k in keys))
        stripes.times.add(time.perf_counter() - t0, 0.0)
        return keys, list(datas)

    async def read(self, stripes: Stripes, index: int, out: np.ndarray, loop: Loop,
                   pool: Executor) -> None:
        _, datas = await self.get_all(stripes, index)
        await loop.run_in_executor(pool, OneShot(stripes.place_all, datas, out,
                                                 time.perf_counter()))

    async def frames(self, stripes: Stripes, index: int, check: FrameCheck, loop: Loop,
                     pool: Executor) -> Frames:
        keys, datas = await self.get_all(stripes, index)
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


@dataclass(frozen=True, eq=False)
class ZarrStoreGets(AsyncGets):
    """Any other zarr store (memory, fsspec, ...): zarr's async ``Store.get``."""

    store: Store
    name: ClassVar[str] = "zarr-store"

    async def get(self, key: str) -> bytes | memoryview | None:
        buf = await self.store.get(key, prototype=default_buffer_prototype())
        return None if buf is None else buf.as_numpy_array().data
