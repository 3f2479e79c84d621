"""AsyncFetchNode: one asyncio event loop on one background thread fetches whole windows."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch
from torchdata.nodes import BaseNode

from ..fetch.first_batch import FirstBatch
from ..fetch.jobs import (
    DirectWindow,
    InPlaceJob,
    Item,
    Scatter,
    batch_writes,
    prepare_in_place,
    read_item,
    read_local_items,
)
from ..io.chunk_cache import ChunkCache
from ..io.device_chain import DeviceChain, HostOnly, device_chain_for
from ..io.device_decode import FrameDecoder, StripeFrames, WindowDecoder
from ..io.loop_thread import LoopThread
from ..io.pool_task import OneShot
from ..io.reader import StripeReader
from ..io.retry import RetryPolicy
from ..memory.arena import BatchArena
from ..memory.ledger import BufferPool, MemoryLedger
from ..metrics.counters import FetchStats
from ..sampling.items import DecodedWindow
from ..sampling.plan import ReadPlan
from ..store.source import Source
from ..workers.child import WorkerSetup
from ..workers.engine import WindowRun, WorkerEngine
from ..workers.jobs import prepare_window
from ..workers.shared_memory import SharedMemoryArena
from .state import copy_state, require, shutdown_source

log = logging.getLogger("insitubatch_nodes")
# A pool task's read of one variable's stripe group: (variable, stripes, buffers, time
# submitted) -> the stripes it could not read.
GroupRead = Callable[[int, list[int], list[np.ndarray], float], list[int]]


# Windows fetched ahead of the one being drawn, on every store (graph.default_prefetch_windows
# says why): the node's default and the loader's are this one number.
DEFAULT_PREFETCH_WINDOWS = 2


def _made(win: DecodedWindow) -> Future:
    """A window already made, as a done future in the queue's place of the one that made it."""
    done: Future = Future()
    done.set_result(win)
    return done


Window = Future | DirectWindow | WindowRun  # a window being fetched, as the queue holds it


def _drain(queue: deque) -> list[Window]:
    """The windows of a queue of ``(window, state, plan)`` entries, the queue emptied."""
    windows = [fut for fut, _, _ in queue]
    queue.clear()
    return windows


def _cancel(windows: list[Window]) -> None:
    """Cancel ``windows``, then wait for the pool tasks of local ones already running
    (``DirectWindow.settle``) and the jobs a worker process is running
    (``WindowRun.settle``); windows on the event loop end their reads as the loop
    cancels them."""
    for fut in windows:
        fut.cancel()
    for fut in windows:
        if not isinstance(fut, Future):
            fut.settle()


class _DirectSlot:
    """``AsyncFetchNode._direct_slot``: a plain class, not a generator context manager, and
    no semaphore when none can run out. It runs around every pool task, between chunks,
    where the decode threads hold the GIL: the generator and the semaphore's Python-level
    condition cost ~2 % of one-step epochs (paired A/B, 2-vCPU VM)."""

    __slots__ = ("stats", "slots")

    def __init__(self, stats: FetchStats, slots: threading.BoundedSemaphore | None) -> None:
        self.stats, self.slots = stats, slots

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


def default_decode_threads(one_sample_in_place: bool = False) -> int:
    """One more decode thread than cores, at most 4. A decode thread waits for the GIL
    around every chunk (open, read, close, decode each release and retake it) while the
    training thread runs Python (the gather copy among it); a third thread on two cores
    keeps them busy meanwhile (DESIGN.md "Decode threads": +7-10% at 8 samples per chunk).
    Decoding in place one sample per chunk there is no copy at all, and the extra thread
    only adds switches: as many as cores (+1-2% on one-step stores). Chunks of several
    samples scattered in place keep the extra thread: their row copies take the GIL back
    several times per chunk (0.96 -> 1.03x the floor + copy at 8 per chunk)."""
    return min(4, (os.cpu_count() or 1) + (0 if one_sample_in_place else 1))


