"""``workers/jobs.prepare_window`` (a window cut into decode workers' jobs, on the training
thread once a window) against the code it replaced, run by the general path for every
window: the same jobs, targets, writes, reads, urgent flags and expected batches, over
random loader geometries (issue 33)."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from test_schedule import cases

from insitubatch_nodes.sampling.plan import KeptSlots
from insitubatch_nodes.workers import jobs as J
from insitubatch_nodes.workers.jobs import BATCH, VAR, WorkerWindow


class FakeArena:
    """What ``prepare_window`` asks of a ``BatchArena``: the restore's skip, the batches
    it expects and the generation."""

    generation = 7

    def __init__(self, skip: int = 0) -> None:
        self.skip, self.expected = skip, {}

    def take_skip(self) -> int:
        skip, self.skip = self.skip, 0
        return skip

    def expect(self, b: int, n: int) -> None:
        self.expected.setdefault(b, n)


# -- the code before ------------------------------------------------------------------------
def old_kept_slots(plan, skip):
    slots = plan.slots
    keep = slots.batch >= 0
    keep[:skip] = False
    steps = np.asarray(plan.offsets, dtype=np.int64)
    n_steps = int(steps.size)
    draws = np.asarray(plan.draw_order, dtype=np.int64)[keep]
    return KeptSlots(sample=(draws[:, None] + steps[None, :]).ravel(),
                     batch=np.repeat(slots.batch[keep], n_steps),
                     row=np.repeat(slots.row[keep], n_steps),
                     step=np.tile(np.arange(n_steps, dtype=np.int64), draws.size),
                     n_steps=n_steps)


def old_expect(plan, arena):
    kept = old_kept_slots(plan, arena.take_skip())
    batches = sorted(set(kept.batch.tolist()))
    for b in batches:
        arena.expect(b, plan.slots.rows_in(b))
    return kept, batches


def old_cut_by_batch(first_batch, nbytes, workers):
    n = len(first_batch)
    bounds = [0, *(np.flatnonzero(first_batch[1:] != first_batch[:-1]) + 1).tolist(), n]
    total = [0, *np.cumsum(nbytes).tolist()]
    cuts = [0]
    for i in range(len(bounds) - 1):
        a, z = bounds[i], bounds[i + 1]
        parts = max(workers if i == 0 else 1, -(-(total[z] - total[a]) // J.JOB_BYTES),
                    -(-(z - a) // J.JOB_READS))
        if parts > 1:
            size = -(-(z - a) // min(z - a, parts))
            cuts += range(a + size, z, size)
        cuts.append(z)
    return cuts


def old_prepare_window(plan, arena, workers, sample_chunks, row_bytes, stripe_nbytes):
    kept, batches = old_expect(plan, arena)
    if not kept.sample.size:
        return WorkerWindow(plan, [], batches, arena.generation)
    # every window by the general path (J's own helpers, unchanged): the fast path for one
    # sample a chunk makes the same targets and jobs (test_workers checks the two agree)
    t, starts = J._in_slot_order(J._targets(kept, sample_chunks))
    var = t[starts, VAR]
    nbytes = np.asarray(row_bytes, dtype=np.int64)[var] * np.diff(np.append(starts, len(t)))
    if all(n == 1 for n in sample_chunks):
        cuts = old_cut_by_batch(t[starts, BATCH], nbytes, workers)
    else:
        cuts = J._cut_even(nbytes, workers)
    jobs = J._jobs(t, starts, np.asarray(cuts), var, stripe_nbytes, workers)
    return WorkerWindow(plan, jobs, batches, arena.generation)


# -- the comparison ---------------------------------------------------------------------------
def restore_point(case, data) -> tuple[int, int]:
    """Where a restore may start: the head window and the draws into it, at the start of
    a batch (the position after a batch that ends a window is the next window's start)."""
    starts = case.schedule.draw_starts
    first = data.draw(st.integers(0, -(-int(starts[-1]) // case.batch_size)))
    at = min(first * case.batch_size, int(starts[-1]))
    head = min(int(np.searchsorted(starts, at, side="right")) - 1, len(starts) - 2)
    return head, at - int(starts[head])


def assert_same_jobs(new: WorkerWindow, old: WorkerWindow) -> None:
    assert new.batches == old.batches and new.generation == old.generation
    assert len(new.jobs) == len(old.jobs)
    for a, b in zip(new.jobs, old.jobs, strict=True):
        assert a.targets.dtype == b.targets.dtype == np.int64
        assert a.targets.flags.c_contiguous or a.targets.shape[0] <= 1
        np.testing.assert_array_equal(a.targets, b.targets)
        assert (a.writes, a.reads, a.urgent) == (b.writes, b.reads, b.urgent)


@settings(max_examples=250, deadline=None)
@given(case=cases(), workers=st.integers(1, 4), data=st.data())
def test_prepare_window_makes_the_jobs_of_the_code_before(case, workers, data):
    """Every window of a rank's epoch, the restore's head window skipping a few batches;
    row bytes of 1 B to 100 MB (jobs split by ``JOB_BYTES``)."""
    _, c = case
    plans = c.plans()
    head, skip = restore_point(c, data)
    n_vars = len(c.variables)
    chunks = [v.sample_chunk for v in c.variables]
    row_bytes = data.draw(st.lists(st.integers(1, 100 << 20), min_size=n_vars,
                                   max_size=n_vars))
    stripe_nbytes = data.draw(st.lists(st.sampled_from([1000, 2000, 64 << 20]),
                                       min_size=n_vars, max_size=n_vars))
    for plan in plans[head:]:
        new_arena, old_arena = FakeArena(skip), FakeArena(skip)
        skip = 0
        got = J.prepare_window(plan, new_arena, workers, chunks, row_bytes, stripe_nbytes)
        want = old_prepare_window(plan, old_arena, workers, chunks, row_bytes, stripe_nbytes)
        assert_same_jobs(got, want)
        assert new_arena.expected == old_arena.expected


@settings(max_examples=150, deadline=None)
@given(case=cases(max_n=400, chunkings=st.lists(st.just(1), min_size=1, max_size=3),
                  steps=False),
       workers=st.integers(1, 4), sizes=st.lists(st.sampled_from([8, 16]), min_size=3,
                                                  max_size=3))
def test_one_sample_per_chunk_windows_cut_as_before(case, workers, sizes):
    """The common case (one sample per chunk, no time steps, padding repeats included):
    its fast path, one stripe size or several."""
    _, c = case
    n_vars = len(c.variables)
    for plan in c.plans():
        args = (workers, [1] * n_vars, [4] * n_vars, sizes[:n_vars])
        assert_same_jobs(J.prepare_window(plan, FakeArena(), *args),
                         old_prepare_window(plan, FakeArena(), *args))
