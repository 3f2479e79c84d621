"""Elastic resume through the public API: W ranks stop at any step, W' ranks finish the epoch.

Each example builds W loaders on a real store, takes ``state_dict()`` after the same number
of batches on every rank (what a DDP job checkpoints), merges them, and finishes the epoch
on W' fresh loaders: every sample of the split is served, none twice except the documented
padding, and every rank takes the same number of steps with the same batch sizes.
"""

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from stores import Var, write_store

import insitubatch_nodes as ib

# (samples, chunk): a short last chunk, one sample per chunk, few fat chunks, many chunks.
SHAPES = [(37, 4), (25, 1), (60, 12), (90, 5)]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    out = {}
    for n, cs in SHAPES:
        path = tmp_path_factory.mktemp("elastic") / f"s{n}x{cs}.zarr"
        write_store(path, [Var("x", (n, 2), (cs, 2))])
        out[n, cs] = ib.open_source(path)
    return out


def _padding(loaders) -> int:
    """Samples the schedules of these loaders' current epoch repeat (``pad``) or leave out
    (``drop``), in all: the documented price of equal steps."""
    scheds = [ld.node(ib.ChunkPermuteNode).schedule for ld in loaders]
    return sum(abs(s.target - s.own_samples) for s in scheds)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=st.sampled_from(SHAPES), fractions=st.sampled_from([(1.0,), (0.7, 0.3)]),
       w_before=st.integers(1, 3), w_after=st.integers(1, 4), batch=st.integers(2, 7),
       block=st.integers(1, 3), uneven=st.sampled_from(["pad", "drop", "none"]),
       stop=st.floats(0.0, 1.0), windowed=st.booleans())
def test_resume_on_another_world_size_at_any_step(sources, shape, fractions, w_before,
                                                  w_after, batch, block, uneven, stop,
                                                  windowed):
    src = sources[shape]
    m = ib.split_by_chunk(src, fractions, seed=3)
    train = m.chunk_ids("train")
    # Time windows (samples span chunks): the schedule deals runs of adjacent chunks.
    win = ib.SampleWindow(1, (1, 2)) if windowed else None
    grid = m.grid if win is None else m.grid.with_valid(win.before, shape[0] - win.after)
    want = set(grid.samples_of(train).tolist())
    if win is not None and len(fractions) > 1:  # a chunk whose windows reach val is left out
        val, cs = set(m.chunk_ids("val").tolist()), m.chunk_size
        reach = {a // cs for a in want
                 if any((a + o) // cs in val for o in range(-win.before, win.after + 1))}
        want = {a for a in want if a // cs not in reach}
    kw = dict(batch_size=batch, block_chunks=block, uneven=uneven, seed=1, steps=win)
    try:
        ib.build_loader(src, m, "train", rank=0, world_size=max(w_before, w_after), **kw)
    except ValueError as e:  # more ranks than chunks (blocks): refused, tested elsewhere
        assert "exceeds" in str(e)
        return
    before = [ib.build_loader(src, m, "train", rank=r, world_size=w_before, **kw)
              for r in range(w_before)]
    its = [iter(ld) for ld in before]
    # (read before the epoch ends: the fetch then starts the next one early)
    pad_before = _padding(before)
    steps = max(-(-s.target // batch) for s in
                (ld.node(ib.ChunkPermuteNode).schedule for ld in before))
    k = round(stop * steps)  # every rank stops after the same step, as a DDP job does
    seen: list[int] = []
    for it in its:
        for _ in range(k):
            b = next(it, None)
            if b is not None:
                seen += b["sample_index"].tolist()
    merged = ib.merge_rank_states([ld.state_dict() for ld in before])
    for ld in before:
        ld.close()

    after = [ib.build_loader(src, m, "train", rank=r, world_size=w_after, **kw)
             for r in range(w_after)]
    for ld in after:
        ld.load_state_dict(merged)
        # A rank with nothing left (fewer samples left than ranks, none/drop) would go on
        # to the next epoch at once; here every rank serves only what is left of this one.
        ld.restart_on_stop_iteration = False
    its = [iter(ld) for ld in after]
    # (read before the epoch ends: the fetch then starts the next one early)
    pad_after = _padding(after)
    rest = [[b["sample_index"].tolist() for b in it] for it in its]
    assert {ld.epoch for ld in after} == {0}
    for ld in after:
        ld.close()

    flat = [s for r in rest for b in r for s in b]
    assert not set(seen) & set(flat)  # nothing served before is served again
    assert set(seen) | set(flat) <= want
    if uneven != "none":  # DDP: the same steps and batch sizes on every rank
        assert len({tuple(len(b) for b in r) for r in rest}) == 1, rest
        assert pad_after <= w_after - 1  # re-dealt evenly: at most one sample per rank
    repeats = sum(c - 1 for c in Counter(seen + flat).values())
    lost = len(want - set(seen) - set(flat))
    if uneven == "none":
        assert sorted(seen + flat) == sorted(want)  # exactly once
    elif uneven == "pad":
        assert lost == 0 and repeats <= pad_before + pad_after
        assert len(flat) - len(set(flat)) == pad_after
    else:
        assert repeats == 0 and lost <= pad_before + pad_after


def test_resume_after_the_last_step_goes_on_to_the_next_epoch(sources):
    """Stopped when every rank had drawn everything: the merged state has nothing left of
    that epoch, so every new rank starts the next one at once (as an exact resume does)."""
    src = sources[37, 4]
    m = ib.split_by_chunk(src, (1.0,))
    before = [ib.build_loader(src, m, "train", rank=r, world_size=2, batch_size=4)
              for r in range(2)]
    for ld in before:
        list(ld)
    merged = ib.merge_rank_states([ld.state_dict() for ld in before])
    after = [ib.build_loader(src, m, "train", rank=r, world_size=3, batch_size=4)
             for r in range(3)]
    for ld in after:
        ld.load_state_dict(merged)
    nxt = [[b["sample_index"].tolist() for b in ld] for ld in after]
    assert [ld.epoch for ld in after] == [1, 1, 1]
    assert len({len(r) for r in nxt}) == 1
    assert {s for r in nxt for b in r for s in b} == set(range(37))
    for ld in before + after:
        ld.close()
