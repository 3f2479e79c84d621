"""A window cut into read jobs for decode workers: which chunk, and the batch slots it fills.

Pure index math on the training process, a few numpy calls per window: each job names
stripes and their destination slots (batch, row, time step, and the row of the stripe the
slot takes), never arrays, so what crosses to a worker is a small list of integers. The
batches are only expected here (``BatchArena.expect``); their memory is taken when a job
that writes them goes out to a worker (``engine``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..memory.arena import BatchArena
from ..sampling.plan import ReadPlan, kept_slots

# (row of the stripe, batch, row of the batch, time step): one slot a stripe fills
Target = tuple[int, int, int, int]
# (variable, stripe, its targets): one stripe read once and written into every target
Read = tuple[int, int, tuple[Target, ...]]

JOB_BYTES = 16 << 20  # decoded bytes a job writes, at most (about)
JOB_READS = 64  # stripes a job reads, at most


@dataclass(frozen=True, eq=False, slots=True)
class ReadJob:
    """One worker's task: its stripe reads, and the row writes they make per batch (what
    the arena is told once the job is done)."""

    reads: list[Read]
    writes: dict[int, int]
    per_variable: dict[int, int]  # stripes read of each variable (the fetch's counters)


@dataclass(frozen=True, eq=False)
class WorkerWindow:
    """A window prepared for the workers: its jobs in the order they should run (the first
    batch's first, split across the workers), the batches it feeds, and the arena's
    generation when prepared (a job of an older one is dropped, never written)."""

    plan: ReadPlan
    jobs: list[ReadJob]
    batches: list[int]
    generation: int


def prepare_window(plan: ReadPlan, arena: BatchArena, workers: int,
                   sample_chunks: Sequence[int], row_bytes: Sequence[int]) -> WorkerWindow:
    """Where every stripe of an in-place window goes, cut into jobs. Each (sample, step) a
    kept draw reads is a slot (batch, row, step), as ``schedule.batch_slots`` placed it;
    every variable's stripe holding that sample fills its part of the slot. A stripe is read
    once per window whatever the number of slots it feeds (neighbours' history, several
    samples per chunk): one worker decodes it and writes every slot, so nothing is copied
    between processes afterwards.

    ``sample_chunks[v]``: samples per stripe of variable ``v``; ``row_bytes[v]``: the bytes
    it writes into one slot."""
    slots = plan.slots
    assert slots is not None, "an in-place window has batch slots"
    kept = kept_slots(plan, arena.take_skip())
    sample, batch, row, step = kept.sample, kept.batch, kept.row, kept.step
    batches = sorted(set(batch.tolist()))
    for b in batches:
        arena.expect(b, slots.rows_in(b))
    if not sample.size:  # every draw dropped (drop_last) or delivered before a restore
        return WorkerWindow(plan, [], batches, arena.generation)
    n_vars = len(sample_chunks)
    per = np.repeat(np.asarray(sample_chunks, dtype=np.int64), sample.size)
    var = np.repeat(np.arange(n_vars, dtype=np.int64), sample.size)
    samples = np.tile(sample, n_vars)
    stripe = samples // per
    cols = [np.tile(a, n_vars) for a in (batch, row, step)]
    # by variable and stripe (one read each), its slots by batch and row
    order = np.lexsort((cols[2], cols[1], cols[0], stripe, var))
    var, stripe = var[order], stripe[order]
    offset = (samples[order] - stripe * per[order]).tolist()
    b_, r_, k_ = (c[order].tolist() for c in cols)
    targets = list(zip(offset, b_, r_, k_, strict=True))
    new = np.flatnonzero((np.diff(var) != 0) | (np.diff(stripe) != 0)) + 1
    starts = [0, *new.tolist()]
    stops = [*starts[1:], len(targets)]
    vs, sts = var[starts].tolist(), stripe[starts].tolist()
    reads = [(v, s, tuple(targets[a:z]))
             for v, s, a, z in zip(vs, sts, starts, stops, strict=True)]
    # in the order of the first slot each fills; a sample's variables together
    reads.sort(key=lambda rd: (rd[2][0][1], rd[2][0][2], rd[0]))
    if all(n == 1 for n in sample_chunks):
        cut = _cut_by_batch(reads, workers, row_bytes)
    else:
        cut = _cut_even(reads, workers, row_bytes)
    jobs = [_job(group) for group in cut if group]
    return WorkerWindow(plan, jobs, batches, arena.generation)


def _job(reads: list[Read]) -> ReadJob:
    writes: dict[int, int] = {}
    per_variable: dict[int, int] = {}
    for v, _, targets in reads:
        per_variable[v] = per_variable.get(v, 0) + 1
        for t in targets:
            writes[t[1]] = writes.get(t[1], 0) + 1
    return ReadJob(reads, writes, per_variable)


def _cut_by_batch(reads: list[Read], workers: int,
                  row_bytes: Sequence[int]) -> list[list[Read]]:
    """One sample per chunk: a job per batch (every worker on its own batch: a batch goes
    out as soon as its job is done), the window's first batch split across the workers so
    it is complete as early as it can be; at most ``JOB_READS`` / ``JOB_BYTES`` a job."""
    jobs: list[list[Read]] = []
    first = [rd[2][0][1] for rd in reads]
    bounds = [0] + [k for k in range(1, len(reads)) if first[k] != first[k - 1]]
    for n, (a, z) in enumerate(zip(bounds, [*bounds[1:], len(reads)], strict=True)):
        nbytes = sum(row_bytes[rd[0]] * len(rd[2]) for rd in reads[a:z])
        parts = max(workers if n == 0 else 1, -(-nbytes // JOB_BYTES), -(-(z - a) // JOB_READS))
        size = -(-(z - a) // min(z - a, parts))
        jobs += [reads[k : min(k + size, z)] for k in range(a, z, size)]
    return jobs


def _cut_even(reads: list[Read], workers: int, row_bytes: Sequence[int]) -> list[list[Read]]:
    """Several samples per chunk: a stripe feeds many batches, so jobs are cut evenly in
    the order of the first batch each stripe feeds, about two per worker (more for big
    windows: ``JOB_BYTES`` / ``JOB_READS``)."""
    nbytes = sum(row_bytes[rd[0]] * len(rd[2]) for rd in reads)
    parts = min(len(reads), max(2 * workers, -(-nbytes // JOB_BYTES),
                                -(-len(reads) // JOB_READS)))
    return [reads[k * len(reads) // parts : (k + 1) * len(reads) // parts]
            for k in range(parts)]
