"""The ways a stripe's stored chunks reach memory: one small class per kind of store.

``StripeReader`` picks one when it is built (``read_path_for``) instead of switching on a mode
string at every read. Each path knows how to get a stripe's stored bytes (a file read on a
pool thread, obstore's async get, zarr's store API, or zarr's own ``getitem`` when we do not
decode the chain) and whether several stripes can share one pool task; the reader keeps the
keys, the decoding into the stripe buffer, and the retries.
"""

from __future__ import annotations

import asyncio
import contextvars
import gzip
import logging
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

import numpy as np
import zarr
import zarr.storage
from zarr.abc.store import ByteRequest, Store
from zarr.core.buffer import Buffer, BufferPrototype, default_buffer_prototype
from zarr.storage import StorePath, WrapperStore

from ..metrics.counters import ReadTimes
from .chunk_cache import CacheScope, ChunkCache
from .pool_task import OneShot
from .retry import DECODE_ERRORS, ChunkDecodeError
from .thread_buffer import ThreadBuffer

Frames = list[bytes | memoryview | None]  # one stripe's stored chunks, in inner-chunk order
FrameCheck = Callable[[bytes | memoryview], None]  # raises ValueError on a damaged frame
Loop = asyncio.AbstractEventLoop
_READ = ThreadBuffer()  # ``LocalFiles.get_scratch``: one chunk file's bytes per thread


log = logging.getLogger("insitubatch_nodes")


class Stripes(Protocol):
    """What a read path needs of its reader. ``times`` is looked up at every read: the
    loader swaps in its own counters after the reader is built."""

    times: ReadTimes
    inner: list[tuple[int, ...]]
    whole_key: str | None  # a stripe stored as one chunk: its key is format(stripe)

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

        Three system calls (open, one read into the whole buffer, close): each releases and
        retakes the GIL, and with two decode threads every retake can wait out the other
        thread's Python. ``open()`` plus ``fstat`` cost five. The size is asked only when the
        read filled the buffer (a chunk larger than any before on this thread).
        """
        try:
            fd = os.open(f"{self.root}/{key}", os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            buf = _READ.raw(0)
            got = os.readv(fd, [buf])
            while got == len(buf):  # maybe more: grow past the file's size, read the rest
                # (one byte more than the file, so a read that reaches its end stops here)
                buf = _READ.raw(max(os.fstat(fd).st_size, got) + 1, keep=got)
                more = os.preadv(fd, [buf[got:]], got)
                if not more:
                    break
                got += more
            return buf[:got]
        finally:
            os.close(fd)

    def read_blocking(self, stripes: Stripes, index: int, out: np.ndarray,
                      submitted: float | None = None) -> None:
        """Read and decode stripe ``index`` into ``out`` on this thread; ``submitted`` (a
        ``perf_counter`` time) is when it was handed to the pool, to count the queueing."""
        t0 = time.perf_counter()
        wait = t0 - submitted if submitted is not None else 0.0
        if stripes.whole_key is not None:  # one chunk: the per-sample hot path, no loop
            data = self.get_scratch(stripes.whole_key.format(index))
            t1 = time.perf_counter()
            stripes.place(data, stripes.inner[0], out)
            stripes.times.add(t1 - t0, time.perf_counter() - t1, wait)
            return
        store = 0.0
        for inner in stripes.inner:
            key = stripes.chunk_key((index, *inner))
            t1 = time.perf_counter()
            data = self.get_scratch(key)
            store += time.perf_counter() - t1
            stripes.place(data, inner, out)
        stripes.times.add(store, time.perf_counter() - t0 - store, wait)

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
        _check_all(check, keys, datas)
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


# Where obstore takes an endpoint or an account from when the store's options do not say.
_PLACE_ENV = {"S3Store": (("endpoint", ("AWS_ENDPOINT_URL", "AWS_ENDPOINT")),),
              "AzureStore": (("endpoint", ("AZURE_STORAGE_ENDPOINT", "AZURE_ENDPOINT")),
                             ("account_name", ("AZURE_STORAGE_ACCOUNT_NAME",
                                               "AZURE_STORAGE_ACCOUNT"))),
              "GCSStore": ()}


def store_place(store: Any) -> str:
    """What besides its URL says which server and account an obstore store reads (its
    endpoint, an Azure account), given in its options or taken from the environment as
    obstore does: a bucket of one name on MinIO and on AWS must not share cache entries."""
    config = {str(k).lower(): v for k, v in (getattr(store, "config", None) or {}).items()}
    place = ""
    for field, names in _PLACE_ENV.get(type(store).__name__, ()):
        value = config.get(field) or next((os.environ[n] for n in names if os.environ.get(n)),
                                          None)
        if value:
            place += f" at {value}" if field == "endpoint" else f" {field} {value}"
    if "endpoint" in config and type(store).__name__ not in _PLACE_ENV:
        place += f" at {config['endpoint']}"
    return place


def stable_name(url: str) -> bool:
    """Whether a store's name says which store it is across objects and processes: a URL,
    not a memory store's ``memory://<id>`` or an object's repr (``<IcechunkStore object at
    0x...>``, ``<FsspecStore(...)>``, which names neither endpoint nor snapshot)."""
    return not (url.startswith(("memory://", "<")) or " object at 0x" in url)


def cached(path: ReadPath, cache: ChunkCache, scope: CacheScope) -> ReadPath:
    """``path`` with its store reads through ``cache``; local files are never cached (their
    chunks are on local disk already). zarr's own ``getitem`` reads (chains we do not
    decode, sharding among them) go through a ``CachingStore``."""
    if isinstance(path, (CachedGets, CachedGetitem)):
        return path
    if not stable_name(scope.url):
        # A memory store's chunks are in memory already, and its name (``memory://<id>``)
        # is no place: another store may have the same id later or in another process; so
        # is a store object known only by its repr (``<... object at 0x...>``).
        log.info("insitubatch: chunks of %s are not cached: it has no name that stays its "
                 "own (open it by URL to cache it)", scope.url)
        return path
    gets = path.gets if isinstance(path, ZarrGetitem) else path
    if isinstance(gets, ObjectStoreGets):  # the same bucket name on another server
        place = store_place(gets.store)
        if place:
            scope = CacheScope.of(f"{scope.url}{place}", scope.snapshot_id)
    if isinstance(path, AsyncGets):
        return CachedGets(path, cache, scope)
    if isinstance(path, ZarrGetitem):
        arr = path.arr
        store = CachingStore(arr.store_path.store, cache, scope)
        on_cache = zarr.Array(zarr.AsyncArray(arr.metadata, StorePath(store, arr.store_path.path),
                                              arr.async_array.config))
        return CachedGetitem(on_cache, CachedGets(path.gets, cache, scope), store)
    return path


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
        except (*DECODE_ERRORS, gzip.BadGzipFile) as e:  # zarr fetched and decoded: received
            # bytes (BadGzipFile is an OSError, but only gzip's decoder raises it)
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
                   pool: Executor) -> None:
        self.store.times = stripes.times
        pending: list[tuple[str, bytes]] = []
        token = _fetched.set(pending)
        try:
            await super().read(stripes, index, out, loop, pool)
        finally:
            _fetched.reset(token)
        for ident, raw in pending:
            self.store.cache.put_later(ident, raw)


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

