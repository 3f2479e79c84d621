"""Stores as other people's tools write them, opened as they are: WeatherBench2 /
ARCO-ERA5 (xarray ``to_zarr``), with static fields and arrays the loader cannot serve."""

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
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
    assert found.skipped == (("b", "'time' is not its first dimension ('x', 'time')"),)


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
