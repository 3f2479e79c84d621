"""Where each sample of a composed variable lives: which member array, which of its rows.

A join whose members start at other dates, a concat of periods, a period or frequency cut
from one store: each serves sample ``g`` from row ``first + (g - start) * step`` of one
member array. Pure index math, so the reader, the statistics and the tests share it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError


@dataclass(frozen=True)
class RowRun:
    """Samples ``[start, stop)`` are rows ``first + (g - start) * step`` of member ``member``."""

    start: int
    stop: int
    member: int
    first: int
    step: int = 1

    def local(self, g: np.ndarray) -> np.ndarray:
        return self.first + (g - self.start) * self.step


@dataclass(frozen=True)
class StripePiece:
    """Part of a composed stripe read from one member stripe: rows ``src`` of the member's
    stripe ``stripe`` (taken ``src_step`` apart) land in rows ``dst`` of the composed one."""

    member: int
    stripe: int
    src: slice
    dst: slice


@dataclass(frozen=True)
class RowMap:
    """The runs of a composed variable's ``n_rows`` samples, ascending and disjoint; samples
    in no run are gaps (missing dates between concatenated periods)."""

    runs: tuple[RowRun, ...]
    n_rows: int

    def __post_init__(self) -> None:
        at = 0
        for r in self.runs:
            if r.start < at or r.stop <= r.start or r.stop > self.n_rows or r.step < 1:
                raise ConfigError(f"row runs must be ascending, disjoint and inside "
                                  f"[0, {self.n_rows}): {self.runs}")
            at = r.stop

    def gaps(self) -> tuple[int, ...]:
        """The samples no member serves."""
        covered = np.zeros(self.n_rows, dtype=bool)
        for r in self.runs:
            covered[r.start:r.stop] = True
        return tuple(int(i) for i in np.flatnonzero(~covered))

    def locate(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(member, local row) of each sample; member -1 for a gap."""
        rows = np.asarray(rows, dtype=np.int64)
        member = np.full(rows.shape, -1, dtype=np.int64)
        local = np.zeros(rows.shape, dtype=np.int64)
        for r in self.runs:
            inside = (rows >= r.start) & (rows < r.stop)
            member[inside] = r.member
            local[inside] = r.local(rows[inside])
        return member, local

    def pieces(self, start: int, stop: int, member_chunks: tuple[int, ...]
               ) -> list[StripePiece]:
        """How to fill composed rows ``[start, stop)`` from member stripes (chunks of
        ``member_chunks[m]`` rows), in order; rows in a gap are in no piece."""
        g = np.arange(start, stop, dtype=np.int64)
        member, local = self.locate(g)
        out: list[StripePiece] = []
        i = 0
        while i < g.size:
            m = int(member[i])
            if m < 0:
                i += 1
                continue
            c = member_chunks[m]
            stripe = int(local[i] // c)
            j = i + 1
            step = int(local[j] - local[i]) if j < g.size and member[j] == m else 1
            while (step >= 1 and j < g.size and member[j] == m and local[j] // c == stripe
                   and local[j] - local[j - 1] == step):
                j += 1
            lo = int(local[i] - stripe * c)
            hi = int(local[j - 1] - stripe * c) + 1
            out.append(StripePiece(m, stripe, slice(lo, hi, step if step > 1 else None),
                                   slice(i, j)))
            i = j
        return out

    @classmethod
    def identity(cls, n_rows: int) -> RowMap:
        """All ``n_rows`` rows of one array, as stored."""
        return cls((RowRun(0, n_rows, 0, 0),) if n_rows else (), n_rows)

    @property
    def is_identity(self) -> bool:
        return (len(self.runs) == 1 and self.runs[0] == RowRun(0, self.n_rows, 0, 0))

    @classmethod
    def of_locations(cls, member: np.ndarray, local: np.ndarray) -> RowMap:
        """Sample ``j`` read from row ``local[j]`` of ``member[j]`` (-1: a gap), as the
        fewest runs of one member and one step (an intersection of dates, a frequency)."""
        member = np.asarray(member, dtype=np.int64)
        local = np.asarray(local, dtype=np.int64)
        n = int(local.size)
        step = np.diff(local, prepend=local[:1])
        # pair (k-1, k) may share a run: one member, rows increasing
        pair = np.zeros(n, dtype=bool)
        pair[1:] = (member[1:] == member[:-1]) & (step[1:] >= 1)
        brk = ~pair  # a run starts where the pair breaks, or its step changes
        brk[2:] |= pair[1:-1] & (step[2:] != step[1:-1])
        edges = [*np.flatnonzero(brk).tolist(), n]
        runs = []
        for a, b in zip(edges[:-1], edges[1:], strict=True):
            if member[a] < 0:
                continue
            s = int(step[a + 1]) if b - a > 1 else 1
            runs.append(RowRun(a, b, int(member[a]), int(local[a]), s))
        return cls(tuple(runs), n)

    def at(self, samples: np.ndarray) -> RowMap:
        """This map's ``samples[j]`` as sample ``j``: a period, a frequency, the dates a
        join keeps."""
        return RowMap.of_locations(*self.locate(samples))

    def take(self, first: int, every: int, n: int) -> RowMap:
        """This map's samples ``first + j * every`` for ``j < n``."""
        return self.at(first + every * np.arange(n, dtype=np.int64))

    def placed(self, offset: int, member_offset: int) -> tuple[RowRun, ...]:
        """These runs shifted ``offset`` samples later and ``member_offset`` members on
        (a concat's later period)."""
        return tuple(RowRun(r.start + offset, r.stop + offset, r.member + member_offset,
                            r.first, r.step) for r in self.runs)
