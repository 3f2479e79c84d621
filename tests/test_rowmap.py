"""RowMap: which member row serves each sample of a composed variable, checked against the
definition (a per-sample table of (member, row)) over many random compositions."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from insitubatch_nodes.errors import ConfigError
from insitubatch_nodes.sampling.rowmap import RowMap, RowRun


@st.composite
def tables(draw):
    """A per-sample table: each sample a (member, row) or a gap (-1), rows of one member
    increasing within a stretch (as compositions make them)."""
    n = draw(st.integers(0, 60))
    member = np.full(n, -1, dtype=np.int64)
    local = np.zeros(n, dtype=np.int64)
    g = 0
    while g < n:
        length = draw(st.integers(1, n - g))
        if draw(st.booleans()):  # a stretch of one member, at some start and step
            member[g:g + length] = draw(st.integers(0, 3))
            local[g:g + length] = (draw(st.integers(0, 50))
                                   + draw(st.integers(1, 4)) * np.arange(length))
        g += length
    return member, local


@given(tables())
@settings(max_examples=200, deadline=None)
def test_of_locations_serves_every_sample_from_its_row(table):
    member, local = table
    rows = RowMap.of_locations(member, local)
    got_member, got_local = rows.locate(np.arange(member.size))
    np.testing.assert_array_equal(got_member, member)
    np.testing.assert_array_equal(got_local[member >= 0], local[member >= 0])
    assert rows.gaps() == tuple(int(i) for i in np.flatnonzero(member < 0))


@given(tables(), st.lists(st.integers(1, 5), min_size=4, max_size=4), st.integers(1, 7))
@settings(max_examples=200, deadline=None)
def test_pieces_fill_each_stripe_from_the_right_member_rows(table, chunks, stripe):
    member, local = table
    rows = RowMap.of_locations(member, local)
    for start in range(0, member.size, stripe):
        stop = min(start + stripe, member.size)
        filled = np.full(stop - start, -1, dtype=np.int64)
        for p in rows.pieces(start, stop, tuple(chunks)):
            c = chunks[p.member]
            src = np.arange(c)[p.src] + p.stripe * c  # the member rows the piece copies
            dst = np.arange(stop - start)[p.dst]
            assert src.size == dst.size
            assert (member[start + dst] == p.member).all()
            np.testing.assert_array_equal(local[start + dst], src)
            assert (filled[dst] == -1).all(), "a row filled twice"
            filled[dst] = p.member
        np.testing.assert_array_equal(filled, member[start:stop])


@given(tables(), st.integers(0, 10), st.integers(1, 4), st.integers(0, 20))
@settings(max_examples=100, deadline=None)
def test_take_is_every_kth_sample(table, first, every, n):
    member, local = table
    rows = RowMap.of_locations(member, local)
    n = max(0, min(n, (member.size - first + every - 1) // every))
    taken = rows.take(first, every, n)
    want = first + every * np.arange(n)
    np.testing.assert_array_equal(taken.locate(np.arange(n))[0], member[want])
    ok = member[want] >= 0
    np.testing.assert_array_equal(taken.locate(np.arange(n))[1][ok], local[want][ok])


def test_runs_must_be_ascending_and_inside():
    with pytest.raises(ConfigError, match="ascending"):
        RowMap((RowRun(5, 8, 0, 0), RowRun(2, 4, 0, 0)), 10)
    with pytest.raises(ConfigError, match="inside"):
        RowMap((RowRun(0, 12, 0, 0),), 10)


def test_identity_is_one_array_as_stored():
    assert RowMap.identity(5).is_identity
    assert not RowMap.identity(5).take(1, 1, 4).is_identity
