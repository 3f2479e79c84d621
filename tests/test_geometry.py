import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from insitubatch_nodes.sampling.geometry import SampleGrid, common_chunk_size


@given(n=st.integers(1, 300), cs=st.integers(1, 40), data=st.data())
def test_samples_of_matches_chunk_ranges(n, cs, data):
    grid = SampleGrid(n, cs)
    ids = data.draw(st.lists(st.integers(0, grid.n_chunks - 1), unique=True, max_size=10))
    want = [s for c in ids for s in range(*grid.chunk_range(c))]
    assert grid.samples_of(np.array(ids, dtype=np.int64)).tolist() == want
    assert grid.n_samples_of(np.array(ids, dtype=np.int64)) == len(want)


def test_last_chunk_is_short():
    grid = SampleGrid(101, 8)
    assert grid.n_chunks == 13
    assert grid.chunk_range(12) == (96, 101)
    assert grid.n_samples_of(np.array([12])) == 5


@pytest.mark.parametrize(("chunks", "want"), [([8], 8), ([8, 4], 8), ([8, 12], 24), ([7, 64], 64)])
def test_common_chunk_size(chunks, want):
    assert common_chunk_size(chunks) == want
