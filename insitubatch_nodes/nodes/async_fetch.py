"""AsyncFetchNode: one asyncio event loop on one background thread fetches whole windows.

The node keeps torchdata's pattern (reset / next / get_state / shutdown) and the order
windows go out in; the parts it runs over live in ``fetch/``: how windows are submitted
(``SubmitPath``: decode threads, event loop, worker processes, device), the first-batch
hold, the batches cut from windows decoded in place, the next epoch started early, and the
loop thread.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, NoReturn

import numpy as np
import torch
from torchdata.nodes import BaseNode

from ..defaults import PREFETCH_WINDOWS, default_decode_threads, why_not_kept
from ..errors import ConfigError, StateError, UsageTypeError
from ..fetch.batches import BatchCut
from ..fetch.device_submit import DeviceSubmit, window_decoder_for
from ..fetch.epoch_ahead import EpochAhead
from ..fetch.hold import FirstBatchHold
from ..fetch.jobs import DirectWindow, slot_parts
from ..fetch.loop import FetchLoop
from ..fetch.loop_submit import LoopSubmit
from ..fetch.submit import FetchContext, SubmitPath, stripe_jobs
from ..fetch.thread_submit import ThreadSubmit
from ..fetch.windows import Entry, EpochWindows, made
from ..fetch.worker_submit import WorkerSubmit
from ..io.chunk_cache import ChunkCache
from ..io.device_decode import FrameDecoder, WindowDecoder
from ..io.loop_thread import LoopThread
from ..io.retry import RetryPolicy
from ..io.served import Reader, open_reader
from ..memory.arena import BatchArena
from ..memory.kept_stripes import KeptStripes
from ..memory.ledger import BufferPool, MemoryLedger
from ..metrics.counters import FetchStats
from ..sampling.items import DecodedBatch, DecodedWindow
from ..sampling.plan import ReadPlan
from ..store.source import Source
from ..workers.engine import JOB_TIMEOUT_S, WindowRun, WorkerEngine
from ..workers.shared_memory import SharedMemoryArena
from .state import copy_state, require, require_count, shutdown_source

# Windows fetched ahead of the one being drawn, on every store (defaults.default_prefetch_windows
# says why): the node's default and the loader's are this one number.
DEFAULT_PREFETCH_WINDOWS = PREFETCH_WINDOWS


def submit_path(ctx: FetchContext, hold: FirstBatchHold, loop: FetchLoop,
                decoder: WindowDecoder | None) -> SubmitPath:
    """Local stores decoded on the host go straight to the decode pool; device decoding and
    every other store go through the event loop."""
    if decoder is not None:
        return DeviceSubmit(ctx, hold, loop, decoder)
    if ctx.grouped:
        return ThreadSubmit(ctx, hold)
    return LoopSubmit(ctx, hold, loop)


class AsyncFetchNode(BaseNode[DecodedWindow | DecodedBatch]):
    """Fetches and decodes each ``ReadPlan``'s stripes, keeping the next windows in flight.

    Up to ``max_inflight`` stripe reads run at once on the loop; decoding happens on a small
    thread pool (the decoders release the GIL). Windows are delivered in plan order, and the
    node's state is the upstream state as of the last window delivered, so in-flight work
    is simply refetched on resume.

    Decoding in place (an ``arena``; plans with batch slots), the chunks are written straight
    into their batches and the node yields those batches (``DecodedBatch``) in plan order,
    each as soon as every window feeding it is submitted; its state is then the upstream
    state before the window holding the next draw and the draws of that window delivered
    (``offset``), which a restore skips. ``batch_size`` says how far the first batch reaches,
    so an epoch or a restore submits just its windows first (DESIGN.md "Time to first
    batch"); without it the first window goes alone.

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

    SOURCE_KEY = "source"  # upstream state before the window holding the next draw
    OFFSET_KEY = "offset"  # in place: draws of that window delivered (0 for whole windows)

    def __init__(self, source: BaseNode[ReadPlan], dataset: Source, *, max_inflight: int = 32,
                 prefetch_windows: int = DEFAULT_PREFETCH_WINDOWS,
                 decode_threads: int | None = None,
                 ledger: MemoryLedger | None = None, pool: BufferPool | None = None,
                 retry: RetryPolicy | None = None,
                 device_decode: FrameDecoder | None = None,
                 arena: BatchArena | None = None, batch_size: int | None = None,
                 prefetch_next_epoch: bool = True, workers: int = 0,
                 shared: SharedMemoryArena | None = None,
                 cache: ChunkCache | None = None,
                 worker_timeout_s: float = JOB_TIMEOUT_S, keep_decoded: int = 0) -> None:
        super().__init__()
        if max_inflight < 1:
            raise ConfigError(f"max_inflight must be >= 1, got {max_inflight}")
        if prefetch_windows < 0:
            raise ConfigError(f"prefetch_windows must be >= 0, got {prefetch_windows}")
        if batch_size is not None and batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1 (or None), got {batch_size}")
        self.batch_size = batch_size
        # Decode worker processes writing into batches in ``shared`` memory (in place only;
        # graph.py sets the arena's pool to allocate there). 0: the decode threads.
        if workers and (arena is None or shared is None):
            raise ConfigError(f"workers={workers} decode into batches in shared memory: they "
                             "need an arena (in-place decoding) and a SharedMemoryArena")
        self.source, self.dataset = source, dataset
        self.max_inflight = int(max_inflight)
        self.prefetch_windows = int(prefetch_windows)
        self.ledger = ledger if ledger is not None else MemoryLedger()
        self.pool = pool if pool is not None else BufferPool(self.ledger)
        self.retry = retry if retry is not None else RetryPolicy()
        # Plans with batch slots are decoded straight into these batches (graph.py decides).
        self.arena = arena
        self.workers, self.shared = int(workers), shared
        # stored chunks of object stores and icechunk through the local chunk cache
        # (the workers open the same cache)
        self.cache = cache
        self.stats = FetchStats()
        self.readers = self._open_readers(dataset, cache)
        sample_chunks = tuple(r.geom.sample_chunk for r in self.readers)
        self.decode_threads = int(decode_threads or default_decode_threads(
            arena is not None and set(sample_chunks) == {1}))
        self.window_decoder = (window_decoder_for(device_decode, self.readers, dataset.arrays,
                                                  self.stats)
                               if device_decode is not None else None)
        self._ctx = FetchContext(
            self.readers, self.pool, self.retry, self.stats, arena, self.decode_threads,
            self.max_inflight, sample_chunks,
            tuple(arena.layout.row_nbytes(v) for v in range(len(self.readers)))
            if arena is not None else (),
            slot_parts(arena, [r.geom.sample_shape for r in self.readers])
            if arena is not None else (),
            self._kept(keep_decoded, device_decode is not None))
        self._loop = FetchLoop(self.decode_threads, self.window_decoder is not None)
        self._hold = FirstBatchHold(arena is not None)
        path = submit_path(self._ctx, self._hold, self._loop, self.window_decoder)
        if self.workers:
            assert shared is not None
            path = WorkerSubmit(self._ctx, self.workers, dataset, shared, cache, path,
                                worker_timeout_s)
        self._path = path
        self._epoch = EpochWindows()
        # In-place windows write into the arena's batches of this epoch: not ahead of it.
        self._ahead = EpochAhead(bool(prefetch_next_epoch) and arena is None)
        self._delivered: dict | None = None  # upstream state after the last window handed on
        # In place: the batches cut from the windows handed on, the restore's skip, and the
        # position after the last batch yielded.
        self._cut = BatchCut()

    def _kept(self, keep_decoded: int, device: bool) -> KeptStripes | None:
        """Stripes kept decoded across epochs (``keep_decoded`` bytes of them), refused
        where this node's decode threads do not decode them (``defaults.why_not_kept``)."""
        if keep_decoded <= 0:
            return None
        why = why_not_kept(self.dataset, self.arena is not None, self.workers, device)
        if why is not None:
            raise ConfigError(f"keep_decoded={keep_decoded}: stripes are kept decoded only "
                              f"where the decode threads decode them for a window or for "
                              f"copies into batches; not here: {why}. Pass keep_decoded=0")
        return KeptStripes(keep_decoded, self.ledger)

    def _open_readers(self, dataset: Source,
                      cache: ChunkCache | None) -> tuple[Reader, ...]:
        origins = [dataset.origin(i) for i in range(len(dataset.variables))]
        readers = tuple(open_reader(a, g, url) for a, g, (url, _) in
                        zip(dataset.arrays, dataset.variables, origins, strict=True))
        for r, (_, snapshot) in zip(readers, origins, strict=True):
            r.count_into(self.stats.read)
            if cache is not None:
                r.use_cache(cache, snapshot)
        return readers

    @property
    def in_place(self) -> bool:
        """Whether chunks are decoded straight into batches (an arena): then this node
        yields batches (``DecodedBatch``), else windows (``DecodedWindow``)."""
        return self.arena is not None

    @property
    def prefetch_next_epoch(self) -> bool:
        return self._ahead.enabled

    @property
    def engine(self) -> WorkerEngine | None:
        """The decode worker processes while they run (``workers``), else ``None``."""
        return self._path.engine

    @property
    def _lt(self) -> LoopThread | None:
        # the loop thread while it runs (tests look at its thread)
        return self._loop.lt

    # -- lifecycle --------------------------------------------------------------------
    def __reduce__(self) -> NoReturn:
        raise UsageTypeError(
            "an AsyncFetchNode (and so an insitubatch loader) cannot be pickled or sent to "
            "worker processes: it owns an event loop thread. Build the loader in the process "
            "that trains (one per rank) and iterate it there, without DataLoader workers."
        )

    def _ensure_loop(self) -> LoopThread:
        lt = self._loop.ensure(self)
        self._path.start(self)
        return lt

    def start(self) -> None:
        """Start the loop thread and the decode workers now rather than at the first
        ``next()`` (``build_graph`` does, so the workers' start overlaps the training
        script's own set-up)."""
        self._ensure_loop()

    def shutdown(self) -> None:
        """Cancel in-flight reads, stop the loop thread and decode pool for good, and shut
        the upstream down (torchdata's ``shutdown()`` protocol: called by the node or
        loader downstream). A later ``next()`` is an error, not a restarted thread: a
        torchdata ``Prefetcher`` still pulling must not bring the loop back."""
        self._loop.shut_down = True
        self.close()
        if self._ctx.kept is not None:
            self._ctx.kept.clear()
        if self.shared is not None:
            self.shared.close()
        shutdown_source(self.source)

    def close(self) -> None:
        """Cancel in-flight reads and stop the loop thread and decode pool now; iterating
        again starts them again (``shutdown`` is final). In place, the batches yielded are
        forgotten with them: a future still held raises ``StaleFuture`` (a consumer waiting
        on one is let through) instead of waiting for reads that will never land."""
        self._cancel_all()
        if self.arena is not None:
            self.arena.clear()
        self._loop.stop()
        self._path.stop()

    def _cancel_all(self) -> None:
        self._epoch.cancel()
        self._ahead.drop()

    @property
    def epoch_untouched(self) -> bool:
        """True while nothing of an epoch begun by ``reset(None)`` was asked for: another
        ``reset(None)`` then starts that same epoch (the upstream moves on once asked)."""
        return self._epoch.began_fresh and not self._epoch.asked

    @property
    def epochs_ahead(self) -> int:
        """1 when the upstream was already reset for the next epoch
        (``prefetch_next_epoch``), else 0: the upstream's epoch less the one delivered."""
        return self._ahead.epochs_ahead

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._loop.check_process()
        skip = (0 if initial_state is None
                else require_count(initial_state, self.OFFSET_KEY, self))
        if skip and self.arena is None:
            raise StateError(f"AsyncFetchNode state field {self.OFFSET_KEY!r} is {skip}: draws "
                             "into a window are counted here only when decoding in place; "
                             "this fetch delivers whole windows (the state was saved by a "
                             "loader built differently)")
        epoch, ahead = self._epoch, self._ahead
        # Nothing of an epoch begun by reset(None) asked for yet: the upstream would start it
        # again (it moves on only once asked), whatever this node fetched ahead since.
        again = (initial_state is None and ahead.enabled and self.epoch_untouched
                 and self._delivered is not None)
        epoch.cancel()
        if self.arena is not None:
            self.arena.clear()
        self._hold.reset()
        self._hold.draws = skip + (self.batch_size or 0)
        epoch.error = None
        epoch.exhausted = False
        start = ahead.start
        adopt = initial_state is None and not again and not ahead.failed
        if not (adopt and start is not None):
            ahead.drop()
        if again:
            assert self._delivered is not None
            self.source.reset(self._delivered)  # this epoch's start: nothing was delivered
        elif initial_state is not None:
            self.source.reset(require(initial_state, self.SOURCE_KEY, self))
        elif start is None:
            self.source.reset(None)
        elif adopt:
            # The next epoch, begun early: its windows are this epoch's first ones.
            epoch.queue, epoch.exhausted = ahead.take()
            self._hold.started = True
        else:
            self.source.reset(start)  # where reset(None) put it: not a second reset(None)
        ahead.clear()  # (its start kept until the upstream reset above succeeded)
        epoch.began_fresh = initial_state is None
        epoch.asked = False
        self._delivered = copy_state(start if adopt and start is not None
                                     else self.source.state_dict())
        self._cut.reset(self._delivered, skip)

    # -- fetching ---------------------------------------------------------------------
    def _jobs(self, plan: ReadPlan, grouped: bool | None = None) -> list[tuple[int, list[int]]]:
        """``submit.stripe_jobs`` with this node's readers (tests look at the groups)."""
        return stripe_jobs(self._ctx, plan, grouped)

    def _submit_cached(self, plan: ReadPlan, lt: LoopThread) -> DirectWindow:
        """A window whose chunks are all in the local chunk cache, on the pool; stripes
        whose entries went missing meanwhile go to ``_refetch``."""
        return self._path.submit_cached(plan, lt, self._refetch)

    def _refetch(self, misses: list[tuple[int, int, np.ndarray]]) -> None:
        """Stripes a cached window found missing after all: from the store, on the loop,
        waited for here."""
        self._path.refetch(misses, self._ensure_loop())

    def _top_up(self, depth: int, draws: int | None = None) -> int:
        """Keep ``depth`` undelivered windows submitted (pulling plans from upstream); with
        ``draws``, stop as soon as the windows pulled here hold that many draws. Returns the
        draws of the windows pulled."""
        lt = self._ensure_loop()
        epoch = self._epoch
        pulled = 0  # draws of the windows pulled here
        while (not epoch.exhausted and len(epoch.queue) < depth
               and (draws is None or pulled < draws)):
            plan = self._pull_into(epoch.queue, lt)
            if plan is None:
                epoch.exhausted = True
                break
            pulled += plan.n_samples
        if epoch.exhausted and draws is None and self._ahead.enabled:
            self._ahead.top_up(depth - len(epoch.queue), self._restart_upstream,
                               lambda queue: self._pull_into(queue, lt) is not None)
        return pulled

    def _restart_upstream(self) -> dict:
        """Reset the upstream for the next epoch; its state at that epoch's start."""
        self.source.reset(None)
        return copy_state(self.source.state_dict())

    def _pull_into(self, queue: deque[Entry], lt: LoopThread) -> ReadPlan | None:
        """The upstream's next plan, its window submitted onto ``queue`` with the upstream's
        state after it; ``None`` once the upstream is exhausted."""
        try:
            plan = next(self.source)
        except StopIteration:
            return None
        queue.append(self._submit(plan, copy_state(self.source.state_dict()), lt))
        return plan

    def _submit(self, plan: ReadPlan, snap: dict, lt: LoopThread) -> Entry:
        """Start fetching ``plan``'s window: its queue entry."""
        if plan.slots is not None and self.arena is not None:
            # Handed on as submitted: its batches go out at once and the gather waits on
            # each (BatchArena.future), so a batch is used as soon as its rows are in. A
            # restore's head window reads none of the draws delivered before (the cut's
            # skip, handed to the window submitted first after the reset).
            return Entry(self._path.submit(plan, lt, self._cut.submit_skip()), snap, plan)
        if self._path.all_cached(plan):
            # read whole from the local chunk cache: straight to the pool as well
            return Entry(self._submit_cached(plan, lt), snap, None)
        return Entry(self._path.submit(plan, lt), snap, None)

    def next(self) -> DecodedWindow | DecodedBatch:
        t_in = time.perf_counter()
        try:
            if self.arena is not None:
                return self._next_batch()
            return self._next_window()
        finally:
            self.stats.next_s += time.perf_counter() - t_in

    def _head(self) -> Entry | None:
        """The next window to hand on, the windows ahead of it submitted as the first-batch
        hold allows; ``None`` once the epoch has none left."""
        self._loop.check_process()
        epoch, hold = self._epoch, self._hold
        epoch.asked = True
        if epoch.error is not None:
            raise epoch.error
        if not hold.started:
            # The first batch's windows alone; the rest go in once all of them are out.
            hold.begin(lambda draws: self._top_up(self.prefetch_windows + 1, draws=draws))
        elif not hold.holding:
            hold.deferred = False  # asked for a window before the first batch went out
            self._top_up(self.prefetch_windows + 1)
        return epoch.queue[0] if epoch.queue else None

    def _next_batch(self) -> DecodedBatch:
        """In place: the next batch the plans made, once every window feeding it is
        submitted (its rows may still be decoding: the gather waits on its arrays)."""
        cut = self._cut
        if cut.served == 1 and self._hold.resume():
            # The first batch went out: the windows ahead held back for it go in now.
            self._top_up(self.prefetch_windows - self._hold.head_holds())
        while not cut.out:
            head = self._head()
            if head is None:
                cut.end(self._delivered)
                raise StopIteration
            fut, snap, plan = head
            assert plan is not None, "an in-place fetch queues windows with batch slots"
            cut.check_head(plan, type(self).__name__)
            self._hold.drawn(plan)
            self._before_delivery()
            self._epoch.queue.popleft()
            self._epoch.handed_on(fut)
            before, self._delivered = self._delivered, snap
            assert self.arena is not None and before is not None
            cut.add(plan, before, snap, cut.take_skip(), self.arena)
        return cut.take()

    def _next_window(self) -> DecodedWindow:
        head = self._head()
        if head is None:
            raise StopIteration
        epoch = self._epoch
        fut, snap, _ = head
        # a window run by decode workers is in place (``WorkerSubmit.submit``)
        assert not isinstance(fut, WindowRun)
        t0 = time.perf_counter()
        try:
            win = fut.result()
        except BaseException as e:
            epoch.error = e
            self._cancel_all()
            raise
        finally:
            self.stats.wait_s += time.perf_counter() - t0
        if isinstance(fut, DirectWindow):  # its stripes were counted on the pool
            self.stats.window_fetched(len(win.plan.chunk_ids))
            # Its result() runs once: should the top-up below raise, the head is kept as made.
            epoch.queue[0] = Entry(made(win), snap, None)
        self._before_delivery()
        epoch.queue.popleft()
        self._delivered = snap
        if self.window_decoder is not None:
            self.window_decoder.hand_over([t for a in win.arrays for t in a.values()
                                           if isinstance(t, torch.Tensor)])
        return win

    def _before_delivery(self) -> None:
        """The head window is about to go out: keep ``prefetch_windows`` ahead of it, unless
        the first-batch hold says not yet. Topped up before the head is popped: if pulling
        or submitting a plan raises, the head stays queued and the next call delivers it
        (popped first, it was lost while the state already counted it delivered)."""
        if self._hold.let_go(len(self._epoch.queue)):
            self._top_up(self.prefetch_windows + 1 - self._hold.head_holds())

    def windows_pending(self) -> tuple[int, int]:
        """(windows submitted and not yet handed over, of which fully fetched). In place,
        windows are handed over as submitted: those still decoding count too."""
        try:
            futs = self._epoch.in_flight() + [f for f, _, _ in list(self._ahead.queue)]
        except RuntimeError:  # mutated while copied from another thread: report nothing
            return 0, 0
        return len(futs), sum(f.done() for f in futs)

    def get_state(self) -> dict[str, Any]:
        if self.arena is not None:
            # (not copied: a snapshot taken when its window was pulled, replaced, never
            # changed; whoever hands a state out or resets from it copies it)
            state, offset = self._cut.at
            return {self.SOURCE_KEY: state, self.OFFSET_KEY: offset}
        return {self.SOURCE_KEY: copy_state(self._delivered), self.OFFSET_KEY: 0}

    def start_state(self, upstream: dict[str, Any]) -> dict[str, Any]:
        """The state of this node before its first window, over ``upstream``'s state."""
        return {self.SOURCE_KEY: upstream, self.OFFSET_KEY: 0}
