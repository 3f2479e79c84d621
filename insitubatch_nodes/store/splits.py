"""Chunk-aligned splits, decided ahead of time and saved as a small JSON manifest.

A split is a set of chunk ids (stripes of ``chunk_size`` samples). Contiguous blocks keep
autocorrelated neighbours on one side, so nothing leaks between train and val.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import SupportsFloat, SupportsIndex

import numpy as np

from ..errors import ConfigTypeError, StoreError, UnknownNameError
from ..sampling.geometry import SampleGrid
from ..sampling.windows import SampleWindow, steps_keyword
from .manifest_fields import (
    check_members,
    checked_field,
    fractions_field,
    is_int,
    periods_field,
    snapshot_field,
)
from .source import Source

MANIFEST_VERSION = 1
_DEFAULT_NAMES = ("train", "val", "test")


@dataclass(frozen=True)
class SplitManifest:
    """Which chunks belong to which split, plus what they were computed from.

    ``splits`` maps a name to half-open ranges of chunk ids. ``variables`` and
    ``n_samples``/``chunk_size`` let a loader check it is given the store it was made for.
    Checked on construction (so on load too): every range non-empty and inside the array,
    each split's ranges ascending, no chunk in two splits; ``content_hash`` is what loader
    states record, so a state is never applied over another manifest.
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
    gap: int = 0  # steps kept free between consecutive splits (time steps)
    periods: tuple[tuple[str, str | None, str | None], ...] = ()  # coordinate ranges asked for
    # a composed source's stores, each described (URL, snapshot, samples, variables'
    # shapes and chunks): a manifest serves only the composition it was made for
    members: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_splits(self.n_samples, self.chunk_size, self.splits)

    @property
    def content_hash(self) -> str:
        """A hash of what decides which samples each split serves (the sample grid and
        every split's chunk ranges; not the metadata), recorded in every loader state."""
        body = json.dumps({"n_samples": self.n_samples, "chunk_size": self.chunk_size,
                           "splits": {n: [list(r) for r in rs] for n, rs in self.splits}},
                          sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(body.encode()).hexdigest()[:16]

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
        raise UnknownNameError(f"unknown split {name!r}; the manifest has splits "
                               f"{list(self.names)}")

    def chunk_ids(self, name: str) -> np.ndarray:
        """The split's chunk ids in canonical (ascending) order."""
        ranges = self.ranges(name)
        if not ranges:
            return np.empty(0, dtype=np.int64)
        return np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in ranges])

    def n_samples_in(self, name: str, steps: SampleWindow | None = None, *,
                     window: SampleWindow | None = None) -> int:
        """Samples of split ``name``; with time ``steps``, its anchors: the samples whose
        every step lies on the axis (what a loader with those steps serves, less the chunks
        it leaves out next to other splits and missing dates). ``window=``: deprecated."""
        steps = steps_keyword(steps, window, "SplitManifest.n_samples_in")
        grid = self.grid if steps is None else steps.grid(self.grid)
        return grid.n_samples_of(self.chunk_ids(name))

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
            "members": list(self.members),
            "splits": {name: [list(r) for r in ranges] for name, ranges in self.splits},
            "content_hash": self.content_hash,
        }

    @classmethod
    def from_dict(cls, d: dict) -> SplitManifest:
        """The manifest ``to_dict`` wrote, checked: a field missing or of the wrong type,
        an invalid split (see the class), or splits edited since the recorded
        ``content_hash`` are ``ValueError``s naming the field."""
        if not isinstance(d, dict):
            raise StoreError(f"a split manifest is a JSON object, got {type(d).__name__}")
        if d.get("version") != MANIFEST_VERSION:
            raise StoreError(
                f"split manifest version {d.get('version')!r} is not supported "
                f"(this library reads version {MANIFEST_VERSION})"
            )
        splits = checked_field(d, "splits", dict)
        parsed = []
        for name, ranges in splits.items():
            if not isinstance(ranges, list) or not all(
                    isinstance(r, list) and len(r) == 2 and all(is_int(x) for x in r)
                    for r in ranges):
                raise StoreError(f"split manifest field 'splits.{name}' must be a list of "
                                 f"[start, stop] chunk-id pairs, got {ranges!r}")
            parsed.append((str(name), tuple((a, b) for a, b in ranges)))
        m = cls(
            n_samples=checked_field(d, "n_samples", int),
            chunk_size=checked_field(d, "chunk_size", int),
            splits=tuple(parsed),
            variables=tuple(str(v) for v in checked_field(d, "variables", list, [])),
            seed=checked_field(d, "seed", int, 0),
            fractions=fractions_field(checked_field(d, "fractions", list, [])),
            mode=str(d.get("mode", "contiguous")),
            source_url=str(d.get("source_url", "")),
            snapshot_id=snapshot_field(d.get("snapshot_id")),
            gap=checked_field(d, "gap", int, 0),
            periods=periods_field(checked_field(d, "periods", list, [])),
            members=tuple(str(m) for m in checked_field(d, "members", list, [])),
        )
        recorded = d.get("content_hash")
        if recorded is not None and recorded != m.content_hash:
            raise StoreError(
                f"split manifest field 'content_hash' is {recorded!r}, but its splits hash to "
                f"{m.content_hash!r}: the splits were edited after the manifest was written. "
                "Loader states saved with the old splits will not load over it; if the edit "
                "is intended, delete the 'content_hash' field."
            )
        return m

    def to_json(self, path: str | os.PathLike[str]) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> SplitManifest:
        """Read and check a manifest written by ``to_json`` (see ``from_dict``)."""
        text = Path(path).read_text()
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise StoreError(f"split manifest {path} is not valid JSON: {e}") from None
        try:
            return cls.from_dict(d)
        except ValueError as e:
            raise StoreError(f"split manifest {path}: {e}") from None

    def check_source(self, source: Source, allow_snapshot_change: bool = False) -> None:
        """Refuse a store whose sample axis (or icechunk snapshot) is not the one this
        manifest was made for."""
        if (self.snapshot_id and source.snapshot_id and self.snapshot_id != source.snapshot_id
                and not allow_snapshot_change):
            raise StoreError(
                f"split manifest was made on icechunk snapshot {self.snapshot_id}, but "
                f"{source.url} now resolves to snapshot {source.snapshot_id} (the branch "
                "moved). Open the old snapshot with open_icechunk(..., snapshot_id=...), or "
                "pass allow_snapshot_change=True to use the new data."
            )
        check_members(self.members, source_members(source), "split manifest")
        if (source.n_samples, source.grid.chunk_size) != (self.n_samples, self.chunk_size):
            raise StoreError(
                f"split manifest was made for {self.n_samples} samples in chunks of "
                f"{self.chunk_size} ({self.source_url or 'unknown store'}), but {source.url} "
                f"serves {source.n_samples} samples in chunks of {source.grid.chunk_size}. "
                "Make a new manifest with split_by_chunk(source, ...)."
            )


