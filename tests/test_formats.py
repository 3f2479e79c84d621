"""Stores as other people's tools write them, opened as they are: WeatherBench2 /
ARCO-ERA5 (xarray ``to_zarr``), with static fields and arrays the loader cannot serve."""

import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import xarray as xr

import insitubatch_nodes as ib
from insitubatch_nodes.synthetic import WB2Spec, write_wb2_store


def _arco_like(path: Path, n_times: int = 12) -> xr.Dataset:
    """An ARCO-ERA5-like dataset written by xarray itself: Zarr v2, consolidated, one step
    per chunk, pressure-level and surface variables, a static mask and orography, a string
    attribute array and the coordinates."""
    rng = np.random.default_rng(0)
    time = pd.date_range("2020-01-01", periods=n_times, freq="6h")
    level = np.array([500, 850, 1000], dtype="int64")
    lat = np.linspace(90, -90, 5)
    lon = np.arange(0, 360, 45.0)
    ds = xr.Dataset(
        {
            "temperature": (("time", "level", "latitude", "longitude"),
                            rng.standard_normal((n_times, 3, 5, 8)).astype("float32")),
            "2m_temperature": (("time", "latitude", "longitude"),
                               rng.standard_normal((n_times, 5, 8)).astype("float32")),
            "land_sea_mask": (("latitude", "longitude"),
                              (rng.random((5, 8)) > 0.5).astype("float32")),
            "geopotential_at_surface": (("latitude", "longitude"),
                                        rng.random((5, 8)).astype("float32")),
            "station_name": (("station",), np.array(["a", "bb"], dtype=object)),
        },
        coords={"time": time, "level": level, "latitude": lat, "longitude": lon},
    )
    enc = {v: {"chunks": (1, *ds[v].shape[1:])} for v in ("temperature", "2m_temperature")}
    ds.to_zarr(path, zarr_format=2, consolidated=True, encoding=enc)
    return ds


@pytest.fixture(scope="module")
def arco(tmp_path_factory) -> tuple[Path, xr.Dataset]:
    path = tmp_path_factory.mktemp("arco") / "arco.zarr"
    return path, _arco_like(path)


def test_an_xarray_written_store_opens_with_no_arguments(arco):
    path, ds = arco
    src = ib.open_source(path)
    assert src.sample_dim == "time"
    assert set(src.names) == {"temperature", "2m_temperature"}
    assert src.static == ("geopotential_at_surface", "land_sea_mask")
    assert src.n_samples == 12 and src.grid.chunk_size == 1
    np.testing.assert_array_equal(src.sample_coord, ds.time.values)
    fields = ib.open_static(src)
    assert set(fields) == {"geopotential_at_surface", "land_sea_mask"}
    np.testing.assert_array_equal(fields["land_sea_mask"], ds.land_sea_mask.values)
    assert set(ib.open_static(path)) == set(fields)  # from the URL too


def test_every_sample_served_matches_xarray_with_static_fields_and_whole_levels(arco):
    path, ds = arco
    src = ib.open_source(path)
    m = ib.split_by_chunk(src, (1.0,))
    loader = ib.build_loader(src, m, "train", batch_size=5,
                             channels=["temperature", "2m_temperature"],
                             static=ib.open_static(src))
    seen = []
    for batch in loader:
        idx = batch["sample_index"].numpy()
        seen += idx.tolist()
        want = np.concatenate([ds.temperature.values[idx],
                               ds["2m_temperature"].values[idx][:, None]], axis=1)
        np.testing.assert_array_equal(batch["channels"].numpy(), want)  # 3 levels + surface
        assert batch["static/land_sea_mask"].shape == (len(idx), 5, 8)
        assert batch["time"].numpy().tolist() == ds.time.values[idx].astype(
            "datetime64[ns]").astype(np.int64).tolist()
    assert sorted(seen) == list(range(12))


def test_what_is_left_out_is_said(tmp_path):
    # Only a string array and a static field: nothing to serve, and the message says why.
    xr.Dataset({"names": (("station",), np.array(["a", "b"], dtype=object)),
                "mask": (("lat", "lon"), np.zeros((2, 3), "float32"))}).to_zarr(
        tmp_path / "s.zarr", zarr_format=2)
    with pytest.raises(ValueError, match=r"names: dtype .* cannot become a tensor"):
        ib.open_source(tmp_path / "s.zarr", sample_dim="time")


