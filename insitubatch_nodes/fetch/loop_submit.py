"""Remote stores: every stripe read is a task on the event loop, gated by one
``asyncio.Semaphore(max_inflight)``, so many requests are in flight without threads;
decoding runs on the pool. Windows whose chunks are all in the local chunk cache go to the
pool from the consumer's thread instead, as a local store's do (DESIGN.md "Threading
model").
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Coroutine, Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import numpy as np

from ..io.loop_thread import LoopThread
from ..io.pool_task import OneShot
from ..sampling.items import DecodedWindow
from ..sampling.plan import ReadPlan
from .hold import FirstBatchHold
from .jobs import DirectWindow, InPlaceJob, Item
from .loop import FetchLoop
from .scatter import Scatter, read_local_items
from .submit import (
    FetchContext,
    PoolTasks,
    Refetch,
    SubmitPath,
    items_landed,
    stripe_jobs,
)

if TYPE_CHECKING:
    import torch


async def gather_or_cancel(coros: Iterable[Coroutine[Any, Any, Any]]) -> list[Any]:
    """Run ``coros`` as tasks; the first failure cancels the others and is raised."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        raise


class LoopSubmit(SubmitPath):
    """Windows fetched by coroutines on the fetch loop (``loop.lt``), read in the
    ``max_inflight`` slots of one semaphore made on that loop."""

    def __init__(self, ctx: FetchContext, hold: FirstBatchHold, loop: FetchLoop) -> None:
        self.ctx, self.hold, self.loop = ctx, hold, loop
        self.tasks = PoolTasks(ctx)  # windows read whole from the chunk cache
        self.sem: asyncio.Semaphore | None = None

    def submit(self, plan: ReadPlan, lt: LoopThread, skip: int = 0) -> Future:
        if plan.slots is not None and self.ctx.arena is not None:
            job = self.hold.prepare(plan, self.ctx, skip)
            return asyncio.run_coroutine_threadsafe(self.fetch_in_place(job), lt.loop)
        return asyncio.run_coroutine_threadsafe(self.fetch_window(plan), lt.loop)

    def stop(self) -> None:
        self.sem = None  # made on the loop just stopped

    # -- windows read whole from the chunk cache ------------------------------------------
    def all_cached(self, plan: ReadPlan) -> bool:
        """Every stored chunk of the window is in the chunk cache (a ``stat`` each)."""
        readers = self.ctx.readers
        return (all(r.reads_cache for r in readers)
                and all(readers[v].is_cached(i) for v, reads in enumerate(plan.reads)
                        for i in reads))

    def submit_cached(self, plan: ReadPlan, lt: LoopThread, refetch: Refetch) -> DirectWindow:
        """A window whose chunks are all in the local chunk cache: read and decoded on the
        pool from this thread, as a local store's are (no event-loop hop per stripe); a
        stripe whose entry went missing meanwhile goes to ``refetch``."""
        readers = self.ctx.readers
        return self.tasks.submit(plan, lt, stripe_jobs(self.ctx, plan, grouped=True),
                                 lambda v, idxs, outs, t: readers[v].read_cached(
                                     idxs, outs, t), refetch)

    def refetch(self, misses: list[tuple[int, int, np.ndarray]], lt: LoopThread) -> None:
        """Stripes a cached window found missing after all: from the store, on the loop
        (retries and errors as every remote read), waited for here."""

        async def fetch() -> None:
            await asyncio.gather(*(self.read(v, [i], [out]) for v, i, out in misses))

        lt.run(fetch())

    # -- on the loop --------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """One of the ``max_inflight`` slots, counted in the stats while held."""
        if self.sem is None:  # made on the loop, for the loop (both read paths)
            self.sem = asyncio.Semaphore(self.ctx.max_inflight)
        stats = self.ctx.stats
        t0 = time.perf_counter()
        async with self.sem:
            stats.slot_taken(time.perf_counter() - t0)
            try:
                yield
            finally:
                stats.slot_released()

    async def read(self, v: int, idxs: list[int],
                   outs: list[np.ndarray] | None = None) -> list[np.ndarray]:
        """Read stripes ``idxs`` of variable ``v``: one stripe, or several of a local store
        in one pool task (``read_group``). Either way one ``max_inflight`` slot: a group
        reads its stripes one after another. Errors carry the reader's note (array, chunk
        key, attempts). ``outs``: where to decode (batch rows); default fresh buffers."""
        lt = self.loop.lt
        assert lt is not None
        ctx = self.ctx
        reader = ctx.readers[v]
        async with self.slot():
            bufs = outs if outs is not None else ctx.pool.take_many(
                reader.geom.stripe_shape, reader.geom.dtype, len(idxs))
            await (
                reader.read(idxs[0], bufs[0], lt.loop, lt.pool, ctx.retry) if len(idxs) == 1
                else reader.read_group(idxs, bufs, lt.loop, lt.pool, ctx.retry))
        ctx.stats.stripes_read(len(idxs), reader.geom.stripe_nbytes)
        return bufs

    async def fetch_window(self, plan: ReadPlan) -> DecodedWindow:
        """A gathered window: every stripe read into a buffer of its own."""
        jobs = stripe_jobs(self.ctx, plan)
        results = await gather_or_cancel(self.read(v, idxs) for v, idxs in jobs)
        arrays: tuple[dict[int, np.ndarray | torch.Tensor], ...] = tuple(
            {} for _ in plan.reads)
        for (v, idxs), bufs in zip(jobs, results, strict=True):
            for idx, buf in zip(idxs, bufs, strict=True):
                arrays[v][idx] = buf
        self.ctx.stats.window_fetched(len(plan.chunk_ids))
        return DecodedWindow(plan, arrays)

    # -- in place -----------------------------------------------------------------------
    async def fetch_in_place(self, job: InPlaceJob) -> DecodedWindow:
        """Run a prepared window: every chunk decoded straight into its batch row, each
        batch counted as its rows land. A failure fails every batch the window feeds."""
        arena = self.ctx.arena
        assert arena is not None
        try:
            await gather_or_cancel(self.read_items(group, job) for group in job.jobs)
            job.copy_rows(arena)
        except BaseException as e:
            job.fail(arena, e, note=not isinstance(e, asyncio.CancelledError))
            raise
        self.ctx.stats.window_fetched(len(job.plan.chunk_ids))
        return DecodedWindow(job.plan, tuple({} for _ in job.plan.reads))

    async def read_items(self, items: list[Item], job: InPlaceJob) -> None:
        """Stripes ``(variable, index, batch, out)`` of ``job`` in one ``max_inflight`` slot:
        of a local store, any variables in one pool task (if it fails, every stripe is read
        again on its own, with its own retries and error note, as
        ``StripeReader.read_group``); else one read each. Then each batch is told how many of
        its rows landed."""
        lt = self.loop.lt
        assert lt is not None
        readers = self.ctx.readers
        async with self.slot():
            ready = job.resolve(items)  # its batches taken as it starts writing them
            if all(readers[v].groups_reads for v, _, _, _ in ready):
                try:
                    await lt.loop.run_in_executor(lt.pool, OneShot(
                        read_local_items, [(readers[v], i, out) for v, i, _, out in ready],
                        time.perf_counter()))
                except asyncio.CancelledError:
                    raise
                except Exception:
                    self.ctx.stats.read.retried(len(ready))  # the failed group try: all again
                    for v, i, _, out in ready:
                        await self.read_item(v, i, out)
            else:
                for v, i, _, out in ready:
                    await self.read_item(v, i, out)
        items_landed(self.ctx, ready, job.generation)

    async def read_item(self, v: int, index: int, out: np.ndarray | Scatter) -> None:
        """One in-place item through the event loop, with retries; a stripe of several
        samples into a buffer of its own (the reads of a remote store await on this loop,
        so a decode thread's scratch buffer cannot be kept across them)."""
        lt = self.loop.lt
        assert lt is not None
        reader = self.ctx.readers[v]
        kept = out.kept if isinstance(out, Scatter) else None
        # a kept stripe: decoded into its buffer once; the loop never waits for another
        # task's decode of it (None: read it the usual way)
        claim = kept.claim(wait=False) if kept is not None else None
        if isinstance(out, Scatter):
            out.decoded = claim is not False
            if claim is False:
                assert kept is not None
                out.fill_from(kept.array)
                return
            stripe, part = (out.target(reader, scratch=False) if kept is None or claim is None
                            else kept.array), out.part
        else:
            stripe, part = out, None
        ok = False
        try:
            await reader.read(index, stripe, lt.loop, lt.pool, self.ctx.retry, part=part)
            ok = True
        finally:
            if claim and kept is not None:
                kept.done(ok)
        if isinstance(out, Scatter):
            out.fill_from(stripe)
