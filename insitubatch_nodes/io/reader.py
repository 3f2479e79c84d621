"""Reading one variable's sample-axis stripe (all inner chunks of it) into a buffer.

Three ways to get bytes, chosen per store: a plain file read on a pool thread (local
stores: one hand-off does fetch and decode), obstore's async get on the event loop
(object stores: many requests in flight without threads), or zarr's async store API
(any other store). Decoding goes through ``ChunkDecoder`` when the codec chain allows,
else the whole stripe is read through zarr's own ``getitem``.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import zarr
import zarr.storage
from zarr.core.buffer import default_buffer_prototype

from ..geometry import VariableGeometry
from ..metrics import ReadTimes
from .decode import ChunkDecoder, decoder_for
from .retry import NO_RETRY, RetryPolicy, classify

T = TypeVar("T")
Frames = list[bytes | memoryview | None]  # one stripe's stored chunks, in inner-chunk order
FrameCheck = Callable[[bytes | memoryview], None]  # raises ValueError on a damaged frame


def _check_all(check: FrameCheck, keys: list[str],
               datas: list[bytes | memoryview | None]) -> None:
    for key, data in zip(keys, datas, strict=True):
        _checked(check, data, key)


def _checked(check: FrameCheck, data: bytes | memoryview | None, key: str) -> None:
    if data is None:
        return
    try:
        check(data)
    except ValueError as e:
        raise ValueError(f"chunk {key!r}: {e}") from None


class StripeReader:
    """Fills ``out`` (shape ``geom.stripe_shape``, native dtype) with one stripe of data."""

    def __init__(self, arr: zarr.Array, geom: VariableGeometry, source_url: str) -> None:
        self.arr = arr
        self.geom = geom
        self.source_url = source_url
        self.decoder: ChunkDecoder | None = decoder_for(arr)
        self.times = ReadTimes()  # store / decode / pool-queue stripe-seconds (metrics)
        store = arr.store_path.store
        self._prefix = arr.store_path.path.strip("/")
        self._root: Path | None = None
        self._obstore = None
        if isinstance(store, zarr.storage.LocalStore):
            self._root = Path(store.root)
            self.mode = "local"
        elif isinstance(store, zarr.storage.ObjectStore):
            self._obstore = store.store
            self.mode = "object"
        else:
            self.mode = "zarr-store"
        if self.decoder is None:
            self.mode = "zarr"
        self._store = store
        fill = arr.metadata.fill_value
        self.fill_value = np.asarray(fill if fill is not None else 0).astype(geom.dtype)
        self.inner = list(itertools.product(*(range(n) for n in geom.inner_grid)))
        # Decode straight into the stripe buffer when one stored chunk is exactly a stripe.
        self.direct = geom.chunks[1:] == geom.shape[1:]
        self.chunk_nbytes = int(np.prod(geom.chunks, dtype=np.int64)) * geom.dtype.itemsize

    # -- keys and regions -------------------------------------------------------------
    def chunk_key(self, coords: tuple[int, ...]) -> str:
        key = self.arr.metadata.encode_chunk_key(coords)
        return f"{self._prefix}/{key}" if self._prefix else key

    def describe(self, index: int) -> str:
        """Names the array and chunk for error notes (never credentials)."""
        coords = (index,) + (0,) * (len(self.geom.shape) - 1)
        return (f"variable {self.geom.name!r} of {self.source_url}, sample-axis chunk {index} "
                f"(first key {self.chunk_key(coords)!r})")

    def region(self, inner: tuple[int, ...]) -> tuple[tuple[slice, ...], tuple[slice, ...]]:
        """Where an inner chunk lands in the stripe buffer, and which part of it is valid."""
        dst, src = [slice(None)], [slice(None)]
        for c, n, size in zip(inner, self.geom.chunks[1:], self.geom.shape[1:], strict=True):
            start = c * n
            stop = min(start + n, size)
            dst.append(slice(start, stop))
            src.append(slice(0, stop - start))
        return tuple(dst), tuple(src)

    def _place(self, data: bytes | memoryview | None, inner: tuple[int, ...],
               out: np.ndarray) -> None:
        if data is None:  # a chunk never written reads as the fill value, as in zarr
            dst, _ = self.region(inner)
            out[dst] = self.fill_value
            return
        assert self.decoder is not None
        if self.direct:
            self.decoder.decode_into(data, out)
            return
        tmp = np.empty(self.geom.chunks, dtype=self.geom.dtype)
        self.decoder.decode_into(data, tmp)
        dst, src = self.region(inner)
        out[dst] = tmp[src]

    # -- local: fetch and decode in one pool task -------------------------------------
    def _read_file(self, key: str) -> bytes | None:
        assert self._root is not None
        try:
            with open(self._root / key, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def read_local(self, index: int, out: np.ndarray, submitted: float | None = None) -> None:
        """Read and decode stripe ``index`` into ``out`` on this thread.

        ``submitted`` (a ``perf_counter`` time) is when the read was handed to the pool, to
        count the time it queued.
        """
        t0 = time.perf_counter()
        store = 0.0
        for inner in self.inner:
            key = self.chunk_key((index, *inner))
            t1 = time.perf_counter()
            data = self._read_file(key)
            t2 = time.perf_counter()
            store += t2 - t1
            self._place(data, inner, out)
        self.times.add(store, time.perf_counter() - t0 - store,
                       t0 - submitted if submitted is not None else 0.0)

    def read_local_many(self, indices: list[int], outs: list[np.ndarray],
                        submitted: float | None = None) -> None:
        """Several stripes in one pool task: small chunks are dominated by the per-task
        hand-off (~0.1 ms), so a window's small stripes are read in a few groups."""
        for index, out in zip(indices, outs, strict=True):
            self.read_local(index, out, submitted)
            submitted = None

    async def read_group(self, indices: list[int], outs: list[np.ndarray],
                         loop: asyncio.AbstractEventLoop, pool: Executor,
                         retry: RetryPolicy = NO_RETRY) -> int:
        """``read`` for several stripes of a local store in one hand-off (``_grouped``)."""
        out_of = dict(zip(indices, outs, strict=True))
        _, attempts = await self._grouped(
            indices,
            lambda: loop.run_in_executor(pool, self.read_local_many, indices, outs,
                                         time.perf_counter()),
            lambda i: self._retrying(i, retry, lambda: self._read_once(i, out_of[i], loop,
                                                                       pool)))
        return attempts

    async def _grouped(self, indices: list[int], group: Callable[[], Awaitable[Any]],
                       one: Callable[[int], Awaitable[tuple[T, int]]]) -> tuple[Any, int]:
        """Run ``group()`` (every stripe in one pool task); if it fails, fall back to
        ``one(index)`` per stripe, each with its own retries and error note. Returns (result,
        attempts), the failed group try counting as one attempt per stripe."""
        try:
            return await group(), len(indices)
        except asyncio.CancelledError:
            raise
        except Exception:
            results, attempts = [], len(indices)
            for index in indices:
                result, n = await one(index)
                results.append(result)
                attempts += n
            return results, attempts

    # -- async paths ------------------------------------------------------------------
    async def _get_all(self, index: int) -> tuple[list[str], list[bytes | memoryview | None]]:
        """Every stored chunk of stripe ``index``, fetched concurrently (async stores)."""
        keys = [self.chunk_key((index, *inner)) for inner in self.inner]
        t0 = time.perf_counter()
        datas = await asyncio.gather(*(self._get_async(k) for k in keys))
        self.times.add(time.perf_counter() - t0, 0.0)
        return keys, list(datas)

    async def _get_async(self, key: str) -> bytes | memoryview | None:
        if self._obstore is not None:
            import obstore

            try:
                resp = await obstore.get_async(self._obstore, key)
            except FileNotFoundError:
                return None
            return memoryview(await resp.bytes_async())
        buf = await self._store.get(key, prototype=default_buffer_prototype())
        return None if buf is None else buf.as_numpy_array().data

    async def read(self, index: int, out: np.ndarray, loop: asyncio.AbstractEventLoop,
                   pool: Executor, retry: RetryPolicy = NO_RETRY) -> int:
        """Fill ``out`` with stripe ``index``, retrying transient failures; returns attempts.

        The error that ends the retries keeps its type and gets a note naming the array,
        the chunk key, the store (without credentials) and the number of attempts.
        """
        _, attempts = await self._retrying(
            index, retry, lambda: self._read_once(index, out, loop, pool))
        return attempts

    async def _retrying(self, index: int, retry: RetryPolicy,
                        once: Callable[[], Awaitable[T]]) -> tuple[T, int]:
        """``once()`` until it succeeds or the policy gives up: (result, attempts)."""
        rng: random.Random | None = None  # only after a failure: seeding costs ~10 us
        attempt = decode_failures = 0
        while True:
            attempt += 1
            try:
                return await once(), attempt
            except asyncio.CancelledError:
                raise
            except Exception as e:
                kind = classify(e)
                decode_failures += kind == "decode"
                give_up = (kind == "permanent" or attempt >= retry.attempts
                           or decode_failures >= retry.decode_attempts)
                if give_up:
                    why = ("not retried: this error does not heal by waiting"
                           if kind == "permanent" else f"gave up after {attempt} attempt(s)")
                    e.add_note(f"insitubatch: {why} reading {self.describe(index)}")
                    raise
                rng = rng or random.Random()
                await asyncio.sleep(retry.delay(attempt, rng))

    # -- compressed frames, for decoding on the device ------------------------------------
    async def read_frames(self, indices: list[int], check: FrameCheck,
                          loop: asyncio.AbstractEventLoop, pool: Executor,
                          retry: RetryPolicy = NO_RETRY) -> tuple[list[Frames], int]:
        """The stored (compressed) chunks of stripes ``indices``, one list per stripe in
        inner-chunk order (``None``: never written), each checked by ``check(frame)`` (a
        ``ValueError`` gets the chunk key).

        A local store reads the group in one pool task; a failure there falls back to one
        stripe at a time, each with its own retries and error note. Returns (frames,
        attempts)."""
        def one(i: int) -> Awaitable[tuple[Frames, int]]:
            return self._retrying(i, retry, lambda: self._frames_once(i, check, loop, pool))

        if self.mode == "local" and len(indices) > 1:
            return await self._grouped(
                indices, lambda: loop.run_in_executor(pool, self._frames_local_many, indices,
                                                      check), one)
        out, attempts = [], 0
        for index in indices:
            frames, n = await one(index)
            out.append(frames)
            attempts += n
        return out, attempts

    async def _frames_once(self, index: int, check: FrameCheck,
                           loop: asyncio.AbstractEventLoop, pool: Executor) -> Frames:
        if self.mode == "local":
            return await loop.run_in_executor(pool, self._frames_local, index, check)
        keys, datas = await self._get_all(index)
        # The checks walk frames in Python: on the pool, not on the loop driving the GETs.
        await loop.run_in_executor(pool, _check_all, check, keys, datas)
        return datas

    def _frames_local(self, index: int, check: FrameCheck) -> Frames:
        t0 = time.perf_counter()
        out = []
        for inner in self.inner:
            key = self.chunk_key((index, *inner))
            data = self._read_file(key)
            _checked(check, data, key)
            out.append(data)
        self.times.add(time.perf_counter() - t0, 0.0)
        return out

    def _frames_local_many(self, indices: list[int], check: FrameCheck) -> list[Frames]:
        return [self._frames_local(i, check) for i in indices]

    async def _read_once(self, index: int, out: np.ndarray, loop: asyncio.AbstractEventLoop,
                         pool: Executor) -> None:
        if self.mode == "local":
            await loop.run_in_executor(pool, self.read_local, index, out, time.perf_counter())
        elif self.mode == "zarr":
            sel = (slice(index * self.geom.chunks[0],
                         min((index + 1) * self.geom.chunks[0], self.geom.shape[0])),)
            t0 = time.perf_counter()
            data = await self.arr.async_array.getitem(sel)  # zarr fetches *and* decodes here
            self.times.add(time.perf_counter() - t0, 0.0)
            rows = int(data.shape[0])
            # Pass the pooled view itself, not a slice: a slice's base is the pool's array,
            # so it would not keep the view (and its place in the pool) alive if this read
            # were cancelled while the copy still runs.
            await loop.run_in_executor(pool, self._copy_rows, out, rows, data,
                                       time.perf_counter())
        else:
            _, datas = await self._get_all(index)
            await loop.run_in_executor(pool, self._place_all, datas, out, time.perf_counter())

    def _copy_rows(self, out: np.ndarray, rows: int, src: np.ndarray, submitted: float) -> None:
        t0 = time.perf_counter()
        np.copyto(out[:rows], src)
        self.times.add(0.0, time.perf_counter() - t0, t0 - submitted)

    def _place_all(self, datas: list, out: np.ndarray, submitted: float | None = None) -> None:
        t0 = time.perf_counter()
        for inner, data in zip(self.inner, datas, strict=True):
            self._place(data, inner, out)
        self.times.add(0.0, time.perf_counter() - t0,
                       t0 - submitted if submitted is not None else 0.0)
