"""Chunk-aligned splits, decided ahead of time and saved as a small JSON manifest.

A split is a set of chunk ids (stripes of ``chunk_size`` samples). Contiguous blocks keep
autocorrelated neighbours on one side, so nothing leaks between train and val.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .geometry import SampleGrid
from .source import Source
from .windows import SampleWindow

MANIFEST_VERSION = 1
_DEFAULT_NAMES = ("train", "val", "test")


@dataclass(frozen=True)
class SplitManifest:
    """Which chunks belong to which split, plus what they were computed from.

    ``splits`` maps a name to half-open ranges of chunk ids. ``variables`` and
    ``n_samples``/``chunk_size`` let a loader check it is given the store it was made for.
    """

    n_samples: int
    chunk_size: int
    splits: tuple[tuple[str, tuple[tuple[int, int], ...]], ...]
    variables: tuple[str, ...] = ()
    seed: int = 0
    fractions: tuple[float, ...] = ()
    mode: str = "contiguous"
    source_url: str = ""
    snapshot_id: str | None = None  # icechunk snapshot the split was made on
    gap: int = 0  # steps kept free between consecutive splits (time windows)
    periods: tuple[tuple[str, str | None, str | None], ...] = ()  # coordinate ranges asked for

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.splits)

    @property
    def grid(self) -> SampleGrid:
        return SampleGrid(self.n_samples, self.chunk_size)

    def ranges(self, name: str) -> tuple[tuple[int, int], ...]:
        for n, r in self.splits:
            if n == name:
                return r
        raise KeyError(f"unknown split {name!r}; the manifest has splits {list(self.names)}")

    def chunk_ids(self, name: str) -> np.ndarray:
        """The split's chunk ids in canonical (ascending) order."""
        ranges = self.ranges(name)
        if not ranges:
            return np.empty(0, dtype=np.int64)
        return np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in ranges])

    def n_samples_in(self, name: str) -> int:
        return self.grid.n_samples_of(self.chunk_ids(name))

    def to_dict(self) -> dict:
        return {
            "version": MANIFEST_VERSION,
            "n_samples": self.n_samples,
            "chunk_size": self.chunk_size,
            "variables": list(self.variables),
            "seed": self.seed,
            "fractions": list(self.fractions),
            "mode": self.mode,
            "source_url": self.source_url,
            "snapshot_id": self.snapshot_id,
            "gap": self.gap,
            "periods": [list(p) for p in self.periods],
            "splits": {name: [list(r) for r in ranges] for name, ranges in self.splits},
        }

    @classmethod
    def from_dict(cls, d: dict) -> SplitManifest:
        if d.get("version") != MANIFEST_VERSION:
            raise ValueError(
                f"split manifest version {d.get('version')!r} is not supported "
                f"(this library reads version {MANIFEST_VERSION})"
            )
        return cls(
            n_samples=int(d["n_samples"]),
            chunk_size=int(d["chunk_size"]),
            splits=tuple(
                (str(name), tuple((int(a), int(b)) for a, b in ranges))
                for name, ranges in d["splits"].items()
            ),
            variables=tuple(d.get("variables", ())),
            seed=int(d.get("seed", 0)),
            fractions=tuple(float(f) for f in d.get("fractions", ())),
            mode=str(d.get("mode", "contiguous")),
            source_url=str(d.get("source_url", "")),
            snapshot_id=d.get("snapshot_id"),
            gap=int(d.get("gap", 0)),
            periods=tuple((str(n), a, b) for n, a, b in d.get("periods", ())),
        )

    def to_json(self, path: str | os.PathLike[str]) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> SplitManifest:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def check_source(self, source: Source, allow_snapshot_change: bool = False) -> None:
        """Refuse a store whose sample axis (or icechunk snapshot) is not the one this
        manifest was made for."""
        if (self.snapshot_id and source.snapshot_id and self.snapshot_id != source.snapshot_id
                and not allow_snapshot_change):
            raise ValueError(
                f"split manifest was made on icechunk snapshot {self.snapshot_id}, but "
                f"{source.url} now resolves to snapshot {source.snapshot_id} (the branch "
                "moved). Open the old snapshot with open_icechunk(..., snapshot_id=...), or "
                "pass allow_snapshot_change=True to use the new data."
            )
        if (source.n_samples, source.grid.chunk_size) != (self.n_samples, self.chunk_size):
            raise ValueError(
                f"split manifest was made for {self.n_samples} samples in chunks of "
                f"{self.chunk_size} ({self.source_url or 'unknown store'}), but {source.url} "
                f"serves {source.n_samples} samples in chunks of {source.grid.chunk_size}. "
                "Make a new manifest with split_by_chunk(source, ...)."
            )


