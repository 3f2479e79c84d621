"""Several stores as one source (issue 42), on stores written by xarray in the layouts people
train on (``composed_stores``): a WB2-like pressure-level store (Zarr v2, 13 levels a chunk)
joined with a single-level store (Zarr v3, 4 steps a chunk) beside an invariants store; two
periods of one archive (v2 and v3, other chunkings, one on S3 through moto) concatenated.

Every value is checked against xarray's own (``xr.merge`` / ``xr.concat`` of the datasets
written), at each batch's ``sample_index``, never against a copy of the code."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import xarray as xr
import zarr
from composed_stores import (
    LATITUDE,
    LEVELS,
    PERIOD_LEVELS,
    on_moto,
    six_hourly,
    write_invariants,
    write_period,
    write_pressure_levels,
    write_single_level,
)
from stores import state_after

import insitubatch_nodes as ib

TIMES = six_hourly("2020-01-01", 48)
PL = ("temperature", "geopotential")
SL = ("2m_temperature", "total_precipitation")
INV = ("land_sea_mask", "geopotential_at_surface")


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """Every store the tests open, written once: {name: (path, the dataset written)}."""
    root = tmp_path_factory.mktemp("compose")
    out = {}

    def add(name, writer, *args, **kw):
        path = root / f"{name}.zarr"
        out[name] = (path, writer(path, *args, **kw))

    add("levels", write_pressure_levels, TIMES, zarr_format=2)
    add("single", write_single_level, TIMES, zarr_format=3)
    add("invariants", write_invariants)
    add("single-late", write_single_level, six_hourly("2020-01-02T12", 48), zarr_format=3)
    add("single-shifted", write_single_level, TIMES + pd.Timedelta("6h"), zarr_format=3)
    add("early", write_period, TIMES[:24], zarr_format=2, chunk=3)
    add("late", write_period, TIMES[24:], zarr_format=3, chunk=4)
    add("before-gap", write_period, TIMES[:16], zarr_format=2, chunk=4)
    add("after-gap", write_period, TIMES[24:40], zarr_format=3, chunk=4)
    add("overlapping", write_period, TIMES[20:44], zarr_format=3, chunk=4)
    return out


@pytest.fixture(scope="module")
def on_s3(stores):
    """The late period served on S3 by moto: (opened source, dataset)."""
    path, ds = stores["late"]
    with on_moto(path) as (url, options):
        yield url, options, ds


def open_(stores, name, **kw):
    return ib.open_source(stores[name][0], **kw)


def epoch(loader):
    return [{k: v.numpy().copy() for k, v in b.items()} for b in loader]


def loader_of(src, **kw):
    kw.setdefault("batch_size", 8)
    kw.setdefault("seed", 0)
    return ib.build_loader(src, ib.split_by_chunk(src, (1.0,)), "train", **kw)


def check_rows(batches, expected, names, n=None):
    """Each batch row is ``expected`` (an xarray dataset) at that row's ``sample_index``,
    its ``time`` the dataset's; with ``n``, every sample of ``range(n)`` is served once."""
    seen = []
    times = expected["time"].values.astype("datetime64[ns]").astype(np.int64)
    for b in batches:
        idx = b["sample_index"]
        seen.extend(idx.tolist())
        np.testing.assert_array_equal(b["time"], times[idx])
        for name in names:
            np.testing.assert_array_equal(b[name], expected[name].values[idx], err_msg=name)
    if n is not None:
        assert sorted(seen) == list(range(n))


def same_batches(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


# -- the stores themselves (no composition) ---------------------------------------------
def test_the_stores_have_the_layouts_people_use(stores):
    pl = zarr.open_group(stores["levels"][0], mode="r")
    assert pl.metadata.zarr_format == 2
    assert pl["temperature"].chunks == (1, 13, 8, 16)  # the 13 levels in one chunk
    np.testing.assert_array_equal(pl["level"][:], LEVELS)
    assert (stores["levels"][0] / ".zmetadata").exists()  # consolidated, as WB2
    sl = zarr.open_group(stores["single"][0], mode="r")
    assert sl.metadata.zarr_format == 3
    assert sl["2m_temperature"].chunks == (4, 8, 16)
    assert list(sl["2m_temperature"].metadata.dimension_names) == ["time", "latitude",
                                                                   "longitude"]
    inv = zarr.open_group(stores["invariants"][0], mode="r")
    assert sorted(inv.array_keys()) == sorted([*INV, "latitude", "longitude"])
    np.testing.assert_array_equal(pl["latitude"][:], LATITUDE)
    assert LATITUDE[0] > LATITUDE[-1]  # descending, as ERA5
    for path, _ in stores.values():
        assert sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) < 2 * 2**20