def test_sample_dimension_not_first_is_named(tmp_path):
    ds = xr.Dataset({"a": (("time", "x"), np.zeros((4, 3), "float32")),
                     "b": (("x", "time"), np.zeros((3, 4), "float32"))})
    ds.to_zarr(tmp_path / "s.zarr", zarr_format=3)
    src = ib.open_source(tmp_path / "s.zarr")
    assert src.names == ("a",)
    found = ib.discover(dict(src.group.arrays()))
    assert found.skipped == (("b", "'time' is not its first dimension ('x', 'time'): pass "
                                   "sample_dim='time' to sample along it"),)
    # asked for, it is sampled along that axis, as stored
    both = ib.open_source(tmp_path / "s.zarr", sample_dim="time")
    assert both.names == ("a", "b") and both.variables[1].shape == (4, 3)
    np.testing.assert_array_equal(both.arrays[1][1:3], ds["b"].values.T[1:3])


def test_open_static_without_static_fields_says_so(tmp_path):
    xr.Dataset({"a": (("time", "x"), np.zeros((4, 3), "float32"))}).to_zarr(
        tmp_path / "s.zarr", zarr_format=3)
    with pytest.raises(ValueError, match=r"no static fields .* arrays there: \['a'\]"):
        ib.open_static(tmp_path / "s.zarr")


def test_the_weatherbench2_layout_opens_as_it_is(tmp_path):
    spec = WB2Spec.small(n_times=4)
    path = write_wb2_store(tmp_path / "wb2.zarr", spec, progress=False)
    src = ib.open_source(path)
    assert src.sample_dim == "time" and "land_sea_mask" not in src.names
    assert src.static == ("land_sea_mask",)
    assert len(src.names) == 6 + 5
    loader = ib.build_loader(src, ib.split_by_chunk(src, (1.0,)), "train", batch_size=2,
                             channels=list(src.names))
    batch = next(iter(loader))
    assert batch["channels"].shape[1] == spec.channels == 83


# -- anemoi datasets -----------------------------------------------------------------------

from insitubatch_nodes.synthetic import ANEMOI_VARIABLES, write_anemoi_store  # noqa: E402


def _stored(path: Path) -> tuple[np.ndarray, np.ndarray]:
    import zarr

    g = zarr.open_group(path, mode="r")
    return g["data"][:], g["dates"][:]


def _epoch(loader) -> list[dict]:
    return [{k: v.clone() for k, v in b.items()} for b in loader]


@pytest.mark.parametrize("dimensions_attr", [True, False])
def test_an_anemoi_dataset_serves_its_variables_by_name(tmp_path, dimensions_attr):
    path = write_anemoi_store(tmp_path / "a.zarr", n_dates=12, dimensions_attr=dimensions_attr)
    data, dates = _stored(path)
    src = ib.open_source(path)
    assert src.format == "anemoi" and src.names == ("data",) and src.sample_dim == "time"
    assert src.variables[0].labels == ANEMOI_VARIABLES
    pick = ["t_500", "2t", "10u"]  # any order: the batch follows it
    sel = [ANEMOI_VARIABLES.index(n) for n in pick]
    sub = ib.open_source(path, variables=pick)
    loader = ib.build_loader(sub, ib.split_by_chunk(sub, (1.0,)), "train", batch_size=5)
    seen = []
    for b in _epoch(loader):
        idx = b["sample_index"].numpy()
        seen += idx.tolist()
        np.testing.assert_array_equal(b["data"].numpy(), data[idx][:, sel])
        np.testing.assert_array_equal(b["time"].numpy(),
                                      dates[idx].astype("datetime64[ns]").astype(np.int64))
    assert sorted(seen) == list(range(12))
    # channels by name over the whole dataset: the same values
    loader = ib.build_loader(src, ib.split_by_chunk(src, (1.0,)), "train", batch_size=12,
                             channels=pick)
    b = next(iter(loader))
    np.testing.assert_array_equal(b["channels"].numpy(), data[b["sample_index"].numpy()][:, sel])


