"""Wanted indices of a stripe, and the byte ranges they are in a chunk (pure).

Along axis 1: the levels of a (time, level, y, x) chunk, the variables of an anemoi (date,
variable, ensemble, cell) chunk; along later axes (``PartSpec.box``): a part of the grid (a
reader group's latitude rows or cells, a region). In a C-order chunk of shape (n0, n1, *rest)
index j of axis 1 in sample s is one contiguous run of ``prod(rest)`` items, a box a few such
runs, so a selection is a few byte ranges per sample: what ``blocks`` maps to blosc blocks.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from ...errors import ConfigError
from ...memory.slots import SlotWhere, is_direct

Ranges = tuple[tuple[int, int], ...]  # half-open [start, stop), sorted, disjoint, non-empty


def merge(ranges: Iterable[tuple[int, int]]) -> Ranges:
    """``ranges`` sorted, with empty ones dropped and overlapping or touching ones joined."""
    out: list[list[int]] = []
    for lo, hi in sorted(r for r in ranges if r[1] > r[0]):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple((lo, hi) for lo, hi in out)


@dataclass(frozen=True)
class PartSpec:
    """Which index ranges along a stripe's axis 1 a read wants (levels, variables): every
    sample of the stripe gets the same ones. Bytes of ``out`` outside them are left as they
    are, or written with their stored values where they share a blosc block with wanted
    ones."""

    ranges: Ranges
    # Wanted ranges along later axes (``(axis, ranges)``, axes >= 2 ascending): a part of
    # the grid. An axis not named is wanted whole.
    box: tuple[tuple[int, Ranges], ...] = ()

    def __post_init__(self) -> None:
        for rs in (self.ranges, *(r for _, r in self.box)):
            if not rs or merge(rs) != tuple(rs):
                raise ConfigError(f"PartSpec ranges must be sorted, disjoint, non-touching "
                                  f"and non-empty (see PartSpec.of), got {rs!r}")
            if rs[0][0] < 0:
                raise ConfigError(f"PartSpec ranges must be >= 0, got {rs!r}")
        axes = [a for a, _ in self.box]
        if any(a < 2 for a in axes) or axes != sorted(set(axes)):
            raise ConfigError(f"PartSpec box axes must be >= 2 and ascending, got {axes}")

    def with_box(self, box: Sequence[tuple[int, Ranges]]) -> PartSpec:
        """This part, wanting only ``box`` along later axes too."""
        return PartSpec(self.ranges, tuple(sorted(box)))

    @classmethod
    def of(cls, indices: Iterable[int]) -> PartSpec:
        """The spec wanting these indices along axis 1 (any order, repeats allowed)."""
        return cls(merge((i, i + 1) for i in indices))

    @classmethod
    def of_levels(cls, levels: Iterable[slice] | None, size: int) -> PartSpec | None:
        """The spec for the level slices a batch takes of a sample whose axis 1 (the
        stripe's; the sample's first) has ``size`` indices; ``None`` where that is all of
        them or ``levels`` is ``None`` (the whole sample): nothing to gain."""
        if levels is None:
            return None
        spec = cls(merge((s.start, s.stop) for s in levels))
        return None if spec.ranges == ((0, size),) else spec

    @classmethod
    def for_slot(cls, where: SlotWhere, sample_shape: tuple[int, ...]) -> PartSpec | None:
        """What a read must decode of a sample whose slot is ``where`` (its placements in a
        batch): the levels they take, or ``None`` for a slot decoded straight (whole)."""
        if is_direct(where) or not sample_shape:
            return None
        levels = [pl.levels for _, _, pl in where]
        if any(lv is None for lv in levels):  # one part takes the whole sample
            return None
        return cls.of_levels([lv for lv in levels if lv is not None], sample_shape[0])

    @property
    def stop(self) -> int:
        """One past the largest wanted index."""
        return self.ranges[-1][1]

    def within(self, start: int, stop: int) -> Ranges:
        """The wanted indices in ``[start, stop)``, counted from ``start``."""
        return tuple((max(lo, start) - start, min(hi, stop) - start)
                     for lo, hi in self.ranges if lo < stop and hi > start)


@dataclass(frozen=True)
class ChunkPart:
    """What one stored chunk gives a partial read: the wanted indices along axis 1 in the
    chunk's own coordinates, the byte ranges of the decoded chunk that hold them, and
    whether that is the whole chunk (then it is read as without a part)."""

    axis1: Ranges
    byte_ranges: Ranges
    whole: bool
    box: tuple[tuple[int, Ranges], ...] = ()  # later axes wanted in part, chunk coordinates


def byte_ranges(shape: tuple[int, ...], itemsize: int, axis1: Ranges,
                box: Sequence[tuple[int, Ranges]] = ()) -> Ranges:
    """The byte ranges of a C-order array of ``shape`` holding indices ``axis1`` along axis
    1 and ``box`` along later axes, in every index along axis 0 (joined where they touch):
    runs along the innermost axis wanted in part, one per index of the axes before it."""
    if len(shape) < 2:
        raise ConfigError(f"an array of shape {shape} has no axis 1 to select along")
    wanted: list[Ranges] = [((0, shape[0]),), axis1,
                            *(((0, n),) for n in shape[2:])]
    for axis, rs in box:
        wanted[axis] = rs
    last = max([1, *(a for a, rs in box if rs != ((0, shape[a]),))])
    run = math.prod(shape[last + 1:]) * itemsize
    strides = [math.prod(shape[k + 1:]) * itemsize for k in range(len(shape))]
    outer = [[i for lo, hi in wanted[k] for i in range(lo, hi)] for k in range(last)]
    out = []
    for index in itertools.product(*outer):
        base = sum(i * strides[k] for k, i in enumerate(index))
        out += [(base + lo * run, base + hi * run) for lo, hi in wanted[last]]
    return merge(out)


def chunk_part(spec: PartSpec, chunks: tuple[int, ...], shape: tuple[int, ...],
               coords: tuple[int, ...], itemsize: int) -> ChunkPart | None:
    """What the inner chunk at ``coords`` (after the sample axis; chunk shape ``chunks`` of
    an array of ``shape``) gives a read of ``spec``: ``None`` when it holds no wanted index
    (not read)."""
    def within(axis: int, rs: Ranges) -> Ranges:
        start = coords[axis - 1] * chunks[axis]
        stop = min(start + chunks[axis], shape[axis])
        return PartSpec(rs).within(start, stop) if rs else ()

    axis1 = within(1, spec.ranges)
    box = tuple((a, within(a, rs)) for a, rs in spec.box)
    if not axis1 or any(not rs for _, rs in box):
        return None
    extent = [min(chunks[a], shape[a] - coords[a - 1] * chunks[a]) for a in range(len(shape))]
    box = tuple((a, rs) for a, rs in box if rs != ((0, extent[a]),))
    whole = axis1 == ((0, extent[1]),) and not box
    return ChunkPart(axis1, byte_ranges(chunks, itemsize, axis1, box), whole, box)


def stripe_parts(spec: PartSpec, name: str, shape: tuple[int, ...], chunks: tuple[int, ...],
                 itemsize: int, inner: list[tuple[int, ...]]) -> tuple[ChunkPart | None, ...]:
    """``chunk_part`` of each inner chunk of a stripe of variable ``name`` (``inner``: their
    coordinates after the sample axis), once ``spec`` is checked against its ``shape``."""
    if len(shape) < 2 or spec.stop > shape[1] or any(
            a >= len(shape) or rs[-1][1] > shape[a] for a, rs in spec.box):
        raise ConfigError(f"variable {name!r} of shape {shape} has no indices "
                          f"{spec.ranges!r} along axis 1 (and {spec.box!r} beyond) to read "
                          "in part")
    return tuple(chunk_part(spec, chunks, shape, c, itemsize) for c in inner)


def copy_wanted(out: np.ndarray, dst: tuple[slice, ...], chunk: np.ndarray,
                src: tuple[slice, ...], axis1: Ranges,
                box: Sequence[tuple[int, Ranges]] = ()) -> None:
    """``out[dst] = chunk[src]`` for the indices ``axis1`` along axis 1 and ``box`` along
    later axes (counted in the chunk) only: a chunk decoded in part holds nothing else for
    sure."""
    wanted: list[Ranges | None] = [None, axis1, *([None] * (len(dst) - 2))]
    for axis, rs in box:
        wanted[axis] = rs
    per_axis = [[(d, s_)] if rs is None else
                [(slice((d.start or 0) + lo, (d.start or 0) + hi), slice(lo, hi))
                 for lo, hi in rs]
                for d, s_, rs in zip(dst, src, wanted, strict=True)]
    for pick in itertools.product(*per_axis):
        out[tuple(d for d, _ in pick)] = chunk[tuple(s_ for _, s_ in pick)]
