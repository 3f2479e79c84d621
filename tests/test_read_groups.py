"""Reader groups, the dealing half (issue 43): balanced parts of the grid, the grid axis,
samples dealt by model group (equal steps, uneven, elastic resume), states across read
groups, and the refusals; each rank's batches its part of the stored grid, and under torchrun
(4 processes, gloo) ``gather_grid`` rebuilding the whole. The reading half
(``Source.grid_part``) is stubbed where a test is about the deal only (``whole_grid``)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from stores import BLOSC, Var, write_store

import insitubatch_nodes as ib
from insitubatch_nodes import graph
from insitubatch_nodes.nodes.read_groups import static_part
from insitubatch_nodes.sampling.grid_parts import deal_of, grid_axis


def anemoi_sizes(num_elements: int, num_partitions: int) -> list[int]:
    """anemoi-core's ``get_balanced_partition_sizes``, written out as it defines it."""
    chunk_size, remainder = divmod(num_elements, num_partitions)
    return [chunk_size + 1 if i < remainder else chunk_size for i in range(num_partitions)]


# -- balanced parts --------------------------------------------------------------------------

def test_balanced_sizes_examples():
    assert ib.balanced_sizes(10, 4) == [3, 3, 2, 2]
    assert ib.balanced_sizes(181, 2) == [91, 90]
    assert ib.balanced_sizes(181, 4) == [46, 45, 45, 45]
    assert ib.balanced_sizes(40320, 3) == [13440] * 3  # o96 cells
    assert [ib.balanced_part(181, 2, i) for i in range(2)] == [slice(0, 91), slice(91, 181)]
    assert [ib.balanced_part(7, 3, i) for i in range(3)] == [slice(0, 3), slice(3, 5),
                                                            slice(5, 7)]


@given(st.integers(0, 5000), st.integers(1, 64))
def test_balanced_parts_are_anemois_and_tile_the_grid(n, k):
    sizes = ib.balanced_sizes(n, k)
    assert sizes == anemoi_sizes(n, k)
    assert sum(sizes) == n and max(sizes) - min(sizes) <= 1
    assert all(s == sizes[0] for s in sizes[: n % k])  # the first n % k are the larger
    parts = [ib.balanced_part(n, k, i) for i in range(k)]
    covered = np.concatenate([np.arange(n)[p] for p in parts])
    assert covered.tolist() == list(range(n))  # contiguous, in order, each cell once
    assert [p.stop - p.start for p in parts] == sizes


@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("n", [181, 40320, 40321, 13, 7])
def test_balanced_parts_for_groups_of_2_3_4(n, k):
    parts = [ib.balanced_part(n, k, i) for i in range(k)]
    assert [p.stop - p.start for p in parts] == anemoi_sizes(n, k)
    assert parts[0].start == 0 and parts[-1].stop == n
    assert all(a.stop == b.start for a, b in zip(parts, parts[1:], strict=False))


def test_balanced_refusals_name_the_value():
    with pytest.raises(ib.ConfigError, match="k must be an integer >= 1, got 0"):
        ib.balanced_sizes(10, 0)
    with pytest.raises(ib.ConfigError, match=r"part i must be an integer in 0\.\.3, got 4"):
        ib.balanced_part(10, 4, 4)


# -- the grid axis -----------------------------------------------------------------------

@pytest.mark.parametrize(("dims", "ndim", "axis"), [
    (("time", "lat", "lon"), 3, 1),
    (("time", "level", "lat", "lon"), 4, 2),
    (("time", "latitude", "longitude"), 3, 1),
    (("time", "lon", "lat"), 3, 2),  # by name, not position
    (("time", "y", "x"), 3, 1),
    (("time", "values"), 2, 1),
    (("time", "ensemble", "cell"), 3, 2),
    (("time", "isobaricInhPa", "latitude", "longitude"), 4, 2),
    (("time", "member", "foo", "bar"), 4, 2),  # the first name that is not a level
    (("time", "level"), 2, None),  # only levels: no grid
    (None, 3, 1), (None, 4, 2), (None, 2, 1), (None, 5, 3),  # by position
    (None, 1, None), (("time",), 1, None),
])
def test_grid_axis(dims, ndim, axis):
    assert grid_axis(dims, ndim) == axis


