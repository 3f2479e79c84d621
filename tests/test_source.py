import numpy as np
import pytest
import zarr
from stores import Var

import insitubatch_nodes as ib


def test_geometry_of_every_variable(store_factory):
    path, _ = store_factory([
        Var("a", (50, 6, 7), (8, 3, 7), extra={"dimension_names": ("time", "y", "x")}),
        Var("b", (50,), (10,), dtype="int16"),
        Var("c", (50, 4), (4, 4), shards=(8, 4)),
    ])
    src = ib.open_source(path)
    assert src.names == ("a", "b", "c")
    a = src.variable("a")
    assert a.shape == (50, 6, 7) and a.chunks == (8, 3, 7) and a.inner_grid == (2, 1)
    assert a.dimension_names == ("time", "y", "x")
    assert src.variable("b").dtype == np.dtype("int16") and src.variable("b").sample_shape == ()
    assert src.variable("c").shards == (8, 4) and src.variable("c").chunks == (4, 4)
    assert src.grid.chunk_size == 40  # lcm(8, 10, 4) = 40 <= 4 * 10: the LCM grid is used
    assert src.n_samples == 50


def test_accepts_file_url_group_and_subset(store_factory):
    path, _ = store_factory([Var("a", (20, 2), (5, 2)), Var("b", (20, 2), (5, 2))])
    assert ib.open_source(f"file://{path}", variables=["b"]).names == ("b",)
    assert ib.open_source(zarr.open_group(path, mode="r"), variables="a").names == ("a",)


def test_coordinates_are_not_variables(store_factory):
    path, _ = store_factory([
        Var("t2m", (20, 3), (5, 3), extra={"dimension_names": ("time", "lat")}),
        Var("time", (20,), (20,), dtype="int64", extra={"dimension_names": ("time",)}),
        Var("lat", (3,), (3,), extra={"dimension_names": ("lat",)}),
    ])
    src = ib.open_source(path, sample_dim="time")
    assert src.names == ("t2m",)


def test_missing_path_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.zarr"):
        ib.open_source(tmp_path / "nope.zarr")


def test_unknown_variable_lists_existing(store_factory):
    path, _ = store_factory([Var("a", (20, 2), (5, 2)), Var("b", (20, 2), (5, 2))])
    with pytest.raises(KeyError, match=r"\['zz'\].*\['a', 'b'\]"):
        ib.open_source(path, variables=["a", "zz"])


def test_sample_axes_must_match(store_factory):
    path, _ = store_factory([Var("a", (20, 2), (5, 2)), Var("b", (21, 2), (5, 2))])
    with pytest.raises(ValueError, match=r"differ in length.*'a': 20.*'b': 21"):
        ib.open_source(path)


def test_non_numeric_dtype_is_refused(tmp_path):
    g = zarr.open_group(tmp_path / "s.zarr", mode="w")
    g.create_array("a", shape=(4,), dtype=float)
    g.create_array("s", shape=(4,), dtype=str)
    with pytest.raises(TypeError, match="'s'.*numeric"):
        ib.open_source(tmp_path / "s.zarr", variables=["a", "s"])


def test_unsupported_scheme(tmp_path):
    with pytest.raises(ValueError, match="ftp"):
        ib.open_source("ftp://host/x.zarr")


def test_redact_url_drops_credentials():
    from insitubatch_nodes.store.source import redact_url

    assert redact_url("https://user:SECRET@host:9000/b/x.zarr?X-Amz-Signature=SECRET") == \
        "https://host:9000/b/x.zarr"


@pytest.mark.parametrize("given", ["path", "group"])
def test_numcodecs_codecs_open_without_zarrs_warning(tmp_path, given):
    """zarr warns on every numcodecs codec in a v3 array (a virtual NetCDF's shuffle + zlib):
    a caution for writers that a reader of an archive cannot act on, so opening is quiet,
    however the store is given."""
    import warnings

    from zarr.codecs import numcodecs as nc

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # writing one is what zarr warns about
        g = zarr.open_group(tmp_path / "s.zarr", mode="w")
        g.create_array("x", shape=(8, 3), chunks=(1, 3), dtype="f4",
                       compressors=[nc.Zlib(level=1)], dimension_names=("time", "c"))[:] = 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        src = ib.open_source(tmp_path / "s.zarr" if given == "path"
                             else zarr.open_group(tmp_path / "s.zarr", mode="r"))
    assert src.names == ("x",)


