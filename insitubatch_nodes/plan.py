"""Read plans: the deduplicated chunk reads of one window and the window's draw order.

Planning per window, not per batch, is what makes every chunk of a window be fetched once
and fully used while resident (the lesson of an earlier prototype).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .geometry import SampleGrid, VariableGeometry
from .permute import DRAW_STREAM


@dataclass(frozen=True, eq=False)
class ReadPlan:
    """One window: which chunks, in what order samples are drawn, and what to read.

    ``reads[v]`` holds the sample-axis chunk indices of variable ``v`` to fetch (each read
    covers every inner chunk of that stripe). ``draw_order`` lists the window's global
    sample indices in the order the shuffle buffer hands them out.
    """

    epoch: int
    window: int
    chunk_ids: tuple[int, ...]
    draw_order: np.ndarray
    reads: tuple[tuple[int, ...], ...]
    nbytes: int

    @property
    def n_samples(self) -> int:
        return int(self.draw_order.size)

    @property
    def n_reads(self) -> int:
        return sum(len(r) for r in self.reads)


def window_draw_order(samples: np.ndarray, seed: int, epoch: int, window: int,
                      rank: int = 0, world_size: int = 1) -> np.ndarray:
    """A uniform permutation of the window's samples, keyed on everything that defines it."""
    rng = np.random.default_rng(
        np.random.SeedSequence([DRAW_STREAM, seed, epoch, window, rank, world_size]))
    return samples[rng.permutation(samples.size)]


def stripe_reads(grid: SampleGrid, var: VariableGeometry, chunk_ids: np.ndarray) -> tuple[int, ...]:
    """Sample-axis chunks of ``var`` that overlap the given grid chunks, each listed once."""
    cs = var.sample_chunk
    starts = np.asarray(chunk_ids, dtype=np.int64) * grid.chunk_size
    stops = np.minimum(starts + grid.chunk_size, grid.n_samples)
    first = starts // cs
    last = (stops - 1) // cs
    if np.all(first == last):
        idx = first
    else:
        idx = np.concatenate([np.arange(a, b + 1) for a, b in zip(first, last, strict=True)])
    return tuple(int(i) for i in np.unique(idx))


def make_read_plan(grid: SampleGrid, variables: Sequence[VariableGeometry],
                   chunk_ids: Sequence[int], *, seed: int, epoch: int, window: int,
                   rank: int = 0, world_size: int = 1) -> ReadPlan:
    ids = np.asarray(chunk_ids, dtype=np.int64)
    samples = grid.samples_of(ids)
    reads = tuple(stripe_reads(grid, v, ids) for v in variables)
    nbytes = sum(len(r) * v.stripe_nbytes for r, v in zip(reads, variables, strict=True))
    return ReadPlan(
        epoch=epoch,
        window=window,
        chunk_ids=tuple(int(i) for i in ids),
        draw_order=window_draw_order(samples, seed, epoch, window, rank, world_size),
        reads=reads,
        nbytes=nbytes,
    )


def max_window_nbytes(grid: SampleGrid, variables: Sequence[VariableGeometry],
                      block_chunks: int) -> int:
    """Upper bound on the decoded bytes of one window of ``block_chunks`` chunks."""
    total = 0
    for v in variables:
        # A grid chunk spans ceil(chunk_size / cs) stripes, +1 when misaligned (LCM fallback).
        per_chunk = -(-grid.chunk_size // v.sample_chunk) + (grid.chunk_size % v.sample_chunk != 0)
        stripes = min(block_chunks * per_chunk, v.n_sample_chunks)
        total += stripes * v.stripe_nbytes
    return total