def test_grid_axis_of_an_anemoi_dataset_is_its_cells():
    assert grid_axis(("time", "variable", "ensemble", "cell"), 4, last=True) == 3
    assert grid_axis(("dates", "variables", "ensembles", "foo"), 4, last=True) == 3


# -- the deal ----------------------------------------------------------------------------

def test_deal_of():
    d = deal_of(5, 8, 2)
    assert (d.group, d.groups, d.member) == (2, 4, 1)
    with pytest.raises(ib.ConfigError, match=r"read_group=3 does not divide world_size=4.*"
                                              r"\[1, 2, 4\]"):
        deal_of(0, 4, 3)
    with pytest.raises(ib.ConfigError, match=r"read_group must be an integer >= 1 \(ranks "
                                              r"per model group.*got 0"):
        deal_of(0, 4, 0)


@pytest.fixture
def whole_grid(monkeypatch):
    """The reading half stubbed: each rank reads the whole grid (its part is still
    computed and exposed), so these tests are about the deal alone."""
    monkeypatch.setattr(graph, "cut_grid", lambda source, part, axes: source)


@pytest.fixture(scope="module")
def weather(tmp_path_factory):
    """99 steps (13 chunks of 8, a short last one), t (time, lat, lon) and z (time, level,
    lat, lon) on a 181-row grid."""
    path = tmp_path_factory.mktemp("read_groups") / "w.zarr"
    data = write_store(path, [
        Var("t", (99, 181, 4), (8, 181, 4), compressors=BLOSC,
            extra=dict(dimension_names=("time", "lat", "lon"))),
        Var("z", (99, 3, 181, 4), (8, 3, 181, 4), compressors=BLOSC,
            extra=dict(dimension_names=("time", "level", "lat", "lon")))])
    src = ib.open_source(path)
    return src, ib.split_by_chunk(src, (1.0,)), data


def _loaders(src, m, world, group, **kw):
    return [ib.build_loader(src, m, "train", rank=r, world_size=world, read_group=group,
                            block_chunks=2, **kw) for r in range(world)]


def _epoch(loaders):
    return [[b["sample_index"].tolist() for b in ld] for ld in loaders]


