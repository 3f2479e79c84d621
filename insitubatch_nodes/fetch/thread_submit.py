"""Local stores decoded on the host: windows go straight to the decode pool.

Waking the event loop from the consumer (``run_coroutine_threadsafe`` writes its
self-pipe) cost the consumer a GIL hand-back per window (~19% of its time on 8-sample
chunks, profiled), so these windows never touch the loop (DESIGN.md "Threading model").
"""

from __future__ import annotations

import threading
import time

import numpy as np

from ..io.loop_thread import LoopThread
from ..io.pool_task import OneShot
from ..sampling.plan import ReadPlan
from .hold import FirstBatchHold
from .jobs import DirectWindow, InPlaceJob, Item
from .scatter import read_item, read_local_items
from .submit import (
    FetchContext,
    PoolTasks,
    SubmitPath,
    items_landed,
    kept_buffers,
    stripe_jobs,
)


class ThreadSubmit(SubmitPath):
    """A local store's windows as pool tasks submitted from the consumer's thread, each
    stripe group retried on its pool thread (``read_local_retrying``)."""

    def __init__(self, ctx: FetchContext, hold: FirstBatchHold) -> None:
        self.ctx, self.hold = ctx, hold
        self.tasks = PoolTasks(ctx)
        self.left_lock = threading.Lock()  # an in-place window's groups still running

    def submit(self, plan: ReadPlan, lt: LoopThread, skip: int = 0) -> DirectWindow:
        if plan.slots is not None and self.ctx.arena is not None:
            return self.in_place(self.hold.prepare(plan, self.ctx, skip), lt)
        jobs = stripe_jobs(self.ctx, plan)
        if self.ctx.kept is not None:
            return self.tasks.submit(plan, lt, jobs, self.read_kept_group,
                                     bufs=kept_buffers(self.ctx, jobs))
        return self.tasks.submit(plan, lt, jobs, self.read_local_group)

    def read_kept_group(self, v: int, idxs: list[int], outs: list[np.ndarray],
                        submitted: float) -> list[int]:
        """``read_local_group`` where stripes are kept across epochs: a kept one decoded
        once (by the first task to reach it), later only handed on (counted here)."""
        ctx, reader, hits = self.ctx, self.ctx.readers[v], 0
        assert ctx.kept is not None
        for i, out in zip(idxs, outs, strict=True):
            kept = ctx.kept.find((v, i))
            if kept is None or kept.array is not out:  # not kept: a pool buffer
                reader.read_local_retrying([i], [out], ctx.retry, submitted)
            elif not kept.decode_once(  # runs now, on this thread: i is this stripe's
                    lambda buf: reader.read_local_retrying([i], [buf], ctx.retry, submitted)):  # noqa: B023
                hits += 1
            submitted = time.perf_counter()  # only the first stripe waited in the queue
        if hits:
            ctx.stats.stripes_from_kept(hits)
        ctx.stats.stripes_read(len(idxs) - hits, reader.geom.stripe_nbytes)
        return []

    def read_local_group(self, v: int, idxs: list[int], outs: list[np.ndarray],
                         submitted: float) -> list[int]:
        """A local stripe group, one stripe after another with retries on this thread (a
        failure raises: nothing is left for a refetch)."""
        self.ctx.readers[v].read_local_retrying(idxs, outs, self.ctx.retry, submitted)
        return []

    def in_place(self, job: InPlaceJob, lt: LoopThread) -> DirectWindow:
        """``LoopSubmit.fetch_in_place`` for a local store, without the event loop: each
        batch-ordered group of chunks is a pool task that tells the arena its rows landed;
        the task that finishes last makes the window's copies (chunks feeding several
        slots)."""
        left = [len(job.jobs)]
        now = time.perf_counter()
        tasks = [OneShot(self.run_items, group, job, left, now) for group in job.jobs]
        return DirectWindow(job.plan, [], [], lt.pool, tasks)

    def run_items(self, items: list[Item], job: InPlaceJob, left: list[int],
                  submitted: float) -> None:
        """One group of an in-place window on a pool thread (``LoopSubmit.read_items`` and,
        for the last group to finish, the rest of ``fetch_in_place``). A failure fails
        every batch the window feeds, as on the event-loop path."""
        ctx = self.ctx
        assert ctx.arena is not None
        arena, stats = ctx.arena, ctx.stats
        try:
            ready = job.resolve(items)  # this task's batches taken now, as it writes them
            with self.tasks.slot:
                again = len(ready) == 1  # one item: its own tries at once, not a group try
                if not again:
                    try:
                        read_local_items([(ctx.readers[v], i, out) for v, i, _, out in ready],
                                         submitted)
                    except Exception:
                        stats.read.retried(len(ready))  # the failed group try: all again
                        again = True
                if again:
                    for v, i, _, out in ready:
                        read_item(ctx.readers[v], i, out,
                                  None if len(ready) > 1 else submitted, ctx.retry)
            items_landed(ctx, ready, job.generation)
            with self.left_lock:
                left[0] -= 1
                last = left[0] == 0
            if not last:
                return
            job.copy_rows(arena)
            stats.window_fetched(len(job.plan.chunk_ids))
        except BaseException as e:
            job.fail(arena, e)
            raise