def test_a_v2_dimension_attribute_written_as_one_string_names_one_dim(tmp_path):
    # ``_ARRAY_DIMENSIONS: "time"`` (a string, not ["time"]) is one dimension, as xarray
    # reads it: it was split into the letters t, i, m, e, so the time coordinate of this
    # store was no coordinate but a static field, served in every batch.
    g = zarr.open_group(tmp_path / "s.zarr", mode="w", zarr_format=2)
    g.create_array("t2m", shape=(8, 3), chunks=(4, 3), dtype="float32",
                   attributes={"_ARRAY_DIMENSIONS": ["time", "lat"]})[:] = 1.0
    g.create_array("time", shape=(8,), chunks=(8,), dtype="int64",
                   attributes={"_ARRAY_DIMENSIONS": "time", "units": "hours since 2000-01-01"}
                   )[:] = np.arange(8)
    src = ib.open_source(tmp_path / "s.zarr")
    assert src.names == ("t2m",) and src.sample_dim == "time"
    assert src.static == ()
    assert src.sample_coord is not None and src.sample_coord.dtype.kind == "M"


def test_a_dimension_attribute_that_is_no_list_of_names_is_refused(tmp_path):
    # was a bare TypeError ('int' object is not iterable) out of the store's description
    g = zarr.open_group(tmp_path / "s.zarr", mode="w", zarr_format=2)
    g.create_array("t2m", shape=(8, 3), chunks=(4, 3), dtype="float32",
                   attributes={"_ARRAY_DIMENSIONS": 2})
    with pytest.raises(ib.StoreError, match="_ARRAY_DIMENSIONS.*not a list of dimension names"):
        ib.open_source(tmp_path / "s.zarr")


def test_a_null_calendar_decodes_the_sample_coordinate_as_the_standard_one(tmp_path):
    g = zarr.open_group(tmp_path / "s.zarr", mode="w", zarr_format=2)
    g.create_array("t2m", shape=(4, 3), chunks=(4, 3), dtype="float32",
                   attributes={"_ARRAY_DIMENSIONS": ["time", "lat"]})
    g.create_array("time", shape=(4,), chunks=(4,), dtype="int64",
                   attributes={"_ARRAY_DIMENSIONS": ["time"], "calendar": None,
                               "units": "hours since 2000-01-01"})[:] = np.arange(4)
    src = ib.open_source(tmp_path / "s.zarr")
    assert src.sample_coord is not None
    assert src.sample_coord[1] == np.datetime64("2000-01-01T01:00")


def _wb2_like(path):
    import pandas as pd
    import xarray as xr

    xr.Dataset(
        {"temperature": (("time", "level", "latitude", "longitude"),
                         np.zeros((4, 2, 3, 5), "float32")),
         "2m_temperature": (("time", "latitude", "longitude"), np.zeros((4, 3, 5), "float32")),
         "land_sea_mask": (("latitude", "longitude"), np.zeros((3, 5), "float32"))},
        coords={"time": pd.date_range("2020-01-01", periods=4, freq="6h"),
                "level": [500, 850], "latitude": np.linspace(90, -90, 3),
                "longitude": np.arange(0, 360, 72.0)},
    ).to_zarr(path, zarr_format=2, consolidated=True)
    return path


def test_unknown_variables_list_what_can_be_served_apart_from_the_rest(tmp_path):
    path = _wb2_like(tmp_path / "w.zarr")
    with pytest.raises(KeyError, match=r"unknown variable\(s\) \['nope'\] in .*; variables "
                       r"that can be served: \['2m_temperature', 'temperature'\]; static "
                       r"fields \(static=ib.open_static\(...\)\): \['land_sea_mask'\]; "
                       r"coordinates: \['latitude', 'level', 'longitude', 'time'\]"):
        ib.open_source(path, variables=["nope"])


def test_a_coordinate_or_a_static_field_is_no_variable(tmp_path):
    """``variables=["latitude"]`` built a source of 3 samples along latitude; a static
    field alone, one along latitude too. Both refused, saying what to do instead."""
    path = _wb2_like(tmp_path / "w.zarr")
    with pytest.raises(ValueError, match=r"names the coordinate\(s\) \['latitude'\] .*"
                       r"not data to serve along one; variables that can be served: "
                       r"\['2m_temperature', 'temperature'\]"):
        ib.open_source(path, variables=["latitude"])
    with pytest.raises(ValueError, match=r"names the static field\(s\) \['land_sea_mask'\].*"
                       r"\(no 'time' axis\): serve them with static=ib.open_static\(source, "
                       r"\['land_sea_mask'\]\)"):
        ib.open_source(path, variables=["2m_temperature", "land_sea_mask"])
    # asked for along another dim, it is served so
    src = ib.open_source(path, variables=["land_sea_mask"], sample_dim="latitude")
    assert src.n_samples == 3 and src.sample_dim == "latitude"
    assert ib.open_source(path, variables=["temperature"]).names == ("temperature",)
