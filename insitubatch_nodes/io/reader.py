"""Reading one variable's sample-axis stripe (all inner chunks of it) into a buffer.

How the stored bytes arrive is a ``read_paths.ReadPath`` chosen once per variable: a plain
file read on a pool thread (local stores: one hand-off does fetch and decode), obstore's
async get on the event loop (object stores), zarr's async store API (any other store), or
zarr's own ``getitem`` when ``ChunkDecoder`` does not take the codec chain. The reader keeps
what every path shares: chunk keys, decoding into the stripe buffer, and retries.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import re
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import zarr

from ..errors import UsageTypeError
from ..metrics.counters import ReadTimes
from ..sampling.geometry import VariableGeometry
from ..store.storage import redact_urls
from .chunk_cache import CacheScope, ChunkCache
from .codec_chain import CodecChain, classify
from .decode import ChunkDecoder, decoder_from
from .partial.fetch import PartialFetch, PartialRule
from .partial.ranges import ChunkPart, PartSpec, copy_wanted, stripe_parts
from .partial.sparse import SparseFrame
from .read_path_base import Parts, Placeable
from .read_paths import CachedGets, FrameCheck, Frames, LocalFiles, ReadPath, cached, read_path_for
from .retry import (
    NO_RETRY,
    ChunkDecodeError,
    ChunkReadError,
    RetryPolicy,
    final_error,
    is_store_error,
)
from .retry import classify as classify_error
from .thread_buffer import ThreadBuffer

__all__ = ["Frames", "PartialRule", "StripeReader"]

T = TypeVar("T")
# A chunk that covers only part of its stripe decodes here first (per decode thread).
_PARTIAL = ThreadBuffer()


@dataclass
class _Tries:
    """One stripe's tries so far, for ``StripeReader._after_failure``."""

    attempt: int = 0
    decode_failures: int = 0
    rng: random.Random | None = None  # made at the first failure: seeding costs ~10 us


def groups_reads(arr: zarr.Array) -> bool:
    """Whether a ``StripeReader`` of ``arr`` reads local files on its pool threads (several
    stripes per task, no event loop): what ``build_loader`` asks before decoding chunks of
    several samples into batches."""
    return read_path_for(arr, decodes=decoder_from(classify(arr)) is not None).groups_reads