def test_values_make_a_wrong_row_obvious(stores):
    _, pl = stores["levels"]
    _, early = stores["early"]
    _, late = stores["late"]
    t = pl["temperature"].values
    # time step * 10_000 + level * 200 + cell (+ the variable's fraction)
    assert t[5, 2, 0, 3] == 5 * 10_000 + 2 * 200 + 3 + 0.25
    assert (np.diff(t[:, 0, 0, 0]) == 10_000).all()
    assert not np.isin(early["2m_temperature"].values, late["2m_temperature"].values).any()
    with xr.open_zarr(stores["single"][0], consolidated=False) as back:
        xr.testing.assert_identical(back.load(), stores["single"][1])
    for name in ("levels", "single"):  # one store each opens as today
        src = open_(stores, name)
        assert src.sample_dim == "time" and src.n_samples == 48


def test_a_store_served_by_moto_opens_and_reads_the_same(on_s3, tmp_path):
    url, options, ds = on_s3
    src = ib.open_source(url, storage_options=options)
    assert src.url == url and src.n_samples == 24
    batches = epoch(loader_of(src, batch_size=5))
    check_rows(batches, ds, ("temperature", "2m_temperature"), n=24)


# -- join --------------------------------------------------------------------------------
def test_a_join_serves_xr_merge_beside_the_invariants(stores):
    src = ib.join([open_(stores, "levels"), open_(stores, "single")])
    assert set(src.names) == {*PL, *SL}
    assert src.n_samples == 48
    assert [m.url for m in src.members] == [open_(stores, n).url for n in ("levels", "single")]
    merged = xr.merge([stores["levels"][1], stores["single"][1]])
    inv = stores["invariants"][1]
    static = ib.open_static(stores["invariants"][0])
    loader = loader_of(src, batch_size=7, seed=3, sample=ib.SampleConfig(static=static))
    batches = epoch(loader)
    check_rows(batches, merged, (*PL, *SL), n=48)
    for b in batches:
        n = len(b["sample_index"])
        assert b["temperature"].shape == (n, 13, 8, 16)
        for name in INV:
            np.testing.assert_array_equal(b[f"static/{name}"],
                                          np.broadcast_to(inv[name].values, (n, 8, 16)))
    # the next epoch: reshuffled, still exactly xr.merge's rows
    again = epoch(loader)
    check_rows(again, merged, (*PL, *SL), n=48)
    assert [b["sample_index"].tolist() for b in again] != [b["sample_index"].tolist()
                                                            for b in batches]


def test_a_join_reads_a_subset_of_levels_in_the_channels(stores):
    src = ib.join([open_(stores, "levels"), open_(stores, "single")])
    merged = xr.merge([stores["levels"][1], stores["single"][1]])
    channels = [("temperature", 850), ("geopotential", 500), "2m_temperature"]
    batches = epoch(loader_of(src, channels=channels, batch_size=6))
    want = np.stack([merged["temperature"].sel(level=850).values,
                     merged["geopotential"].sel(level=500).values,
                     merged["2m_temperature"].values], axis=1)
    seen = []
    for b in batches:
        idx = b["sample_index"]
        seen.extend(idx.tolist())
        np.testing.assert_array_equal(b["channels"], want[idx])
    assert sorted(seen) == list(range(48))


def test_exact_refuses_other_times_naming_the_member_and_the_first_value(stores):
    levels, shifted = open_(stores, "levels"), open_(stores, "single-shifted")
    with pytest.raises(ib.InsitubatchError) as e:
        ib.join([levels, shifted], align="exact")
    text = str(e.value)
    assert shifted.url in text or "single-shifted" in text, text
    assert "2020-01-01T06" in text, text  # its first time, where the levels have 00 UTC
    with pytest.raises(ib.InsitubatchError, match="single-shifted"):
        ib.join([levels, shifted])  # exact is the default


def test_inner_serves_the_common_times_each_member_at_its_own_indices(stores):
    # single-late starts 6 steps later (not on its 4-step chunk boundary)
    src = ib.join([open_(stores, "levels"), open_(stores, "single-late")], align="inner")
    merged = xr.merge([stores["levels"][1], stores["single-late"][1]], join="inner")
    assert merged.sizes["time"] == 42
    assert src.n_samples == 42
    np.testing.assert_array_equal(src.sample_coord, merged["time"].values)
    batches = epoch(loader_of(src, batch_size=5, seed=1))
    check_rows(batches, merged, (*PL, *SL), n=42)


