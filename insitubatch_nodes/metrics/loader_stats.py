"""LoaderStats: one frozen snapshot of the loader's counters, grouped by concern.

Seven small records (progress, fetched, resident memory, consumer time, fetcher time, chunk
cache, partial reads) rather than one flat class of 44 fields; every counter is still read by
its flat name (``stats.starvation``, ``stats.resident_bytes``), as logs and dashboards use
them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from ..errors import ConfigTypeError


@dataclass(frozen=True)
class Progress:
    """What was served: this epoch (``epoch_*``, ``starvation``) and since the build."""

    epoch: int
    epoch_batches: int
    epoch_samples: int
    epoch_wall_s: float  # since iter() started the epoch; frozen when the epoch ends
    epoch_wait_s: float  # time inside next() of the loader iterator this epoch
    starvation: float  # epoch_wait_s / epoch_wall_s: share of wall time the loop waited
    batches: int
    samples: int


@dataclass(frozen=True)
class Fetched:
    """What was read and what of it is on the way (decoded bytes, stripes, windows)."""

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
    worker_restarts: int = 0  # decode worker processes that died and were started again
    stripes_kept: int = 0  # stripes served from their decoded copy kept across epochs


@dataclass(frozen=True)
class Resident:
    """Decode memory held now, its peak and the build-time bound it is checked against."""

    resident_windows: int  # windows the shuffle buffer is drawing from (2 across an edge)
    resident_stripes: int  # stripes those windows still hold
    resident_bytes: int  # live decode buffers (window, prefetch, reads being filled)
    resident_peak_bytes: int
    resident_bound_bytes: int | None  # the build-time bound, when built by build_loader
    window_occupancy: float | None  # resident_bytes / resident_bound_bytes


@dataclass(frozen=True)
class ConsumerTimes:
    """Where the training process's time inside ``next()`` went, stage by stage."""

    wait_fetch_s: float  # consumer blocked on a window still being fetched
    schedule_s: float  # consumer planning windows and submitting them to the fetch loop
    shuffle_s: float  # cutting draws into batches, evicting drained stripes
    gather_s: float  # copying rows into batch tensors
    deliver_s: float  # the rest: device copy (PinOrCudaNode) and loader bookkeeping


@dataclass(frozen=True)
class FetcherTimes:
    """Stripe-seconds of the readers (summed over concurrent reads, not wall time)."""

    store_s: float  # getting stored bytes
    decode_s: float  # decoding
    pool_wait_s: float  # queued for a decode thread
    slot_wait_s: float  # waiting for an in-flight slot (max_inflight)


@dataclass(frozen=True)
class CacheCounters:
    """With a ChunkCache (``fetch.cache``): stored chunks and compressed bytes served from
    it and from the store."""

    cache_hits: int = 0
    cache_misses: int = 0
    cache_bytes: int = 0
    cache_store_bytes: int = 0


@dataclass(frozen=True)
class PartialReads:
    """Stored chunks a read wanted only part of (some levels, anemoi variables): decoded
    block by block or whole all the same, not read at all, fetched from an object store in
    part or whole, and the compressed bytes those fetches got of their frames' size."""

    chunks_read_in_part: int = 0
    chunks_read_whole: int = 0  # a part wanted, the whole frame decoded (``inspect`` says why)
    chunks_skipped: int = 0  # holding no wanted level: not read
    chunks_fetched_in_part: int = 0
    chunks_fetched_whole: int = 0
    part_bytes_fetched: int = 0
    part_frame_bytes: int = 0  # what those fetches would have got whole

    @property
    def fetched_fraction(self) -> float | None:
        """Compressed bytes fetched over the frames' size (``None``: no partial fetch)."""
        return self.part_bytes_fetched / self.part_frame_bytes if self.part_frame_bytes else None


_GROUPS = {"progress": Progress, "fetched": Fetched, "resident": Resident,
           "consumer": ConsumerTimes, "fetcher": FetcherTimes, "cache": CacheCounters,
           "partial": PartialReads}
_FLAT = {f.name: group for group, cls in _GROUPS.items() for f in fields(cls)}


