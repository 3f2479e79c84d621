import pytest

import insitubatch_nodes as ib


def test_quality_rises_with_block_chunks_to_one():
    blocks = (1, 2, 4, 8, 16, 32, 64, 250)
    scores = [ib.shuffle_quality(250, 8, b, 8) for b in blocks]
    assert all(a < b for a, b in zip(scores, scores[1:], strict=False))
    assert scores[-1] == pytest.approx(1.0)
    assert 0 < scores[0] < 0.2
    # A batch larger than the window spans whole windows: flat there, then rising.
    big = [ib.shuffle_quality(250, 8, b, 32) for b in blocks]
    assert all(a <= b for a, b in zip(big, big[1:], strict=False)) and big[-1] == 1.0


def test_recommend_reaches_quality():
    b = ib.recommend_block_chunks(250, 8, 32, quality=0.8)
    assert ib.shuffle_quality(250, 8, b, 32) >= 0.8
    assert ib.shuffle_quality(250, 8, b - 1, 32) < 0.8


def test_bad_arguments():
    with pytest.raises(ValueError):
        ib.shuffle_quality(10, 8, 0, 32)