def test_anemoi_names_that_do_not_exist_are_listed(tmp_path):
    path = write_anemoi_store(tmp_path / "a.zarr", n_dates=4)
    with pytest.raises(KeyError, match=r"unknown variable\(s\) \['t2m'\].*'2t'"):
        ib.open_source(path, variables=["t2m"])
    src = ib.open_source(path)
    with pytest.raises(KeyError, match=r"unknown channel 'msl2'.*named channels: .*'msl'"):
        ib.build_loader(src, ib.split_by_chunk(src, (1.0,)), "train", channels=["msl2"])
    with pytest.raises(ValueError, match=r"channel \('2t', 0\): '2t' is a label of 'data'.*"
                       r"takes no level"):
        ib.build_loader(src, ib.split_by_chunk(src, (1.0,)), "train", channels=[("2t", 0)])
    sub = ib.open_source(path, variables=["2t"])
    with pytest.raises(ValueError, match="choose the variables in one of the two"):
        ib.build_loader(sub, ib.split_by_chunk(sub, (1.0,)), "train", channels=["msl"])


@pytest.mark.parametrize("window", [None, ib.SampleWindow(history=2, lead=(1,))])
def test_anchors_touching_a_missing_date_are_never_served(tmp_path, window):
    missing = (7, 8, 20)
    path = write_anemoi_store(tmp_path / "a.zarr", n_dates=30, missing=missing)
    src = ib.open_source(path)
    assert src.missing == missing
    m = ib.split_by_chunk(src, (1.0,))
    loader = ib.build_loader(src, m, "train", batch_size=4, steps=window)
    seen = []
    for b in _epoch(loader):
        seen += b["sample_index"].tolist()
        for key in ("data", "target/data"):
            if key in b:
                assert not np.isnan(b[key].numpy()).any()
    before, after = (0, 0) if window is None else (window.before, window.after)
    valid = [a for a in range(before, 30 - after)
             if not any(a - before <= d <= a + after for d in missing)]
    assert sorted(seen) == valid  # exactly once over every anchor that stays clear of them


def test_statistics_leave_the_missing_dates_out(tmp_path):
    """A missing date holds no data (NaN as stored here): statistics over it were NaN, and
    every batch normalised with them too. They are the statistics of the dates served."""
    missing = (7, 20)
    path = write_anemoi_store(tmp_path / "a.zarr", n_dates=30, missing=missing)
    data, _ = _stored(path)
    src = ib.open_source(path)
    m = ib.split_by_chunk(src, (1.0,))
    st = ib.compute_stats(src, m, keep_dims=("variable",), progress=False)
    kept = np.delete(data, missing, axis=0).astype(np.float64)
    (var,) = st.variables
    np.testing.assert_allclose(var.mean, kept.mean(axis=(0, 2, 3)), rtol=1e-10)
    np.testing.assert_allclose(var.std, kept.std(axis=(0, 2, 3)), rtol=1e-10)
    np.testing.assert_array_equal(var.min, kept.min(axis=(0, 2, 3)))
    batch = next(iter(ib.build_loader(src, m, "train", batch_size=4, stats=st)))
    assert not np.isnan(batch["data"].numpy()).any()


def test_dates_are_the_sample_coordinate_for_splits(tmp_path):
    path = write_anemoi_store(tmp_path / "a.zarr", n_dates=20)
    _, dates = _stored(path)
    src = ib.open_source(path)
    m = ib.split_by_coordinate(src, {"train": (None, "2020-01-03T18:00"),
                                     "val": ("2020-01-04", None)})
    loader = ib.build_loader(src, m, "val", batch_size=32)
    idx = np.sort(next(iter(loader))["sample_index"].numpy())
    assert dates[idx[0]] == np.datetime64("2020-01-04T00:00:00")
    assert idx[-1] == 19


