"""Wanted indices along axis 1 of a stripe, and the byte ranges they are in a chunk (pure).

Axis 1 is the levels of a (time, level, y, x) chunk, the variables of an anemoi (date,
variable, ensemble, cell) chunk. In a C-order chunk of shape (n0, n1, *rest) index j of axis 1
in sample s is one contiguous run of ``prod(rest)`` items, so a selection is a few byte
ranges per sample: what ``blocks`` maps to blosc blocks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
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

    def __post_init__(self) -> None:
        if not self.ranges or merge(self.ranges) != tuple(self.ranges):
            raise ConfigError(f"PartSpec ranges must be sorted, disjoint, non-touching and "
                              f"non-empty (see PartSpec.of), got {self.ranges!r}")
        if self.ranges[0][0] < 0:
            raise ConfigError(f"PartSpec ranges must be >= 0, got {self.ranges!r}")

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


def byte_ranges(shape: tuple[int, ...], itemsize: int, axis1: Ranges) -> Ranges:
    """The byte ranges of a C-order array of ``shape`` holding indices ``axis1`` along axis
    1, in every index along axis 0 (joined where they touch)."""
    if len(shape) < 2:
        raise ConfigError(f"an array of shape {shape} has no axis 1 to select along")
    inner = math.prod(shape[2:]) * itemsize
    row = shape[1] * inner
    return merge((s * row + lo * inner, s * row + hi * inner)
                 for s in range(shape[0]) for lo, hi in axis1)


def chunk_part(spec: PartSpec, chunks: tuple[int, ...], size1: int, c1: int,
               itemsize: int) -> ChunkPart | None:
    """What chunk ``c1`` along axis 1 (of chunk shape ``chunks``, the array ``size1`` long
    there) gives a read of ``spec``: ``None`` when it holds no wanted index (not read)."""
    start = c1 * chunks[1]
    stop = min(start + chunks[1], size1)
    axis1 = spec.within(start, stop)
    if not axis1:
        return None
    whole = axis1 == ((0, stop - start),)
    return ChunkPart(axis1, byte_ranges(chunks, itemsize, axis1), whole)


def stripe_parts(spec: PartSpec, name: str, shape: tuple[int, ...], chunks: tuple[int, ...],
                 itemsize: int, inner: list[tuple[int, ...]]) -> tuple[ChunkPart | None, ...]:
    """``chunk_part`` of each inner chunk of a stripe of variable ``name`` (``inner``: their
    coordinates after the sample axis), once ``spec`` is checked against its ``shape``."""
    if len(shape) < 2 or spec.stop > shape[1]:
        raise ConfigError(f"variable {name!r} of shape {shape} has no indices "
                          f"{spec.ranges!r} along axis 1 to read in part")
    return tuple(chunk_part(spec, chunks, shape[1], c[0], itemsize) for c in inner)


def copy_wanted(out: np.ndarray, dst: tuple[slice, ...], chunk: np.ndarray,
                src: tuple[slice, ...], axis1: Ranges) -> None:
    """``out[dst] = chunk[src]`` for the indices ``axis1`` (counted in the chunk) along
    axis 1 only: a chunk decoded in part holds nothing else for sure."""
    at = dst[1].start or 0
    for lo, hi in axis1:
        out[(dst[0], slice(at + lo, at + hi), *dst[2:])] = \
            chunk[(src[0], slice(lo, hi), *src[2:])]
