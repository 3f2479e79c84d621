"""The ways a stripe's stored chunks reach memory: one small class per kind of store.

``StripeReader`` picks one when it is built (``read_path_for``) instead of switching on a mode
string at every read. Each path knows how to get a stripe's stored bytes (a file read on a
pool thread, obstore's async get, zarr's store API, or zarr's own ``getitem`` when we do not
decode the chain) and whether several stripes can share one pool task; the reader keeps the
keys, the decoding into the stripe buffer, and the retries.
"""

from __future__ import annotations

import asyncio
import lzma
import os
import threading
import time
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

import numpy as np
import zarr
import zarr.storage
from zarr.abc.store import Store
from zarr.core.buffer import default_buffer_prototype

from ..counters import ReadTimes
from .pool_task import OneShot
from .retry import ChunkDecodeError

Frames = list[bytes | memoryview | None]  # one stripe's stored chunks, in inner-chunk order
FrameCheck = Callable[[bytes | memoryview], None]  # raises ValueError on a damaged frame
# What zarr's codec pipeline raises for stored bytes that do not decode (numcodecs' errors;
# not OSError: there it may be the store's own error).
_ZARR_DECODE_ERRORS = (ValueError, RuntimeError, EOFError, zlib.error, lzma.LZMAError)
Loop = asyncio.AbstractEventLoop


class Stripes(Protocol):
    """What a read path needs of its reader. ``times`` is looked up at every read: the
    loader swaps in its own counters after the reader is built."""

    times: ReadTimes
    inner: list[tuple[int, ...]]

    def chunk_key(self, coords: tuple[int, ...]) -> str: ...

    def keys(self, index: int) -> list[str]: ...

    def rows(self, index: int) -> slice: ...

    def place(self, data: bytes | memoryview | None, inner: tuple[int, ...],
              out: np.ndarray) -> None: ...

    def place_all(self, datas: Frames, out: np.ndarray,
                  submitted: float | None = None) -> None: ...


class ReadPath(ABC):
    """How one stripe's stored chunks are fetched, once: the reader adds the retries and
    (but on the ``zarr`` path) the decoding. ``name`` is what ``StripeReader.mode`` shows."""

    name: ClassVar[str]
    groups_reads: ClassVar[bool] = False  # several stripes in one pool task (read_many)

    @abstractmethod
    async def read(self, stripes: Stripes, index: int, out: np.ndarray, loop: Loop,
                   pool: Executor) -> None:
        """Fill ``out`` with stripe ``index``."""

    @abstractmethod
    async def frames(self, stripes: Stripes, index: int, check: FrameCheck, loop: Loop,
                     pool: Executor) -> Frames:
        """Stripe ``index``'s stored chunks (``None``: never written), each ``check``-ed."""

    async def read_many(self, stripes: Stripes, indices: list[int], outs: list[np.ndarray],
                        loop: Loop, pool: Executor) -> None:
        """``read`` of several stripes in one pool task (only where ``groups_reads``)."""
        raise TypeError(f"the {self.name!r} read path cannot group reads")

    async def frames_many(self, stripes: Stripes, indices: list[int], check: FrameCheck,
                          loop: Loop, pool: Executor) -> list[Frames]:
        """``frames`` of several stripes in one pool task (only where ``groups_reads``)."""
        raise TypeError(f"the {self.name!r} read path cannot group reads")