def source_members(source: Source) -> tuple[str, ...]:
    """What a manifest records of a composed source's stores (nothing for one store)."""
    return tuple(m.describe() for m in source.members)


def check_splits(n_samples: int, chunk_size: int,
                 splits: Sequence[tuple[str, Sequence[tuple[int, int]]]]) -> None:
    """Refuse splits that would serve a sample twice or one that does not exist: a range
    empty, reversed or outside the array's chunks, a split's ranges out of order or
    overlapping, a chunk in two splits, a name used twice. Errors name splits and ranges."""
    if not is_int(n_samples) or n_samples < 0:
        raise StoreError(f"split manifest n_samples must be an integer >= 0, got {n_samples!r}")
    if not is_int(chunk_size) or chunk_size < 1:
        raise StoreError(f"split manifest chunk_size must be an integer >= 1, "
                         f"got {chunk_size!r}")
    n_chunks = -(-n_samples // chunk_size)
    names = [name for name, _ in splits]
    if len(set(names)) != len(names):
        raise StoreError(f"split manifest names a split twice: {names}")
    owner: list[tuple[int, int, str]] = []
    for name, ranges in splits:
        prev: tuple[int, int] | None = None
        for r in ranges:
            if len(r) != 2 or not all(is_int(x) for x in r):
                raise StoreError(f"split {name!r}: range {r!r} is not a pair of chunk ids")
            a, b = r
            if not 0 <= a < b:
                raise StoreError(f"split {name!r}: chunk range [{a}, {b}) is empty or negative "
                                 "(ranges are half-open [start, stop) with 0 <= start < stop)")
            if b > n_chunks:
                raise StoreError(
                    f"split {name!r}: chunk range [{a}, {b}) runs past the last chunk: "
                    f"{n_samples} samples in chunks of {chunk_size} are chunks [0, {n_chunks})")
            if prev is not None and a < prev[1]:
                what = "overlaps" if a >= prev[0] else "comes before"
                raise StoreError(
                    f"split {name!r}: chunk range [{a}, {b}) {what} the range before it "
                    f"[{prev[0]}, {prev[1]}): a split's ranges must be ascending and "
                    "disjoint (a chunk listed twice would be served twice)")
            prev = (a, b)
            owner.append((a, b, name))
    owner.sort()
    for (a0, b0, n0), (a1, b1, n1) in zip(owner, owner[1:], strict=False):
        if a1 < b0:
            lo, hi = a1, min(b0, b1)
            raise StoreError(
                f"splits {n0!r} and {n1!r} overlap: {n0!r} has chunks [{a0}, {b0}) and {n1!r} "
                f"has [{a1}, {b1}), so chunks [{lo}, {hi}) (samples "
                f"[{lo * chunk_size}, {min(hi * chunk_size, n_samples)})) would serve both. "
                "Make the splits disjoint (split_by_chunk / split_by_coordinate do)")


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
            raise StoreError(f"give names= for {len(fractions)} fractions")
        names = _DEFAULT_NAMES[: len(fractions)]
    names = tuple(names)
    if len(names) != len(fractions):
        raise StoreError(f"names {names} and fractions {fractions} differ in length")
    if len(set(names)) != len(names):
        raise StoreError(f"split names must be distinct: {names}")
    if not all(isinstance(n, str) and n for n in names):
        raise StoreError(f"split names must be non-empty strings, got {names}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise StoreError(f"seed must be an integer >= 0, got {seed!r}")
    seed = int(seed)  # the manifest is JSON
    if any(f < 0 or not np.isfinite(f) for f in fractions):
        raise StoreError(f"fractions must be finite and >= 0, got {fractions}")
    if abs(sum(fractions) - 1.0) > 1e-6:
        raise StoreError(f"fractions must sum to 1, got {fractions} (sum {sum(fractions):.6g})")
    if mode not in ("contiguous", "random"):
        raise StoreError(f"mode must be 'contiguous' or 'random', got {mode!r}")

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
        members=source_members(source),
    )


def _as_bound(value: object, coord: np.ndarray, end: bool) -> int:
    """Index where a period starts (or, for ``end``, the index just after it ends); a
    ``TypeError`` or ``ValueError`` where ``value`` is no date (or number) of ``coord``."""
    n = coord.size
    if value is None:
        return n if end else 0
    if np.issubdtype(coord.dtype, np.datetime64):
        if not isinstance(value, (str, bytes, datetime.date, np.datetime64)):
            raise ConfigTypeError(f"{value!r} is not a date (a string such as '2015-06-30', a "
                                  "datetime or a numpy datetime64)")
        t = np.datetime64(value)
        if end:  # "2015" means through the end of 2015; "2015-06-30" through that day
            unit = np.datetime_data(t.dtype)[0]
            t = t + np.timedelta64(1, unit)  # type: ignore[call-overload]  # numpy's stubs want the unit as a Literal; datetime_data gives a str
        return int(np.searchsorted(coord, t.astype(coord.dtype), side="left"))
    if not isinstance(value, (str, bytes, bytearray, SupportsFloat, SupportsIndex)):
        raise ConfigTypeError(f"{value!r} is not a number")
    v = float(value)  # numeric coordinate: inclusive bounds
    return int(np.searchsorted(coord, v, side="right" if end else "left"))


def _check_increasing(source: Source, coord: np.ndarray) -> None:
    """A numeric or datetime sample coordinate must increase: periods of one out of order
    select no range of steps."""
    if np.issubdtype(coord.dtype, np.number) or np.issubdtype(coord.dtype, np.datetime64):
        bad = np.flatnonzero(~(coord[1:] > coord[:-1]))  # not diff: unsigned ints wrap
        if bad.size:
            i = int(bad[0])
            raise StoreError(
                f"split_by_coordinate needs {source.sample_dim!r} increasing, but it goes "
                f"from {coord[i]} (step {i}) to {coord[i + 1]} (step {i + 1}); periods of a "
                "coordinate out of order select no range of steps: use split_by_chunk")


def _step_label(coord: np.ndarray, n: int, i: int) -> str:
    """Step ``i``'s coordinate as text (clamped to the ``n`` steps), for error messages."""
    return str(coord[min(max(i, 0), n - 1)])


def _period_bounds(source: Source, coord: np.ndarray,
                   periods: Mapping[str, tuple[object, object]],
                   label: Callable[[int], str]) -> dict[str, tuple[int, int]]:
    """Each split's period as the steps [i0, i1) it selects; a malformed or empty period is
    an error naming the split and the coordinate's range."""
    bounds = {}
    for name, rng in periods.items():
        if not isinstance(rng, (tuple, list)) or len(rng) != 2:
            raise StoreError(f"period of split {name!r} must be (start, end), got {rng!r}")
        try:
            i0, i1 = _as_bound(rng[0], coord, False), _as_bound(rng[1], coord, True)
        except (ValueError, TypeError) as e:
            kind = "a date" if np.issubdtype(coord.dtype, np.datetime64) else "a number"
            raise StoreError(f"split {name!r}: period {rng!r} has an end that is not {kind} "
                             f"of {source.sample_dim!r} (or None, open): {e}") from None
        if i1 <= i0:
            last = label(source.n_samples - 1)
            raise StoreError(f"split {name!r}: period {rng!r} selects no steps of "
                             f"{source.sample_dim!r} (which runs {label(0)} .. {last})")
        bounds[name] = (i0, i1)
    return bounds


def _check_disjoint(bounds: dict[str, tuple[int, int]], order: list[str], gap: int, need: int,
                    steps: SampleWindow | None, label: Callable[[int], str]) -> None:
    """Consecutive periods (in step order) neither overlap nor, with an explicit ``gap``
    below what ``steps`` span, leave targets of one split among inputs of the next."""
    for a, b in zip(order, order[1:], strict=False):
        (_, a1), (b0, b1) = bounds[a], bounds[b]
        if b0 < a1:
            raise StoreError(f"splits {a!r} and {b!r} overlap from {label(b0)} to "
                             f"{label(min(a1, b1) - 1)}; make their periods disjoint")
        if gap < need and b0 - a1 < need:
            assert steps is not None  # need > 0 only with time steps
            raise StoreError(
                f"split {a!r} would leak into {b!r}: targets of {a!r} up to "
                f"{label(a1 - 1 + steps.after)} are inputs of {b!r} from "
                f"{label(b0 - steps.before)} (gap={gap} steps, but the samples' steps need "
                f"{need}); "
                "leave gap=None or raise it")


def _snapped_chunks(grid: SampleGrid, bounds: dict[str, tuple[int, int]], order: list[str],
                    gap: int, need: int, label: Callable[[int], str]) -> dict[str, list[int]]:
    """Each split's periods snapped to whole chunks [c0, c1), whole chunks given up at the
    start of a later split to keep ``gap`` steps unused; an error where snapping closed the
    steps' ``need`` or left a split no chunk."""
    cs, n = grid.chunk_size, grid.n_samples

    def snap(i: int) -> int:
        return min(grid.n_chunks, int(np.floor(i / cs + 0.5)))

    chunks = {k: [snap(i0), snap(i1) if i1 < n else grid.n_chunks]
              for k, (i0, i1) in bounds.items()}
    for a, b in zip(order, order[1:], strict=False):
        free = (chunks[b][0] - chunks[a][1]) * cs
        if free < gap:
            chunks[b][0] += -(-(gap - free) // cs)
            free = (chunks[b][0] - chunks[a][1]) * cs
        if free < need:  # an explicit gap, and snapping closed what the periods left
            a1, b0 = chunks[a][1] * cs, chunks[b][0] * cs
            raise StoreError(
                f"split {a!r} would leak into {b!r}: snapped to chunks of {cs} steps, "
                f"{a!r} ends at {label(a1 - 1)} and {b!r} starts at {label(b0)}, {free} steps "
                f"apart, but the samples' steps need {need} (gap={gap}); leave gap=None or "
                "raise it")
    empty = [k for k in order if chunks[k][1] <= chunks[k][0]]
    if empty:
        raise StoreError(f"splits {empty} have no whole chunk left after snapping to chunks of "
                         f"{cs} steps and keeping a gap of {gap}; widen their periods")
    return chunks


def split_by_coordinate(
    source: Source,
    periods: Mapping[str, tuple[object, object]],
    *,
    gap: int | None = None,
    steps: SampleWindow | None = None,
    window: SampleWindow | None = None,
) -> SplitManifest:
    """Splits by ranges of the sample coordinate, e.g. years, snapped to chunk boundaries.

    ``{"train": ("1979", "2015"), "val": ("2016", "2017"), "test": ("2018", None)}``: ends
    are inclusive periods ("2015" is all of 2015), ``None`` is open. Between consecutive
    splits at least ``gap`` steps stay unused (default: what the samples' time ``steps``
    span beyond one, so no target of one split is an input of another); whole chunks are
    given up for it at the start of the later split. Overlapping periods, or a ``gap`` too
    small for ``steps``, are errors naming the overlap. ``window=``: the deprecated old name
    of ``steps=``.
    """
    steps = steps_keyword(steps, window, "split_by_coordinate")
    coord = source.sample_coord
    if coord is None:
        raise StoreError(
            f"{source.url} has no coordinate for its sample dimension "
            f"({source.sample_dim!r}); open it with sample_dim='time' (a 'time' array must "
            "exist), pass an xarray Dataset, or use split_by_chunk")
    if not periods:
        raise StoreError("give at least one period, e.g. {'train': ('1979', '2015')}")
    _check_increasing(source, coord)
    need = 0 if steps is None else steps.span - 1
    if gap is None:
        gap = need
    label = partial(_step_label, coord, source.n_samples)
    bounds = _period_bounds(source, coord, periods, label)
    order = sorted(bounds, key=lambda k: bounds[k])
    _check_disjoint(bounds, order, gap, need, steps, label)
    chunks = _snapped_chunks(source.grid, bounds, order, gap, need, label)
    return SplitManifest(
        n_samples=source.n_samples, chunk_size=source.grid.chunk_size,
        splits=tuple((k, ((chunks[k][0], chunks[k][1]),)) for k in periods),
        variables=source.names, mode="coordinate", source_url=source.url,
        members=source_members(source),
        snapshot_id=source.snapshot_id, gap=int(gap),
        periods=tuple((k, None if r[0] is None else str(r[0]), None if r[1] is None else str(r[1]))
                      for k, r in periods.items()),
    )
