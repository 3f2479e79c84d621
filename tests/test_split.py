import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from stores import Var

import insitubatch_nodes as ib
from insitubatch_nodes.store.splits import _apportion


@pytest.fixture
def source(store_factory):
    path, _ = store_factory([Var("x", (103, 4), (8, 4))])
    return ib.open_source(path)


@given(n=st.integers(0, 500), fr=st.lists(st.integers(0, 10), min_size=1, max_size=5))
def test_apportion_sums_and_is_proportional(n, fr):
    if sum(fr) == 0:
        return
    fractions = [f / sum(fr) for f in fr]
    counts = _apportion(n, fractions)
    assert sum(counts) == n
    for c, f in zip(counts, fractions, strict=True):
        assert abs(c - f * n) < 1.0 + 1e-9
        if f == 0:
            assert c == 0


def test_contiguous_blocks_cover_every_chunk_once(source):
    m = ib.split_by_chunk(source, (0.8, 0.1, 0.1))
    assert m.chunk_size == 8 and source.grid.n_chunks == 13
    ids = np.concatenate([m.chunk_ids(n) for n in m.names])
    assert sorted(ids.tolist()) == list(range(13))
    # contiguous: one range per split, in order
    assert all(len(m.ranges(n)) == 1 for n in m.names)
    assert m.ranges("train")[0][0] == 0 and m.ranges("test")[0][1] == 13
    assert sum(m.n_samples_in(n) for n in m.names) == 103


def test_zero_fraction_is_a_valid_empty_split(source):
    m = ib.split_by_chunk(source, fractions=(1.0, 0.0, 0.0))
    assert len(m.chunk_ids("train")) == 13
    assert m.chunk_ids("val").size == 0 and m.chunk_ids("test").size == 0


def test_random_mode_is_a_seeded_partition(source):
    orders = set()
    for seed in range(20):
        m = ib.split_by_chunk(source, (0.5, 0.5), seed=seed, mode="random")
        a, b = m.chunk_ids("train"), m.chunk_ids("val")
        assert not set(a) & set(b) and len(a) + len(b) == 13
        orders.add(tuple(a))
    assert len(orders) > 10


def test_json_round_trip(source, tmp_path):
    m = ib.split_by_chunk(source, (0.7, 0.3), seed=4, names=("fit", "holdout"))
    p = tmp_path / "m.json"
    m.to_json(p)
    json.loads(p.read_text())
    m2 = ib.SplitManifest.from_json(p)
    assert m2 == m
    assert m2.names == ("fit", "holdout")


@pytest.mark.parametrize(
    ("fractions", "match"),
    [((0.5, 0.6), "sum to 1"), ((1.2, -0.2), ">= 0"), ((float("nan"), 1.0), ">= 0")],
)
def test_bad_fractions_are_named(source, fractions, match):
    with pytest.raises(ValueError, match=match):
        ib.split_by_chunk(source, fractions)


@pytest.mark.parametrize(("kw", "match"), [
    (dict(fractions=(0.5, 0.5), names=("train", "")), "non-empty strings"),
    (dict(seed=-1, mode="random"), r"seed must be an integer >= 0, got -1"),
    (dict(seed=1.5), r"seed must be an integer >= 0, got 1.5"),
])
def test_splits_that_would_be_empty_or_misnamed_are_refused_at_once(source, kw, match):
    with pytest.raises(ValueError, match=match):
        ib.split_by_chunk(source, **{"fractions": (1.0,), **kw})


def test_a_coordinate_out_of_order_is_refused_by_coordinate_splits(tmp_path):
    """searchsorted on a newest-first time axis selected the wrong steps silently."""
    import zarr

    g = zarr.open_group(tmp_path / "s.zarr", mode="w")
    g.create_array("x", shape=(16, 2), chunks=(4, 2), dtype="f4",
                   dimension_names=("time", "a"))[:] = 0
    t = g.create_array("time", shape=(16,), dtype="int64", dimension_names=("time",),
                       attributes={"units": "days since 2000-01-01", "calendar": "standard"})
    t[:] = np.arange(16)[::-1]
    src = ib.open_source(tmp_path / "s.zarr", sample_dim="time")
    with pytest.raises(ValueError, match=r"needs 'time' increasing, but it goes from "
                       r"2000-01-16.* \(step 0\) to 2000-01-15"):
        ib.split_by_coordinate(src, {"train": (None, "2000-01-05")})


def test_unknown_split_lists_splits(source):
    m = ib.split_by_chunk(source)
    with pytest.raises(KeyError, match=r"'nope'.*\['train', 'val', 'test'\]"):
        m.chunk_ids("nope")


def test_manifest_for_another_store_is_refused(source, store_factory):
    path, _ = store_factory([Var("x", (50, 4), (8, 4))])
    other = ib.open_source(path)
    m = ib.split_by_chunk(source)
    with pytest.raises(ValueError, match="103 samples"):
        ib.build_loader(other, m, "train")


def test_bad_manifest_version(tmp_path):
    with pytest.raises(ValueError, match="version"):
        ib.SplitManifest.from_dict({"version": 99})