def test_a_join_keeps_each_members_levels(stores):
    """A 13-level store joined with one of 3 levels: a level picked by value, a variable's
    levels stacked and its statistics' rows are that variable's own store's (its level 850
    is the 2nd of 3, the other's the 11th of 13), as xarray selects them."""
    three = open_(stores, "early").rename({"temperature": "t3", "2m_temperature": "t2"})
    src = ib.join([open_(stores, "levels"), three], align="inner")
    merged = xr.merge([stores["levels"][1],
                       stores["early"][1].rename({"temperature": "t3", "2m_temperature": "t2"})
                       .drop_vars("level").rename({"level": "level3"})], join="inner")
    merged = merged.assign_coords(level3=PERIOD_LEVELS)
    with loader_of(src, channels=[("t3", 850), ("temperature", 850)]) as ld:
        assert ld.channel_names == ("t3@850", "temperature@850")
        seen = []
        for b in epoch(ld):
            idx = b["sample_index"]
            seen += idx.tolist()
            np.testing.assert_array_equal(b["channels"][:, 0],
                                          merged["t3"].sel(level3=850).values[idx])
            np.testing.assert_array_equal(b["channels"][:, 1],
                                          merged["temperature"].sel(level=850).values[idx])
    assert sorted(seen) == list(range(merged.sizes["time"]))
    with loader_of(src, channels=["t3"]) as ld:
        assert ld.channel_names == ("t3@500", "t3@850", "t3@1000")
        for b in epoch(ld):
            np.testing.assert_array_equal(b["channels"], merged["t3"].values[b["sample_index"]])
    stats = ib.compute_stats(src, ib.split_by_chunk(src, (1.0,)), variables=["t3"],
                             progress=False)
    assert stats["t3"].coords == tuple(PERIOD_LEVELS.tolist())
    np.testing.assert_allclose(stats["t3"].at(850)[0],
                               stores["early"][1]["temperature"].sel(level=850).mean(), rtol=1e-6)


def test_a_join_of_grids_that_differ_is_refused_naming_the_dimension(stores, tmp_path):
    """Latitudes stored south to north beside a store north to south: one shape, other
    points. Served side by side they would be misaligned; refused."""
    flipped = stores["single"][1].isel(latitude=slice(None, None, -1)).rename(
        {"2m_temperature": "t2", "total_precipitation": "tp"})
    flipped.to_zarr(tmp_path / "flipped.zarr")
    with pytest.raises(ib.StoreError, match=r"join: the 'latitude' of member 1 .*flipped.zarr"
                       r"\) differs from member 0's .* at index 0: -90.0 against 90.0: a join "
                       r"serves its variables on one grid"):
        ib.join([open_(stores, "levels"), ib.open_source(tmp_path / "flipped.zarr")])


def test_a_concat_of_periods_on_other_levels_is_refused_naming_them(stores, tmp_path):
    other = stores["late"][1].assign_coords(level=[300, 500, 700])
    other.to_zarr(tmp_path / "other-levels.zarr")
    with pytest.raises(ib.StoreError, match=r"concat: the 'level' of variable 'temperature' "
                       r"in member 1 .*other-levels.zarr\) differs from member 0's .* at index "
                       r"0: 300 against 500"):
        ib.concat([open_(stores, "early"), ib.open_source(tmp_path / "other-levels.zarr")])


def test_invariants_as_dataarrays_land_on_the_points_they_describe(stores, tmp_path):
    """An invariants store written south to north on longitudes -180..180 (the data: north
    to south on 0..360), opened by xarray, its DataArrays given as static fields (one
    transposed): each value is served at its own point, over a region too; a field
    lacking a point of the data's grid is refused naming it."""
    inv = stores["invariants"][1]
    turned = inv.isel(latitude=slice(None, None, -1)).assign_coords(
        longitude=(((inv["longitude"] + 180) % 360) - 180)).sortby("longitude")
    turned.to_zarr(tmp_path / "turned.zarr")
    opened = xr.open_zarr(tmp_path / "turned.zarr")
    static = {"lsm": opened["land_sea_mask"],
              "orography": opened["geopotential_at_surface"].transpose("longitude", "latitude")}
    src = open_(stores, "single")
    for part in (src, src.region(latitude=(-20, 70), longitude=(-100, 60))):
        want = inv.sel(latitude=part.coordinate("latitude", "2m_temperature"),
                       longitude=part.coordinate("longitude", "2m_temperature"))
        with loader_of(part, static=static) as ld:
            b = next(iter(ld))
        np.testing.assert_array_equal(b["static/lsm"][0].numpy(), want["land_sea_mask"].values)
        np.testing.assert_array_equal(b["static/orography"][0].numpy(),
                                      want["geopotential_at_surface"].values)
    north = opened["land_sea_mask"].sel(latitude=slice(0, 90))
    with pytest.raises(ib.ConfigError, match=r"static field 'lsm' has no latitude -.* a point "
                                             r"of the data's grid"):
        loader_of(src, static={"lsm": north})