class AsyncFetchNode(BaseNode[DecodedWindow]):
    """Fetches and decodes each ``ReadPlan``'s stripes, keeping the next windows in flight.

    Up to ``max_inflight`` stripe reads run at once on the loop; decoding happens on a small
    thread pool (the decoders release the GIL). Windows are delivered in plan order, and the
    node's state is the upstream state as of the last window delivered, so in-flight work
    is simply refetched on resume.

    With ``device_decode`` (a ``FrameDecoder``), variables whose codec chain the device can
    decode are fetched compressed and decoded per window on the device (``WindowDecoder``,
    on one device thread); the others stay on the CPU path, with one log line each saying
    why. Plans, order and state do not change, so neither do resume and exactly-once.

    With ``prefetch_next_epoch`` (the default; not with in-place decoding, whose batches
    belong to one epoch), once this epoch's plans are all submitted the node resets its
    upstream for the next epoch early and submits that epoch's first windows in the free
    prefetch slots, so the next ``iter()`` starts on fetched windows instead of an empty
    pipeline (an epoch's first batch waited for a whole window). They are handed out only
    after the ``reset(None)`` that starts that epoch; any other reset drops them and puts
    the upstream where ``reset(None)`` would have. Turn it off for an upstream whose
    ``reset(None)`` reads something the training loop sets between epochs.
    """

    SOURCE_KEY = "source"  # upstream state as of the last window delivered
    GROUP_BYTES = 4 << 20  # a grouped local pool task reads at most ~this many decoded bytes

    def __init__(self, source: BaseNode[ReadPlan], dataset: Source, *, max_inflight: int = 32,
                 prefetch_windows: int = DEFAULT_PREFETCH_WINDOWS,
                 decode_threads: int | None = None,
                 ledger: MemoryLedger | None = None, pool: BufferPool | None = None,
                 retry: RetryPolicy | None = None,
                 device_decode: FrameDecoder | None = None,
                 arena: BatchArena | None = None, first: FirstBatch | None = None,
                 prefetch_next_epoch: bool = True, workers: int = 0,
                 shared: SharedMemoryArena | None = None,
                 cache: ChunkCache | None = None) -> None:
        super().__init__()
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        if prefetch_windows < 0:
            raise ValueError(f"prefetch_windows must be >= 0, got {prefetch_windows}")
        self.source = source
        self.dataset = dataset
        self.max_inflight = int(max_inflight)
        self.prefetch_windows = int(prefetch_windows)
        self.ledger = ledger if ledger is not None else MemoryLedger()
        self.pool = pool if pool is not None else BufferPool(self.ledger)
        self.retry = retry if retry is not None else RetryPolicy()
        # Plans with batch slots are decoded straight into these batches (graph.py decides).
        self.arena = arena
        # The draws the first batch reaches, from the shuffle buffer (graph.py wires it);
        # a fresh one says 0, and the first window goes alone.
        self.first = first if first is not None else FirstBatch()
        # In-place windows write into the arena's batches of this epoch: not ahead of it.
        self.prefetch_next_epoch = bool(prefetch_next_epoch) and arena is None
        # Decode worker processes writing into batches in ``shared`` memory (in place only;
        # graph.py sets the arena's pool to allocate there). 0: the decode threads.
        if workers and (arena is None or shared is None):
            raise ValueError(f"workers={workers} decode into batches in shared memory: they "
                             "need an arena (in-place decoding) and a SharedMemoryArena")
        self.workers = int(workers)
        self.shared = shared
        self._engine: WorkerEngine | None = None
        self.stats = FetchStats()
        self._pid: int | None = None
        self.readers = tuple(StripeReader(a, g, dataset.url)
                             for a, g in zip(dataset.arrays, dataset.variables, strict=True))
        # stored chunks of object stores and icechunk through the local chunk cache
        # (the workers open the same cache)
        self.cache = cache
        for r in self.readers:
            r.times = self.stats.read
            if cache is not None:
                r.use_cache(cache, dataset.snapshot_id)
        self._sample_chunks = tuple(r.geom.sample_chunk for r in self.readers)
        self._row_bytes = tuple(arena.layout.row_nbytes(v) for v in range(len(self.readers))
                                ) if arena is not None else ()
        self.decode_threads = int(decode_threads or default_decode_threads(
            arena is not None and set(self._sample_chunks) == {1}))
        self.window_decoder: WindowDecoder | None = None
        if device_decode is not None:
            chains: dict[int, DeviceChain] = {}
            for v, (reader, arr) in enumerate(zip(self.readers, dataset.arrays, strict=True)):
                chain = device_chain_for(arr)
                if isinstance(chain, HostOnly):
                    log.warning("insitubatch: variable %r decodes on the CPU, not on %s: %s "
                                "(codec chain %s)", reader.geom.name, device_decode.device,
                                chain.reason, chain.chain)
                else:
                    chains[v] = chain
            self.window_decoder = WindowDecoder(device_decode, self.readers, chains)
            self.window_decoder.times = self.stats.read
        self._lt: LoopThread | None = None
        self._finalizer: weakref.finalize | None = None
        self._engine_finalizer: weakref.finalize | None = None
        self._sem: asyncio.Semaphore | None = None
        # (window future, upstream state, its plan when decoded in place (delivered at once))
        self._fifo: deque[tuple[Window, dict, ReadPlan | None]] = deque()
        self._running: list[Window] = []  # in-place windows, still decoding
        self._delivered: dict | None = None
        self._exhausted = False
        # The next epoch, started early (``prefetch_next_epoch``): its windows, the upstream
        # state at its start (set once the upstream was reset for it), whether its plans ran
        # out, and whether its windows were dropped (then the upstream is reset to the start).
        self._ahead: deque[tuple[Window, dict, ReadPlan | None]] = deque()
        self._ahead_start: dict | None = None
        self._ahead_exhausted = False
        self._ahead_failed = False
        # the upstream is being (or was) reset for the next epoch (set before _ahead_start)
        self._going_ahead = False
        # This epoch began with reset(None), and whether next() was called since: a second
        # reset(None) before it was starts the same epoch again (``reset``).
        self._began_fresh = False
        self._asked = False
        self._started = False  # next() ran since the last reset (the first windows went in)
        self._holding = False  # the first batch's windows are not all out: none go ahead
        self._deferred = False  # in place: the windows ahead wait for the first batch to go out
        self._start_draws = 0  # draws of the windows submitted at the start
        self._starting = False  # the next window prepared is a start's head window
        self._head: InPlaceJob | None = None  # that window, while it holds stripes
        self._error: BaseException | None = None
        self._shut_down = False
        self._left_lock = threading.Lock()  # an in-place window's groups still running
        # Pool tasks run on the decode threads alone: with ``max_inflight`` at least as
        # many, a slot is always free and the tasks are only counted (``_direct_slot``).
        self._direct_slot = _DirectSlot(
            self.stats, threading.BoundedSemaphore(self.max_inflight)
            if self.max_inflight < self.decode_threads else None)
        # Local stores decoded on the host: windows go straight to the decode pool.
        self._direct = (self.window_decoder is None
                        and all(r.groups_reads for r in self.readers))

    # -- lifecycle --------------------------------------------------------------------
    def _check_process(self) -> None:
        if self._pid is not None and os.getpid() != self._pid:
            raise RuntimeError(
                "this insitubatch loader was started in another process and then forked (e.g. "
                "wrapped in a DataLoader with num_workers > 0). It does its own parallel IO on "
                "a background thread, which does not survive fork (and obstore clients hang "
                "after fork): iterate the loader directly in the training process, without "
                "DataLoader workers."
            )

    def __reduce__(self):
        raise TypeError(
            "an AsyncFetchNode (and so an insitubatch loader) cannot be pickled or sent to "
            "worker processes: it owns an event loop thread. Build the loader in the process "
            "that trains (one per rank) and iterate it there, without DataLoader workers."
        )

    def _ensure_loop(self) -> LoopThread:
        self._check_process()
        if self._shut_down:
            raise RuntimeError("this AsyncFetchNode was shut down (loader.shutdown(), "
                               "close() or the end of a with block): build a new loader")
        if self._lt is None:
            self._pid = os.getpid()
            self._lt = LoopThread(self.decode_threads, "fetch", "decode",
                                  device_thread=self.window_decoder is not None)
            self._finalizer = weakref.finalize(self, LoopThread.stop_soon, self._lt)
        if self.workers and self._engine is None:
            self._engine = self._start_workers()
            self._engine_finalizer = weakref.finalize(self, WorkerEngine.stop, self._engine,
                                                      False)
        return self._lt

    def start(self) -> None:
        """Start the loop thread and the decode workers now rather than at the first
        ``next()`` (``build_graph`` does, so the workers' start overlaps the training
        script's own set-up)."""
        self._ensure_loop()

    @property
    def engine(self) -> WorkerEngine | None:
        """The decode worker processes while they run (``workers``), else ``None``."""
        return self._engine

    def _start_workers(self) -> WorkerEngine:
        """The decode worker processes (``workers/engine``), for this node's lifetime."""
        assert self.arena is not None and self.shared is not None
        setup = WorkerSetup.of(self.dataset, self.arena, self.retry, self.cache,
                               self.max_inflight)
        return WorkerEngine(self.workers, setup, self.arena, self.shared, self.stats,
                            [r.geom.stripe_nbytes for r in self.readers])

    def shutdown(self) -> None:
        """Cancel in-flight reads, stop the loop thread and decode pool for good, and shut
        the upstream down (torchdata's ``shutdown()`` protocol: called by the node or
        loader downstream). A later ``next()`` is an error, not a restarted thread: a
        torchdata ``Prefetcher`` still pulling must not bring the loop back."""
        self._shut_down = True
        self.close()
        if self.shared is not None:
            self.shared.close()
        shutdown_source(self.source)

    def close(self) -> None:
        """Cancel in-flight reads and stop the loop thread and decode pool now; iterating
        again starts them again (``shutdown`` is final)."""
        self._cancel_all()
        if self._finalizer is not None and self._finalizer.detach() is not None:
            assert self._lt is not None
            self._lt.stop(wait=True)  # here, unlike in GC, joining is safe
        self._lt = None
        self._finalizer = None
        self._sem = None
        if self._engine_finalizer is not None and self._engine_finalizer.detach() is not None:
            assert self._engine is not None
            self._engine.stop(wait=True)
        self._engine = None
        self._engine_finalizer = None

    def _cancel_all(self) -> None:
        self._cancel_epoch()
        self._drop_ahead()

    def _cancel_epoch(self) -> None:
        """Cancel this epoch's windows (queued, and in-place ones still decoding), and wait
        for their pool tasks already running (``DirectWindow.settle``): the windows that
        replace them count within the same memory bound."""
        running, self._running = self._running, []
        _cancel([*_drain(self._fifo), *running])

    def _drop_ahead(self) -> None:
        """Cancel the next epoch's windows; ``_ahead_start`` stays, so the reset that starts
        that epoch puts the upstream back at its start instead of a second ``reset(None)``
        (which would skip an epoch)."""
        _cancel(_drain(self._ahead))
        if self._ahead_start is not None:
            self._ahead_failed = True

    @property
    def epoch_untouched(self) -> bool:
        """True while nothing of an epoch begun by ``reset(None)`` was asked for: another
        ``reset(None)`` then starts that same epoch (the upstream moves on once asked)."""
        return self._began_fresh and not self._asked

    @property
    def epochs_ahead(self) -> int:
        """1 when the upstream was already reset for the next epoch
        (``prefetch_next_epoch``), else 0: the upstream's epoch less the one delivered."""
        return 1 if self._going_ahead else 0

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._check_process()
        # Nothing of an epoch begun by reset(None) asked for yet: the upstream would start it
        # again (it moves on only once asked), whatever this node fetched ahead since.
        again = (initial_state is None and self.prefetch_next_epoch and self.epoch_untouched
                 and self._delivered is not None)
        self._cancel_epoch()
        if self.arena is not None:
            self.arena.clear()
        self._head = None  # a cancelled head window's held stripes go with it
        self._error = None
        self._exhausted = False
        self._started = False
        self._holding = False
        self._deferred = False
        start = self._ahead_start
        adopt = initial_state is None and not again and not self._ahead_failed
        if not (adopt and start is not None):
            self._drop_ahead()
        if again:
            assert self._delivered is not None
            self.source.reset(self._delivered)  # this epoch's start: nothing was delivered
        elif initial_state is not None:
            self.source.reset(require(initial_state, self.SOURCE_KEY, self))
        elif start is None:
            self.source.reset(None)
        elif adopt:
            # The next epoch, begun early: its windows are this epoch's first ones (the
            # queue is emptied before it is handed over: windows_pending reads both).
            fifo = self._ahead
            self._ahead = deque()
            self._fifo = fifo
            self._exhausted = self._ahead_exhausted
            self._started = True
        else:
            self.source.reset(start)  # where reset(None) put it: not a second reset(None)
        self._ahead_start = None  # (kept until the upstream reset above succeeded)
        self._going_ahead = False
        self._ahead_exhausted = self._ahead_failed = False
        self._began_fresh = initial_state is None
        self._asked = False
        self._delivered = copy_state(start if adopt and start is not None
                                     else self.source.state_dict())

    # -- fetching ---------------------------------------------------------------------
    async def _read(self, v: int, idxs: list[int],
                    outs: list[np.ndarray] | None = None) -> list[np.ndarray]:
        """Read stripes ``idxs`` of variable ``v``: one stripe, or several of a local store
        in one pool task (``read_group``). Either way one ``max_inflight`` slot: a group
        reads its stripes one after another. Errors carry the reader's note (array, chunk
        key, attempts). ``outs``: where to decode (batch rows); default fresh buffers."""
        assert self._lt is not None
        reader = self.readers[v]
        lt = self._lt
        async with self._slot():
            bufs = outs if outs is not None else self.pool.take_many(
                reader.geom.stripe_shape, reader.geom.dtype, len(idxs))
            await (
                reader.read(idxs[0], bufs[0], lt.loop, lt.pool, self.retry) if len(idxs) == 1
                else reader.read_group(idxs, bufs, lt.loop, lt.pool, self.retry))
        self.stats.stripes_read(len(idxs), reader.geom.stripe_nbytes)
        return bufs

    async def _read_items(self, items: list[Item], job: InPlaceJob) -> None:
        """Stripes ``(variable, index, batch, out)`` of ``job`` in one ``max_inflight`` slot:
        of a local store, any variables in one pool task (if it fails, every stripe is read
        again on its own, with its own retries and error note, as
        ``StripeReader.read_group``); else one read each. Then each batch is told how many of
        its rows landed."""
        assert self._lt is not None
        lt = self._lt
        async with self._slot():
            items = job.resolve(items)  # its batches taken as it starts writing them
            if all(self.readers[v].groups_reads for v, _, _, _ in items):
                try:
                    await lt.loop.run_in_executor(lt.pool, OneShot(
                        read_local_items, [(self.readers[v], i, out) for v, i, _, out in items],
                        time.perf_counter()))
                except asyncio.CancelledError:
                    raise
                except Exception:
                    self.stats.read.retried(len(items))  # the failed group try: all again
                    for v, i, _, out in items:
                        await self._read_item(v, i, out)
            else:
                for v, i, _, out in items:
                    await self._read_item(v, i, out)
        self._items_landed(items, job.generation)

    async def _read_item(self, v: int, index: int, out: np.ndarray | Scatter) -> None:
        """One in-place item through the event loop, with retries; a stripe of several
        samples into a buffer of its own (the reads of a remote store await on this loop,
        so a decode thread's scratch buffer cannot be kept across them)."""
        assert self._lt is not None
        reader, lt = self.readers[v], self._lt
        stripe = out.target(reader, scratch=False) if isinstance(out, Scatter) else out
        await reader.read(index, stripe, lt.loop, lt.pool, self.retry)
        if isinstance(out, Scatter):
            out.fill_from(stripe)

    def _items_landed(self, items: list[Item],
                      generation: int) -> None:
        """In-place stripes ``(variable, index, batch, out)`` were read: count them, and tell
        each batch how many of its rows landed."""
        assert self.arena is not None
        per_var: dict[int, int] = {}
        for v, _, _, _ in items:
            per_var[v] = per_var.get(v, 0) + 1
        for v, n in per_var.items():
            self.stats.stripes_read(n, self.readers[v].geom.stripe_nbytes)
        for b, n in batch_writes(items).items():
            self.arena.done(b, n, generation)

    @contextlib.asynccontextmanager
    async def _slot(self) -> AsyncIterator[None]:
        """One of the ``max_inflight`` slots, counted in the stats while held."""
        if self._sem is None:  # made on the loop, for the loop (both read paths)
            self._sem = asyncio.Semaphore(self.max_inflight)
        t0 = time.perf_counter()
        async with self._sem:
            self.stats.slot_taken(time.perf_counter() - t0)
            try:
                yield
            finally:
                self.stats.slot_released()

    async def _read_frames(self, v: int, idxs: list[int]) -> list:
        """``_read`` for a variable decoded on the device: its stored chunks, checked."""
        assert self._lt is not None and self.window_decoder is not None
        reader = self.readers[v]
        chain = self.window_decoder.chains[v]
        nbytes = reader.chunk_nbytes
        lt = self._lt
        async with self._slot():
            frames, _ = await reader.read_frames(
                idxs, lambda f: chain.check(f, nbytes), lt.loop, lt.pool, self.retry)
        self.stats.stripes_read(len(idxs), reader.geom.stripe_nbytes)
        return frames

    def _stripe_buffers(self, jobs: list[tuple[int, list[int]]]) -> list[list[np.ndarray]]:
        """A buffer from the pool for every stripe of ``jobs``, one pool call per variable."""
        need: dict[int, int] = {}
        for v, idxs in jobs:
            need[v] = need.get(v, 0) + len(idxs)
        got = {v: iter(self.pool.take_many(self.readers[v].geom.stripe_shape,
                                           self.readers[v].geom.dtype, n))
               for v, n in need.items()}
        return [[next(got[v]) for _ in idxs] for v, idxs in jobs]

    def _jobs(self, plan: ReadPlan, grouped: bool | None = None) -> list[tuple[int, list[int]]]:
        """Stripe reads to run, as (variable, stripes) groups: local stores (and windows
        read whole from a chunk cache: ``grouped``) group small stripes so a window costs a
        few pool hand-offs, not one per stripe."""
        jobs = []
        for v, reads in enumerate(plan.reads):
            reader = self.readers[v]
            group = reader.groups_reads if grouped is None else grouped
            if group and len(reads) > 2 * self.decode_threads:
                # Enough groups to keep every decode thread busy, at most ~4 MB each.
                by_size = max(1, self.GROUP_BYTES // max(1, reader.geom.stripe_nbytes))
                size = max(1, min(by_size, -(-len(reads) // (2 * self.decode_threads))))
                jobs += [(v, list(reads[i:i + size])) for i in range(0, len(reads), size)]
            else:
                jobs += [(v, [idx]) for idx in reads]
        return jobs

    def _prepare_in_place(self, plan: ReadPlan) -> InPlaceJob:
        """Where every chunk of the window goes (``fetch_jobs.prepare_in_place``), on the
        consumer thread before submitting, so the batches exist before the shuffle buffer
        asks for them."""
        assert self.arena is not None
        first = self._take_starting()
        job = prepare_in_place(plan, self.arena, self.decode_threads,
                               all(r.groups_reads for r in self.readers),
                               self._sample_chunks, first=first)
        if first and job.copies:
            self._head = job
        return job

    def _head_holds(self) -> bool:
        """A start's head window holds stripes for its copies and is being drawn: one
        window fewer goes ahead meanwhile, so the held stripes take that window's memory
        instead of adding to it (at 24 samples per chunk the ledger peaked 100 MB higher).
        Until the next window is handed on, not until the copies end: a count of windows
        ahead that does not depend on the decode threads' timing."""
        return self._head is not None

    def _take_starting(self) -> bool:
        """Whether the window being prepared is the head window of a start (an epoch's or a
        restore's), the only one whose stripes are held for its first batch: at most one
        window's stripes are, which the resident bound counts."""
        head, self._starting = self._starting, False
        return head

    async def _fetch_in_place(self, job: InPlaceJob) -> DecodedWindow:
        """Run a prepared window: every chunk decoded straight into its batch row, each
        batch counted as its rows land. A failure fails every batch the window feeds."""
        assert self.arena is not None
        arena = self.arena
        try:
            tasks = [asyncio.ensure_future(self._read_items(group, job))
                     for group in job.jobs]
            try:
                await asyncio.gather(*tasks)
            except BaseException:
                for t in tasks:
                    t.cancel()
                raise
            job.copy_rows(arena)
        except BaseException as e:
            job.fail(arena, e, note=not isinstance(e, asyncio.CancelledError))
            raise
        self.stats.window_fetched(len(job.plan.chunk_ids))
        return DecodedWindow(job.plan, tuple({} for _ in job.plan.reads))

    async def _fetch_window(self, plan: ReadPlan) -> DecodedWindow:
        jobs = self._jobs(plan)
        wd = self.window_decoder
        on_device = wd.chains if wd is not None else {}
        tasks = [asyncio.ensure_future(self._read_frames(v, idxs) if v in on_device
                                       else self._read(v, idxs)) for v, idxs in jobs]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            raise
        arrays: tuple[dict[int, np.ndarray | torch.Tensor], ...] = tuple({} for _ in plan.reads)
        stripes: list[StripeFrames] = []
        for (v, idxs), bufs in zip(jobs, results, strict=True):
            for idx, buf in zip(idxs, bufs, strict=True):
                if v in on_device:
                    stripes.append(StripeFrames(v, idx, buf))
                else:
                    arrays[v][idx] = buf
        if stripes:
            assert wd is not None and self._lt is not None and self._lt.device_pool is not None
            try:
                tensors = await self._lt.loop.run_in_executor(self._lt.device_pool, wd.decode,
                                                              stripes)
            except Exception as e:
                e.add_note(f"insitubatch: decoding {len(stripes)} stripes of the window of "
                           f"chunks {list(plan.chunk_ids)[:8]} on {wd.device} failed")
                raise
            for st, t in zip(stripes, tensors, strict=True):
                arrays[st.var][st.index] = t
        self.stats.window_fetched(len(plan.chunk_ids))
        return DecodedWindow(plan, arrays)

    def _submit_direct(self, plan: ReadPlan, lt: LoopThread) -> DirectWindow:
        """A local store's window: its stripe groups submitted to the decode pool from this
        (the consumer's) thread, each retried on its pool thread (``read_local_retrying``).
        No event-loop hop: waking the loop cost the consumer a GIL hand-back per window
        (~19% of its time on 8-sample chunks, profiled)."""
        return self._submit_pool(plan, lt, self._jobs(plan), self._read_local_group)

    def _submit_pool(self, plan: ReadPlan, lt: LoopThread, jobs: list[tuple[int, list[int]]],
                     read: GroupRead,
                     refetch: Callable[[list[tuple[int, int, np.ndarray]]], None] | None = None,
                     ) -> DirectWindow:
        """A window's stripe groups as pool tasks submitted from this (the consumer's)
        thread: ``read(v, stripes, outs, submitted)`` on a pool thread, in one of the
        ``max_inflight`` slots, returns the stripes it could not read (``refetch`` gets
        them when the window is waited for)."""
        bufs = self._stripe_buffers(jobs)
        now = time.perf_counter()
        tasks = [OneShot(self._run_pool, read, v, idxs, out, now)
                 for (v, idxs), out in zip(jobs, bufs, strict=True)]
        return DirectWindow(plan, jobs, bufs, lt.pool, tasks, refetch)

    def _run_pool(self, read: GroupRead, v: int, idxs: list[int], outs: list[np.ndarray],
                  submitted: float) -> list[int]:
        """One ``_submit_pool`` task; the stripes it read are counted here, on the pool
        (the ones it missed count when refetched)."""
        with self._direct_slot:
            missed = read(v, idxs, outs, submitted)
        self.stats.stripes_read(len(idxs) - len(missed), self.readers[v].geom.stripe_nbytes)
        return missed

    def _read_local_group(self, v: int, idxs: list[int], outs: list[np.ndarray],
                          submitted: float) -> list[int]:
        """A local stripe group, one stripe after another with retries on this thread (a
        failure raises: nothing is left for a refetch)."""
        self.readers[v].read_local_retrying(idxs, outs, self.retry, submitted)
        return []

    def _submit_in_place_direct(self, job: InPlaceJob, lt: LoopThread) -> DirectWindow:
        """``_fetch_in_place`` for a local store, without the event loop: each batch-ordered
        group of chunks is a pool task that tells the arena its rows landed; the task that
        finishes last makes the window's copies (chunks feeding several slots)."""
        left = [len(job.jobs)]
        now = time.perf_counter()
        tasks = [OneShot(self._run_items_direct, group, job, left, now) for group in job.jobs]
        return DirectWindow(job.plan, [], [], lt.pool, tasks)

    def _run_items_direct(self, items: list[Item], job: InPlaceJob,
                          left: list[int], submitted: float) -> None:
        """One group of an in-place window on a pool thread (``_read_items`` and, for the
        last group to finish, the rest of ``_fetch_in_place``). A failure fails every batch
        the window feeds, as on the event-loop path."""
        assert self.arena is not None
        arena, stats = self.arena, self.stats
        try:
            items = job.resolve(items)  # this task's batches taken now, as it writes them
            with self._direct_slot:
                again = len(items) == 1  # one item: its own tries at once, not a group try
                if not again:
                    try:
                        read_local_items([(self.readers[v], i, out) for v, i, _, out in items],
                                          submitted)
                    except Exception:
                        stats.read.retried(len(items))  # the failed group try: all again
                        again = True
                if again:
                    for v, i, _, out in items:
                        read_item(self.readers[v], i, out,
                                  None if len(items) > 1 else submitted, self.retry)
            self._items_landed(items, job.generation)
            with self._left_lock:
                left[0] -= 1
                last = left[0] == 0
            if not last:
                return
            job.copy_rows(arena)
            stats.window_fetched(len(job.plan.chunk_ids))
        except BaseException as e:
            job.fail(arena, e)
            raise

    def _all_cached(self, plan: ReadPlan) -> bool:
        """Every stored chunk of the window is in the chunk cache (a ``stat`` each)."""
        return all(self.readers[v].is_cached(i) for v, reads in enumerate(plan.reads)
                   for i in reads)

    def _submit_cached(self, plan: ReadPlan, lt: LoopThread) -> DirectWindow:
        """A window whose chunks are all in the local chunk cache: read and decoded on the
        pool from this thread, as a local store's are (no event-loop hop per stripe); a
        stripe whose entry went missing meanwhile is fetched from the store afterwards."""
        return self._submit_pool(plan, lt, self._jobs(plan, grouped=True),
                                 lambda v, idxs, outs, t: self.readers[v].read_cached(
                                     idxs, outs, t), self._refetch)

    def _refetch(self, misses: list[tuple[int, int, np.ndarray]]) -> None:
        """Stripes a cached window found missing after all: from the store, on the loop
        (retries and errors as every remote read), waited for here."""
        lt = self._ensure_loop()

        async def fetch() -> None:
            await asyncio.gather(*(self._read(v, [i], [out]) for v, i, out in misses))

        lt.run(fetch())

    def _top_up(self, depth: int, draws: int | None = None) -> int:
        """Keep ``depth`` undelivered windows submitted (pulling plans from upstream); with
        ``draws``, stop as soon as the windows pulled here hold that many draws. Returns the
        draws of the windows pulled."""
        lt = self._ensure_loop()
        pulled = 0  # draws of the windows pulled here
        while (not self._exhausted and len(self._fifo) < depth
               and (draws is None or pulled < draws)):
            plan = self._pull_into(self._fifo, lt)
            if plan is None:
                self._exhausted = True
                break
            pulled += plan.n_samples
        if self._exhausted and draws is None and self.prefetch_next_epoch:
            self._top_up_ahead(depth, lt)
        return pulled

    def _pull_into(self, queue: deque, lt: LoopThread) -> ReadPlan | None:
        """The upstream's next plan, its window submitted onto ``queue`` with the upstream's
        state after it; ``None`` once the upstream is exhausted."""
        try:
            plan = next(self.source)
        except StopIteration:
            return None
        queue.append(self._submit(plan, copy_state(self.source.state_dict()), lt))
        return plan

    def _submit(self, plan: ReadPlan, snap: dict, lt: LoopThread,
                ) -> tuple[Window, dict, ReadPlan | None]:
        """Start fetching ``plan``'s window: its queue entry (window, upstream state after
        it, and the plan when decoded in place)."""
        if plan.slots is not None and self.arena is not None and self._engine is not None:
            window = prepare_window(plan, self.arena, self.workers, self._sample_chunks,
                                    self._row_bytes)
            return self._engine.submit(window), snap, plan
        if plan.slots is not None and self.arena is not None:
            job = self._prepare_in_place(plan)
            fut = (self._submit_in_place_direct(job, lt) if self._direct else
                   asyncio.run_coroutine_threadsafe(self._fetch_in_place(job), lt.loop))
            # Delivered at once: the shuffle buffer waits per batch (BatchArena.take),
            # so a batch goes out as soon as its rows are in, not its whole window.
            return fut, snap, plan
        if self._direct:
            return self._submit_direct(plan, lt), snap, None
        if (self.window_decoder is None and all(r.reads_cache for r in self.readers)
                and self._all_cached(plan)):
            # read whole from the local chunk cache: straight to the pool as well
            return self._submit_cached(plan, lt), snap, None
        fut = asyncio.run_coroutine_threadsafe(self._fetch_window(plan), lt.loop)
        return fut, snap, None

    def _top_up_ahead(self, depth: int, lt: LoopThread) -> None:
        """This epoch's plans are all submitted: fill the free slots with the next epoch's
        first windows (resetting the upstream for it once). A failure here is not this
        epoch's: the windows are dropped and the epoch starts as it would have."""
        if self._ahead_failed:
            return
        try:
            if self._ahead_start is None:
                self._going_ahead = True
                self.source.reset(None)
                self._ahead_start = copy_state(self.source.state_dict())
            while (not self._ahead_exhausted
                   and len(self._fifo) + len(self._ahead) < depth):
                if self._pull_into(self._ahead, lt) is None:
                    self._ahead_exhausted = True
        except Exception as e:
            log.debug("insitubatch: fetching the next epoch early failed (%r); it starts "
                      "when asked", e)
            self._drop_ahead()
            self._ahead_failed = True

    def next(self) -> DecodedWindow:
        t_in = time.perf_counter()
        try:
            return self._next()
        finally:
            self.stats.next_s += time.perf_counter() - t_in

    def _next(self) -> DecodedWindow:
        self._check_process()
        self._asked = True
        if self._error is not None:
            raise self._error
        if not self._started:
            # The first batch's windows alone: windows ahead of them would share the cores
            # with their last stripes and delay it (DESIGN.md "Time to first batch"); they go
            # in once all of them are out.
            self._starting = True  # the head window (in place: its first batch first)
            try:
                self._start_draws = self._top_up(self.prefetch_windows + 1,
                                                 draws=max(1, self.first.draws))
            finally:
                self._starting = False
            self._holding = True
            self._started = True
        elif not self._holding:
            self._deferred = False  # asked for a window before the first batch went out
            self._top_up(self.prefetch_windows + 1)
        if not self._fifo:
            raise StopIteration
        fut, snap, in_place = self._fifo[0]
        if in_place is not None:
            if self._head is not None and in_place is not self._head.plan:
                # the head window is drawn: its copies are done (but for a batch straddling
                # its end, whose windows ahead the resident bound's held stripes cover)
                self._head = None
            self._before_delivery()
            self._fifo.popleft()
            self._running = [f for f in self._running if not f.done()] + [fut]
            self._delivered = snap
            return DecodedWindow(in_place, tuple({} for _ in in_place.reads))
        t0 = time.perf_counter()
        try:
            win = fut.result()
        except BaseException as e:
            self._error = e
            self._cancel_all()
            raise
        finally:
            self.stats.wait_s += time.perf_counter() - t0
        if isinstance(fut, DirectWindow):  # its stripes were counted on the pool
            self.stats.window_fetched(len(win.plan.chunk_ids))
            # Its result() runs once: should the top-up below raise, the head is kept as made.
            self._fifo[0] = (_made(win), snap, None)
        self._before_delivery()
        self._fifo.popleft()
        self._delivered = snap
        if self.window_decoder is not None:
            self.window_decoder.hand_over([t for a in win.arrays for t in a.values()
                                           if isinstance(t, torch.Tensor)])
        return win

    def _before_delivery(self) -> None:
        """The head window is about to go out: keep ``prefetch_windows`` ahead of it, unless
        windows the first batch needs are still to come after it (then nothing goes ahead of
        them yet). Topped up before the head is popped: if pulling or submitting a plan
        raises, the head stays queued and the next call delivers it (popped first, it was
        lost while the state already counted it delivered)."""
        if self._holding and len(self._fifo) > 1:
            return
        # In place the window goes out undecoded and its first batch lands while the rest
        # decodes: plan the windows ahead once that batch went out, not before it (when
        # the start's windows hold a batch's worth more than it, to keep the pool busy).
        defer = (self._holding and self.arena is not None
                 and self._start_draws >= 2 * max(1, self.first.draws)
                 and self.first.after_first(self._after_first_batch))
        self._holding = False
        self._deferred = defer
        if not defer:
            self._top_up(self.prefetch_windows + 1 - self._head_holds())

    def _after_first_batch(self) -> None:
        """``FirstBatch.went_out``: the windows ahead, held back for the first batch (its
        window is out of the queue by now, so ``prefetch_windows`` of them)."""
        if self._deferred:
            self._deferred = False
            self._top_up(self.prefetch_windows - self._head_holds())

    def windows_pending(self) -> tuple[int, int]:
        """(windows submitted and not yet handed over, of which fully fetched). In place,
        windows are handed over as submitted: those still decoding count too."""
        try:
            futs = ([f for f, _, _ in list(self._fifo)]
                    + [f for f in list(self._running) if not f.done()]
                    + [f for f, _, _ in list(self._ahead)])
        except RuntimeError:  # mutated while copied from another thread: report nothing
            return 0, 0
        return len(futs), sum(f.done() for f in futs)

    def get_state(self) -> dict[str, Any]:
        return {self.SOURCE_KEY: copy_state(self._delivered)}

    def start_state(self, upstream: dict[str, Any]) -> dict[str, Any]:
        """The state of this node before its first window, over ``upstream``'s state."""
        return {self.SOURCE_KEY: upstream}
