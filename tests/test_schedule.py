"""Schedules are pure: rank shares, windows, equal steps and elastic remainders, no store."""

import dataclasses
from collections import Counter

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from insitubatch_nodes.sampling import permute as permute_module
from insitubatch_nodes.sampling import schedule as schedule_module
from insitubatch_nodes.sampling.geometry import SampleGrid, VariableGeometry, common_chunk_size
from insitubatch_nodes.sampling.permute import DRAW_STREAM, seeded_rng
from insitubatch_nodes.sampling.plan import BatchSlots, ReadPlan, max_window_nbytes
from insitubatch_nodes.sampling.schedule import (
    UNEVEN_POLICIES,
    Progress,
    RankSchedule,
    Resumption,
    ScheduleContext,
    WindowSpec,
    batch_slots,
    n_units,
    plan_window,
    rank_schedule,
    rank_schedules,
)
from insitubatch_nodes.sampling.windows import SampleWindow


def ctx(n=203, cs=8, block=3, uneven="none", seed=0, split=None, contiguous=False,
        valid=None):
    grid = SampleGrid(n, cs) if valid is None else SampleGrid(n, cs).with_valid(*valid)
    ids = np.arange(grid.n_chunks) if split is None else np.asarray(split)
    return ScheduleContext(ids, grid, seed, block, uneven, contiguous)


def epoch_draws(c, epoch, world, history=()):
    return [np.concatenate([w.final_draws() for w in rank_schedule(c, epoch, r, world,
                                                                   history).windows] or
                           [np.empty(0, np.int64)]) for r in range(world)]


def var(name, n, cs):
    return VariableGeometry(name, (n, 3), (cs, 3), np.dtype("float32"))


@given(n=st.integers(1, 200), cs=st.lists(st.integers(1, 16), min_size=1, max_size=3),
       block=st.integers(1, 6))
