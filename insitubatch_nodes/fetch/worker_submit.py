"""Decode worker processes: in-place windows are cut into integer jobs on the training
thread (``workers/jobs.prepare_window``) and run by long-lived processes writing into
batches in shared memory, out of the training thread's GIL (DESIGN.md "Worker
processes"). Plans without batch slots go down the path the node would use without them.
"""

from __future__ import annotations

import weakref

import numpy as np

from ..io.chunk_cache import ChunkCache
from ..io.loop_thread import LoopThread
from ..sampling.plan import ReadPlan
from ..store.source import Source
from ..workers.child import WorkerSetup
from ..workers.engine import JOB_TIMEOUT_S, WorkerEngine
from ..workers.jobs import prepare_window
from ..workers.shared_memory import SharedMemoryArena
from .jobs import DirectWindow
from .submit import FetchContext, Refetch, SubmitPath, Window


class WorkerSubmit(SubmitPath):
    """``workers`` processes, started with the loop thread and kept across epochs until
    ``stop``; ``fallback`` submits what they do not take. A worker running one job
    ``job_timeout_s``, holding jobs that long without taking one, or not ready in time is
    killed and replaced (``WorkerEngine``: ``workers/deadlines``)."""

    def __init__(self, ctx: FetchContext, workers: int, dataset: Source,
                 shared: SharedMemoryArena, cache: ChunkCache | None,
                 fallback: SubmitPath, job_timeout_s: float = JOB_TIMEOUT_S) -> None:
        self.ctx, self.workers, self.dataset = ctx, workers, dataset
        self.job_timeout_s = job_timeout_s
        self.shared, self.cache, self.fallback = shared, cache, fallback
        self._engine: WorkerEngine | None = None
        self._stripe_nbytes = [r.geom.stripe_nbytes for r in ctx.readers]
        # the arena's generation of the last window submitted, and the first batch since
        # that start (a start's first window: the next generation; ``prepare_window``)
        self._generation = -1
        self._first_batch: int | None = None
        self.finalizer: weakref.finalize | None = None

    @property
    def engine(self) -> WorkerEngine | None:
        return self._engine

    def start(self, owner: object) -> None:
        if self._engine is None:
            self._engine = self._start_workers()
            self.finalizer = weakref.finalize(owner, WorkerEngine.stop, self._engine, False)

    def _start_workers(self) -> WorkerEngine:
        """The decode worker processes (``workers/engine``), for the node's lifetime."""
        ctx = self.ctx
        assert ctx.arena is not None
        setup = WorkerSetup.of(self.dataset, ctx.arena, ctx.retry, self.cache,
                               ctx.max_inflight)
        return WorkerEngine(self.workers, setup, ctx.arena, self.shared, ctx.stats,
                            job_timeout_s=self.job_timeout_s)

    def stop(self) -> None:
        self.fallback.stop()
        if self.finalizer is not None and self.finalizer.detach() is not None:
            assert self._engine is not None
            self._engine.stop(wait=True)
        self._engine = None
        self.finalizer = None

    def submit(self, plan: ReadPlan, lt: LoopThread, skip: int = 0) -> Window:
        ctx = self.ctx
        arena = ctx.arena
        if plan.slots is not None and arena is not None and self._engine is not None:
            if arena.generation != self._generation:  # a start: its first batch comes first
                self._generation, self._first_batch = arena.generation, None
            window = prepare_window(plan, arena, self.workers, ctx.sample_chunks,
                                    ctx.row_bytes, self._stripe_nbytes, skip,
                                    head=self._holds_first(plan, skip))
            if self._first_batch is None and window.batches:
                self._first_batch = window.batches[0]
            return self._engine.submit(window)
        return self.fallback.submit(plan, lt, skip)

    def _holds_first(self, plan: ReadPlan, skip: int) -> bool:
        """Whether ``plan``'s window holds rows of the start's first batch: the first
        window with a batch since the start, or one whose first kept draw is in that batch
        (a batch across the window's edge)."""
        if self._first_batch is None:
            return True
        slots = plan.slots
        assert slots is not None
        return bool(slots.batch.size > skip and int(slots.batch[skip]) == self._first_batch)

    def all_cached(self, plan: ReadPlan) -> bool:
        return self.fallback.all_cached(plan)

    def submit_cached(self, plan: ReadPlan, lt: LoopThread, refetch: Refetch) -> DirectWindow:
        return self.fallback.submit_cached(plan, lt, refetch)

    def refetch(self, misses: list[tuple[int, int, np.ndarray]], lt: LoopThread) -> None:
        self.fallback.refetch(misses, lt)