class StripeReader:
    """Fills ``out`` (shape ``geom.stripe_shape``, native dtype) with one stripe of data.

    Every read takes ``part``: a ``PartSpec`` of the index ranges along the stripe's axis 1
    it wants (levels, variables; the same in every sample), or ``None`` for all of it.
    With a part, stored chunks holding no wanted index are not read, blosc chunks decode
    only the blocks holding wanted bytes, and object stores fetch only those (header and
    offsets first: ``partial.fetch``); bytes of ``out`` outside the part are left as they
    are or get their stored values. ``partial_stats`` counts what the parts did.
    """

    def __init__(self, arr: zarr.Array, geom: VariableGeometry, source_url: str) -> None:
        self.arr = arr
        self.geom = geom
        self.source_url = source_url
        self.codec_chain: CodecChain = classify(arr)
        self.decoder: ChunkDecoder | None = decoder_from(self.codec_chain)
        self.times = ReadTimes()  # store / decode / pool-queue stripe-seconds (metrics)
        self._path: ReadPath = read_path_for(arr, decodes=self.decoder is not None)
        self._prefix = arr.store_path.path.strip("/")
        self._key_template, self._key_inner = self._template()
        fill = arr.metadata.fill_value
        self.fill_value = np.asarray(fill if fill is not None else 0).astype(geom.dtype)
        self.inner = list(itertools.product(*(range(n) for n in geom.inner_grid)))
        # A stripe stored as one chunk: its key is this template's format(stripe) (the one
        # chunk per sample of the archives, read on the hot path without the general loop).
        self.whole_key = self._key_template if len(self.inner) == 1 else None
        # Decode straight into the stripe buffer when one stored chunk is exactly a stripe.
        self.direct = geom.chunks[1:] == geom.shape[1:]
        self.chunk_nbytes = int(np.prod(geom.chunks, dtype=np.int64)) * geom.dtype.itemsize
        # Blosc alone on native bytes: chunks decode (and fetch) in part.
        self.blocks_ok = self.decoder is not None and self.decoder.blosc_only
        self.partial_stats = self.times.partial
        self.partial = PartialFetch(PartialRule(), self.partial_stats)
        self._parts: dict[PartSpec, Parts] = {}

    def count_into(self, times: ReadTimes) -> None:
        """Count reads (times, cache, partial reads) into ``times``: the loader's own."""
        self.times, self.partial_stats = times, times.partial
        self.partial = PartialFetch(self.partial.rule, times.partial)

    @property
    def partial_rule(self) -> PartialRule:
        """When object-store chunks are fetched in part (``PartialRule``); settable."""
        return self.partial.rule

    @partial_rule.setter
    def partial_rule(self, rule: PartialRule) -> None:
        self.partial = PartialFetch(rule, self.partial_stats)

    def chunk_parts(self, part: PartSpec | None) -> Parts | None:
        """Per inner chunk of a stripe (``inner`` order), what a read of ``part`` wants
        of it (``None``: nothing, not read); ``None`` for no part. Computed once per part."""
        if part is None:
            return None
        parts = self._parts.get(part)
        if parts is None:
            g = self.geom
            parts = self._parts[part] = stripe_parts(part, g.name, g.shape, g.chunks,
                                                     g.dtype.itemsize, self.inner)
        return parts

    @property
    def mode(self) -> str:
        """The read path's name: ``"local"``, ``"object"``, ``"zarr-store"`` or ``"zarr"``."""
        return self._path.name

    def use_cache(self, cache: ChunkCache, snapshot_id: str | None = None) -> None:
        """Read stored chunks through ``cache`` from now on, keyed by this store (its URL
        and endpoint, without credentials), ``snapshot_id`` (icechunk) and the chunk key.
        Local stores are never cached: their chunks are on local disk already."""
        self._path = cached(self._path, cache, CacheScope.of(self.source_url, snapshot_id))

    @property
    def reads_cache(self) -> bool:
        """Stored chunks come through a local ``ChunkCache`` (``use_cache``) and are decoded
        here: a stripe whose chunks are all cached can be read on a pool thread directly."""
        return isinstance(self._path, CachedGets)

    def is_cached(self, index: int, *, part: PartSpec | None = None) -> bool:
        """Every stored chunk of stripe ``index`` (that ``part`` needs) is in the cache now
        (``reads_cache``)."""
        assert isinstance(self._path, CachedGets)
        return self._path.all_cached(self, index, part)

    def read_cached(self, indices: list[int], outs: list[np.ndarray],
                    submitted: float | None = None, *,
                    part: PartSpec | None = None) -> list[int]:
        """Decode stripes (``part`` of them) from the cache on this (pool) thread; the
        indices that were not all there after all (dropped or damaged meanwhile, or cached
        for a narrower part), for the store path."""
        assert isinstance(self._path, CachedGets)
        missed = []
        for i, out in zip(indices, outs, strict=True):
            if not self._path.read_cached_blocking(self, i, out, submitted, part):
                missed.append(i)
            submitted = None  # only the first stripe waited in the queue
        return missed

    @property
    def groups_reads(self) -> bool:
        """Several stripes can be read in one pool task (``read_group``): local files,
        where the per-task hand-off dominates small stripes."""
        return self._path.groups_reads

    # -- keys and regions -------------------------------------------------------------
    def chunk_key(self, coords: tuple[int, ...]) -> str:
        if self._key_template is not None and coords[1:] == self._key_inner:
            return self._key_template.format(coords[0])
        key = self.arr.metadata.encode_chunk_key(coords)
        return f"{self._prefix}/{key}" if self._prefix else key

    def _template(self) -> tuple[str | None, tuple[int, ...]]:
        """A format string for the keys of a stripe's first inner chunk (all of it when a
        stored chunk is a stripe): zarr's key encoding costs microseconds per chunk, and
        one-sample chunks pay it once per sample. Checked against zarr's own keys."""
        inner = (0,) * (len(self.geom.shape) - 1)
        probe = 987_654_321
        key = self.arr.metadata.encode_chunk_key((probe, *inner))
        if key.count(str(probe)) != 1:
            return None, inner
        key = f"{self._prefix}/{key}" if self._prefix else key
        template = key.replace("{", "{{").replace("}", "}}").replace(str(probe), "{}")
        for i in (0, 7, 12345):
            want = self.arr.metadata.encode_chunk_key((i, *inner))
            want = f"{self._prefix}/{want}" if self._prefix else want
            if template.format(i) != want:
                return None, inner
        return template, inner

    def stored_key(self, coords: tuple[int, ...]) -> str:
        """The key of the stored object that holds chunk ``coords``: in a sharded array, its
        shard (zarr's chunk grid is the shard grid there), which is what errors must name."""
        shards = self.arr.shards
        if shards is None:
            return self.chunk_key(coords)
        grid = tuple(c * n // s for c, n, s in zip(coords, self.geom.chunks, shards,
                                                    strict=True))
        key = self.arr.metadata.encode_chunk_key(grid)
        return f"{self._prefix}/{key}" if self._prefix else key

    def stored_keys(self, index: int) -> list[str]:
        """The stored objects holding stripe ``index`` (its shards, in a sharded array)."""
        return list(dict.fromkeys(self.stored_key((index, *inner)) for inner in self.inner))

    def keys(self, index: int) -> list[str]:
        """The store keys of stripe ``index``'s inner chunks, in inner-chunk order."""
        return [self.chunk_key((index, *inner)) for inner in self.inner]

    def rows(self, index: int) -> slice:
        """Stripe ``index``'s rows along the sample axis."""
        n = self.geom.chunks[0]
        return slice(index * n, min((index + 1) * n, self.geom.shape[0]))

    def describe(self, index: int) -> str:
        """Names the array and chunk for error notes (never credentials)."""
        coords = (index,) + (0,) * (len(self.geom.shape) - 1)
        return (f"variable {self.geom.name!r} of {self.source_url}, sample-axis chunk {index} "
                f"(first key {self.stored_key(coords)!r})")

    def region(self, inner: tuple[int, ...]) -> tuple[tuple[slice, ...], tuple[slice, ...]]:
        """Where an inner chunk lands in the stripe buffer, and which part of it is valid."""
        dst, src = [slice(None)], [slice(None)]
        for c, n, size in zip(inner, self.geom.chunks[1:], self.geom.shape[1:], strict=True):
            start = c * n
            stop = min(start + n, size)
            dst.append(slice(start, stop))
            src.append(slice(0, stop - start))
        return tuple(dst), tuple(src)

    # -- decoding into the stripe buffer ----------------------------------------------
    def place(self, data: bytes | memoryview | SparseFrame | None, inner: tuple[int, ...],
              out: np.ndarray, cp: ChunkPart | None = None) -> None:
        """Decode one stored inner chunk (``None``: never written) into its region of
        ``out``; with ``cp``, at least the part of it that ``cp`` wants."""
        if data is None:  # a chunk never written reads as the fill value, as in zarr
            dst, _ = self.region(inner)
            out[dst] = self.fill_value
            return
        assert self.decoder is not None
        some = cp is not None and not cp.whole
        try:
            target = out if self.direct else _PARTIAL.array(self.geom.chunks, self.geom.dtype)
            if some:
                assert cp is not None
                self.partial_stats.decoded(
                    self.decoder.decode_part_into(data, target, cp.byte_ranges))
            else:
                if cp is not None:
                    self.partial_stats.decoded(False)
                assert not isinstance(data, SparseFrame)  # fetched for a part only (``some``)
                self.decoder.decode_into(data, target)
        except ChunkDecodeError as e:
            e.inner = inner  # the reader names the chunk key (it knows the stripe)
            raise
        if self.direct:
            return
        dst, src = self.region(inner)
        if not some:
            out[dst] = target[src]
            return
        assert cp is not None
        copy_wanted(out, dst, target, src, cp.axis1, cp.box)  # the rest may not be decoded

    def place_all(self, datas: Placeable, out: np.ndarray, submitted: float | None = None,
                  parts: Parts | None = None) -> None:
        """``place`` every inner chunk of a stripe (with ``parts``, those wanted), counting
        the decode (and the time queued for the pool since ``submitted``, a
        ``perf_counter`` time)."""
        t0 = time.perf_counter()
        if parts is None:
            for inner, data in zip(self.inner, datas, strict=True):
                self.place(data, inner, out)
        else:
            for inner, data, cp in zip(self.inner, datas, parts, strict=True):
                if cp is not None:
                    self.place(data, inner, out, cp)
        self.times.add(0.0, time.perf_counter() - t0,
                       t0 - submitted if submitted is not None else 0.0)

    # -- local stores: fetch and decode on the calling thread -------------------------
    def _local(self) -> LocalFiles:
        if not isinstance(self._path, LocalFiles):
            raise UsageTypeError(f"variable {self.geom.name!r} of {self.source_url} is read by "
                                 f"the {self.mode!r} path, not from local files")
        return self._path

    def read_local(self, index: int, out: np.ndarray, submitted: float | None = None, *,
                   part: PartSpec | None = None) -> None:
        """Read and decode stripe ``index`` (``part`` of it) into ``out`` on this thread
        (local stores).

        ``submitted`` (a ``perf_counter`` time) is when the read was handed to the pool, to
        count the time it queued.
        """
        self._local().read_blocking(self, index, out, submitted, part)

    def read_local_many(self, indices: list[int], outs: list[np.ndarray],
                        submitted: float | None = None, *,
                        part: PartSpec | None = None) -> None:
        """Several stripes in one pool task: small chunks are dominated by the per-task
        hand-off (~0.1 ms), so a window's small stripes are read in a few groups."""
        self._local().read_many_blocking(self, indices, outs, submitted, part)

    def _read_file(self, key: str) -> bytes | None:
        """One stored object of a local store (``benchmarks/bench_gpu_decode.py``)."""
        return self._local().get(key)

    # -- reads with retries ----------------------------------------------------------
    async def read(self, index: int, out: np.ndarray, loop: asyncio.AbstractEventLoop,
                   pool: Executor, retry: RetryPolicy = NO_RETRY, *,
                   part: PartSpec | None = None) -> int:
        """Fill ``out`` with stripe ``index`` (``part`` of it), retrying transient
        failures; returns attempts.

        A store or decode failure that ends the retries is raised as ``ChunkReadError``
        (``CorruptChunkError`` for bytes that never decoded) naming the store (without
        credentials), the variable, the chunk key and the attempts, the failure as its
        ``__cause__``; any other error keeps its type. Either gets a note naming the stripe.
        """
        _, attempts = await self._retrying(
            index, retry, lambda: self._path.read(self, index, out, loop, pool, part))
        return attempts

    async def read_group(self, indices: list[int], outs: list[np.ndarray],
                         loop: asyncio.AbstractEventLoop, pool: Executor,
                         retry: RetryPolicy = NO_RETRY, *,
                         part: PartSpec | None = None) -> int:
        """``read`` for several stripes: in one pool hand-off where ``groups_reads`` (see
        ``_grouped``), else one after another. Returns attempts."""
        out_of = dict(zip(indices, outs, strict=True))

        def one(i: int) -> Awaitable[tuple[None, int]]:
            return self._retrying(i, retry, lambda: self._path.read(self, i, out_of[i], loop,
                                                                    pool, part))

        if self.groups_reads:
            _, attempts = await self._grouped(
                indices, lambda: self._path.read_many(self, indices, outs, loop, pool, part),
                one)
        else:
            _, attempts = await self._each(indices, one)
        return attempts

    async def read_frames(self, indices: list[int], check: FrameCheck,
                          loop: asyncio.AbstractEventLoop, pool: Executor,
                          retry: RetryPolicy = NO_RETRY) -> tuple[list[Frames], int]:
        """The stored (compressed) chunks of stripes ``indices``, one list per stripe in
        inner-chunk order (``None``: never written), each checked by ``check(frame)`` (a
        ``ValueError`` gets the chunk key), for decoding on the device.

        Where ``groups_reads``, the group is read in one pool task; a failure there falls
        back to one stripe at a time, each with its own retries and error note. Returns
        (frames, attempts)."""
        def one(i: int) -> Awaitable[tuple[Frames, int]]:
            return self._retrying(i, retry, lambda: self._path.frames(self, i, check, loop,
                                                                      pool))

        if self.groups_reads and len(indices) > 1:
            return await self._grouped(
                indices, lambda: self._path.frames_many(self, indices, check, loop, pool), one)
        return await self._each(indices, one)

    async def _each(self, indices: list[int],
                    one: Callable[[int], Awaitable[tuple[T, int]]]) -> tuple[list[T], int]:
        """``one(index)`` for each stripe in turn: (results, attempts)."""
        results, attempts = [], 0
        for index in indices:
            result, n = await one(index)
            results.append(result)
            attempts += n
        return results, attempts

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
            self.times.retried(len(indices))
            results, attempts = await self._each(indices, one)
            return results, attempts + len(indices)

    async def _retrying(self, index: int, retry: RetryPolicy,
                        once: Callable[[], Awaitable[T]]) -> tuple[T, int]:
        """``once()`` until it succeeds or the policy gives up: (result, attempts)."""
        tries = _Tries()
        while True:
            tries.attempt += 1
            try:
                return await once(), tries.attempt
            except asyncio.CancelledError:
                raise
            except Exception as e:
                await asyncio.sleep(self._after_failure(index, e, tries, retry))

    def _after_failure(self, index: int, e: Exception, tries: _Tries,
                       retry: RetryPolicy) -> float:
        """Attempt ``tries.attempt`` of stripe ``index`` failed with ``e``: raise what to give
        up with (``e`` itself, or the ``ChunkReadError`` naming the chunk, from ``e``), else
        count the retry and return the seconds to wait. The one policy of the async and the
        pool-thread retries."""
        kind = classify_error(e)
        tries.decode_failures += kind == "decode"
        attempt = tries.attempt
        give_up = (kind == "permanent" or attempt >= retry.attempts
                   or tries.decode_failures >= retry.decode_attempts)
        if not give_up:
            self.times.retried()
            tries.rng = tries.rng or random.Random()
            return retry.delay(attempt, tries.rng)
        why = ("not retried: this error does not heal by waiting"
               if kind == "permanent" else f"gave up after {attempt} attempt(s)")
        if not is_store_error(e):  # a programming error keeps its own type
            e.add_note(f"insitubatch: {why} reading {self.describe(index)}")
            raise e
        final = self._failure(index, e, attempt, kind)
        final.add_note(f"insitubatch: {why} reading {self.describe(index)}")
        raise final from e

    # -- local stores, retried on the pool thread -------------------------------------
    def read_local_retrying(self, indices: list[int], outs: list[np.ndarray],
                            retry: RetryPolicy = NO_RETRY,
                            submitted: float | None = None, *,
                            part: PartSpec | None = None) -> int:
        """``read_group`` for a local store, run on the calling (pool) thread: the same
        grouped try, per-stripe fallback and retries, without an event loop, so the
        consumer thread can submit a window's reads straight to the pool. Returns attempts."""
        if len(indices) == 1:  # its first try is the one that waited in the pool's queue
            return self._read_local_one(indices[0], outs[0], retry, submitted, part)
        if not indices:
            return 0
        try:
            self.read_local_many(indices, outs, submitted, part=part)
            return len(indices)
        except Exception:
            self.times.retried(len(indices))
            attempts = len(indices)  # the failed group try, once per stripe
        for index, out in zip(indices, outs, strict=True):
            attempts += self._read_local_one(index, out, retry, None, part)
        return attempts

    def _read_local_one(self, index: int, out: np.ndarray, retry: RetryPolicy,
                        submitted: float | None = None,
                        part: PartSpec | None = None) -> int:
        tries = _Tries()
        while True:
            tries.attempt += 1
            try:
                self.read_local(index, out, submitted if tries.attempt == 1 else None,
                                part=part)
                return tries.attempt
            except Exception as e:
                time.sleep(self._after_failure(index, e, tries, retry))

    def _failure(self, index: int, exc: BaseException, attempts: int,
                 kind: str) -> ChunkReadError:
        """The error that ends the reads of stripe ``index``: its message alone says where
        (store, variable, chunk key), how often it was tried, and what failed last."""
        key = exc.key if isinstance(exc, ChunkDecodeError) else None
        if key is None and isinstance(exc, ChunkDecodeError) and exc.inner is not None:
            key = self.stored_key((index, *exc.inner))
        stored = self.stored_keys(index) if key is None else [key]
        what = "shard" if self.arr.shards is not None else "chunk"
        if len(stored) == 1:
            key = stored[0]
            chunk = f"{what} {key!r}"
        else:
            chunk = (f"one of the {len(stored)} {what}s {stored[0]!r} ... {stored[-1]!r} of "
                     f"sample-axis chunk {index}")
        where = f"{chunk} of variable {self.geom.name!r} in {self.source_url}"
        last = f"{type(exc).__name__}: {_summary(exc)}"
        return final_error(kind, where, last, attempts, self.source_url, self.geom.name, key)


# Where a response body starts (``<?xml``, ``<!DOCTYPE``, ``<Error>``); not ``'<f4'``.
_MARKUP = re.compile(r"<(?:\?xml|!DOCTYPE|/?[A-Za-z][\w:.-]*(?:\s+[\w:.-]+=[^>]*)?>)",
                     re.IGNORECASE)


def _summary(exc: BaseException) -> str:
    """The first line of an error, before any response body (which can echo request
    details), URLs without user info or query strings, at most 300 characters."""
    text = (str(exc).strip().splitlines() or [""])[0]
    text = _MARKUP.split(text, 1)[0].rstrip(" :")
    return redact_urls(text)[:300]
