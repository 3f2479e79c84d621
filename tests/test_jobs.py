"""A window cut into jobs, checked against what the cut is defined to be, not against a copy
of the code: ``sampling/cuts.cut_jobs`` (the one cut behind the decode threads' pool tasks
and the decode workers' jobs) over random runs, read sizes and limits, and
``workers/jobs.prepare_window`` (a window's every (stripe, slot) target in jobs, on the
training thread once a window) over random loader geometries: every kept target in exactly
one job, a stripe's targets together, stripes in the order of the first slot each fills, a
job per batch (the first split across the workers) for one sample per chunk, no job over
the limits unless one stripe alone is, and each batch's row writes counted once."""

from collections import Counter
from itertools import pairwise

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from test_schedule import cases

from insitubatch_nodes.sampling.cuts import THREAD_LIMITS, WORKER_LIMITS, JobLimits, cut_jobs
from insitubatch_nodes.workers.jobs import (
    BATCH,
    ROW,
    STEP,
    STRIPE,
    VAR,
    WorkerWindow,
    prepare_window,
)


class FakeArena:
    """What ``prepare_window`` asks of a ``BatchArena``: the batches it expects and the
    generation."""

    generation = 7

    def __init__(self) -> None:
        self.expected = {}

    def expect(self, b: int, n: int) -> None:
        self.expected.setdefault(b, n)

    def expect_many(self, first: int, rows: list[int]) -> None:
        for b, n in enumerate(rows, first):
            self.expect(b, n)