@dataclass(frozen=True)
class LoaderStats:
    """A snapshot of the loader's counters (``loader.stats()``).

    ``epoch_*`` and ``starvation`` cover the current epoch (or the last one, once it ended);
    every other counter is cumulative since the loader was built. Byte counts are decoded
    bytes: ``bytes_fetched`` of the stripes read, ``bytes_delivered`` of the variables'
    tensors in the batches handed out (inputs and targets; ``sample_index`` and coordinates
    excluded). Counters are read by their flat names or through their group.
    """

    progress: Progress
    fetched: Fetched
    resident: Resident
    consumer: ConsumerTimes
    fetcher: FetcherTimes
    cache: CacheCounters
    partial: PartialReads

    @classmethod
    def of(cls, **counters: Any) -> LoaderStats:
        """Build from flat counter names (as ``as_dict`` gives them); the cache's may be
        left out. An unknown or missing name is a TypeError naming it."""
        unknown = sorted(set(counters) - set(_FLAT))
        if unknown:
            raise ConfigTypeError(f"LoaderStats.of: unknown counters {unknown}; known: "
                                  f"{sorted(_FLAT)}")
        groups = {g: c(**{f.name: counters[f.name] for f in fields(c) if f.name in counters})
                  for g, c in _GROUPS.items()}
        return cls(**groups)

    def __getattr__(self, name: str) -> Any:
        group = _FLAT.get(name)
        if group is None:
            raise AttributeError(f"LoaderStats has no counter {name!r}; counters: "
                                 f"{sorted(_FLAT)}")
        return getattr(object.__getattribute__(self, group), name)

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *_FLAT})

    @property
    def cache_hit_ratio(self) -> float | None:
        """Stored chunks served by the local chunk cache, of those looked up there."""
        n = self.cache.cache_hits + self.cache.cache_misses
        return self.cache.cache_hits / n if n else None

    def as_dict(self) -> dict[str, Any]:
        """Every counter by its flat name (one level: what a logger or a JSON row wants)."""
        return {k: v for group in _GROUPS for k, v in asdict(getattr(self, group)).items()}

    @property
    def amplification(self) -> float | None:
        """``bytes_fetched / bytes_delivered``: about 1.0 when every decoded byte is used."""
        f = self.fetched
        return f.bytes_fetched / f.bytes_delivered if f.bytes_delivered else None

    def summary(self) -> str:
        """One line for logs."""
        p, f, r, c, t = self.progress, self.fetched, self.resident, self.consumer, self.fetcher
        occ = "-" if r.window_occupancy is None else f"{100 * r.window_occupancy:.0f}%"
        return (
            f"epoch {p.epoch}: {p.epoch_batches} batches, {p.epoch_samples} samples in "
            f"{p.epoch_wall_s:.2f} s, starvation {100 * p.starvation:.1f}% | fetched "
            f"{_size(f.bytes_fetched)} ({f.stripes_fetched} stripes, "
            f"{f.retries} retries), delivered {_size(f.bytes_delivered)} | in flight "
            f"{f.stripes_in_flight} stripes, {f.windows_ready}/{f.windows_in_flight} "
            f"windows ready, resident {_size(r.resident_bytes)} ({occ} of bound) | "
            f"consumer s: fetch {c.wait_fetch_s:.2f} schedule {c.schedule_s:.2f} shuffle "
            f"{c.shuffle_s:.2f} gather {c.gather_s:.2f} deliver {c.deliver_s:.2f} | "
            f"fetcher stripe-s: store {t.store_s:.2f} decode {t.decode_s:.2f} pool-queue "
            f"{t.pool_wait_s:.2f} slot-queue {t.slot_wait_s:.2f}"
            + (f" | {f.worker_restarts} decode workers restarted" if f.worker_restarts else "")
            + self._partial_summary()
            + ("" if self.cache_hit_ratio is None else
               f" | chunk cache {100 * self.cache_hit_ratio:.1f}% hits, "
               f"{_size(self.cache.cache_bytes)} from cache, "
               f"{_size(self.cache.cache_store_bytes)} from the store")
        )


    def _partial_summary(self) -> str:
        p = self.partial
        if not (p.chunks_read_in_part or p.chunks_read_whole or p.chunks_fetched_in_part):
            return ""
        frac = p.fetched_fraction
        return (f" | part of a chunk: {p.chunks_read_in_part} read in part, "
                f"{p.chunks_read_whole} whole"
                + ("" if frac is None else f", fetched {100 * frac:.0f}% of their bytes"))


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"
