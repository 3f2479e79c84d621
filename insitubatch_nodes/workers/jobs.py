"""A window cut into read jobs for decode workers: which chunk, and the batch slots it fills.

Pure index math on the training process, a few numpy calls per window and none per stripe:
a job is one integer array, a row per slot a stripe fills (``VAR``, ``STRIPE``, ``OFFSET`` in
the stripe, ``BATCH``, ``ROW``, ``STEP``), a stripe's rows together, so what crosses to a
worker is one buffer and the training process's cost does not grow with the number of
variables. The batches are only expected here (``BatchArena.expect``); their memory is taken
when a job that writes them goes out to a worker (``engine``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..memory.arena import BatchArena
from ..sampling.cuts import WORKER_LIMITS, cut_jobs
from ..sampling.plan import KeptSlots, ReadPlan, kept_slots

# the columns of a job's ``targets``: one row per slot a stripe fills
VAR, STRIPE, OFFSET, BATCH, ROW, STEP = range(6)
# (row of the stripe, batch, row of the batch, time step): one slot a stripe fills
Target = tuple[int, int, int, int]


@dataclass(eq=False, slots=True)
class ReadJob:
    """One worker's task: the slots its stripes fill (``targets``, a stripe's rows together,
    the first where it decodes), the row writes they make per batch (what the arena is told
    once the job is done) and its stripes as (count, decoded bytes of one) pairs (the
    fetch's counters: one pair per stripe size, not one per variable). Never changed once
    made; not frozen, whose ``__init__`` costs a call per field (a window makes ~16)."""

    targets: np.ndarray  # (slots, 6) int64, columns VAR .. STEP
    writes: dict[int, int]
    reads: tuple[tuple[int, int], ...]
    urgent: bool = False  # of its window's first batch: answered at once (``wire``)

    def stripes(self) -> list[tuple[int, int]]:
        """The (variable, stripe) pairs it reads, sorted: what an error names."""
        t = self.targets
        at = read_starts(t)
        return sorted(zip(t[at, VAR].tolist(), t[at, STRIPE].tolist(), strict=True))


@dataclass(frozen=True, eq=False)
class WorkerWindow:
    """A window prepared for the workers: its jobs in the order they should run (the first
    batch's first, split across the workers), the batches it feeds, the arena's generation
    when prepared (a job of an older one is dropped, never written) and the bytes its
    largest job writes (a worker's credit: ``wire.credit``)."""

    plan: ReadPlan
    jobs: list[ReadJob]
    batches: list[int]
    generation: int
    job_nbytes: int = 0


def read_starts(targets: np.ndarray) -> np.ndarray:
    """The rows of ``targets`` where each stripe's rows begin."""
    if not len(targets):
        return np.zeros(0, dtype=np.int64)
    change = (np.diff(targets[:, VAR]) != 0) | (np.diff(targets[:, STRIPE]) != 0)
    return np.concatenate(([0], np.flatnonzero(change) + 1))


def _expect(plan: ReadPlan, arena: BatchArena, skip: int) -> tuple[KeptSlots, list[int]]:
    """The window's kept slots (without a restore's first ``skip`` draws), and the batches
    they feed (expected in the arena here). Kept draws are in draw order, so their batches
    are one ascending run (each batch between the first and the last has a draw here): a
    range, not a set of them."""
    slots = plan.slots
    assert slots is not None, "an in-place window has batch slots"
    kept = kept_slots(plan, skip)
    b = kept.batch
    if not b.size:
        return kept, []
    first, last = int(b[0]), int(b[-1])
    size, total = slots.batch_size, slots.total
    arena.expect_many(first, [min(size, total - k * size) for k in range(first, last + 1)])
    return kept, list(range(first, last + 1))


def _distinct(plan: ReadPlan, kept: KeptSlots) -> bool:
    """Whether no kept sample repeats (only padding for equal steps repeats one). Called
    with one sample per chunk and no time steps, where the plan's first read list holds
    the window's distinct samples: as many as its draws, none repeats (no set needed)."""
    if plan.reads and len(plan.reads[0]) == plan.n_samples:
        return True
    return len(set(kept.sample.tolist())) == kept.sample.size


def _targets(kept: KeptSlots, sample_chunks: Sequence[int]) -> np.ndarray:
    """Every (stripe, slot) pair of the window, sorted by variable, stripe and slot."""
    n_vars, n = len(sample_chunks), kept.sample.size
    per = np.repeat(np.asarray(sample_chunks, dtype=np.int64), n)
    samples = np.tile(kept.sample, n_vars)
    t = np.empty((n * n_vars, 6), dtype=np.int64)
    t[:, VAR] = np.repeat(np.arange(n_vars, dtype=np.int64), n)
    t[:, STRIPE] = samples // per
    t[:, OFFSET] = samples - t[:, STRIPE] * per
    for col, a in ((BATCH, kept.batch), (ROW, kept.row), (STEP, kept.step)):
        t[:, col] = np.tile(a, n_vars)
    order = np.lexsort((t[:, STEP], t[:, ROW], t[:, BATCH], t[:, STRIPE], t[:, VAR]))
    return t[order]


def _in_slot_order(t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``t`` (sorted by variable, stripe and slot) with its stripes in the order of the first
    slot each fills (a sample's variables together), and where each stripe starts."""
    starts = read_starts(t)
    counts = np.diff(np.append(starts, len(t)))
    ro = np.lexsort((t[starts, VAR], t[starts, ROW], t[starts, BATCH]))
    lengths = counts[ro]
    new_starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    return t[np.repeat(starts[ro] - new_starts, lengths) + np.arange(len(t))], new_starts


def _one_slot_each(kept: KeptSlots, n_vars: int, batch_size: int) -> np.ndarray:
    """What ``_in_slot_order`` makes where every stripe fills one slot (one sample per
    chunk, no time steps: the common case), made directly: slots in (batch, row) order, a
    slot's variables together (a few numpy calls: each costs microseconds)."""
    order = (kept.batch * batch_size + kept.row).argsort(kind="stable")
    n = order.size
    t = np.zeros((n, n_vars, 6), dtype=np.int64)
    # column by column (a stack of the three, then one fancy copy, cost more calls)
    for col, a in ((STRIPE, kept.sample), (BATCH, kept.batch), (ROW, kept.row)):
        t[:, :, col] = a[order][:, None]
    if n_vars > 1:
        t[:, :, VAR] = np.arange(n_vars, dtype=np.int64)
    return t.reshape(n * n_vars, 6)


def prepare_window(plan: ReadPlan, arena: BatchArena, workers: int,
                   sample_chunks: Sequence[int], row_bytes: Sequence[int],
                   stripe_nbytes: Sequence[int], skip: int = 0,
                   head: bool = True) -> WorkerWindow:
    """Where every stripe of an in-place window goes, cut into jobs. Each (sample, step) a
    kept draw reads is a slot (batch, row, step), as ``schedule.batch_slots`` placed it;
    every variable's stripe holding that sample fills its part of the slot. A stripe is read
    once per window whatever the number of slots it feeds (neighbours' history, several
    samples per chunk): one worker decodes it and writes every slot, so nothing is copied
    between processes afterwards. Stripes go in the order of the first slot each fills (a
    sample's variables together), so the window's first batches complete first.

    ``sample_chunks[v]``: samples per stripe of variable ``v``; ``row_bytes[v]``: the bytes
    it writes into one slot; ``stripe_nbytes[v]``: the decoded bytes of one of its stripes;
    ``skip``: the draws of a restore's head window delivered before, not read; ``head``:
    the window holds the first batch of a start (an epoch, a restore): that batch is split
    across the ``workers`` and answered at once (``urgent``), so it lands first. Any other
    window's first batch is a job like the rest, answered with its group (``wire``): one
    wake-up of the training process less per window, and a job less."""
    kept, batches = _expect(plan, arena, skip)
    urgent = workers if head else 0
    if not kept.sample.size:  # every draw dropped (drop_last) or delivered before a restore
        return WorkerWindow(plan, [], batches, arena.generation)
    n_vars = len(sample_chunks)
    if (kept.n_steps == 1 and all(c == 1 for c in sample_chunks)
            and _distinct(plan, kept)):  # (not padded twice)
        # a stripe per slot and variable: the common case, cut with the fewest numpy calls
        assert plan.slots is not None
        t = _one_slot_each(kept, n_vars, plan.slots.batch_size)
        # a job per batch, the first split across the workers (``sampling.cuts``)
        nbytes = (np.full(len(t), row_bytes[0], dtype=np.int64) if n_vars == 1 else
                  np.tile(np.asarray(row_bytes, dtype=np.int64), len(t) // n_vars))
        cuts = cut_jobs(nbytes, max(1, urgent), WORKER_LIMITS, t[:, BATCH])
        return WorkerWindow(plan, _one_each_jobs(t, cuts, stripe_nbytes, urgent), batches,
                            arena.generation, _largest(nbytes, cuts))
    t, starts = _in_slot_order(_targets(kept, sample_chunks))
    var = t[starts, VAR]
    nbytes = np.asarray(row_bytes, dtype=np.int64)[var] * np.diff(np.append(starts, len(t)))
    if all(n == 1 for n in sample_chunks):  # a job per batch, a start's first split
        cuts = cut_jobs(nbytes, max(1, urgent), WORKER_LIMITS, t[starts, BATCH])
    else:  # a stripe feeds many batches: the window one run, about two jobs a worker
        cuts = cut_jobs(nbytes, 2 * workers, WORKER_LIMITS)
    jobs = _jobs(t, starts, np.asarray(cuts), var, stripe_nbytes, urgent)
    return WorkerWindow(plan, jobs, batches, arena.generation, _largest(nbytes, cuts))


def _largest(nbytes: np.ndarray, cuts: Sequence[int]) -> int:
    """The bytes the largest job writes (``nbytes``: per row of the cut, ``cuts``: where
    each job starts, then the end)."""
    return int(np.add.reduceat(nbytes, np.asarray(cuts[:-1])).max()) if len(cuts) > 1 else 0


def _one_each_jobs(t: np.ndarray, cuts: list[int], stripe_nbytes: Sequence[int],
                   urgent: int) -> list[ReadJob]:
    """``_jobs`` where a row of ``t`` is a stripe and a job's rows are of one batch."""
    firsts = t[cuts[:-1], BATCH].tolist()
    n_jobs = len(cuts) - 1
    if len(set(stripe_nbytes)) == 1:  # one stripe size (one variable): a job's rows
        size = stripe_nbytes[0]
        return [ReadJob(t[cuts[j]:cuts[j + 1]], {firsts[j]: cuts[j + 1] - cuts[j]},
                        ((cuts[j + 1] - cuts[j], size),), j < urgent) for j in range(n_jobs)]
    # rows are (slot, variable) in order: row i reads variable i % n_vars, so the stripes
    # of each size in rows [a, z) are counted from one cycle's running counts
    n_vars = len(stripe_nbytes)
    running = {size: [0] * (n_vars + 1) for size in stripe_nbytes}
    for size, counts in running.items():
        for v in range(n_vars):
            counts[v + 1] = counts[v] + (stripe_nbytes[v] == size)

    def upto(i: int, counts: list[int]) -> int:  # rows before row i of that size
        return i // n_vars * counts[n_vars] + counts[i % n_vars]

    reads = [tuple((n, size) for size, counts in running.items()
                   if (n := upto(cuts[j + 1], counts) - upto(cuts[j], counts)))
             for j in range(n_jobs)]
    return [ReadJob(t[cuts[j]:cuts[j + 1]], {firsts[j]: cuts[j + 1] - cuts[j]}, reads[j],
                    j < urgent) for j in range(n_jobs)]


def _jobs(t: np.ndarray, starts: np.ndarray, cuts: np.ndarray, var: np.ndarray,
          stripe_nbytes: Sequence[int], urgent: int) -> list[ReadJob]:
    """The jobs of stripes ``cuts[i]:cuts[i + 1]`` (``starts``: each stripe's first row of
    ``t``; ``var``: each stripe's variable), with their row writes per batch and stripes per
    size counted for the whole window at once (a few numpy calls, not a few per job); the
    first ``urgent`` jobs (the window's first batch) are answered at once."""
    n_jobs = len(cuts) - 1
    bounds = np.append(starts, len(t))[cuts]
    lo = bounds.tolist()
    writes = _counted(np.repeat(np.arange(n_jobs), np.diff(bounds)), t[:, BATCH], n_jobs)
    sizes = np.asarray(stripe_nbytes, dtype=np.int64)
    reads: list[tuple[tuple[int, int], ...]]
    if (sizes == sizes[0]).all():  # one stripe size: the stripes a job reads
        n = np.diff(cuts).tolist()
        reads = [((n[j], int(sizes[0])),) for j in range(n_jobs)]
    else:
        per = _counted(np.repeat(np.arange(n_jobs), np.diff(cuts)), sizes[var], n_jobs)
        # sizes in the variables' order, as ``_one_each_jobs`` gives them: either path
        # makes the same jobs
        in_order = list(dict.fromkeys(int(x) for x in stripe_nbytes))
        reads = [tuple((p[size], size) for size in in_order if size in p) for p in per]
    return [ReadJob(t[lo[j]:lo[j + 1]], writes[j], reads[j], j < urgent)
            for j in range(n_jobs)]


def _counted(job: np.ndarray, key: np.ndarray, n_jobs: int) -> list[dict[int, int]]:
    """Per job, how many times each value of ``key`` occurs in its rows (``job[i]``: the job
    of row ``i``): one ``np.unique`` for the window."""
    span = int(key.max()) + 1
    keys, counts = np.unique(job * span + key, return_counts=True)
    out: list[dict[int, int]] = [{} for _ in range(n_jobs)]
    for k, c in zip(keys.tolist(), counts.tolist(), strict=True):
        out[k // span][k % span] = c
    return out