def test_plans_read_each_needed_stripe_once(n, cs, block):
    variables = [var(f"v{i}", n, c) for i, c in enumerate(cs)]
    c = ctx(n, common_chunk_size(cs), block)
    for w_i, spec in enumerate(rank_schedule(c, 0, 0, 1).windows):
        plan = plan_window(spec, variables, w_i)
        samples = c.grid.samples_of(spec.chunk_ids)
        assert sorted(plan.draw_order.tolist()) == sorted(samples.tolist())
        for v, reads, last in zip(variables, plan.reads, plan.last_use, strict=True):
            assert list(reads) == sorted(set((samples // v.sample_chunk).tolist()))
            # the position of the last draw that reads each stripe (the shuffle buffer
            # lets the stripe go once it is taken)
            stripe_of = (plan.draw_order // v.sample_chunk).tolist()
            assert list(last) == [max(k for k, s in enumerate(stripe_of) if s == r)
                                  for r in reads]
        assert plan.nbytes <= max_window_nbytes(c.grid, variables, block)


def test_draw_order_depends_on_seed_and_epoch_only_through_keys():
    a = epoch_draws(ctx(seed=0), 0, 1)[0]
    assert np.array_equal(a, epoch_draws(ctx(seed=0), 0, 1)[0])
    assert not np.array_equal(a, epoch_draws(ctx(seed=1), 0, 1)[0])
    assert not np.array_equal(a, epoch_draws(ctx(seed=0), 1, 1)[0])


@given(n=st.integers(1, 300), cs=st.integers(1, 12), block=st.integers(1, 5),
       world=st.integers(1, 4), epoch=st.integers(0, 3))
def test_ranks_cover_the_split_once(n, cs, block, world, epoch):
    c = ctx(n, cs, block)
    if world > c.grid.n_chunks:
        return
    draws = np.concatenate(epoch_draws(c, epoch, world))
    assert sorted(draws.tolist()) == list(range(n))


def test_shares_are_redealt_every_epoch():
    c = ctx(400, 8, 2)
    s0 = set(rank_schedule(c, 0, 0, 2).windows[0].chunk_ids.tolist())
    s1 = set(rank_schedule(c, 1, 0, 2).windows[0].chunk_ids.tolist())
    assert s0 != s1


@pytest.mark.parametrize("uneven", ["pad", "drop"])
@given(n=st.integers(1, 300), cs=st.integers(1, 12), block=st.integers(1, 5),
       world=st.integers(2, 4))
def test_equal_samples_per_rank(uneven, n, cs, block, world):
    c = ctx(n, cs, block, uneven)
    if world > c.grid.n_chunks:
        return
    per_rank = epoch_draws(c, 0, world)
    sizes = {d.size for d in per_rank}
    assert len(sizes) == 1  # equal steps whatever batch size and drop_last
    allc = Counter(np.concatenate(per_rank).tolist())
    if uneven == "pad":
        assert set(allc) == set(range(n))  # nothing lost
        # padding repeats only the rank's own samples, and only as much as needed
        for r, d in enumerate(per_rank):
            sched = rank_schedule(c, 0, r, world)
            assert d.size == sched.target and len(set(d.tolist())) == sched.own_samples
    else:
        assert max(allc.values()) == 1 and len(allc) == world * sizes.pop()


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 260), cs=st.integers(1, 10), block=st.integers(1, 4),
       w0=st.integers(1, 4), w1=st.integers(1, 4), w2=st.integers(1, 4),
       contiguous=st.booleans(), data=st.data())
def test_elastic_resumes_lose_and_repeat_nothing(n, cs, block, w0, w1, w2, contiguous, data):
    """Stop anywhere at W0, resume at W1, stop again, resume at W2: the epoch is exact."""
    c = ctx(n, cs, block, contiguous=contiguous)
    if max(w0, w1, w2) > c.grid.n_chunks:
        return
    seen: list[int] = []
    history: tuple[Resumption, ...] = ()
    for world in (w0, w1):
        progress = []
        for r in range(world):
            wins = rank_schedule(c, 0, r, world, history).windows
            h = data.draw(st.integers(0, len(wins)))
            o = data.draw(st.integers(0, max(0, wins[h].n_base - 1))) if h < len(wins) else 0
            for w in wins[:h]:
                seen += w.final_draws().tolist()
            if h < len(wins):
                seen += wins[h].final_draws()[:o].tolist()
            progress.append(Progress(h, o))
        history = (*history, Resumption(world, tuple(progress)))
    rest = np.concatenate(epoch_draws(c, 0, w2, history)).tolist()
    assert sorted(seen + rest) == list(range(n))
    counts = rank_schedule(c, 0, 0, w2, history).counts
    assert max(counts) - min(counts) <= 1  # re-dealt evenly: every rank has work


def test_resumption_json_round_trip():
    r = Resumption(2, (Progress(1, 5), Progress(0, 0)))
    assert Resumption.from_json(r.to_json()) == r


def test_rank_left_with_nothing_pads_from_the_rest():
    c = ctx(16, 8, 1, "pad")
    history = (Resumption(2, (Progress(1, 0), Progress(0, 7))),)  # one sample left
    last = int(rank_schedule(c, 0, 1, 2).windows[0].final_draws()[7])
    scheds = [rank_schedule(c, 0, r, 3, history) for r in range(3)]
    assert [s.own_samples for s in scheds] == [1, 0, 0]
    draws = [np.concatenate([w.final_draws() for w in s.windows]).tolist() for s in scheds]
    assert draws == [[last]] * 3  # equal steps; the one sample left is the padding
    assert all(last // 8 in s.windows[-1].chunk_ids for s in scheds)


def test_late_stop_is_redealt_evenly():
    """Two tails and nothing untouched (the README's crash: samples per rank [32, 24, 0])."""
    c = ctx(160, 8, 4, "pad")
    before = [rank_schedule(c, 0, r, 2) for r in range(2)]
    progress = tuple(Progress(len(s.windows) - 1, 3) for s in before)
    history = (Resumption(2, progress),)
    scheds = [rank_schedule(c, 0, r, 3, history) for r in range(3)]
    left = sum(s.windows[-1].n_base - 3 for s in before)
    assert sum(s.own_samples for s in scheds) == left
    assert max(s.own_samples for s in scheds) - min(s.own_samples for s in scheds) <= 1
    assert len({s.target for s in scheds}) == 1


def test_resume_record_out_of_range():
    c = ctx(16, 8, 1)
    for bad in (Progress(5, 0), Progress(0, -1), Progress(-1, 0)):
        with pytest.raises(ValueError, match="rank 0 of 1 finished"):
            rank_schedule(c, 0, 0, 2, (Resumption(1, (bad,)),))


def test_bad_policy():
    with pytest.raises(ValueError, match="uneven"):
        ctx(uneven="spread")


@given(n=st.integers(1, 300), cs=st.integers(1, 12), block=st.integers(1, 5),
       world=st.integers(1, 4), before=st.integers(0, 9), after=st.integers(0, 9))
def test_contiguous_windows_cover_valid_anchors_in_runs(n, cs, block, world, before, after):
    c = ctx(n, cs, block, contiguous=True, valid=(before, n - after))
    draws = np.concatenate(epoch_draws(c, 0, world))
    assert sorted(draws.tolist()) == list(range(before, max(before, n - after)))
    for r in range(world):
        for w in rank_schedule(c, 0, r, world).windows:
            assert np.all(np.diff(w.chunk_ids) == 1)  # a window is a run of adjacent chunks


def test_window_reads_include_every_step():
    from insitubatch_nodes.sampling.windows import SampleWindow

    win = SampleWindow(history=2, lead=(1, 6))
    c = ctx(100, 8, 2, contiguous=True, valid=(1, 94))
    spec = rank_schedule(c, 0, 0, 1).windows[0]
    plan = plan_window(spec, [var("a", 100, 8)], 0, win.offsets)
    rows = (plan.draw_order[:, None] + win.offsets[None, :]).ravel()
    assert list(plan.reads[0]) == sorted(set((rows // 8).tolist()))
    # a stripe is last used by the last draw any of whose steps reads it
    stripes = (plan.draw_order[:, None] + win.offsets[None, :]) // 8
    assert list(plan.last_use[0]) == [int(np.flatnonzero((stripes == r).any(axis=1))[-1])
                                      for r in plan.reads[0]]


@given(n=st.integers(1, 120), cs=st.integers(1, 6), block=st.integers(1, 4),
       world=st.integers(1, 5), uneven=st.sampled_from(["pad", "drop", "none"]))
@settings(max_examples=40, deadline=None)
def test_all_ranks_at_once_are_each_ranks_own_schedule(n, cs, block, world, uneven):
    assume(world <= -(-n // cs))  # at most one rank per chunk (else both refuse to pad)
    c = ctx(n, cs, block, uneven=uneven)
    history = [Resumption(2, (Progress(0, 1), Progress(1, 0)))] if n >= 4 * cs else []
    for r, together in enumerate(rank_schedules(c, 1, world, history)):
        alone = rank_schedule(c, 1, r, world, history)
        assert (together.target, together.own_samples, together.counts) == (
            alone.target, alone.own_samples, alone.counts)
        assert [w.final_draws().tolist() for w in together.windows] == [
            w.final_draws().tolist() for w in alone.windows]


# -- the per-window fast paths against the code they replaced (issue 33) -------------------
# The planning that runs once a window on the training thread was rewritten for fewer numpy
# calls; these references are the code before, and the seeded streams, plans and batch
# slots must stay bit for bit what they were (checkpoints, fingerprints, exact resume).
def old_rng(*key):
    return np.random.default_rng(np.random.SeedSequence(list(key)))


def old_base_draws(self):
    if self.draws is not None:
        return self.draws
    samples = self.ctx.grid.samples_of(self.chunk_ids)
    rng = old_rng(DRAW_STREAM, self.ctx.seed, self.epoch, *self.key)
    return samples[rng.permutation(samples.size)]


def old_plan_window(spec, variables, window, offsets=None, draws=None):
    draws = spec.final_draws() if draws is None else draws
    steps = np.zeros(1, dtype=np.int64) if offsets is None else np.asarray(offsets, np.int64)
    plan = ReadPlan(epoch=spec.epoch, window=window,
                    chunk_ids=tuple(np.asarray(spec.chunk_ids).tolist()), draw_order=draws,
                    reads=(), nbytes=0, offsets=steps)
    rows = plan.rows(draws)
    reads, last_use = [], []
    per_chunking = {}
    for v in variables:
        got = per_chunking.get(v.sample_chunk)
        if got is None:
            idx, first = np.unique((rows // v.sample_chunk)[::-1], return_index=True)
            last = (rows.size - 1 - first) // steps.size
            got = per_chunking[v.sample_chunk] = (tuple(idx.tolist()), tuple(last.tolist()))
        reads.append(got[0])
        last_use.append(got[1])
    nbytes = sum(len(r) * v.stripe_nbytes for r, v in zip(reads, variables, strict=True))
    return dataclasses.replace(plan, reads=tuple(reads), last_use=tuple(last_use),
                               nbytes=nbytes)


def expected_batch_slots(draws, window, batch_size, drop_last):
    """``batch_slots`` from its definition, not its code: the epoch's draws (``draws``, a
    list per window) cut every ``batch_size``, each batch's rows ranked by sample (ties in
    draw order), a short last batch -1 under ``drop_last``; ``window``'s share of them."""
    every = np.concatenate([np.zeros(0, dtype=np.int64), *draws])
    total = every.size
    batch = np.arange(total, dtype=np.int64) // batch_size
    row = np.empty(total, dtype=np.int64)
    for lo in range(0, total, batch_size):
        hi = min(lo + batch_size, total)
        row[lo + np.argsort(every[lo:hi], kind="stable")] = np.arange(hi - lo)
        if drop_last and hi - lo < batch_size:
            batch[lo:hi] = -1
    g0 = sum(d.size for d in draws[:window])
    g1 = g0 + draws[window].size
    return batch[g0:g1], row[g0:g1]


@dataclasses.dataclass
class Case:
    """One rank's epoch of a random loader geometry, its windows planned as
    ``ReadPlanNode`` plans them (in place: with batch slots)."""

    schedule: RankSchedule
    variables: list
    offsets: np.ndarray | None
    batch_size: int
    drop_last: bool

    def plans(self):
        out = []
        for i, spec in enumerate(self.schedule.windows):
            batch, row = batch_slots(self.schedule, i, self.batch_size, self.drop_last)
            slots = BatchSlots(batch, row, self.batch_size, int(self.schedule.draw_starts[-1]))
            out.append(plan_window(spec, self.variables, i, self.offsets,
                                   draws=self.schedule.draws_of(i), slots=slots))
        return out


CHUNKINGS = st.lists(st.integers(1, 6), min_size=1, max_size=3)  # variables' sample chunks


@st.composite
def cases(draw, max_n=240, chunkings=CHUNKINGS, steps=True):
    """Several samples per chunk or one, variables of different chunkings, time steps
    (offsets), ranks of unequal shares under every policy, an elastic resume, seeds past
    32 bits, batches across window edges, ``drop_last``."""
    cs = draw(chunkings)
    n = draw(st.integers(1, max_n))
    grid = SampleGrid(n, common_chunk_size(cs))
    steps = draw(st.none() | st.builds(SampleWindow, st.integers(1, 3),
                                       st.lists(st.integers(1, 4), max_size=2, unique=True))
                 if steps else st.none())
    if steps is not None:
        assume(steps.span < n)
        grid = steps.grid(grid)
    if draw(st.booleans()):
        grid = grid.with_every(2, draw(st.integers(0, 1)))
    ids = np.flatnonzero(grid.n_samples_each(np.arange(grid.n_chunks)))
    assume(ids.size)
    c = ScheduleContext(ids, grid, draw(st.integers(0, 2**40) | st.integers(0, 9)),
                        draw(st.integers(1, 5)), draw(st.sampled_from(UNEVEN_POLICIES)),
                        contiguous=steps is not None and draw(st.booleans()))
    world = draw(st.integers(1, 3))
    assume(world <= n_units(c))
    epoch = draw(st.integers(0, 3))
    history: tuple[Resumption, ...] = ()
    if draw(st.booleans()):  # an elastic resume from another world size
        old = draw(st.integers(1, 3))
        assume(old <= n_units(c))
        progress = []
        for r in range(old):
            wins = rank_schedule(c, epoch, r, old).windows
            h = draw(st.integers(0, len(wins)))
            o = draw(st.integers(0, max(0, wins[h].n_base - 1))) if h < len(wins) else 0
            progress.append(Progress(h, o))
        history = (Resumption(old, tuple(progress)),)
    rank = draw(st.integers(0, world - 1))
    variables = [var(f"v{i}", n, k) for i, k in enumerate(cs)]
    return (c, epoch, rank, world, history), Case(
        rank_schedule(c, epoch, rank, world, history), variables,
        None if steps is None else steps.offsets, draw(st.integers(1, 40)),
        draw(st.booleans()))


def old_schedule(c, epoch, rank, world, history):
    """``rank_schedule`` seeded the way it was (a key list through SeedSequence)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(schedule_module, "seeded_rng", old_rng)
        mp.setattr(permute_module, "seeded_rng", old_rng)
        mp.setattr(WindowSpec, "base_draws", old_base_draws)
        sched = rank_schedule(c, epoch, rank, world, history)
        return sched, [sched.windows[i].final_draws() for i in range(len(sched.windows))]


def assert_same_plan(new, old):
    for f in ("epoch", "window", "chunk_ids", "reads", "nbytes", "last_use"):
        assert getattr(new, f) == getattr(old, f), f
    for f in ("draw_order", "offsets"):
        a, b = getattr(new, f), getattr(old, f)
        assert a.dtype == b.dtype and np.array_equal(a, b), f


@settings(max_examples=300, deadline=None)
@given(cases())
def test_schedules_plans_and_slots_are_those_of_the_code_before(case):
    args, new = case
    sched, old_draws = old_schedule(*args)
    assert len(sched.windows) == len(new.schedule.windows)
    assert (sched.own_samples, sched.target, sched.counts) == (
        new.schedule.own_samples, new.schedule.target, new.schedule.counts)
    plans = new.plans()
    for i, (a, b) in enumerate(zip(new.schedule.windows, sched.windows, strict=True)):
        assert np.array_equal(a.chunk_ids, b.chunk_ids) and a.key == b.key
        assert a.limit == b.limit
        for f in ("draws", "extra"):
            x, y = getattr(a, f), getattr(b, f)
            assert (x is None) == (y is None) and (x is None or np.array_equal(x, y)), f
        want = old_plan_window(b, new.variables, i, new.offsets, draws=old_draws[i])
        assert_same_plan(plans[i], want)
        batch, row = expected_batch_slots(old_draws, i, new.batch_size, new.drop_last)
        assert plans[i].slots is not None
        np.testing.assert_array_equal(plans[i].slots.batch, batch)
        np.testing.assert_array_equal(plans[i].slots.row, row)
        assert plans[i].slots.total == int(sched.draw_starts[-1])


@settings(max_examples=200, deadline=None)
@given(key=st.lists(st.integers(0, 2**70) | st.integers(0, 2**32), min_size=1, max_size=8),
       n=st.integers(0, 300))
def test_seeded_rng_is_seed_sequence_of_the_key(key, n):
    """One uint32 array for the key: the SeedSequence state of the key as a list."""
    assert np.array_equal(seeded_rng(*key).permutation(n), old_rng(*key).permutation(n))
    samples = np.arange(n, dtype=np.int64) * 3 + 1
    assert np.array_equal(seeded_rng(*key).permutation(samples),
                          samples[old_rng(*key).permutation(n)])
    with pytest.raises(ValueError):
        seeded_rng(*key, -1)
