"""Counters and stats types: the leaf every layer may import.

The readers (``io/``), the nodes and the loader bump these plain counters where the work
happens; ``metrics.collect_stats`` reads them into one frozen ``LoaderStats``. Nothing here
imports the rest of the package, so no layer has to reach upward for a counter.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import asdict, dataclass, field
from typing import Any

log = logging.getLogger("insitubatch_nodes")


class ReadTimes:
    """Stripe-seconds the readers spent getting bytes, decoding, and queued for the pool,
    and the reads they tried again (``retries``, counted when the retry is decided, so a
    read that fails for good still shows its retries).

    Pool threads add concurrently, so additions take a lock (once per stripe read).
    """

    __slots__ = ("_lock", "store_s", "decode_s", "pool_wait_s", "retries", "cache_hits",
                 "cache_misses", "cache_bytes", "store_bytes")
    _FIELDS = __slots__[1:]

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.store_s = 0.0  # getting the stored bytes (file read, object GET, zarr getitem)
        self.decode_s = 0.0  # decoding them into the stripe buffer (incl. placing inner chunks)
        self.pool_wait_s = 0.0  # handed to the decode pool but not yet running
        self.retries = 0  # stripe reads tried again after a failure
        # With a ChunkCache: stored chunks read from it / from the store, and their bytes.
        self.cache_hits = self.cache_misses = self.cache_bytes = self.store_bytes = 0

    def add(self, store_s: float, decode_s: float, pool_wait_s: float = 0.0) -> None:
        with self._lock:
            self.store_s += store_s
            self.decode_s += decode_s
            self.pool_wait_s += pool_wait_s

    def retried(self, reads: int = 1) -> None:
        with self._lock:
            self.retries += reads

    def take(self) -> tuple[float, ...]:
        """Every counter since the last ``take``, zeroed: a decode worker sends them with
        each job, and the loader's own ``ReadTimes`` adds them (``merge``)."""
        with self._lock:
            out = tuple(getattr(self, k) for k in self._FIELDS)
            for k in self._FIELDS:
                setattr(self, k, type(getattr(self, k))())
        return out

    def merge(self, values: tuple[float, ...]) -> None:
        """Add the counters a worker's ``take`` returned."""
        with self._lock:
            for k, v in zip(self._FIELDS, values, strict=True):
                setattr(self, k, getattr(self, k) + v)

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
    bytes_decoded: int = 0  # decoded bytes of those stripes (the "bytes fetched")
    wait_s: float = 0.0  # time the consumer blocked on a window that was not ready
    next_s: float = 0.0  # consumer time inside next() (wait_s, planning, submitting)
    in_flight: int = 0  # stripe reads holding an in-flight slot now
    peak_in_flight: int = 0
    slot_wait_s: float = 0.0  # stripe-seconds waiting for an in-flight slot
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


@dataclass(frozen=True)
class LoaderStats:
    """A snapshot of the loader's counters (``loader.stats()``).

    ``epoch_*`` and ``starvation`` cover the current epoch (or the last one, once it ended);
    every other counter is cumulative since the loader was built. Byte counts are decoded
    bytes: ``bytes_fetched`` of the stripes read, ``bytes_delivered`` of the variables'
    tensors in the batches handed out (inputs and targets; ``sample_index`` and coordinates
    excluded).
    """

    epoch: int
    epoch_batches: int
    epoch_samples: int
    epoch_wall_s: float  # since iter() started the epoch; frozen when the epoch ends
    epoch_wait_s: float  # time inside next() of the loader iterator this epoch
    starvation: float  # epoch_wait_s / epoch_wall_s: share of wall time the loop waited
    batches: int
    samples: int
    bytes_fetched: int
    bytes_delivered: int
    windows_fetched: int
    chunks_fetched: int
    stripes_fetched: int
    retries: int
    stripes_in_flight: int  # stripe reads holding one of the max_inflight slots now
    peak_stripes_in_flight: int
    windows_in_flight: int  # windows submitted to the fetch loop, not yet handed over
    windows_ready: int  # of those, fully decoded and waiting for the shuffle buffer
    resident_windows: int  # windows the shuffle buffer is drawing from (2 across an edge)
    resident_stripes: int  # stripes those windows still hold
    resident_bytes: int  # live decode buffers (window, prefetch, reads being filled)
    resident_peak_bytes: int
    resident_bound_bytes: int | None  # the build-time bound, when built by build_loader
    window_occupancy: float | None  # resident_bytes / resident_bound_bytes
    wait_fetch_s: float  # consumer blocked on a window still being fetched
    schedule_s: float  # consumer planning windows and submitting them to the fetch loop
    shuffle_s: float  # cutting draws into batches, evicting drained stripes
    gather_s: float  # copying rows into batch tensors
    deliver_s: float  # the rest: device copy (PinOrCudaNode) and loader bookkeeping
    store_s: float  # stripe-seconds getting stored bytes
    decode_s: float  # stripe-seconds decoding
    pool_wait_s: float  # stripe-seconds queued for a decode thread
    slot_wait_s: float  # stripe-seconds waiting for an in-flight slot (max_inflight)
    # with a ChunkCache (fetch.cache): stored chunks and compressed bytes from it / the store
    cache_hits: int = 0
    cache_misses: int = 0
    cache_bytes: int = 0
    cache_store_bytes: int = 0

    @property
    def cache_hit_ratio(self) -> float | None:
        """Stored chunks served by the local chunk cache, of those looked up there."""
        n = self.cache_hits + self.cache_misses
        return self.cache_hits / n if n else None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def amplification(self) -> float | None:
        """``bytes_fetched / bytes_delivered``: about 1.0 when every decoded byte is used."""
        return self.bytes_fetched / self.bytes_delivered if self.bytes_delivered else None

    def summary(self) -> str:
        """One line for logs."""
        occ = "-" if self.window_occupancy is None else f"{100 * self.window_occupancy:.0f}%"
        return (
            f"epoch {self.epoch}: {self.epoch_batches} batches, {self.epoch_samples} samples in "
            f"{self.epoch_wall_s:.2f} s, starvation {100 * self.starvation:.1f}% | fetched "
            f"{_size(self.bytes_fetched)} ({self.stripes_fetched} stripes, "
            f"{self.retries} retries), delivered {_size(self.bytes_delivered)} | in flight "
            f"{self.stripes_in_flight} stripes, {self.windows_ready}/{self.windows_in_flight} "
            f"windows ready, resident {_size(self.resident_bytes)} ({occ} of bound) | "
            f"consumer s: fetch {self.wait_fetch_s:.2f} schedule {self.schedule_s:.2f} shuffle "
            f"{self.shuffle_s:.2f} gather {self.gather_s:.2f} deliver {self.deliver_s:.2f} | "
            f"fetcher stripe-s: store {self.store_s:.2f} decode {self.decode_s:.2f} pool-queue "
            f"{self.pool_wait_s:.2f} slot-queue {self.slot_wait_s:.2f}"
            + ("" if self.cache_hit_ratio is None else
               f" | chunk cache {100 * self.cache_hit_ratio:.1f}% hits, "
               f"{_size(self.cache_bytes)} from cache, {_size(self.cache_store_bytes)} "
               "from the store")
        )


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"