def test_stored_statistics_and_normalization_schemes(tmp_path):
    path = write_anemoi_store(tmp_path / "a.zarr", n_dates=10)
    import zarr

    g = zarr.open_group(path, mode="r")
    src = ib.open_source(path, variables=["2t", "msl", "lsm", "10u", "z_500"])
    stats = ib.dataset_stats(src)
    i2t = ANEMOI_VARIABLES.index("2t")
    assert stats["2t"].mean == g["mean"][i2t] and stats["2t"].std == g["stdev"][i2t]
    assert stats["data"].kept_dims == ("variable",) and stats["data"].mean.shape == (9,)
    schemes = {"default": "mean-std", "msl": "min-max", "lsm": "none", "10u": "std",
               "z_500": "max"}
    loader = ib.build_loader(src, ib.split_by_chunk(src, (1.0,)), "train", batch_size=10,
                             stats=stats, normalize=schemes)
    b = next(iter(loader))
    raw = g["data"][:][b["sample_index"].numpy()].astype(np.float64)
    mean, std = g["mean"][:], g["stdev"][:]
    lo, hi = g["minimum"][:], g["maximum"][:]
    want = {"2t": lambda x, k: (x - mean[k]) / std[k],
            "msl": lambda x, k: (x - lo[k]) / (hi[k] - lo[k]),
            "lsm": lambda x, k: x, "10u": lambda x, k: x / std[k],
            "z_500": lambda x, k: x / hi[k]}
    for c, name in enumerate(["2t", "msl", "lsm", "10u", "z_500"]):
        k = ANEMOI_VARIABLES.index(name)
        np.testing.assert_allclose(b["data"][:, c].numpy(), want[name](raw[:, k], k),
                                   rtol=1e-4, atol=1e-4, err_msg=name)  # float32 math
    with pytest.raises(ValueError, match=r"unknown schemes \{'2t': 'zscore'\}"):
        ib.build_loader(src, ib.split_by_chunk(src, (1.0,)), "train", stats=stats,
                        normalize={"2t": "zscore"})
    # statistics over the whole field (not per label) cannot honour a label's scheme
    whole = ib.compute_stats(src, ib.split_by_chunk(src, (1.0,)), keep_dims=(),
                             progress=False)
    with pytest.raises(ValueError, match=r"schemes for \['msl'\] of 'data' need its "
                                         r"statistics per label"):
        ib.build_loader(src, ib.split_by_chunk(src, (1.0,)), "train", stats=whole,
                        normalize={"msl": "none"})
    # a label the selection leaves out is not served: its scheme is refused, not ignored
    with pytest.raises(KeyError, match=r"scheme given for 'z_850', which is not served"):
        ib.build_loader(src, ib.split_by_chunk(src, (1.0,)), "train", stats=stats,
                        normalize={"z_850": "max"})
    with pytest.raises(ValueError, match="not an anemoi dataset"):
        ib.dataset_stats(ib.open_source(write_wb2_store(
            tmp_path / "wb2.zarr", WB2Spec.small(n_times=2), progress=False)))


def test_channels_last_without_the_ensemble_axis(tmp_path):
    path = write_anemoi_store(tmp_path / "a.zarr", n_dates=10)
    data, _ = _stored(path)
    src = ib.open_source(path)
    w = ib.SampleWindow(history=2, lead=(1,))
    loader = ib.build_loader(src, ib.split_by_chunk(src, (1.0,)), "train", batch_size=3,
                             steps=w, channels_last=True, drop_ensemble=True)
    b = next(iter(loader))
    idx = b["sample_index"].numpy()
    assert b["data"].shape == (3, 2, 40, 9) and b["target/data"].shape == (3, 1, 40, 9)
    want = np.stack([data[idx - 1], data[idx]], axis=1)[:, :, :, 0].transpose(0, 1, 3, 2)
    np.testing.assert_array_equal(b["data"].numpy(), want)
    two = write_anemoi_store(tmp_path / "e.zarr", n_dates=4, n_ensemble=2)
    src2 = ib.open_source(two)
    loader = ib.build_loader(src2, ib.split_by_chunk(src2, (1.0,)), "train", batch_size=2,
                             drop_ensemble=True)
    with pytest.raises(ValueError, match="has 2 along axis -2.*single ensemble member"):
        next(iter(loader))


