import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from insitubatch_nodes.geometry import SampleGrid, VariableGeometry, common_chunk_size
from insitubatch_nodes.plan import make_read_plan, max_window_nbytes


def var(name, n, cs, inner=(3,)):
    return VariableGeometry(name, (n, *inner), (cs, *inner), np.dtype("float32"))


@given(n=st.integers(1, 200), cs=st.lists(st.integers(1, 16), min_size=1, max_size=3),
       data=st.data())
def test_plan_reads_cover_window_exactly_once(n, cs, data):
    variables = [var(f"v{i}", n, c) for i, c in enumerate(cs)]
    grid = SampleGrid(n, common_chunk_size(cs))
    ids = data.draw(st.lists(st.integers(0, grid.n_chunks - 1), unique=True, min_size=1,
                             max_size=6))
    plan = make_read_plan(grid, variables, ids, seed=0, epoch=0, window=0)
    samples = grid.samples_of(np.array(ids))
    assert sorted(plan.draw_order.tolist()) == sorted(samples.tolist())
    for v, reads in zip(variables, plan.reads, strict=True):
        assert len(set(reads)) == len(reads)  # deduplicated
        assert set(reads) == set((samples // v.sample_chunk).tolist())  # minimal and complete
    assert plan.nbytes <= max_window_nbytes(grid, variables, len(ids))


def test_draw_order_depends_on_seed_epoch_window():
    grid = SampleGrid(64, 8)
    v = [var("a", 64, 8)]
    p = lambda **k: make_read_plan(grid, v, [0, 1, 2], **k).draw_order.tolist()  # noqa: E731
    base = p(seed=0, epoch=0, window=0)
    assert base == p(seed=0, epoch=0, window=0)
    assert base != p(seed=1, epoch=0, window=0)
    assert base != p(seed=0, epoch=1, window=0)
    assert base != p(seed=0, epoch=0, window=1)
