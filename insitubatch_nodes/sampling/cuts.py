"""A window's reads cut into jobs: the one cut behind the decode threads' pool tasks
(``fetch.jobs``) and the decode workers' jobs (``workers.jobs``).

A window's reads come in the order they should run (the first batch's first), each with
the decoded bytes it writes. ``cut_jobs`` says where jobs start: a job per run of reads
(a batch, for one sample per chunk: every thread or worker on its own batch, which goes
out as soon as its job is done; the whole window, for several samples per chunk, where a
stripe feeds many batches), the first run split evenly into at least ``first`` jobs (the
batch a training loop waits for at an epoch's start or after a restore is complete as early
as it can be), and more wherever a job would hold over ``JobLimits``. Once a window, on
the training thread: a few numpy calls and a step per run, none per read.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import numpy as np


@dataclass(frozen=True, slots=True)
class JobLimits:
    """What one job holds at most: decoded bytes (unless one read alone writes more) and
    reads."""

    nbytes: int
    reads: int


# Two pairs, one per executor, because a job costs each a different thing. A worker's job
# costs the training process tens of microseconds (the engine thread sends it, takes its
# answer, counts its writes): a WB2 sample of 9.6 MB cost 61-81 us a sample on the engine
# thread in 16 MB jobs, 30-37 us in 64 MB ones (docs/benchmarks.md, "Decode worker
# processes"), so the workers' grew. A pool task costs a future and a GIL hand-off, a few
# microseconds, none of which the bigger jobs saved: the threads keep the 16 MB / 64 they
# were built and measured with (a job per batch rather than per thread and batch: ~3-5 % of
# one-step epochs in hand-offs, paired, 2-vCPU VM).
THREAD_LIMITS = JobLimits(16 << 20, 64)
WORKER_LIMITS = JobLimits(64 << 20, 256)


def cut_jobs(nbytes: np.ndarray, first: int, limits: JobLimits,
             runs: np.ndarray | None = None) -> list[int]:
    """Where a window's reads are cut into jobs: the index of each job's first read, then
    the number of reads. ``nbytes``: the bytes each read writes, in the order they run
    (one dimension); ``runs``: per read, its run (equal values together; ``None``: the
    window is one run).

    No job spans two runs. Each run is split evenly (by reads) into as few jobs as hold at
    most ``limits.reads`` reads and, on average, ``limits.nbytes`` bytes, the first run into
    at least ``first`` (never more jobs than reads); a job still over ``limits.nbytes``
    (reads of unequal sizes) is then cut where its bytes would pass it, so no job holds more
    unless one read alone does."""
    n = int(nbytes.size)
    if not n:
        return [0]
    if runs is None:
        bounds = [0, n]
    else:
        bounds = [0, *(np.flatnonzero(runs[1:] != runs[:-1]) + 1).tolist(), n]
    reads, most = limits.reads, limits.nbytes
    top = int(nbytes.max())  # the largest read's bytes: a run of m reads holds <= m * top
    sums: list[int] = []  # each run's bytes, counted once some run may pass ``most``
    cuts = [0]
    for i in range(len(bounds) - 1):
        a, z = bounds[i], bounds[i + 1]
        m = z - a
        parts = max(first if i == 0 else 1, -(-m // reads))
        if m * top > most:
            sums = sums or np.add.reduceat(nbytes, bounds[:-1]).tolist()
            parts = max(parts, -(-sums[i] // most))
        if parts > 1:
            parts = min(parts, m)
            if -(-m // parts) * top <= most:  # no job of the even split can pass it
                cuts += [a + k * m // parts for k in range(1, parts)]
            else:
                cuts += _within_bytes(nbytes[a:z], [k * m // parts for k in range(parts)],
                                      most, a)
        cuts.append(z)
    return cuts


def _within_bytes(nbytes: np.ndarray, starts: list[int], limit: int, at: int) -> list[int]:
    """The inner cuts (``at`` added) of reads ``nbytes`` cut at ``starts`` (0 first), each
    job over ``limit`` bytes cut where its bytes would pass it: one job of the reads that
    fit, then the next."""
    if not (np.add.reduceat(nbytes, starts) > limit).any():
        return [at + k for k in starts[1:]]
    cum = np.zeros(nbytes.size + 1, dtype=np.int64)
    np.cumsum(nbytes, out=cum[1:])
    out: list[int] = []
    for a, z in pairwise([*starts, int(nbytes.size)]):
        if a:
            out.append(at + a)
        while z - a > 1 and cum[z] - cum[a] > limit:
            # the last read that still fits (one at least), from ``a``
            a = max(a + 1, int(np.searchsorted(cum, cum[a] + limit, side="right")) - 1)
            out.append(at + a)
    return out
