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
