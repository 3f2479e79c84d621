"""Samples of several time steps (steps=): right steps across chunk edges, exactly once,
exact resume, reads; window= as the deprecated old name of steps=."""

import json

import numpy as np
import pandas as pd
import pytest
import xarray as xr
import zarr
from hypothesis import given, settings
from hypothesis import strategies as st
from stores import BLOSC, Var, state_after, write_store

import insitubatch_nodes as ib
from insitubatch_nodes.sampling.windows import SampleWindow


@pytest.fixture(scope="module")
def weather(tmp_path_factory):
    """Two variables chunked differently in time, a CF time coordinate, a level dim."""
    path = tmp_path_factory.mktemp("win") / "w.zarr"
    g = zarr.open_group(path, mode="w")
    n = 203
    rng = np.random.default_rng(0)
    a = g.create_array("t2m", shape=(n, 5, 6), chunks=(4, 5, 6), dtype="float32",
                       compressors=BLOSC, dimension_names=("time", "lat", "lon"))
    b = g.create_array("z", shape=(n, 3, 5, 6), chunks=(8, 3, 5, 6), dtype="float32",
                       dimension_names=("time", "level", "lat", "lon"))
    t = g.create_array("time", shape=(n,), dtype="int64", dimension_names=("time",),
                       attributes={"units": "hours since 1979-01-01", "calendar": "standard"})
    lev = g.create_array("level", shape=(3,), dtype="int64", dimension_names=("level",))
    data = {"t2m": (rng.standard_normal((n, 5, 6)) + np.arange(n)[:, None, None]).astype("f4"),
            "z": (rng.standard_normal((n, 3, 5, 6)) * 10 + 500).astype("float32")}
    a[:] = data["t2m"]
    b[:] = data["z"]
    t[:] = np.arange(n) * 24 * 30  # about monthly, so periods of years are easy
    lev[:] = [500, 850, 1000]
    return ib.open_source(path, sample_dim="time"), data


def epoch(loader):
    return [{k: v.numpy().copy() for k, v in b.items()} for b in loader]


WINDOWS = [SampleWindow(2, (1,)), SampleWindow(3, (1, 5), 2), SampleWindow(1, (7,)),
           SampleWindow(4, ())]


@pytest.mark.parametrize("win", WINDOWS, ids=str)
@pytest.mark.parametrize("block", [1, 3])
def test_windows_hold_the_right_steps_exactly_once(weather, win, block):
    src, data = weather
    m = ib.split_by_chunk(src, (1.0,))
    loader = ib.build_loader(src, m, "train", batch_size=7, block_chunks=block, steps=win)
    batches = epoch(loader)
    anchors = np.concatenate([b["sample_index"] for b in batches])
    assert sorted(anchors.tolist()) == list(range(win.before, 203 - win.after))
    for b in batches:
        a = b["sample_index"]
        for name, arr in data.items():
            np.testing.assert_array_equal(b[name], arr[a[:, None] + win.input_offsets])
            if win.lead:
                np.testing.assert_array_equal(b[f"target/{name}"],
                                              arr[a[:, None] + win.target_offsets])
        assert b["t2m"].shape[1] == win.history
        assert "target/t2m" in b or not win.lead