@pytest.mark.parametrize("uneven", ["none", "pad", "drop"])
@pytest.mark.parametrize(("world", "group"), [(4, 2), (6, 3), (6, 2), (4, 4)])
def test_a_model_group_is_dealt_as_one_rank(weather, whole_grid, uneven, world, group):
    src, m, _ = weather
    loaders = _loaders(src, m, world, group, batch_size=5, uneven=uneven)
    alone = _loaders(src, m, world // group, 1, batch_size=5, uneven=uneven)
    for _ in range(2):  # two epochs: re-dealt alike
        got, want = _epoch(loaders), _epoch(alone)
        for r in range(world):  # every rank of a group: the group's samples, in order
            assert got[r] == want[r // group]
        if uneven == "none":
            seen = sorted(s for g in range(0, world, group) for b in got[g] for s in b)
            assert seen == list(range(99))  # the groups disjoint, together the split once
        if uneven != "none":
            assert len({len(r) for r in got}) == 1  # equal steps across all ranks
    n = 181
    for r, ld in enumerate(loaders):
        assert ld.grid_part == ib.balanced_part(n, group, r % group)
        assert ld.grid_axes == {"t": 1, "z": 2} and ld.grid_axis == -2
        ld.close()
    for ld in alone:
        ld.close()


def test_read_group_1_serves_the_whole_grid(weather):
    src, m, _ = weather
    ld = ib.build_loader(src, m, "train", batch_size=4, block_chunks=2)
    assert ld.grid_part == slice(None) and ld.grid_axes == {} and ld.grid_axis is None
    assert "read_group" not in ld.state_dict()["fingerprint"]  # states as before


def test_read_group_refusals(weather, whole_grid, tmp_path):
    src, m, _ = weather
    with pytest.raises(ib.ConfigError, match=r"read_group=3 does not divide world_size=4"):
        ib.build_loader(src, m, "train", rank=0, world_size=4, read_group=3)
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ib.ConfigError, match=r"sampling\.read_group must be an integer"):
            ib.build_loader(src, m, "train", read_group=bad)
    # more model groups than chunks: named as groups
    with pytest.raises(ib.ConfigError, match=r"world_size=28 in model groups of read_group=2 "
                                             r"\(14 groups\) exceeds the 13 chunks"):
        ib.build_loader(src, m, "train", rank=0, world_size=28, read_group=2)
    # variables on two grids: each named with its dims
    path = tmp_path / "two.zarr"
    write_store(path, [Var("a", (16, 181, 4), (8, 181, 4),
                           extra=dict(dimension_names=("time", "lat", "lon"))),
                       Var("b", (16, 91, 4), (8, 91, 4),
                           extra=dict(dimension_names=("time", "lat", "lon")))])
    two = ib.open_source(path)
    tm = ib.split_by_chunk(two, (1.0,))
    with pytest.raises(ib.ConfigError, match=r"disagree on the grid \(a \{'time': 16, 'lat': "
                                             r"181, 'lon': 4\}: axis 1 of 181; b .*axis 1 of 91"):
        ib.build_loader(two, tm, "train", rank=0, world_size=2, read_group=2)
    ib.build_loader(two.select(["a"]), tm, "train", rank=0, world_size=2, read_group=2).close()
    # a variable with only the sample axis: nothing to cut
    path = tmp_path / "series.zarr"
    write_store(path, [Var("a", (16, 9), (8, 9)), Var("s", (16,), (8,))])
    series = ib.open_source(path)
    with pytest.raises(ib.ConfigError, match=r"variables \['s \(16,\)'\] have no grid axis"):
        ib.build_loader(series, ib.split_by_chunk(series, (1.0,)), "train", rank=0,
                        world_size=2, read_group=2)
    # a grid of fewer rows than the group
    path = tmp_path / "three.zarr"
    write_store(path, [Var("a", (16, 3), (8, 3))])
    three = ib.open_source(path)
    with pytest.raises(ib.ConfigError, match=r"read_group=4 exceeds the 3 rows \(cells\) of "
                                             r"the grid \(a \(16, 3\)\)"):
        ib.build_loader(three, ib.split_by_chunk(three, (1.0,)), "train", rank=0,
                        world_size=4, read_group=4)


def test_static_fields_are_cut_along_the_grid(weather):
    src, _, _ = weather
    part, axes = slice(91, 181), {"t": 1, "z": 2}
    lsm = np.arange(181 * 4, dtype=np.float32).reshape(181, 4)
    out = static_part({"lsm": lsm, "lsm3": lsm[None], "lon": np.arange(4.0),
                       "t_lsm": torch.from_numpy(lsm)}, src, part, axes)
    np.testing.assert_array_equal(out["lsm"], lsm[91:])
    np.testing.assert_array_equal(out["lsm3"], lsm[None, 91:])
    np.testing.assert_array_equal(out["lon"], np.arange(4.0))  # no grid axis: whole
    assert torch.equal(out["t_lsm"], torch.from_numpy(lsm[91:]))
    with pytest.raises(ib.ConfigError, match=r"static field 'bad' has shape \(90, 4\)"):
        static_part({"bad": np.zeros((90, 4))}, src, part, axes)


# -- states ------------------------------------------------------------------------------

def _take(loader, k):
    it = iter(loader)
    return [next(it)["sample_index"].tolist() for _ in range(k)]


def test_a_read_group_state_resumes_alone_on_as_many_groups(weather, whole_grid):
    """4 ranks in groups of 2 saved mid-epoch: the states of ranks 0 and 2 resume on 2 ranks
    without reader groups (the same deal), rank 3's on rank 2 (its group's other rank);
    group 1's on group 0 is refused, as is a state on another number of groups."""
    src, m, _ = weather
    kw = dict(batch_size=5, uneven="none")
    before = _loaders(src, m, 4, 2, **kw)
    seen = [_take(ld, 3) for ld in before]
    states = [ld.state_dict() for ld in before]
    assert states[0]["fingerprint"]["read_group"] == 2
    assert states[0]["fingerprint"]["world_size"] == 2  # the deal's: groups
    assert states[0]["progress"] == states[1]["progress"]
    want = _epoch(_loaders(src, m, 2, 1, **kw))  # the uninterrupted run, dealt alone
    alone = _loaders(src, m, 2, 1, **kw)
    for r, ld in enumerate(alone):
        ld.load_state_dict(states[2 * r])
    rest = _epoch(alone)
    for g in range(2):
        assert seen[2 * g] + rest[g] == want[g]
    again = _loaders(src, m, 4, 2, **kw)
    again[2].load_state_dict(states[3])  # another rank of the same group: the same deal
    with pytest.raises(ib.StateError, match=r"rank: saved 1, this loader 0 .*rank // G"):
        again[0].load_state_dict(states[2])
    with pytest.raises(ib.StateError, match=r"world_size: saved 2, this loader 1"):
        _loaders(src, m, 4, 4, **kw)[0].load_state_dict(states[0])
    for ld in before + alone + again:
        ld.close()


@pytest.mark.parametrize(("after_world", "after_group"), [(3, 1), (6, 3), (2, 2), (1, 1)])
def test_merged_read_group_states_resume_on_another_group_count(weather, whole_grid,
                                                                after_world, after_group):
    src, m, _ = weather
    kw = dict(batch_size=4, uneven="none")
    before = _loaders(src, m, 4, 2, **kw)
    seen = [_take(ld, k) for ld, k in zip(before, [2, 2, 3, 3], strict=True)]
    states = [ld.state_dict() for ld in before]
    merged = json.loads(json.dumps(ib.merge_rank_states(states)))
    assert merged == ib.merge_rank_states([states[0], states[2]])  # one per group: the same
    after = _loaders(src, m, after_world, after_group, **kw)
    for ld in after:
        ld.load_state_dict(merged)
    rest = _epoch(after)
    for r in range(after_world):
        assert rest[r] == rest[r - r % after_group]  # a group's ranks alike
    done = [s for g in (0, 2) for b in seen[g] for s in b]
    done += [s for r in range(0, after_world, after_group) for b in rest[r] for s in b]
    assert sorted(done) == list(range(99))  # exactly once over the resume
    nxt = _epoch(after)  # and the next epoch is dealt on the new groups
    assert sorted(s for r in range(0, after_world, after_group) for b in nxt[r]
                  for s in b) == list(range(99))
    for ld in before + after:
        ld.close()


def test_merge_refuses_a_group_whose_ranks_disagree(weather, whole_grid):
    src, m, _ = weather
    loaders = _loaders(src, m, 4, 2, batch_size=4, uneven="none")
    for ld, k in zip(loaders, [2, 3, 1, 1], strict=True):  # rank 1 one step ahead of rank 0
        _take(ld, k)
    states = [ld.state_dict() for ld in loaders]
    with pytest.raises(ib.StateError, match=r"ranks 0 and 1 are model group 0 \(read_group=2\)"
                                            r".*progress differ"):
        ib.merge_rank_states(states)
    with pytest.raises(ib.StateError, match=r"got 3 states saved with read_group=2 on 2 model "
                                            r"groups: pass every rank's state \(2 \* 2\)"):
        ib.merge_rank_states(states[:3])
    mixed = [states[0], ib.build_loader(src, m, "train", rank=1, world_size=2, batch_size=4,
                                        uneven="none", block_chunks=2).state_dict()]
    with pytest.raises(ib.StateError, match="different read_group values"):
        ib.merge_rank_states(mixed)
    for ld in loaders:
        ld.close()


def test_gather_grid_without_a_group_of_several_returns_the_part():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised here")
    with pytest.raises(ib.LoaderUsageError, match="initialised torch.distributed"):
        ib.gather_grid(torch.zeros(2, 3))


# -- with the reading half: each rank's batches are its part of the stored grid -----------

def _batches(loader):
    with loader:
        return [{k: v.numpy().copy() for k, v in b.items()} for b in loader]


@pytest.mark.parametrize("group", [2, 3, 4])
def test_anemoi_cells_are_cut_by_the_balanced_rule(tmp_path, group):
    from anemoi_stores import read_anemoi, write_anemoi

    path = write_anemoi(tmp_path / "a.zarr", ("2t", "10u", "msl"), "2020-01-01", 12,
                        n_cells=101)  # odd: 101 = 26 + 25 + 25 + 25 in 4
    stored = read_anemoi(path).data
    src = ib.open_source(path)
    m = ib.split_by_chunk(src, (1.0,))
    joined = []
    for r in range(group):
        ld = ib.build_loader(src, m, "train", rank=r, world_size=group, read_group=group,
                             batch_size=4, block_chunks=4)
        part = ib.balanced_part(101, group, r)
        assert ld.grid_part == part and ld.grid_axes == {"data": 3} and ld.grid_axis == -1
        got = _batches(ld)
        for b in got:
            np.testing.assert_array_equal(b["data"], stored[b["sample_index"]][..., part])
        joined.append(got)
    for k in range(len(joined[0])):  # the members' parts of a batch, joined, are the samples
        whole = np.concatenate([j[k]["data"] for j in joined], axis=-1)
        np.testing.assert_array_equal(whole, stored[joined[0][k]["sample_index"]])


def test_the_grid_axis_of_anemoi_batches_with_channels_last(tmp_path):
    """(batch, cells, variables): the cells one from the end, where gather_grid joins the
    parts."""
    from anemoi_stores import read_anemoi, write_anemoi

    path = write_anemoi(tmp_path / "a.zarr", ("2t", "msl"), "2020-01-01", 8, n_cells=11)
    stored = read_anemoi(path).data  # (dates, variables, ensemble, cells)
    src = ib.open_source(path)
    m = ib.split_by_chunk(src, (1.0,))
    joined = []
    for r in range(2):
        ld = ib.build_loader(src, m, "train", rank=r, world_size=2, read_group=2,
                             batch_size=4, block_chunks=4, channels_last=True,
                             drop_ensemble=True)
        assert ld.grid_axis == -2
        joined.append(_batches(ld))
    for k in range(len(joined[0])):
        whole = np.concatenate([j[k]["data"] for j in joined], axis=-2)
        want = np.moveaxis(stored[joined[0][k]["sample_index"]][:, :, 0], 1, -1)
        np.testing.assert_array_equal(whole, want)


def test_latitude_rows_of_a_181_row_grid(weather):
    src, m, data = weather
    lsm = np.arange(181 * 4, dtype=np.float32).reshape(181, 4)
    for r in range(2):
        ld = ib.build_loader(src, m, "train", rank=r, world_size=2, read_group=2,
                             batch_size=5, block_chunks=2, static={"lsm": lsm})
        part = ib.balanced_part(181, 2, r)
        for b in _batches(ld):
            np.testing.assert_array_equal(b["t"], data["t"][b["sample_index"]][:, part])
            np.testing.assert_array_equal(b["z"], data["z"][b["sample_index"]][:, :, part])
            np.testing.assert_array_equal(b["static/lsm"][0], lsm[part])


# -- 4 processes under torchrun ------------------------------------------------------------

@pytest.mark.torchrun
def test_torchrun_4_ranks_in_read_groups_of_2(tmp_path):
    """4 processes, read_group=2, gloo on CPU: within each group the same samples in the same
    order, the two groups disjoint and together the split exactly once; each rank's parts,
    joined along the grid, are the stored samples, and gather_grid returns them on every
    rank of the group (uneven parts: 181 rows are 91 + 90)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import zarr

    store = tmp_path / "w.zarr"
    write_store(store, [
        Var("t", (32, 181, 4), (4, 181, 4), compressors=BLOSC,
            extra=dict(dimension_names=("time", "lat", "lon"))),
        Var("z", (32, 3, 181, 4), (4, 3, 181, 4), compressors=BLOSC,
            extra=dict(dimension_names=("time", "level", "lat", "lon")))])
    script = Path(__file__).with_name("read_group_ranks.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
           str(script), "--store", str(store), "--out", str(tmp_path), "--read-group", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    meta = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    got = [np.load(tmp_path / f"rank{r}.npz") for r in range(4)]
    assert [m["grid_part"] for m in meta] == [[0, 91], [91, 181]] * 2
    assert all(m["axes"] == {"t": 1, "z": 2} and m["axis"] == -2 for m in meta)
    assert meta[0]["samples"] == meta[1]["samples"] and meta[2]["samples"] == meta[3]["samples"]
    groups = [[s for b in meta[r]["samples"] for s in b] for r in (0, 2)]
    assert not set(groups[0]) & set(groups[1])
    assert sorted(groups[0] + groups[1]) == list(range(32))
    stored = zarr.open_group(store, mode="r")
    for r in (0, 2):
        for k, samples in enumerate(meta[r]["samples"]):
            for name, axis in (("t", 1), ("z", 2)):
                want = stored[name][np.asarray(samples)]
                joined = np.concatenate([got[r][f"part/{name}/{k}"],
                                         got[r + 1][f"part/{name}/{k}"]], axis=axis)
                np.testing.assert_array_equal(joined, want)
                assert got[r][f"part/{name}/{k}"].shape[axis] == 91
                for q in (r, r + 1):
                    np.testing.assert_array_equal(got[q][f"whole/{name}/{k}"], want)
