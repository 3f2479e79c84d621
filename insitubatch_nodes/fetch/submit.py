"""The seam between ``AsyncFetchNode`` and the ways a window's reads are submitted.

The node decides which windows go in and in what order they go out; a ``SubmitPath``
turns one plan into a window being fetched (decode threads, the event loop, worker
processes or the device). What every path shares sits here: the node's read context, how
a window's stripes are cut into pool tasks, and the pool tasks' ``max_inflight`` slots.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from ..io.loop_thread import LoopThread
from ..io.partial.ranges import PartSpec
from ..io.pool_task import OneShot
from ..io.retry import RetryPolicy
from ..io.served import Reader
from ..memory.arena import BatchArena
from ..memory.kept_stripes import KeptStripe, KeptStripes
from ..memory.ledger import BufferPool
from ..metrics.counters import FetchStats
from ..sampling.plan import ReadPlan
from ..workers.engine import WindowRun, WorkerEngine
from .jobs import DirectWindow, Item, batch_writes
from .scatter import Scatter

Window = Future | DirectWindow | WindowRun  # a window being fetched, as the queue holds it
# A pool task's read of one variable's stripe group: (variable, stripes, buffers, time
# submitted) -> the stripes it could not read.
GroupRead = Callable[[int, list[int], list[np.ndarray], float], list[int]]
# Stripes a cached window found missing after all: (variable, stripe, buffer) each.
Refetch = Callable[[list[tuple[int, int, np.ndarray]]], None]

GROUP_BYTES = 4 << 20  # a grouped local pool task reads at most ~this many decoded bytes


@dataclass(frozen=True)
class FetchContext:
    """What every submit path reads with: the node's readers, buffers, retries, counters
    and (in place) arena, fixed when the node is built."""

    readers: tuple[Reader, ...]
    pool: BufferPool
    retry: RetryPolicy
    stats: FetchStats
    arena: BatchArena | None
    decode_threads: int
    max_inflight: int
    sample_chunks: tuple[int, ...]  # samples per chunk along the sample axis, per variable
    row_bytes: tuple[int, ...]  # in place: one batch row's bytes per variable, else ()
    # in place: per variable, the levels its slots take where not all (partial reads)
    parts: tuple[PartSpec | None, ...] = ()
    # in place, several samples a chunk: stripes decoded once and kept across epochs
    kept: KeptStripes | None = None

    def kept_stripe(self, v: int, index: int) -> KeptStripe | None:
        """Stripe ``index`` of variable ``v`` kept across epochs, if it is (or now fits)."""
        if self.kept is None:
            return None
        geom = self.readers[v].geom
        return self.kept.get((v, index), geom.stripe_shape, geom.dtype)

    @property
    def grouped(self) -> bool:
        """Every variable is on a local store, whose stripes a pool task reads in groups."""
        return all(r.groups_reads for r in self.readers)


def stripe_jobs(ctx: FetchContext, plan: ReadPlan,
                grouped: bool | None = None) -> list[tuple[int, list[int]]]:
    """Stripe reads to run, as (variable, stripes) groups: local stores (and windows
    read whole from a chunk cache: ``grouped``) group small stripes so a window costs a
    few pool hand-offs, not one per stripe."""
    jobs = []
    for v, reads in enumerate(plan.reads):
        reader = ctx.readers[v]
        group = reader.groups_reads if grouped is None else grouped
        if group and len(reads) > 2 * ctx.decode_threads:
            # Enough groups to keep every decode thread busy, at most ~4 MB each.
            by_size = max(1, GROUP_BYTES // max(1, reader.geom.stripe_nbytes))
            size = max(1, min(by_size, -(-len(reads) // (2 * ctx.decode_threads))))
            jobs += [(v, list(reads[i:i + size])) for i in range(0, len(reads), size)]
        else:
            jobs += [(v, [idx]) for idx in reads]
    return jobs


def stripe_buffers(ctx: FetchContext,
                   jobs: list[tuple[int, list[int]]]) -> list[list[np.ndarray]]:
    """A buffer from the pool for every stripe of ``jobs``, one pool call per variable."""
    need: dict[int, int] = {}
    for v, idxs in jobs:
        need[v] = need.get(v, 0) + len(idxs)
    got = {v: iter(ctx.pool.take_many(ctx.readers[v].geom.stripe_shape,
                                      ctx.readers[v].geom.dtype, n))
           for v, n in need.items()}
    return [[next(got[v]) for _ in idxs] for v, idxs in jobs]


def kept_buffers(ctx: FetchContext,
                 jobs: list[tuple[int, list[int]]]) -> list[list[np.ndarray]]:
    """``stripe_buffers`` where stripes are kept across epochs: a stripe's kept buffer
    (decoded or to be), from the pool where it is not kept."""
    kept = [[ctx.kept_stripe(v, i) for i in idxs] for v, idxs in jobs]
    rest = [(v, [i for i, k in zip(idxs, ks, strict=True) if k is None])
            for (v, idxs), ks in zip(jobs, kept, strict=True)]
    pooled = [iter(b) for b in stripe_buffers(ctx, rest)]
    return [[k.array if k is not None else next(p) for k in ks]
            for ks, p in zip(kept, pooled, strict=True)]


def items_landed(ctx: FetchContext, items: Sequence[Item], generation: int) -> None:
    """In-place stripes ``(variable, index, batch, out)`` were read: count them, and tell
    each batch how many of its rows landed."""
    assert ctx.arena is not None
    per_var: dict[int, int] = {}
    kept = 0
    for v, _, _, out in items:
        if isinstance(out, Scatter) and not out.decoded:
            kept += 1  # copied from a stripe kept decoded: not read
            continue
        per_var[v] = per_var.get(v, 0) + 1
    if kept:
        ctx.stats.stripes_from_kept(kept)
    for v, n in per_var.items():
        ctx.stats.stripes_read(n, ctx.readers[v].geom.stripe_nbytes)
    for b, n in batch_writes(items).items():
        ctx.arena.landed(b, n, generation)


class PoolSlot:
    """A pool task's ``max_inflight`` slot: a plain class, not a generator context manager,
    and no semaphore when none can run out. It runs around every pool task, between chunks,
    where the decode threads hold the GIL: the generator and the semaphore's Python-level
    condition cost ~2 % of one-step epochs (paired A/B, 2-vCPU VM)."""

    __slots__ = ("stats", "slots")

    def __init__(self, stats: FetchStats, slots: threading.BoundedSemaphore | None) -> None:
        self.stats, self.slots = stats, slots

    @classmethod
    def of(cls, ctx: FetchContext) -> PoolSlot:
        """Pool tasks run on the decode threads alone: with ``max_inflight`` at least as
        many, a slot is always free and the tasks are only counted."""
        return cls(ctx.stats, threading.BoundedSemaphore(ctx.max_inflight)
                   if ctx.max_inflight < ctx.decode_threads else None)

    def __enter__(self) -> None:
        if self.slots is None:
            self.stats.slot_taken(0.0)
            return
        t0 = time.perf_counter()
        self.slots.acquire()
        self.stats.slot_taken(time.perf_counter() - t0)

    def __exit__(self, *exc: object) -> None:
        self.stats.slot_released()
        if self.slots is not None:
            self.slots.release()


class PoolTasks:
    """A window's stripe groups as decode-pool tasks submitted from the consumer's thread
    (local stores, and windows read whole from the chunk cache): no event-loop hop."""

    def __init__(self, ctx: FetchContext) -> None:
        self.ctx = ctx
        self.slot = PoolSlot.of(ctx)

    def submit(self, plan: ReadPlan, lt: LoopThread, jobs: list[tuple[int, list[int]]],
               read: GroupRead, refetch: Refetch | None = None,
               bufs: list[list[np.ndarray]] | None = None) -> DirectWindow:
        """``read(v, stripes, outs, submitted)`` on a pool thread, in one of the
        ``max_inflight`` slots, returns the stripes it could not read (``refetch`` gets
        them when the window is waited for). ``bufs``: the stripes' buffers, given (kept
        stripes, which ``read`` counts itself), else taken from the pool."""
        counted = bufs is not None
        if bufs is None:
            bufs = stripe_buffers(self.ctx, jobs)
        now = time.perf_counter()
        tasks = [OneShot(self.run, read, v, idxs, out, now, counted)
                 for (v, idxs), out in zip(jobs, bufs, strict=True)]
        return DirectWindow(plan, jobs, bufs, lt.pool, tasks, refetch)

    def run(self, read: GroupRead, v: int, idxs: list[int], outs: list[np.ndarray],
            submitted: float, counted: bool = False) -> list[int]:
        """One ``submit`` task; the stripes it read are counted here, on the pool (the ones
        it missed count when refetched), unless ``read`` counts them."""
        with self.slot:
            missed = read(v, idxs, outs, submitted)
        if not counted:
            self.ctx.stats.stripes_read(len(idxs) - len(missed),
                                        self.ctx.readers[v].geom.stripe_nbytes)
        return missed


class SubmitPath:
    """One way of submitting windows, chosen when the node is built. ``submit`` starts a
    plan's window (in place when the plan has batch slots and the node an arena: ``skip``,
    a restore's draws of its head window delivered before, is not read); the rest are the
    hooks only some paths need, no-ops here."""

    def submit(self, plan: ReadPlan, lt: LoopThread, skip: int = 0) -> Window:
        raise NotImplementedError

    def all_cached(self, plan: ReadPlan) -> bool:
        """Every stored chunk of ``plan`` is in the chunk cache, so the window is read on
        the pool (``submit_cached``) instead of through the event loop."""
        return False

    def submit_cached(self, plan: ReadPlan, lt: LoopThread, refetch: Refetch) -> DirectWindow:
        raise NotImplementedError(f"{type(self).__name__} reads no chunk cache")

    def refetch(self, misses: list[tuple[int, int, np.ndarray]], lt: LoopThread) -> None:
        raise NotImplementedError(f"{type(self).__name__} reads no chunk cache")

    def start(self, owner: object) -> None:
        """Start what the path runs on besides the loop thread, tied to ``owner``'s life."""

    def stop(self) -> None:
        """Stop what ``start`` started, and drop what was made on the loop thread."""

    @property
    def engine(self) -> WorkerEngine | None:
        """The decode worker processes while they run, else ``None``."""
        return None
