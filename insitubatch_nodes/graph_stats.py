"""Reading a graph's counters: ``collect_stats`` makes the ``LoaderStats`` snapshot from the
nodes of a graph; ``first_node``, ``current_epoch`` and ``maybe_log`` answer the loader's
questions about them. Beside ``graph.py`` because it knows the stages; the counters and the
snapshot themselves are ``metrics/`` (the bottom layer, which imports no stage).

Per-stage metrics: cheap counters the nodes keep, read as one frozen ``LoaderStats``.

Every counter is a plain int/float bumped where the work happens (a few ``perf_counter``
calls per batch and per stripe read, no locks on the consumer path), so metrics are always
on. ``InSituLoader.stats()`` gathers them into a snapshot at any time;
``InSituLoader.log_stats_every(seconds)`` logs a one-line summary through ``logging``.

Times are of two kinds:

- **consumer** times (``wait_fetch_s``, ``schedule_s``, ``shuffle_s``, ``gather_s``,
  ``deliver_s``) are wall time on the training thread, exclusive per stage: together they
  add up to the time spent inside ``next()`` of the loader's iterator;
- **fetcher** times (``store_s``, ``decode_s``, ``pool_wait_s``, ``slot_wait_s``) are summed
  over concurrent stripe reads (stripe-seconds), so they can exceed wall time; their ratio
  says whether reads wait on the store or on decoding. With ``decode="gpu"``, ``decode_s``
  also counts the device thread's time per window (pack, copy, batched decode, assembly,
  stream sync).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from torchdata.nodes import BaseNode

from .metrics.counters import ConsumerMeter, PartialStats, ReadTimes
from .metrics.loader_stats import LoaderStats
from .nodes import AsyncFetchNode, ChunkPermuteNode, GatherNode, ShuffleBufferNode


def first_node(nodes: Sequence[BaseNode], kind: type) -> Any:
    """The first node of type ``kind`` in ``nodes`` (``None`` if there is none)."""
    for n in nodes:
        if isinstance(n, kind):
            return n
    return None


def current_epoch(nodes: Sequence[BaseNode]) -> int:
    """The epoch being delivered: ``ChunkPermuteNode``'s, less the epoch the fetch may have
    started early (``AsyncFetchNode(prefetch_next_epoch=True)``); 0 without those stages."""
    permute = first_node(nodes, ChunkPermuteNode)
    if permute is None:
        return 0
    fetch = first_node(nodes, AsyncFetchNode)
    return permute.epoch - (fetch.epochs_ahead if fetch is not None else 0)


def collect_stats(nodes: Sequence[BaseNode], meter: ConsumerMeter, bound: int | None,
                  now: float | None = None) -> LoaderStats:
    """Read the counters of a graph's ``nodes`` (root first) and of the loader's ``meter``
    into a ``LoaderStats``; nodes a graph lacks count zero. ``bound`` is the build-time
    resident bound (``None`` for a graph not built by ``build_loader``)."""
    now = time.perf_counter() if now is None else now
    fetch = first_node(nodes, AsyncFetchNode)
    shuffle = first_node(nodes, ShuffleBufferNode)
    gather = first_node(nodes, GatherNode)

    g_batches = gather.stats.batches if gather else 0
    g_samples = gather.stats.samples if gather else 0
    start, end = meter.epoch_start, meter.epoch_end
    wall = 0.0 if start is None else (end if end is not None else now) - start
    starvation = min(1.0, meter.epoch_wait_s / wall) if wall > 0 else 0.0

    fs = fetch.stats if fetch else None
    in_flight, ready = fetch.windows_pending() if fetch else (0, 0)
    res_windows, res_stripes = shuffle.resident_counts() if shuffle else (0, 0)
    ledger = fetch.ledger if fetch is not None else None
    resident = ledger.resident if ledger is not None else 0
    peak = ledger.peak if ledger is not None else 0

    # Decoding in place, the consumer waits for a batch's rows inside the gather (its
    # BatchFuture): that is waiting on the fetch (the gather counts it as upstream time).
    arena_wait = fetch.arena.wait_s if fetch is not None and fetch.arena is not None else 0.0
    fetch_next = fs.next_s if fs else 0.0
    fetch_wait = (fs.wait_s if fs else 0.0) + arena_wait
    sh_next = shuffle.stats.next_s if shuffle else 0.0
    sh_up = shuffle.stats.upstream_s if shuffle else 0.0
    g_next = gather.stats.next_s if gather else 0.0
    g_up = gather.stats.upstream_s if gather else 0.0
    rt = fs.read if fs else ReadTimes()
    return LoaderStats.of(
        epoch=current_epoch(nodes),
        epoch_batches=g_batches - meter.gather_mark[0],
        epoch_samples=g_samples - meter.gather_mark[1],
        epoch_wall_s=wall,
        epoch_wait_s=meter.epoch_wait_s,
        starvation=starvation,
        batches=g_batches,
        samples=g_samples,
        bytes_fetched=fs.bytes_decoded if fs else 0,
        bytes_delivered=gather.stats.nbytes if gather else 0,
        windows_fetched=fs.windows if fs else 0,
        chunks_fetched=fs.chunks if fs else 0,
        stripes_fetched=fs.stripes if fs else 0,
        stripes_kept=fs.stripes_kept if fs else 0,
        retries=fs.retries if fs else 0,
        stripes_in_flight=fs.in_flight if fs else 0,
        peak_stripes_in_flight=fs.peak_in_flight if fs else 0,
        windows_in_flight=in_flight,
        windows_ready=ready,
        worker_restarts=fs.worker_restarts if fs else 0,
        resident_windows=res_windows,
        resident_stripes=res_stripes,
        resident_bytes=resident,
        resident_peak_bytes=peak,
        resident_bound_bytes=bound,
        window_occupancy=resident / bound if bound else None,
        wait_fetch_s=fetch_wait,
        schedule_s=max(0.0, fetch_next - fetch_wait + arena_wait),
        shuffle_s=max(0.0, sh_next - sh_up),
        gather_s=max(0.0, g_next - g_up),
        deliver_s=max(0.0, meter.total_wait_s - g_next),
        store_s=rt.store_s,
        decode_s=rt.decode_s,
        pool_wait_s=rt.pool_wait_s,
        slot_wait_s=fs.slot_wait_s if fs else 0.0,
        cache_hits=rt.cache_hits,
        cache_misses=rt.cache_misses,
        cache_bytes=rt.cache_bytes,
        cache_store_bytes=rt.store_bytes,
        **_partial_counters(rt.partial),
    )


def _partial_counters(pr: PartialStats) -> dict[str, int]:
    """The partial reads' counters by their ``LoaderStats`` names."""
    return {"chunks_read_in_part": pr.partial_reads, "chunks_read_whole": pr.whole_reads,
            "chunks_skipped": pr.skipped_reads, "chunks_fetched_in_part": pr.partial_fetches,
            "chunks_fetched_whole": pr.whole_fetches, "part_bytes_fetched": pr.bytes_fetched,
            "part_frame_bytes": pr.frame_bytes}


def maybe_log(nodes: Sequence[BaseNode], meter: ConsumerMeter, bound: int | None,
              now: float) -> None:
    """Log ``stats().summary()`` if ``log_stats_every``'s interval has passed."""
    if meter.next_log is None or now < meter.next_log or meter.log_every_s is None:
        return
    meter.next_log = now + meter.log_every_s
    meter.logger.log(meter.level, "insitubatch %s",
                     collect_stats(nodes, meter, bound, now).summary())