def restore_point(case, data) -> tuple[int, int]:
    """Where a restore may start: the head window and the draws into it, at the start of
    a batch (the position after a batch that ends a window is the next window's start)."""
    starts = case.schedule.draw_starts
    first = data.draw(st.integers(0, -(-int(starts[-1]) // case.batch_size)))
    at = min(first * case.batch_size, int(starts[-1]))
    head = min(int(np.searchsorted(starts, at, side="right")) - 1, len(starts) - 2)
    return head, at - int(starts[head])


# -- the cut ---------------------------------------------------------------------------------
def assert_cut(cuts: list[int], nbytes: list[int], first: int, limits: JobLimits,
               runs: list[int] | None) -> None:
    """``cuts`` is the cut ``cut_jobs`` is defined to make of reads of ``nbytes`` in
    ``runs``: contiguous jobs covering every read once, none spanning two runs, none over
    the limits unless one read alone is, the first run in at least ``min(first, reads)``
    jobs, and a run split no more than that unless a limit forces it (then evenly)."""
    n = len(nbytes)
    assert cuts[0] == 0 and cuts[-1] == n
    assert all(a < z for a, z in pairwise(cuts))  # no empty job
    run_of = [0] * n if runs is None else runs
    edges = [0, *(k for k in range(1, n) if run_of[k] != run_of[k - 1]), n]
    assert set(edges) <= set(cuts)  # every run starts a job: no job spans two runs
    for a, z in pairwise(cuts):
        assert z - a <= limits.reads
        assert sum(nbytes[a:z]) <= limits.nbytes or z - a == 1
    for i, (a, z) in enumerate(pairwise(edges)):
        jobs = [(x, y) for x, y in pairwise(cuts) if a <= x < z]
        m = z - a
        want = min(first, m) if i == 0 else 1
        assert len(jobs) >= want
        if m <= want * limits.reads and sum(nbytes[a:z]) <= limits.nbytes:
            # no limit binds: exactly the jobs wanted, their reads as even as can be
            assert len(jobs) == want
            assert max(y - x for x, y in jobs) - min(y - x for x, y in jobs) <= 1


@st.composite
def reads(draw):
    """Runs of reads (batches, or one run), the bytes each read writes (all one size, as
    one variable's, or any), how many jobs the first run wants, and limits that bind."""
    lengths = draw(st.lists(st.integers(1, 30), min_size=1, max_size=8))
    first_run = draw(st.integers(0, 1000))
    runs = None if draw(st.booleans()) else [first_run + i for i, m in enumerate(lengths)
                                               for _ in range(m)]
    n = sum(lengths)
    if draw(st.booleans()):
        nbytes = [draw(st.integers(1, 100))] * n
    else:
        nbytes = draw(st.lists(st.integers(1, 100), min_size=n, max_size=n))
    limits = JobLimits(draw(st.integers(1, 600)), draw(st.integers(1, 40)))
    return runs, nbytes, draw(st.integers(1, 8)), limits


@settings(max_examples=200, deadline=None)
@given(reads())
def test_the_cut_is_a_job_per_run_the_first_split_within_the_limits(window):
    runs, nbytes, first, limits = window
    got = cut_jobs(np.asarray(nbytes, dtype=np.int64), first, limits,
                   None if runs is None else np.asarray(runs, dtype=np.int64))
    assert_cut(got, nbytes, first, limits, runs)


def test_the_cut_by_example():
    """Two batches of two samples of three variables (5, 7 and 11 B a read), the first
    batch wanted in two jobs, 30 B and 5 reads a job: a sample a job. Reads of unequal
    sizes: an even split over the byte limit is cut where the bytes pass it."""
    row = np.asarray([5, 7, 11], dtype=np.int64)
    assert cut_jobs(np.tile(row, 4), 2, JobLimits(30, 5),
                    np.repeat([3, 3, 4, 4], 3)) == [0, 3, 6, 9, 12]
    assert cut_jobs(np.asarray([100, 100, 1, 1]), 1, JobLimits(101, 10)) == [0, 1, 2, 4]
    assert cut_jobs(np.asarray([300, 1]), 1, JobLimits(101, 10)) == [0, 1, 2]
    assert cut_jobs(np.zeros(0, dtype=np.int64), 3, THREAD_LIMITS) == [0]


def test_each_executor_keeps_the_limits_measured_for_it():
    """The decode threads' tasks and the workers' jobs pay differently per job
    (``sampling/cuts``): 16 MB / 64 reads a task, 64 MB / 256 a worker's job."""
    assert (THREAD_LIMITS.nbytes, THREAD_LIMITS.reads) == (16 << 20, 64)
    assert (WORKER_LIMITS.nbytes, WORKER_LIMITS.reads) == (64 << 20, 256)


# -- a window's jobs -------------------------------------------------------------------------
def slots_by_definition(plan, skip: int) -> list[tuple[int, int, int, int]]:
    """Every (sample, batch, row, step) a window fills: each draw from ``skip`` on whose
    batch is kept (-1: a short last batch ``drop_last`` drops), at each of its steps."""
    offsets = np.asarray(plan.offsets).tolist()
    out = []
    for p, (d, b, r) in enumerate(zip(plan.draw_order.tolist(), plan.slots.batch.tolist(),
                                      plan.slots.row.tolist(), strict=True)):
        if p >= skip and b >= 0:
            out += [(d + o, b, r, k) for k, o in enumerate(offsets)]
    return out


def stripes_of(targets: np.ndarray) -> list[list[list[int]]]:
    """A job's targets as its stripes' runs of rows (one run per stripe read)."""
    rows = targets.tolist()
    runs: list[list[list[int]]] = []
    for row in rows:
        if runs and runs[-1][-1][VAR] == row[VAR] and runs[-1][-1][STRIPE] == row[STRIPE]:
            runs[-1].append(row)
        else:
            runs.append([row])
    return runs


def check_window(win: WorkerWindow, plan, skip: int, chunks, row_bytes, stripe_nbytes,
                 workers: int, expected: dict[int, int]) -> Counter:
    """``win`` is the window ``prepare_window`` is defined to make (``workers``: its first
    batch split across that many and answered at once; 0 for a window not holding a
    start's first batch, not split); returns its row writes per batch."""
    slots = slots_by_definition(plan, skip)
    want = sorted((v, s // c, s % c, b, r, k) for s, b, r, k in slots
                  for v, c in enumerate(chunks))
    assert sorted(tuple(t) for j in win.jobs for t in j.targets.tolist()) == want
    assert win.batches == sorted({b for _, b, _, _ in slots})
    assert win.generation == FakeArena.generation
    assert {b: expected[b] for b in win.batches} == {b: plan.slots.rows_in(b)
                                                     for b in win.batches}
    assert [j.urgent for j in win.jobs] == [k < workers for k in range(len(win.jobs))]
    seen: set[tuple[int, int]] = set()
    order: list[tuple[int, int]] = []  # each stripe's first slot, in the order they run
    writes: Counter = Counter()
    per_job_batches = []
    for job in win.jobs:
        t = job.targets
        assert t.dtype == np.int64 and t.ndim == 2 and t.shape[1] == 6 and len(t)
        assert t.flags.c_contiguous or t.shape[0] <= 1  # one buffer on the wire
        stripes = stripes_of(t)
        keys = [(s[0][VAR], s[0][STRIPE]) for s in stripes]
        assert not seen & set(keys) and len(set(keys)) == len(keys)  # a stripe read once
        seen |= set(keys)
        for s in stripes:  # its slots in slot order, the first where it decodes
            assert s == sorted(s, key=lambda r: (r[BATCH], r[ROW], r[STEP]))
            order.append((s[0][BATCH], s[0][ROW]))
        got = Counter(r[BATCH] for r in t.tolist())
        assert job.writes == dict(got)
        writes += got
        sizes = Counter(stripe_nbytes[v] for v, _ in keys)
        assert dict(Counter({size: n for n, size in job.reads})) == dict(sizes)
        assert len(stripes) <= WORKER_LIMITS.reads
        nbytes = sum(row_bytes[s[0][VAR]] * len(s) for s in stripes)
        assert nbytes <= WORKER_LIMITS.nbytes or len(stripes) == 1
        per_job_batches.append({s[0][BATCH] for s in stripes})
    assert order == sorted(order)  # the window's first batches complete first
    if all(c == 1 for c in chunks) and win.jobs:
        # a job per batch (by the batch each stripe first fills), the first split
        assert all(len(bs) == 1 for bs in per_job_batches)
        b0 = min(b for bs in per_job_batches for b in bs)
        first = [k for k, bs in enumerate(per_job_batches) if bs == {b0}]
        n_first = sum(len(stripes_of(win.jobs[k].targets)) for k in first)
        assert first == list(range(len(first)))
        split = max(1, workers)
        assert len(first) >= min(split, n_first)
        fits = (n_first <= WORKER_LIMITS.reads
                and sum(row_bytes[r[VAR]] for k in first for r in win.jobs[k].targets.tolist())
                <= WORKER_LIMITS.nbytes)
        if fits:
            assert len(first) == min(split, n_first)
    return writes


def epoch_jobs(c, workers, head, skip, row_bytes, stripe_nbytes) -> None:
    """Every window of a rank's epoch from ``head`` (its first ``skip`` draws delivered
    before a restore): each as defined, and over the epoch every kept row of every batch
    written once per variable and step."""
    chunks = [v.sample_chunk for v in c.variables]
    writes: Counter = Counter()
    rows: Counter = Counter()
    expected: dict[int, int] = {}
    n_steps = 1
    for k, plan in enumerate(c.plans()[head:]):
        arena = FakeArena()
        # the start's head window first, split and urgent; the others not
        win = prepare_window(plan, arena, workers, chunks, row_bytes, stripe_nbytes, skip,
                             head=k == 0)
        writes += check_window(win, plan, skip, chunks, row_bytes, stripe_nbytes,
                               workers if k == 0 else 0, arena.expected)
        n_steps = len(np.asarray(plan.offsets))
        rows += Counter(b for p, b in enumerate(plan.slots.batch.tolist()) if p >= skip
                        and b >= 0)
        expected.update(arena.expected)
        skip = 0
    assert set(expected) == set(rows)
    assert all(rows[b] == expected[b] for b in rows)  # every row of a batch once
    assert dict(writes) == {b: n * len(chunks) * n_steps for b, n in rows.items()}


@settings(max_examples=80, deadline=None)
@given(case=cases(), workers=st.integers(1, 4), data=st.data())
def test_a_window_is_cut_into_the_jobs_defined(case, workers, data):
    """Every window of a rank's epoch (several samples per chunk or one, time steps,
    ``drop_last``, uneven ranks, elastic resumes), the restore's head window skipping a
    few batches; row bytes of 1 B to 100 MB, so the byte limit binds now and then."""
    _, c = case
    head, skip = restore_point(c, data)
    n_vars = len(c.variables)
    row_bytes = data.draw(st.lists(st.integers(1, 1000) | st.integers(1, 100 << 20),
                                   min_size=n_vars, max_size=n_vars))
    stripe_nbytes = data.draw(st.lists(st.sampled_from([1000, 2000, 64 << 20]),
                                       min_size=n_vars, max_size=n_vars))
    epoch_jobs(c, workers, head, skip, row_bytes, stripe_nbytes)


@settings(max_examples=50, deadline=None)
@given(case=cases(max_n=400, chunkings=st.lists(st.just(1), min_size=1, max_size=3),
                  steps=False),
       workers=st.integers(1, 4), sizes=st.lists(st.sampled_from([8, 16]), min_size=3,
                                                  max_size=3),
       big=st.booleans(), data=st.data())
def test_one_sample_per_chunk_windows_are_cut_as_defined(case, workers, sizes, big, data):
    """The common case (one sample per chunk, no time steps, padding repeats included),
    cut on its fast path: one stripe size or several, rows of 4 B or of 3-40 MB (a batch
    then needs several jobs)."""
    _, c = case
    head, skip = restore_point(c, data)
    n_vars = len(c.variables)
    row_bytes = (data.draw(st.lists(st.integers(3 << 20, 40 << 20), min_size=n_vars,
                                    max_size=n_vars)) if big else [4] * n_vars)
    epoch_jobs(c, workers, head, skip, row_bytes, sizes[:n_vars])
