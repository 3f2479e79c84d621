"""Static fields from a store of their own (issue 42): ``ib.open_static(url)`` of an ERA5
invariants store (no time axis anywhere) opens every field but the coordinates; stores with
a sample axis keep their reading; static fields from another store sit beside a source's
batches, on the data's grid or refused naming both shapes."""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr
import zarr
from composed_stores import (
    invariants_dataset,
    six_hourly,
    write_invariants,
    write_pressure_levels,
    write_single_level,
)
from stores import write_wb2_like

import insitubatch_nodes as ib
from insitubatch_nodes.store.discovery import static_only

INVARIANTS = ("geopotential_at_surface", "land_sea_mask")


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("static")
    times = six_hourly("2020-01-01", 24)
    return {"inv2": (root / "inv2.zarr", write_invariants(root / "inv2.zarr", zarr_format=2)),
            "inv3": (root / "inv3.zarr", write_invariants(root / "inv3.zarr", zarr_format=3)),
            "single": (root / "single.zarr", write_single_level(root / "single.zarr", times)),
            "levels": (root / "levels.zarr", write_pressure_levels(root / "levels.zarr", times))}


@pytest.mark.parametrize("which", ["inv2", "inv3"])
def test_an_invariants_store_opens_all_its_fields(stores, which):
    path, ds = stores[which]
    fields = ib.open_static(path)
    assert sorted(fields) == list(INVARIANTS)  # the coordinates are not fields
    for name in INVARIANTS:
        np.testing.assert_array_equal(fields[name], ds[name].values, err_msg=name)
        assert fields[name].shape == (8, 16)
    # xarray reads the same values back
    with xr.open_zarr(path, consolidated=which == "inv2") as back:
        for name in INVARIANTS:
            np.testing.assert_array_equal(fields[name], back[name].values)


def test_named_fields_of_an_invariants_store_and_an_opened_source(stores):
    path, ds = stores["inv2"]
    only = ib.open_static(path, ["land_sea_mask"])
    assert list(only) == ["land_sea_mask"]
    # the store opened as a source (served along latitude, as before): its fields all the same
    src = ib.open_source(path)
    fields = ib.open_static(src)
    assert sorted(fields) == list(INVARIANTS)
    np.testing.assert_array_equal(fields["geopotential_at_surface"],
                                  ds["geopotential_at_surface"].values)


def test_stores_with_a_sample_axis_keep_their_reading(stores, tmp_path):
    # WB2-like: only the field without ``time`` is static
    wb2 = write_wb2_like(tmp_path / "wb2.zarr")
    assert list(ib.open_static(wb2)) == ["land_sea_mask"]
    assert ib.open_source(wb2).static == ("land_sea_mask",)
    # a store of time-dependent fields only still has none, and says so
    with pytest.raises(ib.ConfigError, match="no static fields"):
        ib.open_static(stores["levels"][0])
    # discovery of an invariants store is unchanged: a leading dim is its sample axis
    found = ib.discover(dict(zarr.open_group(stores["inv2"][0], mode="r").arrays()))
    assert found.sample_dim == "latitude" and found.static == ()


def test_what_counts_as_a_store_of_static_fields_only(tmp_path):
    def arrays(ds, fmt=3):
        path = tmp_path / f"s{len(list(tmp_path.iterdir()))}.zarr"
        ds.to_zarr(path, zarr_format=fmt, consolidated=False)
        return dict(zarr.open_group(path, mode="r").arrays())

    grid = {"latitude": np.arange(3.0), "longitude": np.arange(4.0)}
    two_d = np.ones((3, 4), "float32")
    assert static_only(arrays(xr.Dataset({"a": (("latitude", "longitude"), two_d)},
                                         coords=grid))) == ("a",)
    # a dim of another name whose coordinate holds dates is a time axis (CF-encoded by xarray)
    dated = xr.Dataset({"a": (("step", "latitude", "longitude"), np.ones((2, 3, 4), "f4"))},
                       coords={**grid, "step": six_hourly("2020-01-01", 2)})
    assert static_only(arrays(dated)) == ()
    # an array along ``time`` among the fields: the group has a sample axis
    mixed = xr.Dataset({"a": (("latitude", "longitude"), two_d),
                        "b": (("time", "latitude"), np.ones((2, 3), "f4"))},
                       coords={**grid, "time": [0, 1]})
    assert static_only(arrays(mixed, 2)) == ()
    # arrays without dimension names are not guessed at
    g = zarr.open_group(tmp_path / "bare.zarr", mode="w", zarr_format=3)
    g.create_array("a", shape=(3, 4), dtype="float32")
    assert static_only(dict(g.arrays())) == ()
    with pytest.raises(ib.ConfigError, match="no static fields"):
        ib.open_static(tmp_path / "bare.zarr")


@pytest.mark.parametrize("data", ["single", "levels"])
def test_static_fields_from_another_store_sit_beside_the_batches(stores, data):
    path, ds = stores[data]
    inv_path, inv = stores["inv3"]
    src = ib.open_source(path)
    m = ib.split_by_chunk(src, (1.0,))
    sample = ib.SampleConfig(static=ib.open_static(inv_path))
    loader = ib.build_loader(src, m, "train", batch_size=5, seed=1, sample=sample)
    rows = 0
    for b in loader:
        n = len(b["sample_index"])
        rows += n
        for name in INVARIANTS:
            assert b[f"static/{name}"].shape == (n, 8, 16)
            np.testing.assert_array_equal(b[f"static/{name}"].numpy(),
                                          np.broadcast_to(inv[name].values, (n, 8, 16)))
        for name in src.names:  # the data beside them are the store's rows
            np.testing.assert_array_equal(b[name].numpy(),
                                          ds[name].values[b["sample_index"].numpy()])
    assert rows == ds.sizes["time"]


def test_static_fields_of_another_grid_are_refused_naming_both_shapes(stores, tmp_path):
    coarse = invariants_dataset().isel(latitude=slice(0, 4), longitude=slice(0, 8))
    coarse.to_zarr(tmp_path / "coarse.zarr", zarr_format=2)
    fields = ib.open_static(tmp_path / "coarse.zarr")
    src = ib.open_source(stores["single"][0])
    m = ib.split_by_chunk(src, (1.0,))
    with pytest.raises(ib.ConfigError, match=r"\(4, 8\)") as e:
        ib.build_loader(src, m, "train", batch_size=4,
                        sample=ib.SampleConfig(static=fields))
    assert "(8, 16)" in str(e.value)
    assert any(repr(name) in str(e.value) for name in INVARIANTS)
    # transposed: the same cells, the data's axes the other way round
    flipped = {k: np.ascontiguousarray(v.T) for k, v in ib.open_static(stores["inv2"][0]).items()}
    with pytest.raises(ib.ConfigError, match=r"\(16, 8\).*\(8, 16\)"):
        ib.build_loader(src, m, "train", batch_size=4, sample=ib.SampleConfig(static=flipped))