def test_a_name_two_members_serve_is_refused_unless_renamed(stores):
    # the levels' first 24 steps and the early period (its own temperature on 3 levels)
    levels = open_(stores, "levels").period(end="2020-01-06T18")
    early = open_(stores, "early")
    with pytest.raises(ib.InsitubatchError, match="temperature"):
        ib.join([levels, early])
    src = ib.join([levels, early.drop(["2m_temperature"]).rename({"temperature": "t3"})])
    assert set(src.names) == {*PL, "t3"}
    want = stores["early"][1]
    batches = epoch(loader_of(src, batch_size=6))
    for b in batches:
        np.testing.assert_array_equal(b["t3"], want["temperature"].values[b["sample_index"]])


# -- select / drop / rename / period -----------------------------------------------------
def test_select_drop_rename_on_a_join(stores):
    join = ib.join([open_(stores, "levels"), open_(stores, "single")])
    merged = xr.merge([stores["levels"][1], stores["single"][1]])
    chosen = join.select(["2m_temperature", "temperature"])
    assert chosen.names == ("2m_temperature", "temperature")  # the order given
    dropped = join.drop(["geopotential", "total_precipitation"])
    assert set(dropped.names) == {"temperature", "2m_temperature"}
    renamed = join.rename({"2m_temperature": "t2m"})
    assert "t2m" in renamed.names and "2m_temperature" not in renamed.names
    for src, names in ((chosen, ("2m_temperature", "temperature")),
                       (dropped, ("temperature", "2m_temperature"))):
        batches = epoch(loader_of(src, batch_size=9))
        assert {k for k in batches[0] if k in (*PL, *SL)} == set(names)
        check_rows(batches, merged, names, n=48)
    batches = epoch(loader_of(renamed, batch_size=9))
    check_rows(batches, merged.rename({"2m_temperature": "t2m"}), ("t2m", "temperature"),
               n=48)
    with pytest.raises(ib.UnknownNameError, match="no_such"):
        join.select(["no_such"])
    with pytest.raises(ib.InsitubatchError):
        join.rename({"2m_temperature": "temperature"})  # onto a name already served


def test_period_by_coordinate_value_inclusive_and_frequency(stores):
    join = ib.join([open_(stores, "levels"), open_(stores, "single")])
    merged = xr.merge([stores["levels"][1], stores["single"][1]])
    part = join.period(start="2020-01-03", end="2020-01-08T18")
    want = merged.sel(time=slice("2020-01-03", "2020-01-08T18"))  # xarray: inclusive
    assert part.n_samples == want.sizes["time"] == 24
    check_rows(epoch(loader_of(part, batch_size=5)), want, (*PL, *SL), n=24)
    daily = join.period(start="2020-01-03", frequency="12h")
    want = merged.sel(time=slice("2020-01-03", None))
    want = want.sel(time=want["time"].dt.hour.isin([0, 12]))
    np.testing.assert_array_equal(daily.sample_coord, want["time"].values)
    check_rows(epoch(loader_of(daily, batch_size=5)), want, (*PL, *SL), n=want.sizes["time"])


# -- concat ------------------------------------------------------------------------------
def test_two_periods_one_on_s3_concatenated_equal_xr_concat(stores, on_s3):
    url, options, late = on_s3
    src = ib.concat([open_(stores, "early"),  # Zarr v2, 3 steps a chunk
                     ib.open_source(url, storage_options=options)])  # Zarr v3, 4, on S3
    want = xr.concat([stores["early"][1], late], dim="time")
    assert src.n_samples == 48
    np.testing.assert_array_equal(src.sample_coord, want["time"].values)
    assert [m.url for m in src.members][1] == url  # no credentials in it
    assert all(options["secret_access_key"] not in m.url for m in src.members)
    batches = epoch(loader_of(src, batch_size=7, seed=5))
    check_rows(batches, want, ("temperature", "2m_temperature"), n=48)