def test_an_anemoi_epoch_resumes_exactly(tmp_path):
    path = write_anemoi_store(tmp_path / "a.zarr", n_dates=40, missing=(13,))
    src = ib.open_source(path, variables=["2t", "10v"])
    m = ib.split_by_chunk(src, (1.0,))
    full = [b["sample_index"].tolist() for b in
            ib.build_loader(src, m, "train", batch_size=3, seed=5)]
    loader = ib.build_loader(src, m, "train", batch_size=3, seed=5)
    it = iter(loader)
    head = [next(it)["sample_index"].tolist() for _ in range(4)]
    state = loader.state_dict()
    again = ib.build_loader(src, m, "train", batch_size=3, seed=5)
    again.load_state_dict(state)
    assert head + [b["sample_index"].tolist() for b in again] == full


# -- xarray Datasets: served only as stored -------------------------------------------------

@pytest.fixture
def opened(arco):
    import warnings

    path, _ = arco
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return xr.open_zarr(path)


def test_an_opened_dataset_is_served_from_its_store(opened):
    src = ib.open_source(opened)
    assert set(src.names) == {"temperature", "2m_temperature"}
    np.testing.assert_array_equal(src.sample_coord, opened.time.values)


@pytest.mark.parametrize(("change", "match"), [
    (lambda ds: ds.isel(latitude=slice(0, 4)), r"sliced along \['latitude'\]"),
    (lambda ds: ds.isel(time=slice(None, None, -1)), r"coordinate 'time' .*reversed"),
    (lambda ds: ds.assign(temperature=ds.temperature + 1), "values were computed"),
    (lambda ds: ds.assign(temperature=ds.temperature.astype("float64")),
     "values were computed"),
    (lambda ds: ds.transpose("time", "level", "longitude", "latitude", ...), "transposed"),
    (lambda ds: ds.assign_coords(longitude=ds.longitude + 1), r"coordinate 'longitude'"),
])
def test_a_changed_dataset_is_refused_saying_what_changed(opened, change, match):
    with pytest.raises(ValueError, match=match):
        ib.open_source(change(opened), variables=["temperature", "2m_temperature"])


def test_a_cf_encoded_variable_is_refused_unless_opened_raw(tmp_path):
    import warnings

    ds = xr.Dataset({"t": (("time", "x"), np.linspace(200, 300, 12, dtype="float32")
                           .reshape(4, 3))})
    ds.t.encoding = {"dtype": "int16", "scale_factor": 0.01, "add_offset": 250.0}
    ds.to_zarr(tmp_path / "cf.zarr", zarr_format=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=r"CF-encoded.*mask_and_scale=False"):
            ib.open_source(xr.open_zarr(tmp_path / "cf.zarr"))
        raw = ib.open_source(xr.open_zarr(tmp_path / "cf.zarr", mask_and_scale=False))
    assert raw.variable("t").dtype == np.dtype("int16")


def test_a_state_over_other_missing_dates_is_refused(tmp_path):
    a = write_anemoi_store(tmp_path / "a.zarr", n_dates=30, missing=(13,))
    src = ib.open_source(a)
    m = ib.split_by_chunk(src, (1.0,))
    loader = ib.build_loader(src, m, "train", batch_size=4)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    b = write_anemoi_store(tmp_path / "b.zarr", n_dates=30, missing=(14,))
    other = ib.build_loader(ib.open_source(b), m, "train", batch_size=4)
    with pytest.raises(ValueError, match=r"excluded: saved '[0-9a-f]+', this loader"):
        other.load_state_dict(state)


def test_static_fields_must_lie_on_the_data_grid(arco):
    """A mask transposed or from another grid, or an array with the sample axis, would be
    broadcast next to the data as it is: refused at build time, naming the field and the
    samples' shapes. A field on the grid is cut into the same patches as the data."""
    path, ds = arco
    src = ib.open_source(path)
    m = ib.split_by_chunk(src, (1.0,))
    lsm = ib.open_static(src)["land_sea_mask"]
    for bad in (lsm.T, lsm[:, :4], ds["2m_temperature"].values):
        shape = re.escape(str(bad.shape))
        with pytest.raises(ValueError, match=rf"static field 'lsm' has shape {shape}.*"
                           r"'2m_temperature': \(5, 8\)"):
            ib.build_loader(src, m, "train", batch_size=4, static={"lsm": bad})
    with ib.build_loader(src, m, "train", batch_size=4, static={"lsm": lsm},
                         patch_size=(5, 4)) as ld:
        b = next(iter(ld))
    assert b["static/lsm"].shape == b["2m_temperature"].shape == (8, 5, 4)
    np.testing.assert_array_equal(b["static/lsm"][1].numpy(), lsm[:, 4:])