def _apportion(n: int, fractions: Sequence[float]) -> list[int]:
    """Integer counts summing to n, proportional to fractions (largest remainder)."""
    raw = [f * n for f in fractions]
    counts = [int(np.floor(r)) for r in raw]
    order = sorted(range(len(raw)), key=lambda i: (-(raw[i] - counts[i]), i))
    for i in order[: n - sum(counts)]:
        counts[i] += 1
    return counts


def _as_ranges(ids: np.ndarray) -> tuple[tuple[int, int], ...]:
    ids = np.sort(np.asarray(ids, dtype=np.int64))
    if ids.size == 0:
        return ()
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.concatenate(([0], breaks))
    stops = np.concatenate((breaks, [ids.size]))
    return tuple((int(ids[a]), int(ids[b - 1]) + 1) for a, b in zip(starts, stops, strict=True))


def split_by_chunk(
    source: Source,
    fractions: Sequence[float] = (0.8, 0.1, 0.1),
    seed: int = 0,
    *,
    names: Sequence[str] | None = None,
    mode: str = "contiguous",
) -> SplitManifest:
    """Assign whole chunks to splits in proportion to ``fractions``.

    ``mode="contiguous"`` (default) gives each split one block, in order: no autocorrelated
    neighbours leak across. ``mode="random"`` assigns chunks at random from ``seed`` (use
    it only when neighbouring samples are independent).
    """
    fractions = tuple(float(f) for f in fractions)
    if names is None:
        if len(fractions) > len(_DEFAULT_NAMES):
            raise ValueError(f"give names= for {len(fractions)} fractions")
        names = _DEFAULT_NAMES[: len(fractions)]
    names = tuple(names)
    if len(names) != len(fractions):
        raise ValueError(f"names {names} and fractions {fractions} differ in length")
    if len(set(names)) != len(names):
        raise ValueError(f"split names must be distinct: {names}")
    if any(f < 0 or not np.isfinite(f) for f in fractions):
        raise ValueError(f"fractions must be finite and >= 0, got {fractions}")
    if abs(sum(fractions) - 1.0) > 1e-6:
        raise ValueError(f"fractions must sum to 1, got {fractions} (sum {sum(fractions):.6g})")
    if mode not in ("contiguous", "random"):
        raise ValueError(f"mode must be 'contiguous' or 'random', got {mode!r}")

    n_chunks = source.grid.n_chunks
    counts = _apportion(n_chunks, fractions)
    if mode == "contiguous":
        order = np.arange(n_chunks, dtype=np.int64)
    else:
        order = np.random.default_rng(np.random.SeedSequence([seed, 0x5E11])).permutation(n_chunks)
    bounds = np.concatenate(([0], np.cumsum(counts)))
    splits = tuple(
        (name, _as_ranges(order[bounds[i] : bounds[i + 1]])) for i, name in enumerate(names)
    )
    return SplitManifest(
        n_samples=source.n_samples,
        chunk_size=source.grid.chunk_size,
        splits=splits,
        variables=source.names,
        seed=seed,
        fractions=fractions,
        mode=mode,
        source_url=source.url,
        snapshot_id=source.snapshot_id,
    )


def _as_bound(value: object, coord: np.ndarray, end: bool) -> int:
    """Index where a period starts (or, for ``end``, the index just after it ends)."""
    n = coord.size
    if value is None:
        return n if end else 0
    if np.issubdtype(coord.dtype, np.datetime64):
        t = np.datetime64(value)
        if end:  # "2015" means through the end of 2015; "2015-06-30" through that day
            t = t + np.timedelta64(1, np.datetime_data(t.dtype)[0])
        return int(np.searchsorted(coord, t.astype(coord.dtype), side="left"))
    v = float(value)  # numeric coordinate: inclusive bounds
    return int(np.searchsorted(coord, v, side="right" if end else "left"))