def test_overlapping_periods_are_refused_naming_a_date(stores):
    with pytest.raises(ib.InsitubatchError, match="2020-01-06"):
        ib.concat([open_(stores, "early"), open_(stores, "overlapping")])  # from 01-06 00 UTC
    with pytest.raises(ib.InsitubatchError):  # out of order
        ib.concat([open_(stores, "late"), open_(stores, "early")])


def test_a_gap_between_periods_is_missing_samples_never_served(stores):
    src = ib.concat([open_(stores, "before-gap"), open_(stores, "after-gap")])
    # 16 steps, a gap of 8 (2020-01-05 00 UTC to 2020-01-06 18 UTC), 16 steps
    assert src.n_samples == 40
    np.testing.assert_array_equal(src.sample_coord, TIMES[:40].values)
    assert tuple(src.missing) == tuple(range(16, 24))
    want = xr.concat([stores["before-gap"][1], stores["after-gap"][1]], dim="time")
    want = want.reindex(time=TIMES[:40])  # the gap: NaN rows, which must never be served
    batches = epoch(loader_of(src, batch_size=6))
    served = sorted(i for b in batches for i in b["sample_index"].tolist())
    assert served == [i for i in range(40) if not 16 <= i < 24]
    check_rows(batches, want, ("temperature", "2m_temperature"))
    # a time window never crosses the gap
    win = ib.SampleWindow(2, (1,))
    batches = epoch(loader_of(src, batch_size=6, steps=win))
    anchors = [i for b in batches for i in b["sample_index"].tolist()]
    # an anchor reads a - 1, a, a + 1: none of them in the gap (16..23) nor out of the store;
    # splits leave out whole chunks, so fewer anchors may be served near the gap
    valid = set(range(1, 15)) | set(range(25, 39))
    assert len(anchors) == len(set(anchors)) and set(anchors) <= valid, sorted(anchors)
    assert {1, 2, 36, 37, 38} <= set(anchors)
    for b in batches:
        a = b["sample_index"]
        read = a[:, None] + np.concatenate([win.input_offsets, win.target_offsets])
        assert not np.isin(read, np.arange(16, 24)).any()
        values = want["2m_temperature"].values
        np.testing.assert_array_equal(b["2m_temperature"], values[a[:, None] + win.input_offsets])
        np.testing.assert_array_equal(b["target/2m_temperature"],
                                      values[a[:, None] + win.target_offsets])


def test_every_across_the_members_of_a_concat(stores):
    src = ib.concat([open_(stores, "early"), open_(stores, "late")])
    hours = TIMES.hour.values
    kept = np.flatnonzero(hours % 12 == 0).tolist()
    batches = epoch(loader_of(src, batch_size=5, every="12h"))
    assert sorted(i for b in batches for i in b["sample_index"].tolist()) == kept
    want = xr.concat([stores["early"][1], stores["late"][1]], dim="time")
    check_rows(batches, want, ("temperature", "2m_temperature"))


def test_a_concat_resumes_mid_epoch_exactly(stores):
    def build():
        src = ib.concat([open_(stores, "early"), open_(stores, "late")])
        return loader_of(src, batch_size=5, seed=11, block_chunks=2)

    ref = build()
    full, nxt = epoch(ref), epoch(ref)
    want = xr.concat([stores["early"][1], stores["late"][1]], dim="time")
    check_rows(full, want, ("temperature", "2m_temperature"), n=48)
    for k in (3, len(full) - 1):
        state = state_after(build(), k)
        resumed = build()
        resumed.load_state_dict(state)
        same_batches(epoch(resumed), full[k:])
        same_batches(epoch(resumed), nxt)


