"""Counters and stats types: the leaf every layer may import.

The readers (``io/``), the nodes and the loader bump these plain counters where the work
happens; ``graph_stats.collect_stats`` reads them into one frozen ``LoaderStats``
(``metrics/loader_stats.py``). Nothing here
imports the rest of the package, so no layer has to reach upward for a counter.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("insitubatch_nodes")


class PartialStats:
    """Counters of the reads given a ``PartSpec`` (``io/partial``): chunks decoded in part or
    whole, fetched in part or whole, bytes. Part of ``ReadTimes``, so a decode worker's go
    back with its read times. Pool threads and the event loop add concurrently, so
    additions take a lock (once per chunk)."""

    __slots__ = ("_lock", "partial_reads", "whole_reads", "skipped_reads", "partial_fetches",
                 "whole_fetches", "bytes_fetched", "frame_bytes")
    FIELDS = __slots__[1:]

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.partial_reads = 0  # stored chunks decoded block by block
        self.whole_reads = 0  # stored chunks decoded whole all the same (see blocks.Whole)
        self.skipped_reads = 0  # stored chunks holding no wanted index: not read at all
        self.partial_fetches = 0  # object-store chunks fetched as header + needed blocks
        self.whole_fetches = 0  # object-store chunks fetched whole all the same
        self.bytes_fetched = 0  # bytes those fetches received
        self.frame_bytes = 0  # the whole frames' sizes: what whole fetches would receive

    def decoded(self, partial: bool) -> None:
        with self._lock:
            if partial:
                self.partial_reads += 1
            else:
                self.whole_reads += 1

    def skipped(self, chunks: int) -> None:
        with self._lock:
            self.skipped_reads += chunks

    def fetched(self, partial: bool, nbytes: int, frame_bytes: int) -> None:
        with self._lock:
            if partial:
                self.partial_fetches += 1
            else:
                self.whole_fetches += 1
            self.bytes_fetched += nbytes
            self.frame_bytes += frame_bytes

    @property
    def fetched_fraction(self) -> float | None:
        """Bytes fetched over the frames' sizes (``None`` before any fetch)."""
        return self.bytes_fetched / self.frame_bytes if self.frame_bytes else None

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return {k: getattr(self, k) for k in self.FIELDS}

    def take(self) -> tuple[int, ...]:
        """Every counter since the last ``take``, zeroed (a worker sends them)."""
        with self._lock:
            out = tuple(getattr(self, k) for k in self.FIELDS)
            for k in self.FIELDS:
                setattr(self, k, 0)
        return out

    def merge(self, values: tuple[int, ...]) -> None:
        """Add what another reader's ``take`` returned."""
        with self._lock:
            for k, v in zip(self.FIELDS, values, strict=True):
                setattr(self, k, getattr(self, k) + v)

    def __repr__(self) -> str:
        return f"PartialStats({self.as_dict()})"


class ReadTimes:
    """Stripe-seconds the readers spent getting bytes, decoding, and queued for the pool,
    and the reads they tried again (``retries``, counted when the retry is decided, so a
    read that fails for good still shows its retries).

    Pool threads add concurrently, so additions take a lock (once per stripe read).
    """

    __slots__ = ("_lock", "store_s", "decode_s", "pool_wait_s", "retries", "cache_hits",
                 "cache_misses", "cache_bytes", "store_bytes", "partial")
    _FIELDS = __slots__[1:-1]  # the partial reads' counters go in their own record

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.store_s = 0.0  # getting the stored bytes (file read, object GET, zarr getitem)
        self.decode_s = 0.0  # decoding them into the stripe buffer (incl. placing inner chunks)
        self.pool_wait_s = 0.0  # handed to the decode pool but not yet running
        self.retries = 0  # stripe reads tried again after a failure
        # With a ChunkCache: stored chunks read from it / from the store, and their bytes.
        self.cache_hits = self.cache_misses = self.cache_bytes = self.store_bytes = 0
        self.partial = PartialStats()  # reads of part of a chunk (levels a model takes)

    def add(self, store_s: float, decode_s: float, pool_wait_s: float = 0.0) -> None:
        with self._lock:
            self.store_s += store_s
            self.decode_s += decode_s
            self.pool_wait_s += pool_wait_s

    def retried(self, reads: int = 1) -> None:
        with self._lock:
            self.retries += reads

    def take(self) -> tuple[Any, ...]:
        """Every counter since the last ``take``, zeroed (the partial reads' last): a decode
        worker sends them, and the loader's own ``ReadTimes`` adds them (``merge``)."""
        with self._lock:
            out = tuple(getattr(self, k) for k in self._FIELDS)
            for k in self._FIELDS:
                setattr(self, k, type(getattr(self, k))())
        return (*out, self.partial.take())

    def merge(self, values: tuple[Any, ...]) -> None:
        """Add the counters a worker's ``take`` returned."""
        *own, partial = values
        with self._lock:
            for k, v in zip(self._FIELDS, own, strict=True):
                setattr(self, k, getattr(self, k) + v)
        self.partial.merge(partial)

    def cached(self, chunks: int, nbytes: int) -> None:
        """``chunks`` stored chunks (``nbytes``) came from the local chunk cache."""
        with self._lock:
            self.cache_hits += chunks
            self.cache_bytes += nbytes

    def fetched(self, chunks: int, nbytes: int) -> None:
        """``chunks`` stored chunks (``nbytes``) missed the chunk cache: read from the store."""
        with self._lock:
            self.cache_misses += chunks
            self.store_bytes += nbytes