@pytest.mark.parametrize("kw,err,match", [
    (dict(static=["land_sea_mask"]), TypeError, r"sample.static must map names to arrays.*"
     r"got a list: \['land_sea_mask'\]"),
    (dict(static={"s": np.array(["a", "b"])}), TypeError, r"sample.static\['s'\] must be "
     r"a numeric array"),
    (dict(patch_size=(2.5, 4)), ValueError, r"patch_size must be positive integers.*2.5"),
    (dict(patch_size=(2, 2), patch_stride=(1,)), ValueError, "one entry per patched dim"),
    (dict(patch_size=(1, 2, 2, 2)), ValueError, r"cuts the last 4 dims of each sample, but "
     r"these samples have fewer: .*'2m_temperature': \(5, 8\)"),
])
def test_static_and_patch_options_are_checked_by_name(arco, kw, err, match):
    path, _ = arco
    src = ib.open_source(path)
    with pytest.raises(err, match=match):
        ib.build_loader(src, ib.split_by_chunk(src, (1.0,)), "train", batch_size=4, **kw)


def test_statistics_that_do_not_fit_the_variables_are_refused_by_name(tmp_path):
    """A variable the statistics lack was silently served raw next to normalized ones;
    statistics kept over another level count, or over a dim the variable lacks (another
    store's), failed deep in torch. Each is refused at build time naming the variable."""
    from insitubatch_nodes.store.statistics import Stats, VariableStats

    path = write_wb2_store(tmp_path / "wb2.zarr", WB2Spec.small(n_times=4), progress=False)
    src = ib.open_source(path, variables=["temperature", "2m_temperature"])
    m = ib.split_by_chunk(src, (1.0,))
    only_t = Stats("train", (ib.compute_stats(src, m, progress=False)["temperature"],))
    for schemes in (None, {"2m_temperature": "max"}):
        with pytest.raises(ValueError, match=r"no entry for '2m_temperature'.*they have "
                           r"\['temperature'\]"):
            ib.build_loader(src, m, "train", stats=only_t, normalize=schemes)
    # served as stored only when asked for by name
    raw = ib.build_loader(src, m, "train", stats=only_t, normalize={"2m_temperature": "none"})
    b = next(iter(raw))
    assert float(b["2m_temperature"].mean()) > 200  # kelvin, not standardised
    raw.close()
    five = tuple(np.full(5, v, float) for v in (0.0, 1.0, 0.0, 1.0))
    n_levels = src.variables[0].shape[1]
    for name, kept, match in [
            ("temperature", ("level",), rf"'temperature' kept over \['level'\] have shape "
             rf"\(5,\), but the variable's \['level'\] has \({n_levels},\)"),
            ("2m_temperature", ("level",), r"statistics of '2m_temperature' are kept over "
             r"'level', which is not a dim of its samples")]:
        bad = Stats("train", (VariableStats(name, kept, *five, 1),))
        other = ({"temperature", "2m_temperature"} - {name}).pop()
        with pytest.raises(ValueError, match=match):
            ib.build_loader(src, m, "train", stats=bad, normalize={other: "none"})


def test_static_fields_take_the_loaders_dtype(arco):
    """Float fields are cast with the data; a class index keeps its integers (bfloat16
    holds integers exactly only up to 256); a (1, y, x) field is a (y, x) one."""
    path, _ = arco
    src = ib.open_source(path)
    lsm = ib.open_static(src)["land_sea_mask"]
    classes = np.arange(40, dtype=np.int32).reshape(5, 8) * 100
    with ib.build_loader(src, ib.split_by_chunk(src, (1.0,)), "train", batch_size=4,
                         static={"lsm": lsm[None], "soil": classes},
                         dtype=torch.bfloat16) as ld:
        b = next(iter(ld))
    assert b["static/lsm"].dtype == b["2m_temperature"].dtype == torch.bfloat16
    np.testing.assert_array_equal(b["static/lsm"][0, 0].float().numpy(), lsm)  # 0/1: exact
    assert b["static/soil"].dtype == torch.int32
    np.testing.assert_array_equal(b["static/soil"][0].numpy(), classes)
