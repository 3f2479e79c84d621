"""What partial reads did: chunks decoded in part or whole, fetches, bytes (one per reader).

Kept on the reader (``StripeReader.partial_stats``) for the loader's stats to take; decode
workers ``take`` theirs and send them, the loader ``merge``s them, as with ``ReadTimes``.
"""

from __future__ import annotations

import threading


class PartialStats:
    """Counters of the reads given a ``PartSpec``. Pool threads and the event loop add
    concurrently, so additions take a lock (once per chunk)."""

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
