"""The WeatherBench2-layout writer: xarray's Zarr v2 layout, all 83 channels on a small grid,
deterministic smooth values, served by the loader as one (B, 83, lon, lat) tensor."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import insitubatch_nodes as ib
from insitubatch_nodes import synthetic
from insitubatch_nodes.synthetic import (
    WB2_LEVEL_VARIABLES,
    WB2_LEVELS,
    WB2_SURFACE_VARIABLES,
    WB2_VARIABLES,
    DemoSpec,
    WB2Spec,
    write_store,
    write_wb2_store,
)

SPEC = WB2Spec.small(n_times=6)
LZ4 = {"id": "blosc", "cname": "lz4", "clevel": 5, "shuffle": 1, "blocksize": 0}


@pytest.fixture(scope="module")
def wb2(tmp_path_factory) -> Path:
    return write_wb2_store(tmp_path_factory.mktemp("wb2") / "wb2.zarr", SPEC, progress=False)


def _meta(path: Path) -> dict:
    meta = json.loads((path / ".zmetadata").read_text())
    assert meta["zarr_consolidated_format"] == 1
    return meta["metadata"]


def test_wb2_layout_is_what_xarray_writes(wb2):
    md = _meta(wb2)
    assert md[".zgroup"] == {"zarr_format": 2}
    plane = [SPEC.n_lon, SPEC.n_lat]
    assert len(WB2_VARIABLES) == 11 and SPEC.channels == 83
    for name in WB2_VARIABLES:
        arr, attrs = md[f"{name}/.zarray"], md[f"{name}/.zattrs"]
        levels = [13] if name in WB2_LEVEL_VARIABLES else []
        dims = ["time", *(["level"] if levels else []), "longitude", "latitude"]
        assert attrs["_ARRAY_DIMENSIONS"] == dims, name
        assert arr["shape"] == [SPEC.n_times, *levels, *plane]
        assert arr["chunks"] == [1, *levels, *plane]  # one time step per chunk
        assert arr["dtype"] == "<f4" and arr["fill_value"] == "NaN" and arr["order"] == "C"
        assert arr["compressor"] == LZ4 and arr["filters"] is None
    time, level = md["time/.zarray"], md["level/.zarray"]
    assert time["dtype"] == "<i8" and time["shape"] == [SPEC.n_times]
    assert md["time/.zattrs"] == {"_ARRAY_DIMENSIONS": ["time"],
                                  "units": "hours since 1959-01-01",
                                  "calendar": "proleptic_gregorian"}
    assert level["dtype"] == "<i8" and md["level/.zattrs"]["_ARRAY_DIMENSIONS"] == ["level"]
    for name, n in (("latitude", SPEC.n_lat), ("longitude", SPEC.n_lon)):
        assert md[f"{name}/.zarray"]["dtype"] == "<f8"
        assert md[f"{name}/.zarray"]["shape"] == [n]
    assert md["land_sea_mask/.zattrs"]["_ARRAY_DIMENSIONS"] == ["longitude", "latitude"]
    assert md["land_sea_mask/.zarray"]["shape"] == plane  # static: no time axis


def test_wb2_coordinates_decode_as_cf(wb2):
    import xarray as xr

    ds = xr.open_zarr(wb2)
    assert ds["temperature"].dims == ("time", "level", "longitude", "latitude")
    assert list(ds["level"].values) == list(WB2_LEVELS)
    t = ds["time"].values
    assert t[0] == np.datetime64("1959-01-01T00:00")
    assert (np.diff(t) == np.timedelta64(6, "h")).all()
    lat, lon = ds["latitude"].values, ds["longitude"].values
    assert lat[0] == -90 and lat[-1] == 90 and lon[0] == 0 and lon[-1] < 360
    mask = ds["land_sea_mask"].values
    assert mask.min() >= 0 and mask.max() <= 1 and 0.1 < mask.mean() < 0.9


def test_wb2_values_are_smooth_deterministic_and_compress_like_data(wb2, tmp_path, monkeypatch):
    import zarr

    g = zarr.open_group(wb2, mode="r")
    for name in ("temperature", "geopotential", "2m_temperature", "mean_sea_level_pressure"):
        x = g[name][:]
        assert np.isfinite(x).all() and x.std() > 0, name
        assert np.abs(np.diff(x, axis=-1)).mean() < x.std(), name  # smooth along latitude
    t = g["temperature"][0]
    assert t[0].mean() < t[-1].mean()  # colder aloft (50 hPa) than at 1000 hPa
    assert (g["total_precipitation_6hr"][:] == 0).mean() > 0.2  # dry areas, never negative
    assert (g["specific_humidity"][:] >= 0).all()
    # The same steps whatever the writes: one step per write here.
    monkeypatch.setattr(synthetic, "WRITE_BYTES", 1)
    again = zarr.open_group(write_wb2_store(tmp_path / "again.zarr", SPEC, progress=False))
    for name in WB2_VARIABLES:
        assert np.array_equal(g[name][:], again[name][:]), name
    # Neither noise nor constant: blosc-lz4 saves some bytes, not most of them.
    stored = sum(f.stat().st_size for f in (wb2 / "temperature").iterdir() if f.name[0] != ".")
    ratio = g["temperature"].nbytes / stored
    assert 1.1 < ratio < 4, ratio


def test_the_loader_stacks_all_83_channels(wb2):
    import zarr

    src = ib.open_source(wb2, variables=list(WB2_VARIABLES))
    assert src.names == WB2_VARIABLES and src.grid.chunk_size == 1
    manifest = ib.split_by_chunk(src, fractions=(1.0,), seed=0)
    with ib.build_loader(src, manifest, "train", batch_size=4,
                         channels=list(WB2_VARIABLES)) as loader:
        batch = next(iter(loader))
    x = batch["channels"]
    assert tuple(x.shape) == (4, 83, SPEC.n_lon, SPEC.n_lat)
    g = zarr.open_group(wb2, mode="r")
    i = int(batch["sample_index"][1])
    want = np.concatenate([g[v][i] for v in WB2_LEVEL_VARIABLES]
                          + [g[v][i][None] for v in WB2_SURFACE_VARIABLES])
    assert np.array_equal(x[1].numpy(), want)


def test_wb2_spec_checks_its_sizes():
    with pytest.raises(ValueError, match="n_lon must be an integer >= 1, got 0"):
        WB2Spec(n_times=4, n_lon=0)
    assert WB2Spec(n_times=3).sample_nbytes == 83 * 240 * 121 * 4  # 9.6 MB, as WB2
    assert WB2Spec.for_size(100).n_times == int(100e6 // (83 * 240 * 121 * 4))


def test_v2_demo_stores_keep_dims_and_consolidate(tmp_path):
    spec = DemoSpec(n_times=8, n_lat=4, n_lon=8, time_chunk=1, variables=("t2m",))
    path = write_store(tmp_path / "v2.zarr", spec, zarr_format=2, progress=False)
    md = _meta(path)
    assert md["t2m/.zattrs"]["_ARRAY_DIMENSIONS"] == ["time", "lat", "lon"]
    assert md["time/.zattrs"]["_ARRAY_DIMENSIONS"] == ["time"]
    assert md["time/.zattrs"]["units"] == "hours since 2000-01-01"
    assert ib.open_source(path, variables=["t2m"]).variable("t2m").dimension_names == (
        "time", "lat", "lon")


def test_layout_matches_zarr_belugas_wb2_fixture(wb2, tmp_path):
    """zarr-beluga ships a WB2 fixture: same arrays, dims, chunks, codec and dtypes, except
    where ours follows WeatherBench2 more closely (listed)."""
    beluga = pytest.importorskip("beluga")
    beluga.write_wb2_fixture(str(tmp_path), root="bel.zarr", preset="era5",
                             height=SPEC.n_lon, width=SPEC.n_lat, n_time=SPEC.n_times,
                             lon_major=True)
    theirs, ours = _meta(tmp_path / "bel.zarr"), _meta(wb2)
    # beluga writes sea_surface_temperature (NaN over land); WB2's ERA5 store has
    # total_precipitation_6hr among the 83 channels we write.
    assert set(theirs) - set(ours) == {"sea_surface_temperature/.zarray",
                                       "sea_surface_temperature/.zattrs"}
    assert set(ours) - set(theirs) == {"total_precipitation_6hr/.zarray",
                                       "total_precipitation_6hr/.zattrs"}
    for key in set(ours) & set(theirs):
        a, b = theirs[key], ours[key]
        if key.endswith(".zarray"):
            same = ("shape", "compressor", "fill_value", "order", "filters")
            if key != "time/.zarray":  # beluga cuts its time coordinate in chunks of 4
                same += ("chunks",)
            assert {k: a.get(k) for k in same} == {k: b.get(k) for k in same}, key
            if not key.startswith(("latitude", "longitude")):  # float32 there, float64 here
                assert a["dtype"] == b["dtype"], key
        elif key.endswith(".zattrs") and "_ARRAY_DIMENSIONS" in a:
            assert a["_ARRAY_DIMENSIONS"] == b["_ARRAY_DIMENSIONS"], key
    assert theirs["time/.zattrs"]["calendar"] == ours["time/.zattrs"]["calendar"]
