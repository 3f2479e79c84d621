import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from insitubatch_nodes.sampling.permute import epoch_chunk_order, rank_share, resolve_rank


def test_order_is_a_pure_function_of_seed_and_epoch():
    ids = np.arange(50)
    a = epoch_chunk_order(ids, seed=1, epoch=0)
    assert np.array_equal(a, epoch_chunk_order(ids, seed=1, epoch=0))
    assert not np.array_equal(a, epoch_chunk_order(ids, seed=1, epoch=1))
    assert not np.array_equal(a, epoch_chunk_order(ids, seed=2, epoch=0))
    assert sorted(a.tolist()) == list(range(50))


@given(n=st.integers(0, 200), w=st.integers(1, 8))
def test_rank_shares_are_disjoint_and_cover(n, w):
    order = epoch_chunk_order(np.arange(n), 0, 0)
    shares = [rank_share(order, r, w) for r in range(w)]
    assert sorted(np.concatenate(shares).tolist()) == list(range(n))


def test_resolve_rank_without_process_group():
    assert resolve_rank(None, None) == (0, 1)
    assert resolve_rank(1, 3) == (1, 3)
    with pytest.raises(ValueError, match="rank"):
        resolve_rank(3, 3)
    with pytest.raises(ValueError, match="give both"):
        resolve_rank(1, None)