# -- states and executors ----------------------------------------------------------------
def test_a_state_of_a_join_is_refused_by_a_join_whose_member_changed(stores, tmp_path):
    single = tmp_path / "single.zarr"
    write_single_level(single, TIMES, zarr_format=3, steps_per_chunk=4)

    def join():
        return ib.join([open_(stores, "levels"), ib.open_source(single)])

    saved = ib.split_by_chunk(join(), (1.0,))  # the manifest saved beside the state
    kw = dict(batch_size=8, seed=0)
    state = state_after(ib.build_loader(join(), saved, "train", **kw), 2)
    resumed = ib.build_loader(join(), saved, "train", **kw)  # the same composition resumes
    resumed.load_state_dict(state)
    assert len(epoch(resumed)) == 4

    def refused(src):
        """The message of resuming ``state`` into ``src``: with the saved manifest, and with
        one made for ``src``; each must name the member (its URL)."""
        texts = []
        for manifest in (saved, ib.split_by_chunk(src, (1.0,))):
            with pytest.raises(ib.InsitubatchError) as e:
                ib.build_loader(src, manifest, "train", **kw).load_state_dict(state)
            texts.append(str(e.value))
        return texts

    # another store (the same values, shapes and chunking) in the member's place: a state
    # resumes only into the composition it was saved with, members named by URL
    other = ib.join([open_(stores, "levels"), open_(stores, "single")])
    for text in refused(other):
        assert "member 1" in text and other.members[1].url in text, text
    # the member rewritten with another chunking at the same URL
    write_single_level(single, TIMES, zarr_format=3, steps_per_chunk=2)
    changed = join()
    for text in refused(changed):
        # which member changed, not only the composition's name (it holds both URLs)
        assert "member" in text and changed.members[1].url in text, text


def test_the_manifest_names_every_member(stores, tmp_path):
    src = ib.join([open_(stores, "levels"), open_(stores, "single")])
    m = ib.split_by_chunk(src, (1.0,))
    m.to_json(tmp_path / "m.json")
    text = (tmp_path / "m.json").read_text()
    for member in src.members:
        assert member.url in text
    back = ib.SplitManifest.from_json(tmp_path / "m.json")
    with ib.build_loader(src, back, "train", batch_size=8) as ld:
        assert sum(len(b["sample_index"]) for b in ld) == 48


@pytest.mark.parametrize("kind", ["join", "concat"])
def test_workers_serve_the_same_batches_as_threads(stores, kind):
    if kind == "join":  # each variable from one member
        src = ib.join([open_(stores, "levels"), open_(stores, "single")])
        want, names = xr.merge([stores["levels"][1], stores["single"][1]]), (*PL, *SL)
    else:  # each variable across two members (v2, 3 steps a chunk; v3, 4)
        src = ib.concat([open_(stores, "early"), open_(stores, "late")])
        want = xr.concat([stores["early"][1], stores["late"][1]], dim="time")
        names = ("temperature", "2m_temperature")
    static = ib.open_static(stores["invariants"][0])
    kw = dict(batch_size=8, seed=2, sample=ib.SampleConfig(static=static))
    with loader_of(src, workers=2, **kw) as w, loader_of(src, workers=0, **kw) as t:
        got, ref = epoch(w), epoch(t)
    same_batches(got, ref)
    check_rows(got, want, names, n=48)


# -- statistics and inspect --------------------------------------------------------------
def test_statistics_of_a_join_and_of_a_concat_with_a_gap_are_xarrays(stores):
    join = ib.join([open_(stores, "levels"), open_(stores, "single")])
    merged = xr.merge([stores["levels"][1], stores["single"][1]])
    stats = ib.compute_stats(join, ib.split_by_chunk(join, (1.0,)), progress=False)
    t = stats["temperature"]  # per level, by default
    assert t.kept_dims == ("level",) and t.coords == tuple(LEVELS.tolist())
    grid = ("time", "latitude", "longitude")
    want = merged["temperature"].astype("float64")
    np.testing.assert_allclose(t.mean, want.mean(grid).values, rtol=1e-12)
    np.testing.assert_allclose(t.std, want.std(grid).values, rtol=1e-10)
    t2m = stats["2m_temperature"]
    assert t2m.min == float(merged["2m_temperature"].min())
    assert t2m.max == float(merged["2m_temperature"].max())
    gap = ib.concat([open_(stores, "before-gap"), open_(stores, "after-gap")])
    s = ib.compute_stats(gap, ib.split_by_chunk(gap, (1.0,)), progress=False)["2m_temperature"]
    want = xr.concat([stores["before-gap"][1], stores["after-gap"][1]], dim="time")
    assert np.isfinite(s.mean)  # the gap holds no data and is not counted
    np.testing.assert_allclose(s.mean, want["2m_temperature"].astype("float64").mean().item(),
                               rtol=1e-12)
    assert s.count == want["2m_temperature"].size


def test_inspect_lists_the_members(stores):
    from insitubatch_nodes.inspection import format_report, inspect_source

    src = ib.concat([open_(stores, "early"), open_(stores, "late")])
    text = format_report(inspect_source(src, quality=None, sample_objects=2))
    for m in src.members:
        assert m.url in text
    assert "48 samples" in text
