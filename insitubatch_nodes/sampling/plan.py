"""Read plans: the deduplicated chunk reads of one window and the window's draw order.

Planning per window, not per batch, is what makes every chunk of a window be fetched once
and fully used while resident (the lesson of an earlier prototype). Plans are made from
scheduled windows by ``schedule.plan_window``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .geometry import SampleGrid, VariableGeometry


@dataclass(frozen=True, eq=False)
class BatchSlots:
    """Where a window's draws land in the epoch's batches (``schedule.batch_slots``):
    ``batch[j]``, ``row[j]`` for draw ``j`` (batch -1: a short last batch that is dropped),
    with the batch size, the epoch's total draws (the last batch may be short) and the
    epoch draw number of the window's first draw (a resume point is a batch edge when
    ``first + skip`` is a multiple of the batch size)."""

    batch: np.ndarray
    row: np.ndarray
    batch_size: int
    total: int
    first: int = 0

    def starts_batch(self, skip: int) -> bool:
        """Whether draw ``skip`` of the window is the first of its batch (or past the
        window's kept draws): where a resume may start batches planned from the epoch's
        start."""
        return (self.first + skip) % self.batch_size == 0 or skip >= kept_end(self.batch)

    def rows_in(self, b: int) -> int:
        """Rows of batch ``b``."""
        return min(self.batch_size, self.total - b * self.batch_size)


@dataclass(frozen=True, eq=False)
class ReadPlan:
    """One window: which chunks, in what order samples are drawn, and what to read.

    ``reads[v]`` holds the sample-axis chunk indices of variable ``v`` to fetch (each read
    covers every inner chunk of that stripe) and ``last_use[v]`` the position in
    ``draw_order`` of the last draw that reads each: once that draw is taken, the shuffle
    buffer lets the stripe go (no per-batch counting). ``draw_order``
    lists the window's global sample indices in the order the shuffle buffer hands them out;
    each sample reads the steps ``sample + offsets`` (``[0]`` unless samples are windows).
    """

    epoch: int
    window: int
    chunk_ids: tuple[int, ...]
    draw_order: np.ndarray
    reads: tuple[tuple[int, ...], ...]
    nbytes: int
    last_use: tuple[tuple[int, ...], ...] = ()
    offsets: np.ndarray = field(default_factory=lambda: np.zeros(1, dtype=np.int64))
    # (batch, row) of every draw, aligned with draw_order, when the window is decoded
    # straight into its batches (schedule.batch_slots); batch -1: a dropped short batch
    slots: BatchSlots | None = None

    def rows(self, samples: np.ndarray) -> np.ndarray:
        """Every row (step) the given samples read, flattened."""
        if self.offsets.size == 1 and self.offsets[0] == 0:
            return samples
        return (samples[:, None] + self.offsets[None, :]).ravel()

    @property
    def n_samples(self) -> int:
        return int(self.draw_order.size)

    @property
    def n_reads(self) -> int:
        return sum(len(r) for r in self.reads)


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


@dataclass(frozen=True, eq=False)
class KeptSlots:
    """The slots a decoded-in-place window fills, in draw order (time steps inner): each
    (sample, step) read by a draw neither dropped (``drop_last``) nor delivered before a
    restore, with its batch, row and step."""

    sample: np.ndarray
    batch: np.ndarray
    row: np.ndarray
    step: np.ndarray
    n_steps: int


def kept_slots(plan: ReadPlan, skip: int) -> KeptSlots:
    """``plan``'s slots (it has ``slots``) without its first ``skip`` draws (delivered
    before a restore) and the draws of a short last batch that ``drop_last`` drops (-1).

    Kept draws are one run, ``[skip, kept_end)``: batches number the epoch's draws in
    order, so a dropped (last) batch is the window's tail. Without time steps the slots
    are views of the plan's arrays (read only, as the plan is): a window's index math runs
    on the training thread, a few numpy calls."""
    slots = plan.slots
    assert slots is not None, "an in-place window has batch slots"
    end = kept_end(slots.batch)
    lo = min(skip, end)
    steps = np.asarray(plan.offsets, dtype=np.int64)
    n_steps = int(steps.size)
    draws = np.asarray(plan.draw_order, dtype=np.int64)[lo:end]
    batch, row = slots.batch[lo:end], slots.row[lo:end]
    if n_steps == 1:
        return KeptSlots(sample=draws + steps[0] if steps[0] else draws, batch=batch, row=row,
                         step=np.zeros(draws.size, dtype=np.int64), n_steps=1)
    return KeptSlots(sample=(draws[:, None] + steps[None, :]).ravel(),
                     batch=np.repeat(batch, n_steps), row=np.repeat(row, n_steps),
                     step=np.tile(np.arange(n_steps, dtype=np.int64), draws.size),
                     n_steps=n_steps)


def kept_end(batch: np.ndarray) -> int:
    """Where the draws of a dropped short last batch (-1: always a window's tail) begin in
    a window's ``BatchSlots.batch``; its size when none is dropped."""
    if not batch.size or batch[-1] >= 0:
        return int(batch.size)
    return int(np.count_nonzero(batch >= 0))