def split_by_coordinate(
    source: Source,
    periods: Mapping[str, tuple[object, object]],
    *,
    gap: int | None = None,
    window: SampleWindow | None = None,
) -> SplitManifest:
    """Splits by ranges of the sample coordinate, e.g. years, snapped to chunk boundaries.

    ``{"train": ("1979", "2015"), "val": ("2016", "2017"), "test": ("2018", None)}``: ends
    are inclusive periods ("2015" is all of 2015), ``None`` is open. Between consecutive
    splits at least ``gap`` steps stay unused (default: what ``window`` spans beyond one step,
    so no target of one split is an input of another); whole chunks are given up for it at
    the start of the later split. Overlapping periods, or a ``gap`` too small for
    ``window``, are errors naming the overlap.
    """
    coord = source.sample_coord
    if coord is None:
        raise ValueError(
            f"{source.url} has no coordinate for its sample dimension "
            f"({source.sample_dim!r}); open it with sample_dim='time' (a 'time' array must "
            "exist), pass an xarray Dataset, or use split_by_chunk"
        )
    if not periods:
        raise ValueError("give at least one period, e.g. {'train': ('1979', '2015')}")
    need = 0 if window is None else window.span - 1
    if gap is None:
        gap = need
    cs, n = source.grid.chunk_size, source.n_samples

    def label(i: int) -> str:
        return str(coord[min(max(i, 0), n - 1)])

    bounds = {}
    for name, rng in periods.items():
        if not isinstance(rng, (tuple, list)) or len(rng) != 2:
            raise ValueError(f"period of split {name!r} must be (start, end), got {rng!r}")
        i0, i1 = _as_bound(rng[0], coord, False), _as_bound(rng[1], coord, True)
        if i1 <= i0:
            raise ValueError(f"split {name!r}: period {rng!r} selects no steps of "
                             f"{source.sample_dim!r} (which runs {label(0)} .. {label(n - 1)})")
        bounds[name] = (i0, i1)
    order = sorted(bounds, key=lambda k: bounds[k])
    for a, b in zip(order, order[1:], strict=False):
        (_, a1), (b0, b1) = bounds[a], bounds[b]
        if b0 < a1:
            raise ValueError(f"splits {a!r} and {b!r} overlap from {label(b0)} to "
                             f"{label(min(a1, b1) - 1)}; make their periods disjoint")
        if gap < need and b0 - a1 < need:
            raise ValueError(
                f"split {a!r} would leak into {b!r}: targets of {a!r} up to "
                f"{label(a1 - 1 + window.after)} are inputs of {b!r} from "
                f"{label(b0 - window.before)} (gap={gap} steps, but the window needs {need}); "
                "leave gap=None or raise it"
            )

    def snap(i: int) -> int:
        return min(source.grid.n_chunks, int(np.floor(i / cs + 0.5)))

    chunks = {k: [snap(i0), snap(i1) if i1 < n else source.grid.n_chunks]
              for k, (i0, i1) in bounds.items()}
    for a, b in zip(order, order[1:], strict=False):
        free = (chunks[b][0] - chunks[a][1]) * cs
        if free < gap:
            chunks[b][0] += -(-(gap - free) // cs)
    empty = [k for k in order if chunks[k][1] <= chunks[k][0]]
    if empty:
        raise ValueError(f"splits {empty} have no whole chunk left after snapping to chunks of "
                         f"{cs} steps and keeping a gap of {gap}; widen their periods")
    return SplitManifest(
        n_samples=n,
        chunk_size=cs,
        splits=tuple((k, ((chunks[k][0], chunks[k][1]),)) for k in periods),
        variables=source.names,
        mode="coordinate",
        source_url=source.url,
        snapshot_id=source.snapshot_id,
        gap=int(gap),
        periods=tuple((k, None if r[0] is None else str(r[0]), None if r[1] is None else str(r[1]))
                      for k, r in periods.items()),
    )
