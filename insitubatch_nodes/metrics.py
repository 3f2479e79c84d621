"""Per-stage metrics: cheap counters the nodes keep, read as one frozen ``LoaderStats``.

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

import logging
import threading
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .loader import InSituLoader

log = logging.getLogger("insitubatch_nodes")


class ReadTimes:
    """Stripe-seconds the readers spent getting bytes, decoding, and queued for the pool.

    Pool threads add concurrently, so additions take a lock (once per stripe read).
    """

    __slots__ = ("_lock", "store_s", "decode_s", "pool_wait_s")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.store_s = 0.0  # getting the stored bytes (file read, object GET, zarr getitem)
        self.decode_s = 0.0  # decoding them into the stripe buffer (incl. placing inner chunks)
        self.pool_wait_s = 0.0  # handed to the decode pool but not yet running

    def add(self, store_s: float, decode_s: float, pool_wait_s: float = 0.0) -> None:
        with self._lock:
            self.store_s += store_s
            self.decode_s += decode_s
            self.pool_wait_s += pool_wait_s


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
        )


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def first_node(nodes: list, kind: type) -> Any:
    for n in nodes:
        if isinstance(n, kind):
            return n
    return None


def collect_stats(loader: InSituLoader, now: float | None = None) -> LoaderStats:
    """Read every node's counters into a ``LoaderStats`` (nodes a graph lacks count zero)."""
    from .nodes import AsyncFetchNode, ChunkPermuteNode, GatherNode, ShuffleBufferNode

    now = time.perf_counter() if now is None else now
    nodes = loader._nodes()
    meter: ConsumerMeter = loader._meter
    fetch = first_node(nodes, AsyncFetchNode)
    shuffle = first_node(nodes, ShuffleBufferNode)
    gather = first_node(nodes, GatherNode)
    permute = first_node(nodes, ChunkPermuteNode)

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
    bound = getattr(loader, "resident_bound", None)

    fetch_next = fs.next_s if fs else 0.0
    fetch_wait = fs.wait_s if fs else 0.0
    sh_next = shuffle.stats.next_s if shuffle else 0.0
    sh_up = shuffle.stats.upstream_s if shuffle else 0.0
    g_next = gather.stats.next_s if gather else 0.0
    g_up = gather.stats.upstream_s if gather else 0.0
    rt = fs.read if fs else ReadTimes()
    return LoaderStats(
        epoch=permute.epoch if permute else 0,
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
        retries=fs.retries if fs else 0,
        stripes_in_flight=fs.in_flight if fs else 0,
        peak_stripes_in_flight=fs.peak_in_flight if fs else 0,
        windows_in_flight=in_flight,
        windows_ready=ready,
        resident_windows=res_windows,
        resident_stripes=res_stripes,
        resident_bytes=resident,
        resident_peak_bytes=peak,
        resident_bound_bytes=bound,
        window_occupancy=resident / bound if bound else None,
        wait_fetch_s=fetch_wait,
        schedule_s=max(0.0, fetch_next - fetch_wait),
        shuffle_s=max(0.0, sh_next - sh_up),
        gather_s=max(0.0, g_next - g_up),
        deliver_s=max(0.0, meter.total_wait_s - g_next),
        store_s=rt.store_s,
        decode_s=rt.decode_s,
        pool_wait_s=rt.pool_wait_s,
        slot_wait_s=fs.slot_wait_s if fs else 0.0,
    )


def maybe_log(loader: InSituLoader, now: float) -> None:
    """Log ``stats().summary()`` if ``log_stats_every``'s interval has passed."""
    meter: ConsumerMeter = loader._meter
    if meter.next_log is None or now < meter.next_log or meter.log_every_s is None:
        return
    meter.next_log = now + meter.log_every_s
    meter.logger.log(meter.level, "insitubatch %s", collect_stats(loader, now).summary())