class ConsumerMeter:
    """What the training thread saw: time inside the loader iterator's ``next()``.

    ``InSituLoader`` owns one; its iterator adds to it around every pull from the graph.
    """

    __slots__ = ("epoch_start", "epoch_end", "wait_mark", "total_wait_s", "gather_mark",
                 "next_log", "log_every_s", "logger", "level")

    def __init__(self) -> None:
        self.epoch_start: float | None = None
        self.epoch_end: float | None = None
        self.wait_mark = 0.0  # total_wait_s when the epoch started
        self.total_wait_s = 0.0
        self.gather_mark = (0, 0)  # GatherNode (batches, samples) when the epoch started
        self.next_log: float | None = None
        self.log_every_s: float | None = None
        self.logger = log
        self.level = logging.INFO

    def start_epoch(self, now: float, gather_mark: tuple[int, int]) -> None:
        self.epoch_start = now
        self.epoch_end = None
        self.wait_mark = self.total_wait_s
        self.gather_mark = gather_mark

    @property
    def epoch_wait_s(self) -> float:
        return self.total_wait_s - self.wait_mark

    def waited(self, seconds: float) -> None:
        self.total_wait_s += seconds


@dataclass
class FetchStats:
    """Counters kept by the fetcher; cheap enough to stay on (see ``metrics.LoaderStats``).

    Stripes, bytes, windows, slots in flight and slot waits are counted from the event loop,
    the consumer thread and pool threads alike (local windows skip the loop), so they
    change only through the methods below, under one lock. The consumer-thread timers
    (``next_s``, ``wait_s``) have one writer; ``read`` takes its own lock.
    """

    windows: int = 0  # windows fully fetched
    chunks: int = 0  # sample-grid chunks of those windows
    stripes: int = 0  # stripe reads completed
    stripes_kept: int = 0  # stripes copied from their decoded copy kept across epochs
    bytes_decoded: int = 0  # decoded bytes of those stripes (the "bytes fetched")
    wait_s: float = 0.0  # time the consumer blocked on a window that was not ready
    next_s: float = 0.0  # consumer time inside next() (wait_s, planning, submitting)
    in_flight: int = 0  # stripe reads holding an in-flight slot now
    peak_in_flight: int = 0
    slot_wait_s: float = 0.0  # stripe-seconds waiting for an in-flight slot
    worker_restarts: int = 0  # decode worker processes that died and were started again
    read: ReadTimes = field(default_factory=ReadTimes)  # store / decode / pool-queue times
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False,
                                  compare=False)

    def slot_taken(self, waited_s: float) -> None:
        """A stripe read took one of the ``max_inflight`` slots after ``waited_s``."""
        with self._lock:
            self.slot_wait_s += waited_s
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)

    def slot_released(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def stripes_read(self, stripes: int, stripe_nbytes: int) -> None:
        """``stripes`` reads of ``stripe_nbytes`` decoded bytes each completed (retries are
        counted by the readers as they retry, a failed read's too)."""
        with self._lock:
            self.stripes += stripes
            self.bytes_decoded += stripes * stripe_nbytes

    def stripes_from_kept(self, stripes: int) -> None:
        """``stripes`` were served from their decoded copy kept across epochs, not read."""
        with self._lock:
            self.stripes_kept += stripes

    def stripes_done(self, stripes: int, nbytes: int) -> None:
        """``stripes`` reads of ``nbytes`` decoded bytes in all completed (the decode
        workers' engine sums a socket read's answers and counts them at once)."""
        with self._lock:
            self.stripes += stripes
            self.bytes_decoded += nbytes

    def worker_restarted(self) -> None:
        """A decode worker died (or hung and was killed) and was started again; its jobs
        ran again on the live workers."""
        with self._lock:
            self.worker_restarts += 1

    def window_fetched(self, chunks: int) -> None:
        with self._lock:
            self.windows += 1
            self.chunks += chunks

    @property
    def retries(self) -> int:
        """Stripe reads tried again, counted by the readers as they retry."""
        return self.read.retries


@dataclass
class ShuffleStats:
    """Consumer time in ``next()`` (``next_s``) and, inside it, pulling windows from upstream
    (``upstream_s``); the difference is this stage's own work."""

    next_s: float = 0.0
    upstream_s: float = 0.0
    windows: int = 0  # windows pulled


@dataclass
class GatherStats:
    """Batches made, their rows and variable bytes; consumer time in ``next()`` and, inside
    it, waiting on upstream (``upstream_s``)."""

    batches: int = 0
    samples: int = 0
    nbytes: int = 0  # bytes of the variables' tensors (not sample_index, not coordinates)
    next_s: float = 0.0
    upstream_s: float = 0.0