@dataclass(frozen=True)
class LocalFiles(ReadPath):
    """Local stores: plain file reads on a pool thread, fetch and decode in one hand-off.
    Small stripes are grouped a few per pool task, since the hand-off (~0.1 ms) dominates."""

    root: Path
    name: ClassVar[str] = "local"
    groups_reads: ClassVar[bool] = True

    def get(self, key: str) -> bytes | None:
        try:
            # a string join: pathlib's ``/`` costs several microseconds per chunk
            with open(f"{self.root}/{key}", "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def get_scratch(self, key: str) -> memoryview | None:
        """``get``, into this thread's reused buffer: valid until this thread's next call.

        A fresh ``bytes`` per chunk is a fresh ``mmap`` for anything over glibc's 128 kB
        threshold, so every read page-faulted its buffer in (seen in profiles of 140 kB blosc
        chunks). Only for bytes decoded at once.
        """
        try:
            with open(f"{self.root}/{key}", "rb", buffering=0) as f:
                n = os.fstat(f.fileno()).st_size
                buf = _scratch(n)
                got = f.readinto(buf[:n])
                while got < n:  # a short read: keep going (files do not shrink under us)
                    more = f.readinto(buf[got:n])
                    if not more:
                        break
                    got += more
                return buf[:got]
        except FileNotFoundError:
            return None

    def read_blocking(self, stripes: Stripes, index: int, out: np.ndarray,
                      submitted: float | None = None) -> None:
        """Read and decode stripe ``index`` into ``out`` on this thread; ``submitted`` (a
        ``perf_counter`` time) is when it was handed to the pool, to count the queueing."""
        t0 = time.perf_counter()
        store = 0.0
        for inner in stripes.inner:
            key = stripes.chunk_key((index, *inner))
            t1 = time.perf_counter()
            data = self.get_scratch(key)
            store += time.perf_counter() - t1
            stripes.place(data, inner, out)
        stripes.times.add(store, time.perf_counter() - t0 - store,
                          t0 - submitted if submitted is not None else 0.0)

    def read_many_blocking(self, stripes: Stripes, indices: list[int], outs: list[np.ndarray],
                           submitted: float | None = None) -> None:
        for index, out in zip(indices, outs, strict=True):
            self.read_blocking(stripes, index, out, submitted)
            submitted = None  # only the first stripe waited in the queue

    def frames_blocking(self, stripes: Stripes, index: int, check: FrameCheck) -> Frames:
        t0 = time.perf_counter()
        out = []
        for inner in stripes.inner:
            key = stripes.chunk_key((index, *inner))
            data = self.get(key)
            _checked(check, data, key)
            out.append(data)
        stripes.times.add(time.perf_counter() - t0, 0.0)
        return out

    def _frames_many_blocking(self, stripes: Stripes, indices: list[int],
                              check: FrameCheck) -> list[Frames]:
        return [self.frames_blocking(stripes, i, check) for i in indices]

    async def read(self, stripes: Stripes, index: int, out: np.ndarray, loop: Loop,
                   pool: Executor) -> None:
        await loop.run_in_executor(pool, OneShot(self.read_blocking, stripes, index, out,
                                                 time.perf_counter()))

    async def read_many(self, stripes: Stripes, indices: list[int], outs: list[np.ndarray],
                        loop: Loop, pool: Executor) -> None:
        await loop.run_in_executor(pool, OneShot(self.read_many_blocking, stripes, indices,
                                                 outs, time.perf_counter()))

    async def frames(self, stripes: Stripes, index: int, check: FrameCheck, loop: Loop,
                     pool: Executor) -> Frames:
        return await loop.run_in_executor(pool, self.frames_blocking, stripes, index, check)

    async def frames_many(self, stripes: Stripes, indices: list[int], check: FrameCheck,
                          loop: Loop, pool: Executor) -> list[Frames]:
        return await loop.run_in_executor(pool, self._frames_many_blocking, stripes, indices,
                                          check)


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
        await loop.run_in_executor(pool, _check_all, check, keys, datas)
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


@dataclass(frozen=True, eq=False)
class ZarrGetitem(ReadPath):
    """Chains we do not decode (sharding, transpose, filters, ...): zarr fetches and decodes
    the whole stripe in ``getitem``, then one copy into the stripe buffer. Stored frames,
    if asked for, come through ``gets``."""

    arr: zarr.Array
    gets: AsyncGets
    name: ClassVar[str] = "zarr"

    async def read(self, stripes: Stripes, index: int, out: np.ndarray, loop: Loop,
                   pool: Executor) -> None:
        t0 = time.perf_counter()
        try:
            data = await self.arr.async_array.getitem((stripes.rows(index),))
        except _ZARR_DECODE_ERRORS as e:  # zarr fetched and decoded: received bytes
            raise ChunkDecodeError(f"zarr could not decode the stripe: {e}") from e
        stripes.times.add(time.perf_counter() - t0, 0.0)
        rows = int(data.shape[0])
        # Pass the pooled view itself, not a slice: a slice's base is the pool's array, so
        # it would not keep the view (and its place in the pool) alive if this read were
        # cancelled while the copy still runs.
        await loop.run_in_executor(pool, OneShot(_copy_rows, stripes, out, rows, data,
                                                 time.perf_counter()))

    async def frames(self, stripes: Stripes, index: int, check: FrameCheck, loop: Loop,
                     pool: Executor) -> Frames:
        return await self.gets.frames(stripes, index, check, loop, pool)


def read_path_for(arr: zarr.Array, decodes: bool) -> ReadPath:
    """The path for ``arr``'s store; ``decodes``: our ``ChunkDecoder`` takes its chain (else
    zarr's ``getitem`` reads it, whatever the store)."""
    store = arr.store_path.store
    gets: AsyncGets
    if isinstance(store, zarr.storage.ObjectStore):
        gets = ObjectStoreGets(store.store)
    else:
        gets = ZarrStoreGets(store)
    if not decodes:
        return ZarrGetitem(arr, gets)
    if isinstance(store, zarr.storage.LocalStore):
        return LocalFiles(Path(store.root))
    return gets


def _copy_rows(stripes: Stripes, out: np.ndarray, rows: int, src: np.ndarray,
               submitted: float) -> None:
    t0 = time.perf_counter()
    np.copyto(out[:rows], src)
    stripes.times.add(0.0, time.perf_counter() - t0, t0 - submitted)


def _check_all(check: FrameCheck, keys: list[str], datas: Frames) -> None:
    for key, data in zip(keys, datas, strict=True):
        _checked(check, data, key)


def _checked(check: FrameCheck, data: bytes | memoryview | None, key: str) -> None:
    if data is None:
        return
    try:
        check(data)
    except ValueError as e:
        raise ChunkDecodeError(f"chunk {key!r}: {e}", key) from e


_local = threading.local()


def _scratch(n: int) -> memoryview:
    """This thread's read buffer, at least ``n`` bytes (grown, never shrunk)."""
    buf = getattr(_local, "buf", None)
    if buf is None or len(buf) < n:
        buf = _local.buf = memoryview(bytearray(max(n, 1 << 16)))
    return buf
