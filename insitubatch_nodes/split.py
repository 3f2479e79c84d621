"""Chunk-aligned splits, decided ahead of time and saved as a small JSON manifest.

A split is a set of chunk ids (stripes of ``chunk_size`` samples). Contiguous blocks keep
autocorrelated neighbours on one side, so nothing leaks between train and val.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .geometry import SampleGrid
from .source import Source

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