def test_each_chunk_read_once_plus_window_halos(weather):
    src, _ = weather
    win = SampleWindow(2, (1, 3))
    m = ib.split_by_chunk(src, (1.0,))
    block = 4
    loader = ib.build_loader(src, m, "train", batch_size=16, block_chunks=block, steps=win,
                             prefetch_next_epoch=False)  # two epochs' reads, no more
    for _ in range(2):
        epoch(loader)
        st = loader.stats()
    n_windows = -(-m.grid.n_chunks // block)
    # Per variable: every stripe once, plus at most one halo stripe on each side of a window.
    stripes = sum(v.n_sample_chunks for v in src.variables)
    assert stripes <= st.stripes_fetched / 2 <= stripes + 2 * n_windows * len(src.variables)
    assert st.bytes_fetched / 2 <= sum(v.n_sample_chunks * v.stripe_nbytes
                                       for v in src.variables) * (1 + 2 / block) + 1


@pytest.mark.parametrize("k", [0, 5, 13])
def test_resume_with_windows_is_exact(weather, k):
    src, _ = weather
    kw = dict(batch_size=6, block_chunks=2, steps=SampleWindow(2, (1, 4)), seed=3)
    m = ib.split_by_chunk(src, (1.0,))
    ref = ib.build_loader(src, m, "train", **kw)
    full, nxt = epoch(ref), epoch(ref)
    run = ib.build_loader(src, m, "train", **kw)
    it = iter(run)
    for _ in range(k):
        next(it)
    fresh = ib.build_loader(src, m, "train", **kw)
    fresh.load_state_dict(json.loads(json.dumps(run.state_dict())))
    for got, want in ((epoch(fresh), full[k:]), (epoch(fresh), nxt)):
        assert len(got) == len(want)
        for x, y in zip(got, want, strict=True):
            np.testing.assert_array_equal(x["sample_index"], y["sample_index"])
            np.testing.assert_array_equal(x["target/z"], y["target/z"])


def test_batches_carry_the_time_coordinate(weather):
    src, _ = weather
    m = ib.split_by_chunk(src, (1.0,))
    b = next(iter(ib.build_loader(src, m, "train", batch_size=5,
                                  steps=SampleWindow(2, (1,)))))
    want = (np.datetime64("1979-01-01", "ns")
            + b["sample_index"].numpy() * np.timedelta64(24 * 30, "h")).astype(np.int64)
    np.testing.assert_array_equal(b["time"].numpy(), want)


def test_window_validation():
    with pytest.raises(ValueError, match="history"):
        SampleWindow(0)
    with pytest.raises(ValueError, match="leads"):
        SampleWindow(2, (0, 1))
    assert SampleWindow(2, 6).lead == (6,)
    assert SampleWindow(3, (1, 6), 2).span == 4 + 12 + 1


@pytest.mark.parametrize("mode", ["contiguous", "random"])
def test_windows_never_read_another_splits_steps(weather, mode):
    """split_by_chunk leaves no steps free between splits: an anchor at a split's edge
    read the neighbouring split's steps as inputs or targets (validation targets in a
    training batch). The chunks holding such anchors are left out; everything else is
    served once."""
    src, _ = weather
    win = SampleWindow(2, (1, 3))
    m = ib.split_by_chunk(src, (0.6, 0.2, 0.2), seed=1, mode=mode)
    cs = m.chunk_size
    served = []
    for split in m.names:
        own = set(m.chunk_ids(split).tolist())
        try:
            batches = epoch(ib.build_loader(src, m, split, batch_size=5, block_chunks=2,
                                            steps=win))
        except ValueError as e:  # random splits: maybe no chunk of it is clear of the others
            assert mode == "random" and "left out" in str(e) and split in str(e)
            continue
        anchors = np.concatenate([b["sample_index"] for b in batches])
        steps = anchors[:, None] + np.concatenate([win.input_offsets, win.target_offsets])
        assert {int(s) // cs for s in steps.ravel()} <= own, split
        assert len(set(anchors.tolist())) == anchors.size > 0
        served.append(split)
        # an anchor left out is one whose steps reach outside the split (or the store)
        kept = set(anchors.tolist())
        for c in own:
            for a in range(c * cs, min((c + 1) * cs, 203)):
                inside = all((a + o) // cs in own and 0 <= a + o < 203
                             for o in range(-win.before, win.after + 1))
                if inside and all(((c * cs + k) - win.before) // cs in own
                                  and ((c * cs + k) + win.after) // cs in own
                                  and (c * cs + k) + win.after < 203
                                  for k in range(min(cs, 203 - c * cs))):
                    assert a in kept, (split, a)  # a whole clean chunk is served
    assert "train" in served and (mode == "random" or served == list(m.names))


def test_coordinate_splits_with_gap_and_leak_errors(weather):
    src, _ = weather
    win = SampleWindow(2, (1, 3))
    periods = {"train": ("1979", "1990"), "val": ("1991", "1993"), "test": ("1994", None)}
    m = ib.split_by_coordinate(src, periods, steps=win)
    assert m.mode == "coordinate" and m.gap == win.span - 1
    coord = src.sample_coord
    ranges = {k: m.ranges(k)[0] for k in m.names}
    for (a, b) in zip(m.names, m.names[1:], strict=False):
        assert ranges[b][0] * 4 - ranges[a][1] * 4 >= win.span - 1  # nothing shared
    first_val = coord[ranges["val"][0] * m.chunk_size]
    assert np.datetime64("1991-01-01") <= first_val < np.datetime64("1991-08-01")
    assert ib.SplitManifest.from_dict(json.loads(json.dumps(m.to_dict()))) == m
    with pytest.raises(ValueError, match="overlap from 1990"):
        ib.split_by_coordinate(src, {"train": ("1979", "1991"), "val": ("1990", "1993")})
    with pytest.raises(ValueError, match="would leak into 'val'"):
        ib.split_by_coordinate(src, {"train": ("1979", "1990"), "val": ("1991", "1993")},
                               steps=win, gap=0)
    with pytest.raises(ValueError, match="selects no steps"):
        ib.split_by_coordinate(src, {"train": ("2100", None)})


def test_a_coordinate_split_that_snapping_makes_leak_is_refused(tmp_path):
    """Periods 3 steps apart pass a window that needs 2 with gap=0, but snapped to chunks of
    8 they touch: that is refused too, not handed back as a leaking manifest."""
    g = zarr.open_group(tmp_path / "s.zarr", mode="w")
    g.create_array("x", shape=(40, 2), chunks=(8, 2), dtype="f4",
                   dimension_names=("time", "c"))[:] = 0
    g.create_array("time", shape=(40,), dtype="float64",
                   dimension_names=("time",))[:] = np.arange(40.0)
    src = ib.open_source(tmp_path / "s.zarr", sample_dim="time")
    periods = {"train": (0, 11), "val": (15, 39)}
    with pytest.raises(ValueError, match="'train' would leak into 'val': snapped to chunks"):
        ib.split_by_coordinate(src, periods, steps=SampleWindow(2, (1,)), gap=0)
    m = ib.split_by_coordinate(src, periods, steps=SampleWindow(2, (1,)))  # the default gap
    assert (m.ranges("val")[0][0] - m.ranges("train")[0][-1]) * 8 >= 2


def test_coordinate_split_needs_a_coordinate(tmp_path):
    g = zarr.open_group(tmp_path / "s.zarr", mode="w")
    g.create_array("x", shape=(20, 2), chunks=(4, 2), dtype="f4")
    src = ib.open_source(tmp_path / "s.zarr")
    with pytest.raises(ValueError, match="no coordinate"):
        ib.split_by_coordinate(src, {"train": ("1979", None)})


def test_stats_match_numpy_and_normalize(weather):
    src, data = weather
    m = ib.split_by_chunk(src, (0.75, 0.25))
    st = ib.compute_stats(src, m, "train", keep_dims=("level",), progress=False)
    rows = m.grid.samples_of(m.chunk_ids("train"))
    t = data["t2m"][rows].astype(np.float64)
    np.testing.assert_allclose(st["t2m"].mean, t.mean(), rtol=1e-10)
    np.testing.assert_allclose(st["t2m"].std, t.std(), rtol=1e-10)
    assert st["t2m"].min == t.min() and st["t2m"].max == t.max()
    z = data["z"][rows].astype(np.float64)
    assert st["z"].kept_dims == ("level",) and st["z"].mean.shape == (3,)
    np.testing.assert_allclose(st["z"].mean, z.mean(axis=(0, 2, 3)), rtol=1e-10)
    np.testing.assert_allclose(st["z"].std, z.std(axis=(0, 2, 3)), rtol=1e-10)
    again = ib.Stats.from_dict(json.loads(json.dumps(st.to_dict())))
    np.testing.assert_array_equal(again["z"].std, st["z"].std)

    import torch

    loader = ib.build_loader(src, m, "train", batch_size=300, stats=st, dtype=torch.bfloat16,
                             steps=SampleWindow(2, (1,)))
    (b,) = list(loader)
    assert b["t2m"].dtype == torch.bfloat16 and b["target/z"].dtype == torch.bfloat16
    zb = b["z"].float().numpy()
    assert np.all(np.abs(zb.mean(axis=(0, 1, 3, 4))) < 0.1)  # per level, about 0 and 1
    assert np.all(np.abs(zb.std(axis=(0, 1, 3, 4)) - 1) < 0.1)
    assert b["sample_index"].dtype == torch.int64  # untouched


def test_normalisation_keeps_the_precision_and_the_dims_of_the_statistics(tmp_path):
    """float64 data around 1e9 (and int64) were standardised in float32, which cannot hold
    the noise on top; statistics kept over two dims could not be broadcast; a negative "max"
    became 1e-12."""
    import torch

    g = zarr.open_group(tmp_path / "p.zarr", mode="w")
    rng = np.random.default_rng(0)
    n = 16
    big = 1e9 + rng.random((n, 3, 4))
    g.create_array("big", shape=big.shape, chunks=(4, 3, 4), dtype="float64",
                   dimension_names=("time", "lat", "lon"))[:] = big
    ints = (2**40 + rng.integers(0, 1000, (n, 3, 4))).astype("int64")
    g.create_array("ints", shape=ints.shape, chunks=(4, 3, 4), dtype="int64",
                   dimension_names=("time", "lat", "lon"))[:] = ints
    neg = -5.0 - rng.random((n, 2, 3, 4))
    g.create_array("neg", shape=neg.shape, chunks=(4, 2, 3, 4), dtype="float32",
                   dimension_names=("time", "level", "lat", "lon"))[:] = neg
    src = ib.open_source(tmp_path / "p.zarr")
    m = ib.split_by_chunk(src, (1.0,))
    st = ib.compute_stats(src, m, keep_dims=("level", "lat"), progress=False)
    assert st["neg"].mean.shape == (2, 3)
    (b,) = ib.build_loader(src, m, "train", batch_size=n, stats=st,
                           normalize={"neg": "max"})
    idx = b["sample_index"].numpy()
    assert b["big"].dtype == torch.float64 and b["ints"].dtype == torch.float32
    per_lat = (slice(None), None)  # statistics kept over lat (the sample's first axis)
    want = (big[idx] - big.mean(axis=(0, 2))[per_lat]) / big.std(axis=(0, 2))[per_lat]
    np.testing.assert_allclose(b["big"].numpy(), want, atol=1e-5)  # float32: ~1 std off
    wide = ints.astype(np.float64)
    wi = (wide[idx] - wide.mean(axis=(0, 2))[per_lat]) / wide.std(axis=(0, 2))[per_lat]
    np.testing.assert_allclose(b["ints"].numpy(), wi, atol=1e-5)
    hi = neg.astype(np.float64).max(axis=(0, 3))  # per (level, lat), negative
    np.testing.assert_allclose(b["neg"].numpy(), neg[idx] / hi[None, :, :, None], rtol=1e-6)


def test_xarray_dataset_in(weather, tmp_path):
    import warnings

    import xarray as xr

    src, _ = weather
    path = src.url.removeprefix("file://")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = xr.open_zarr(path, consolidated=False)
    from_ds = ib.open_source(ds, variables=["t2m"])
    assert from_ds.names == ("t2m",) and from_ds.sample_dim == "time"
    np.testing.assert_array_equal(from_ds.sample_coord, ds.time.values)
    with pytest.raises(ValueError, match="unsliced"):
        ib.open_source(ds.isel(time=slice(0, 10)))


def test_channels_stack_levels_in_the_given_order(weather):
    src, data = weather
    m = ib.split_by_chunk(src, (1.0,))
    win = SampleWindow(2, (1,))
    loader = ib.build_loader(src, m, "train", batch_size=9, steps=win,
                             channels=[("z", 850), "t2m", ("z", 500)])
    b = next(iter(loader))
    a = b["sample_index"].numpy()
    x, y = b["channels"].numpy(), b["target/channels"].numpy()
    assert x.shape == (9, 2, 3, 5, 6) and y.shape == (9, 1, 3, 5, 6)
    steps = a[:, None] + win.input_offsets
    np.testing.assert_array_equal(x[:, :, 0], data["z"][steps][:, :, 1])  # level 850
    np.testing.assert_array_equal(x[:, :, 1], data["t2m"][steps])
    np.testing.assert_array_equal(x[:, :, 2], data["z"][steps][:, :, 0])  # level 500
    assert "z" not in b and "t2m" not in b
    plain = next(iter(ib.build_loader(src, m, "train", batch_size=4, channels=["t2m"])))
    assert plain["channels"].shape == (4, 1, 5, 6)
    with pytest.raises(KeyError, match=r"level=700.*\[500, 850, 1000\]"):
        ib.build_loader(src, m, "train", channels=[("z", 700)])
    # A name alone stacks every level, in the order of the level coordinate.
    whole = next(iter(ib.build_loader(src, m, "train", batch_size=4, channels=["z", "t2m"])))
    rows = whole["sample_index"].numpy()
    assert whole["channels"].shape == (4, 4, 5, 6)
    np.testing.assert_array_equal(whole["channels"][:, :3].numpy(), data["z"][rows])
    np.testing.assert_array_equal(whole["channels"][:, 3].numpy(), data["t2m"][rows])


def test_a_level_pick_needs_level_y_x_samples(tmp_path):
    """A (time, level, cell) variable would have its *batch* axis selected: refused."""
    g = zarr.open_group(tmp_path / "g.zarr", mode="w")
    g.create_array("q", shape=(16, 3, 7), chunks=(4, 3, 7), dtype="float32",
                   dimension_names=("time", "level", "cell"))
    g.create_array("level", data=np.array([500, 850, 1000]), dimension_names=("level",))
    src = ib.open_source(tmp_path / "g.zarr", variables=["q"])
    m = ib.split_by_chunk(src, (1.0,))
    with pytest.raises(ValueError, match=r"needs samples shaped \(level, y, x\)"):
        ib.build_loader(src, m, "train", channels=[("q", 850)])


def test_stacking_samples_without_two_grid_dims_is_refused_at_build_time(tmp_path):
    """(time, cell) variables: channels stack on the axis before (y, x); the first batch
    used to fail inside the gather with numpy's message."""
    g = zarr.open_group(tmp_path / "g.zarr", mode="w")
    for name in ("a", "b"):
        g.create_array(name, shape=(16, 7), chunks=(1, 7), dtype="float32",
                       dimension_names=("time", "cell"))
    src = ib.open_source(tmp_path / "g.zarr")
    with pytest.raises(ValueError, match=r"stacking 'a' into channels needs samples shaped "
                       r"\(y, x\) or \(level, y, x\); its samples are \(7,\)"):
        ib.build_loader(src, ib.split_by_chunk(src, (1.0,)), "train", channels=["a", "b"])


def test_patches_cover_each_sample_patch_pair_once(weather):
    src, data = weather
    m = ib.split_by_chunk(src, (1.0,))
    loader = ib.build_loader(src, m, "train", batch_size=8, patch_size=(2, 3))
    pairs = []
    for b in loader:
        a, corner = b["sample_index"].numpy(), b["patch"].numpy()
        assert b["t2m"].shape[1:] == (2, 3) and b["z"].shape[1:] == (3, 2, 3)
        for i in range(len(a)):
            y, x = corner[i]
            np.testing.assert_array_equal(b["t2m"][i].numpy(), data["t2m"][a[i], y:y + 2, x:x + 3])
            pairs.append((int(a[i]), int(y), int(x)))
    # 5x6 grid, 2x3 patches: rows 0,2 (row 4 would not fit) x cols 0,3 = 4 patches per sample
    assert len(pairs) == len(set(pairs)) == 203 * 4
    with pytest.raises(ValueError, match="does not fit"):
        ib.build_loader(src, m, "train", patch_size=(9, 9))


def test_patches_of_variables_on_different_grids_are_refused(tmp_path):
    """One grid of patch corners (the first variable's) cut the others wrong or not at all:
    a variable on another grid came through whole, repeated per patch."""
    g = zarr.open_group(tmp_path / "g.zarr", mode="w")
    g.create_array("fine", shape=(8, 8, 8), chunks=(4, 8, 8), dtype="f4",
                   dimension_names=("time", "y", "x"))[:] = 1
    g.create_array("coarse", shape=(8, 4, 4), chunks=(4, 4, 4), dtype="f4",
                   dimension_names=("time", "y2", "x2"))[:] = 2
    src = ib.open_source(tmp_path / "g.zarr")
    m = ib.split_by_chunk(src, (1.0,))
    with pytest.raises(ValueError, match=r"their last 2 dims differ: \{'coarse': \(4, 4\), "
                                         r"'fine': \(8, 8\)\}"):
        ib.build_loader(src, m, "train", patch_size=(4, 4))


def test_static_fields_from_a_second_store(weather, tmp_path):
    src, _ = weather
    g = zarr.open_group(tmp_path / "static.zarr", mode="w")
    g.create_array("lsm", shape=(5, 6), dtype="float32")[:] = np.eye(5, 6, dtype="float32")
    fields = ib.open_static(tmp_path / "static.zarr", ["lsm"])
    with pytest.raises(KeyError, match=r"\['oro'\].*\['lsm'\]"):
        ib.open_static(tmp_path / "static.zarr", ["oro"])
    m = ib.split_by_chunk(src, (1.0,))
    b = next(iter(ib.build_loader(src, m, "train", batch_size=4, static=fields,
                                  patch_size=(5, 3))))
    assert b["static/lsm"].shape == (8, 5, 3)  # broadcast, then patched like the data
    np.testing.assert_array_equal(b["static/lsm"][1].numpy(), np.eye(5, 6)[:, 3:6])


def test_windows_across_ranks_and_elastic_resume(weather):
    src, _ = weather
    win = SampleWindow(2, (1, 2))
    m = ib.split_by_chunk(src, (1.0,))
    kw = dict(batch_size=5, block_chunks=3, steps=win, uneven="none")
    want = list(range(win.before, 203 - win.after))
    loaders = [ib.build_loader(src, m, "train", rank=r, world_size=2, **kw) for r in range(2)]
    seen, states = [], []
    for ld in loaders:
        it = iter(ld)
        for _ in range(4):
            seen += next(it)["sample_index"].tolist()
        states.append(ld.state_dict())
    merged = ib.merge_rank_states(states)
    rest = []
    for r in range(3):
        ld = ib.build_loader(src, m, "train", rank=r, world_size=3, **kw)
        ld.load_state_dict(merged)
        rest += [s for b in ld for s in b["sample_index"].tolist()]
    assert sorted(seen + rest) == want
    padded = [ib.build_loader(src, m, "train", rank=r, world_size=2, batch_size=5,
                              block_chunks=3, steps=win) for r in range(2)]
    assert len({sum(1 for _ in ld) for ld in padded}) == 1  # equal steps with windows too


def test_windows_on_one_step_chunks_mix_the_whole_split(tmp_path):
    """Runs long enough for the halo (<= 25% extra reads), several per window from
    scattered places: a batch mixes periods across the split, and the score says so."""
    write_store(tmp_path / "s.zarr", [Var("x", (1000, 4, 4), (1, 4, 4))])
    src = ib.open_source(tmp_path / "s.zarr")
    m = ib.split_by_chunk(src, (1.0,))
    w = SampleWindow(history=2, lead=(1,))
    n = 998  # anchors

    def run(**kw):
        loader = ib.build_loader(src, m, "train", batch_size=8, steps=w, **kw)
        batches = [b["sample_index"].numpy() for b in loader]
        assert sorted(np.concatenate(batches).tolist()) == list(range(1, 999))
        runs = -(-n // loader.run_chunks)
        measured = ib.measured_shuffle_quality(batches, loader.run_chunks, runs)
        spread = np.median([b.max() - b.min() for b in batches if len(b) == 8])
        st = loader.stats()
        return loader, spread, measured, st.stripes_fetched

    loader, spread, measured, stripes = run()
    assert spread >= 0.25 * n
    assert stripes <= 1.25 * 1000  # halo reads: at most 25% over the chunks themselves
    assert abs(loader.shuffle_quality - measured) <= 0.1
    # one long run per window (the old way): batches from consecutive dates, and a low score
    old, spread, measured, _ = run(block_chunks=16, run_chunks=16)
    assert spread < 0.05 * n
    assert old.shuffle_quality < 0.3 and abs(old.shuffle_quality - measured) <= 0.1
    with pytest.raises(ValueError, match="run_chunks=32 exceeds block_chunks=16"):
        ib.build_loader(src, m, "train", steps=w, block_chunks=16, run_chunks=32)


def test_a_state_from_another_run_length_is_refused(tmp_path):
    write_store(tmp_path / "s.zarr", [Var("x", (200, 2), (1, 2))])
    src = ib.open_source(tmp_path / "s.zarr")
    m = ib.split_by_chunk(src, (1.0,))
    w = SampleWindow(history=2, lead=(1,))
    loader = ib.build_loader(src, m, "train", batch_size=4, steps=w, block_chunks=16)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    other = ib.build_loader(src, m, "train", batch_size=4, steps=w, block_chunks=16,
                            run_chunks=4)
    with pytest.raises(ValueError, match=r"run_chunks: saved 8, this loader 4"):
        other.load_state_dict(state)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(8, 60), chunk=st.integers(1, 5), history=st.integers(1, 4),
       leads=st.lists(st.integers(1, 6), max_size=3, unique=True), stride=st.integers(1, 3),
       data=st.data())
def test_windows_leave_out_exactly_the_chunks_whose_read_steps_touch(n, chunk, history, leads,
                                                                     stride, data):
    """A chunk is left out iff one of its anchors *reads* a missing step (or a step of
    another split): its offsets, not its whole span (a stride or sparse leads skip most)."""
    from insitubatch_nodes.sampling.geometry import SampleGrid
    from insitubatch_nodes.sampling.windows import chunks_reaching, chunks_touching

    w = SampleWindow(history, tuple(leads), stride)
    if w.span > n:
        return
    grid = w.grid(SampleGrid(n_samples=n, chunk_size=chunk))
    n_chunks = -(-n // chunk)
    anchors = np.arange(grid.first, grid.end)
    reads = {c: {int(a + o) for a in anchors[anchors // chunk == c] for o in w.offsets}
             for c in range(n_chunks)}
    missing = sorted(data.draw(st.sets(st.integers(0, n - 1), max_size=4)))
    out = set(chunks_touching(missing, grid, w).tolist())
    for c in range(n_chunks):
        if reads[c]:  # chunks without a valid anchor may go either way: they serve nothing
            assert (c in out) == bool(reads[c] & set(missing)), c
    others = sorted(data.draw(st.sets(st.integers(0, n_chunks - 1), max_size=3)))
    mine = np.array([c for c in range(n_chunks) if c not in others], dtype=np.int64)
    got = set(chunks_reaching(mine, np.array(others, np.int64), grid, w).tolist())
    for c in mine.tolist():
        want = bool({s // chunk for s in reads[c]} & set(others))
        assert (c in got) == want, c


def _steps_store(path, n, chunk=1):
    write_store(path, [Var("x", (n, 3), (chunk, 3))])
    return ib.open_source(path)


@pytest.mark.parametrize("uneven", ["pad", "drop"])
def test_chunks_without_an_anchor_are_not_dealt_to_ranks(tmp_path, uneven):
    """17 one-step chunks, inputs (t-1, t), target t+1: chunks 0 and 16 hold no anchor.
    Dealt as blocks, the last (chunk 16 alone) left its rank empty: 'drop' then served
    nothing on every rank, 'pad' repeated a whole share. Left out, ranks share the 15."""
    src = _steps_store(tmp_path / "s.zarr", 17)
    m = ib.split_by_chunk(src, (1.0,))
    w = SampleWindow(2, (1,))
    per = []
    for rank in range(2):
        with ib.build_loader(src, m, "train", batch_size=4, steps=w, rank=rank,
                             world_size=2, uneven=uneven, seed=0) as ld:
            per.append([i for b in ld for i in b["sample_index"].tolist()])
    got = per[0] + per[1]
    assert len(per[0]) == len(per[1]) > 0
    assert set(got) <= set(range(1, 16))
    if uneven == "drop":
        assert len(set(got)) == len(got) >= 15 - 8
    else:
        assert set(got) == set(range(1, 16)) and len(got) - 15 < 8  # under a block repeated
    with pytest.raises(ValueError, match=r"world_size=3 exceeds the 2 blocks"):
        ib.build_loader(src, m, "train", steps=w, rank=0, world_size=3)


def test_a_window_or_split_without_samples_is_refused_by_name(tmp_path):
    src = _steps_store(tmp_path / "s.zarr", 40, chunk=4)
    with pytest.raises(ValueError, match=r"spans 45 steps, more than the 40 steps"):
        ib.build_loader(src, ib.split_by_chunk(src, (1.0,)), "train",
                        steps=SampleWindow(30, (15,)))
    m = ib.split_by_chunk(src, (0.9, 0.1))  # val: the last chunk, steps 36..39
    with pytest.raises(ValueError, match=r"split 'val' holds no sample of the time window "
                       r".*chunks \[9\] lie outside the steps 0..35"):
        ib.build_loader(src, m, "val", steps=SampleWindow(1, (4,)))
    with pytest.raises(ValueError, match=r"split 'val' holds no sample"):
        ib.SampleDataset(src, m, "val", steps=SampleWindow(1, (4,)))


@pytest.mark.parametrize(("kw", "match"), [
    (dict(history=2.5), r"history must be an integer >= 1 \(steps\), got 2.5"),
    (dict(history=True), r"history must be an integer >= 1 \(steps\), got True"),
    (dict(stride="2"), r"stride must be an integer >= 1 \(steps\), got '2'"),
    (dict(lead=(1.7,)), r"leads must be distinct integers >= 1, got \(1.7,\)"),
    (dict(lead=(2, 2)), r"leads must be distinct integers >= 1, got \(2, 2\)"),
    (dict(lead=None), r"lead must be a step count or a sequence of them"),
])
def test_a_window_takes_whole_steps_only(kw, match):
    """history=2.5 made inputs (t-1, t, t+1): the target step among the inputs."""
    with pytest.raises(ValueError, match=match):
        SampleWindow(**kw)
    assert SampleWindow(lead=3).lead == (3,) and SampleWindow(lead=[1, 6]).lead == (1, 6)


@pytest.mark.parametrize("window", [ib.SampleWindow(2, (1,)), ib.SampleWindow(1, (2, 6), stride=2)])
def test_n_samples_in_counts_the_anchors_a_loader_serves(tmp_path, window):
    write_store(tmp_path / "s.zarr", [Var("x", (50, 3), (4, 3))])
    src = ib.open_source(tmp_path / "s.zarr")
    m = ib.split_by_chunk(src, (1.0,))
    with ib.build_loader(src, m, "train", batch_size=5, steps=window) as ld:
        served = sum(len(b["sample_index"]) for b in ld)
    assert m.n_samples_in("train") == 50
    assert m.n_samples_in("train", steps=window) == served == 50 - window.span + 1


@pytest.fixture(scope="module")
def hourly(tmp_path_factory):
    """An hourly archive starting at 03 UTC, one step per chunk (as ARCO-ERA5), and a
    second store chunked 5 steps at a time."""
    out = {}
    for chunk in (1, 5):
        path = tmp_path_factory.mktemp("hourly") / f"h{chunk}.zarr"
        g = zarr.open_group(path, mode="w")
        n = 100
        g.create_array("x", shape=(n, 2), chunks=(chunk, 2), dtype="float32",
                       dimension_names=("time", "c"))[:] = np.arange(2 * n).reshape(n, 2)
        t = g.create_array("time", shape=(n,), dtype="int64", dimension_names=("time",),
                           attributes={"units": "hours since 2000-01-01 03:00",
                                       "calendar": "standard"})
        t[:] = np.arange(n)
        out[chunk] = ib.open_source(path, sample_dim="time")
    return out


@pytest.mark.parametrize("chunk", [1, 5])
@pytest.mark.parametrize(("every", "window"), [
    ("6h", None), (4, None), ("6h", SampleWindow(2, (1,))), ("1D", None)])
def test_every_keeps_those_anchors_each_once_and_resumes_exactly(hourly, chunk, every, window):
    src = hourly[chunk]
    m = ib.split_by_chunk(src, (1.0,))
    hours = (np.arange(100) + 3) % 24  # the store starts at 03 UTC
    if every == "6h":
        kept = np.flatnonzero(hours % 6 == 0)
    elif every == "1D":
        kept = np.flatnonzero(hours == 0)
    else:
        kept = np.arange(0, 100, every)
    if window is not None:
        kept = kept[(kept >= window.before) & (kept < 100 - window.after)]
    kw = dict(batch_size=3, seed=2, every=every, steps=window, block_chunks=4)
    with ib.build_loader(src, m, "train", **kw) as ld:
        assert len(ld) == -(-kept.size // 3)
        epochs = [[b["sample_index"].tolist() for b in ld] for _ in range(2)]
    for e in epochs:
        assert sorted(i for b in e for i in b) == kept.tolist()  # exactly once
    assert epochs[0] != epochs[1]  # reshuffled
    k = len(epochs[0]) // 2  # mid-epoch
    with ib.build_loader(src, m, "train", **kw) as a:
        state = state_after(a, k)
    with ib.build_loader(src, m, "train", **kw) as b:
        b.load_state_dict(state)
        assert [x["sample_index"].tolist() for x in b] == epochs[0][k:]
    # a state saved keeping other anchors is refused, naming the field
    with ib.build_loader(src, m, "train", **{**kw, "every": None}) as other, \
            pytest.raises(ValueError, match="every: saved"):
        other.load_state_dict(state)


def test_every_is_checked(hourly, tmp_path):
    src = hourly[1]
    m = ib.split_by_chunk(src, (1.0,))
    for bad, match in [("90min", "not a whole number"), ("soon", "not a duration"),
                       (0, "sampling.every must be an integer >= 1")]:
        with pytest.raises(ValueError, match=match):
            ib.build_loader(src, m, "train", every=bad)
    data = write_store(tmp_path / "plain.zarr", [Var("x", (30, 2), (1, 2))])  # no time axis
    plain = ib.open_source(tmp_path / "plain.zarr")
    with pytest.raises(ValueError, match="no time coordinate"):
        ib.build_loader(plain, ib.split_by_chunk(plain, (1.0,)), "train", every="6h")
    m = ib.split_by_chunk(plain, (1.0,))
    with ib.build_loader(plain, m, "train", every=7) as ld:
        assert sorted(i for b in ld for i in b["sample_index"].tolist()) == [0, 7, 14, 21, 28]
    ds = ib.SampleDataset(plain, m, "train", every=7)  # random access keeps the same ones
    assert ds.sample_indices.tolist() == [0, 7, 14, 21, 28]
    np.testing.assert_array_equal(ds[1]["x"], data["x"][7])
    _six_hourly(tmp_path / "holed.zarr", 12, 1, missing=[5])
    holed = ib.open_source(tmp_path / "holed.zarr")
    with pytest.raises(ValueError, match=r"every='12h' needs a regular time axis; .* steps are "
                                         r"0 days 06:00:00, 0 days 12:00:00"):
        ib.build_loader(holed, ib.split_by_chunk(holed, (1.0,)), "train", every="12h")


# -- steps= is the name; window= its deprecated alias ------------------------------------
def test_window_is_a_deprecated_alias_of_steps_naming_it(weather):
    src, _ = weather
    win = SampleWindow(2, (1,))
    periods = {"train": ("1979", "1990"), "val": ("1992", None)}
    with pytest.warns(DeprecationWarning, match=r"split_by_coordinate\(window=.*steps=") as w:
        old = ib.split_by_coordinate(src, periods, window=win)
    assert w[0].filename == __file__  # the warning points at the caller's line
    m = ib.split_by_coordinate(src, periods, steps=win)
    assert old == m
    with pytest.warns(DeprecationWarning, match=r"build_loader\(window=.*steps=") as w:
        old_loader = ib.build_loader(src, m, "train", batch_size=4, window=win)
    assert w[0].filename == __file__
    new_loader = ib.build_loader(src, m, "train", batch_size=4, steps=win)
    assert old_loader.config == new_loader.config and old_loader.config.sample.steps == win
    assert [b["sample_index"].tolist() for b in old_loader] == \
        [b["sample_index"].tolist() for b in new_loader]
    with pytest.warns(DeprecationWarning, match="steps="):
        ds = ib.SampleDataset(src, m, "train", window=win)
    assert ds.config.sample.steps == win
    with pytest.warns(DeprecationWarning, match="steps="):
        assert ib.LoaderConfig.of(window=win).sample.steps == win
    with pytest.warns(DeprecationWarning, match="steps="):
        assert m.n_samples_in("train", window=win) == m.n_samples_in("train", steps=win)
    assert "window" not in ib.LoaderConfig.of(steps=win).as_kwargs()


def test_steps_and_window_together_are_a_config_error(weather):
    src, _ = weather
    win = SampleWindow(2, (1,))
    periods = {"train": ("1979", "1990"), "val": ("1992", None)}
    with pytest.raises(ib.ConfigError, match="both steps=.*and window="):
        ib.split_by_coordinate(src, periods, steps=win, window=win)
    m = ib.split_by_coordinate(src, periods, steps=win)
    with pytest.raises(ib.ConfigError, match="both steps=.*and window="):
        ib.build_loader(src, m, "train", steps=win, window=win)
    with pytest.raises(ib.ConfigError, match="both steps=.*and window="):
        ib.LoaderConfig.of(steps=win, window=win)


def test_steps_raise_no_deprecation_warning(weather, recwarn):
    src, _ = weather
    win = SampleWindow(2, (1,))
    m = ib.split_by_coordinate(src, {"train": ("1979", "1990"), "val": ("1992", None)},
                               steps=win)
    ib.build_loader(src, m, "train", batch_size=4, steps=win).shutdown()
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning)]


# -- gaps in the sample coordinate ------------------------------------------------------
SIX_HOURS = np.timedelta64(6, "h")


def _six_hourly(path, n: int, chunk: int, missing=()) -> xr.Dataset:
    """``t2m`` every 6 hours from 2020-01-01, ``missing`` steps never written (a date an
    archive lacks), ``chunk`` steps a chunk; values that say their step."""
    times = np.delete(np.datetime64("2020-01-01", "ns") + np.arange(n) * SIX_HOURS, missing)
    values = np.broadcast_to(np.arange(times.size, dtype="f4")[:, None, None],
                             (times.size, 3, 4)).copy()
    ds = xr.Dataset({"t2m": (("time", "lat", "lon"), values)},
                    coords={"time": times, "lat": [10.0, 0.0, -10.0], "lon": np.arange(4.0)})
    ds.to_zarr(path, encoding={"t2m": {"chunks": (chunk, 3, 4)}})
    return ds


def _evenly_spaced(times, chunk, win) -> list[int]:
    """The anchors a loader may serve: its read steps ``o * 6h`` from it, in chunks where
    every anchor's are (whole chunks go, as for missing steps)."""
    anchors = range(win.before, times.size - win.after)
    ok = {a: all(times[a + o] - times[a] == o * SIX_HOURS for o in win.offsets.tolist())
          for a in anchors}
    bad = {a // chunk for a, good in ok.items() if not good}
    return [a for a, good in ok.items() if good and a // chunk not in bad]


@pytest.mark.parametrize("chunk", [1, 3])
def test_windows_never_cross_a_step_the_store_lacks(tmp_path, chunk):
    """A 6-hourly store missing two dates: each window served reads its steps at their
    offsets in hours (never a 12-hour gap read as 6), each such anchor once."""
    ds = _six_hourly(tmp_path / "s.zarr", 40, chunk, missing=[17, 30])
    src = ib.open_source(tmp_path / "s.zarr")
    win = SampleWindow(2, (1, 2))
    batches = epoch(ib.build_loader(src, ib.split_by_chunk(src, (1.0,)), "train",
                                    batch_size=5, steps=win))
    anchors = np.concatenate([b["sample_index"] for b in batches])
    assert sorted(anchors.tolist()) == _evenly_spaced(ds["time"].values, chunk, win)
    for b in batches:
        a = b["sample_index"]
        np.testing.assert_array_equal(b["t2m"], ds["t2m"].values[a[:, None] + win.input_offsets])


def test_windows_of_an_inner_join_never_cross_a_date_a_member_lacks(tmp_path):
    full = _six_hourly(tmp_path / "full.zarr", 40, 1)
    _six_hourly(tmp_path / "holed.zarr", 40, 1, missing=[17])
    src = ib.join([ib.open_source(tmp_path / "full.zarr"),
                   ib.open_source(tmp_path / "holed.zarr").rename({"t2m": "other"})],
                  align="inner")
    times = np.delete(full["time"].values, [17])
    np.testing.assert_array_equal(src.sample_coord, times)
    win = SampleWindow(1, (1,))
    batches = epoch(ib.build_loader(src, ib.split_by_chunk(src, (1.0,)), "train",
                                    batch_size=4, steps=win))
    anchors = sorted(np.concatenate([b["sample_index"] for b in batches]).tolist())
    assert anchors == _evenly_spaced(times, 1, win) and 16 not in anchors


def test_calendar_months_are_steps_not_gaps(tmp_path):
    """Monthly means (28 to 31 days apart) are regular in their calendar: every anchor."""
    months = pd.date_range("2000-01-01", periods=30, freq="MS").values
    ds = xr.Dataset({"t2m": (("time", "lat", "lon"), np.zeros((30, 3, 4), "f4"))},
                    coords={"time": months, "lat": [1.0, 0.0, -1.0], "lon": np.arange(4.0)})
    ds.to_zarr(tmp_path / "m.zarr", encoding={"t2m": {"chunks": (1, 3, 4)}})
    src = ib.open_source(tmp_path / "m.zarr")
    win = SampleWindow(3, (1,))
    batches = epoch(ib.build_loader(src, ib.split_by_chunk(src, (1.0,)), "train",
                                    batch_size=4, steps=win))
    assert sorted(np.concatenate([b["sample_index"] for b in batches]).tolist()) == list(
        range(2, 29))


def test_windows_on_a_coordinate_that_turns_back_are_refused_naming_where(tmp_path):
    """A date written twice (or out of order): windows count steps along the axis, so they
    would read other times; refused naming the index and both values. One step a sample
    reads no neighbour: served. A decreasing axis is evenly spaced too: served."""
    times = np.datetime64("2020-01-01", "ns") + np.arange(12) * SIX_HOURS
    times[6] = times[5]
    ds = xr.Dataset({"t2m": (("time", "lat"), np.zeros((12, 3), "f4"))},
                    coords={"time": times, "lat": [1.0, 0.0, -1.0]})
    ds.to_zarr(tmp_path / "twice.zarr", encoding={"t2m": {"chunks": (1, 3)}})
    src = ib.open_source(tmp_path / "twice.zarr")
    m = ib.split_by_chunk(src, (1.0,))
    with pytest.raises(ib.ConfigError, match=r"'time', which does not move one way: "
                                             r"2020-01-02T06:00:00.* at index 5, then "
                                             r"2020-01-02T06:00:00"):
        ib.build_loader(src, m, "train", steps=SampleWindow(2, (1,)))
    with ib.build_loader(src, m, "train", batch_size=4) as ld:
        assert sorted(i for b in ld for i in b["sample_index"].tolist()) == list(range(12))
    depth = xr.Dataset({"v": (("z", "x"), np.arange(24, dtype="f4").reshape(8, 3))},
                       coords={"z": np.arange(8.0)[::-1] * 2.5, "x": [0.0, 1.0, 2.0]})
    depth.to_zarr(tmp_path / "depth.zarr", encoding={"v": {"chunks": (2, 3)}})
    down = ib.open_source(tmp_path / "depth.zarr", sample_dim="z")
    batches = epoch(ib.build_loader(down, ib.split_by_chunk(down, (1.0,)), "train",
                                    batch_size=3, steps=SampleWindow(2, (1,))))
    assert sorted(np.concatenate([b["sample_index"] for b in batches]).tolist()) == list(
        range(1, 7))
