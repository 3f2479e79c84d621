"""A part of the grid served and read alone: a region equals xarray's selection of the same
box, a read group's share of the cells or latitude rows equals the stored values cut by hand,
and a quarter of a 0.25-degree chunk reads at most 0.35x the bytes of the whole, locally and
on S3 (moto)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import xarray as xr
import zarr
from anemoi_stores import read_anemoi, write_anemoi
from composed_stores import on_moto
from zarr.codecs import BloscCodec

import insitubatch_nodes as ib

TIMES = pd.date_range("2020-01-01", periods=12, freq="6h")


@pytest.fixture(scope="module")
def wb2(tmp_path_factory):
    """A WB2-like store on a 10-degree grid: latitude descending 90..-90 (19 rows, odd),
    longitude 0..350, three levels in a chunk; values distinct everywhere."""
    lat = np.linspace(90, -90, 19)
    lon = np.arange(0, 360, 10.0)
    shape = (len(TIMES), 3, lat.size, lon.size)
    ds = xr.Dataset(
        {"temperature": (("time", "level", "latitude", "longitude"),
                         np.arange(np.prod(shape), dtype="float32").reshape(shape)),
         "2m_temperature": (("time", "latitude", "longitude"),
                            1e6 + np.arange(np.prod(shape) // 3, dtype="float32").reshape(
                                shape[:1] + shape[2:]))},
        coords={"time": TIMES, "level": [500, 850, 1000], "latitude": lat, "longitude": lon})
    path = tmp_path_factory.mktemp("grid") / "wb2.zarr"
    ds.to_zarr(path, zarr_format=2, encoding={
        "temperature": {"chunks": (1, 3, lat.size, lon.size)},
        "2m_temperature": {"chunks": (1, lat.size, lon.size)}})
    return path, ds


def epoch(src, **kw):
    manifest = ib.split_by_chunk(src, (1.0,), names=["train"])
    kw.setdefault("batch_size", 4)
    return [{k: v.numpy() for k, v in b.items()}
            for b in ib.build_loader(src, manifest, "train", **kw)]


def check(batches, want: xr.Dataset, names):
    seen = []
    for b in batches:
        idx = b["sample_index"]
        seen += idx.tolist()
        for name in names:
            np.testing.assert_array_equal(b[name], want[name].values[idx], err_msg=name)
    assert sorted(seen) == list(range(len(TIMES)))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_region_across_the_antimeridian_equals_xarrays_selection(wb2, workers):
    path, ds = wb2
    src = ib.open_source(path).region(latitude=(35, 72), longitude=(-25, 45))
    box = ds.sel(latitude=slice(72, 35))
    box = xr.concat([box.sel(longitude=slice(335, 360)), box.sel(longitude=slice(0, 45))],
                    "longitude")
    assert [v.shape for v in src.variables] == [box[n].shape for n in src.names]
    check(epoch(src, workers=workers), box, src.names)


def test_a_region_by_index_with_levels_picked(wb2):
    path, ds = wb2
    src = ib.open_source(path).region(latitude=slice(2, 9), longitude=slice(30, 36))
    box = ds.isel(latitude=slice(2, 9), longitude=slice(30, 36))
    for b in epoch(src, channels=[("temperature", 850), "2m_temperature"]):
        idx = b["sample_index"]
        np.testing.assert_array_equal(b["channels"][:, 0],
                                      box["temperature"].sel(level=850).values[idx])
        np.testing.assert_array_equal(b["channels"][:, 1], box["2m_temperature"].values[idx])


def test_a_region_of_a_region_takes_its_bounds_among_the_values_kept(wb2):
    """The second region's values are looked up among the first's points, in its order
    (across the antimeridian too), not among the whole grid's indices."""
    path, ds = wb2
    src = ib.open_source(path).region(latitude=(0, 60), longitude=(-90, 90))
    inner = src.region(latitude=(30, 50), longitude=(-20, 30))
    box = ds.sel(latitude=slice(50, 30))
    box = xr.concat([box.sel(longitude=slice(340, 360)), box.sel(longitude=slice(0, 30))],
                    "longitude")
    assert [v.shape for v in inner.variables] == [box[n].shape for n in inner.names]
    check(epoch(inner), box, inner.names)
    first = ds.sel(latitude=slice(60, 0))
    first = xr.concat([first.sel(longitude=slice(270, 360)), first.sel(longitude=slice(0, 90))],
                      "longitude")
    by_index = src.region(latitude=slice(1, 3))  # slices count the first region's rows
    check(epoch(by_index), first.isel(latitude=slice(1, 3)), by_index.names)


def test_a_coordinate_of_another_length_is_refused(tmp_path):
    g = zarr.open_group(tmp_path / "s.zarr", mode="w", zarr_format=3)
    g.create_array("t", shape=(4, 6, 8), chunks=(1, 6, 8), dtype="float32",
                   dimension_names=("time", "lat", "lon"))
    g.create_array("lat", shape=(5,), dtype="float64", dimension_names=("lat",))[:] = np.arange(5)
    with pytest.raises(ib.StoreError, match=r"coordinate 'lat' .* has shape \(5,\), but "
                                            r"variable 't' has 6 values along 'lat'.*slice"):
        ib.open_source(tmp_path / "s.zarr").region(lat=(1, 3))


def test_channels_of_a_region_of_levels_are_the_levels_it_kept(wb2):
    """A level picked by value among a region's levels is that level (it was picked by its
    index among the store's: 850 served the 1000 hPa values)."""
    path, ds = wb2
    src = ib.open_source(path).region(level=(850, 1000))
    for channels, levels in (([("temperature", 850)], [850]), ([("temperature", 1000)], [1000]),
                             (["temperature"], [850, 1000])):
        manifest = ib.split_by_chunk(src, (1.0,), names=["train"])
        with ib.build_loader(src, manifest, "train", batch_size=4, channels=channels) as ld:
            assert ld.channel_names == tuple(f"temperature@{lv}" for lv in levels)
            for b in ld:
                np.testing.assert_array_equal(
                    b["channels"].numpy(),
                    ds["temperature"].sel(level=levels).values[b["sample_index"]])


@pytest.mark.parametrize("workers", [0, 2])
def test_a_period_of_a_region_equals_xarrays_selection(wb2, workers):
    """A region first, then a period every 12 hours (it was refused: "compose sources
    first"), or the other way round: the same samples, xarray's."""
    path, ds = wb2
    box = ds.sel(latitude=slice(72, 35))
    box = xr.concat([box.sel(longitude=slice(335, 360)), box.sel(longitude=slice(0, 45))],
                    "longitude").sel(time=slice("2020-01-01T06", "2020-01-03T06"))
    box = box.isel(time=slice(None, None, 2))
    whole = ib.open_source(path)
    for src in (whole.region(latitude=(35, 72), longitude=(-25, 45)).period(
                    start="2020-01-01T06", end="2020-01-03T06", frequency="12h"),
                whole.period(start="2020-01-01T06", end="2020-01-03T06", frequency="12h")
                .region(latitude=(35, 72), longitude=(-25, 45))):
        np.testing.assert_array_equal(src.sample_coord, box["time"].values)
        seen = []
        for b in epoch(src, workers=workers, batch_size=2):
            seen += b["sample_index"].tolist()
            for name in src.names:
                np.testing.assert_array_equal(b[name], box[name].values[b["sample_index"]])
        assert sorted(seen) == list(range(box.sizes["time"]))


def test_a_region_naming_no_dimension_or_no_value_is_refused(wb2):
    src = ib.open_source(wb2[0])
    with pytest.raises(ib.UnknownNameError, match="'lat'.*latitude"):
        src.region(lat=(0, 10))
    with pytest.raises(ib.ConfigError, match="holds no latitude value.*-90"):
        src.region(latitude=(91, 95))


def test_statistics_of_the_whole_grid_normalize_each_part_with_its_own_points(wb2):
    """Statistics kept per grid point and level, computed over the whole store, normalize a
    region (across the antimeridian), a cut of the levels and a read-group rank's rows with
    the statistics of the points and levels each serves (numpy's, over the whole split)."""
    path, ds = wb2
    whole = ib.open_source(path)
    manifest = ib.split_by_chunk(whole, (1.0,), names=["train"])
    stats = ib.compute_stats(whole, manifest, keep_dims=["level", "latitude", "longitude"],
                             progress=False)

    def normalized(box: xr.Dataset, name: str, idx) -> np.ndarray:
        x = ds[name].astype("float64")
        mean = x.mean("time").sel({d: box[d] for d in box[name].dims if d != "time"})
        std = x.std("time").sel({d: box[d] for d in box[name].dims if d != "time"})
        return ((box[name].values[idx] - mean.values) / std.values).astype("float32")

    east = ds.sel(latitude=slice(72, 35))
    parts = {
        "region": (whole.region(latitude=(35, 72), longitude=(-25, 45)),
                   xr.concat([east.sel(longitude=slice(335, 360)),
                              east.sel(longitude=slice(0, 45))], "longitude")),
        "levels": (whole.region(level=(500, 850)), ds.sel(level=[500, 850]))}
    for what, (part, box) in parts.items():
        for b in epoch(part, stats=stats):
            for name in part.names:
                np.testing.assert_allclose(b[name], normalized(box, name, b["sample_index"]),
                                           rtol=1e-5, atol=1e-5, err_msg=f"{what}: {name}")
    with ib.build_loader(whole, manifest, "train", batch_size=4, stats=stats, rank=1,
                         world_size=2, read_group=2) as ld:
        box = ds.isel(latitude=ld.grid_part)
        assert box.sizes["latitude"] == 9
        for b in ld:
            for name in whole.names:
                np.testing.assert_allclose(b[name].numpy(),
                                           normalized(box, name, b["sample_index"]),
                                           rtol=1e-5, atol=1e-5, err_msg=f"rank 1: {name}")


def test_channels_normalized_per_point_denormalize_to_the_stored_values(wb2):
    """Levels and a single-level field stacked into channels, normalized with statistics
    per level and grid point (cut to a region): ``denormalize`` gives back the stored values
    (its parameters were (channels, 1, 1) only, which per-point statistics do not fit)."""
    path, ds = wb2
    whole = ib.open_source(path)
    stats = ib.compute_stats(whole, ib.split_by_chunk(whole, (1.0,), names=["train"]),
                             keep_dims=["level", "latitude", "longitude"], progress=False)
    part = whole.region(latitude=(0, 60), longitude=(-40, 40))
    box = ds.sel(latitude=slice(60, 0))
    box = xr.concat([box.sel(longitude=slice(320, 360)), box.sel(longitude=slice(0, 40))],
                    "longitude")
    want = np.concatenate([box["temperature"].values, box["2m_temperature"].values[:, None]], 1)
    manifest = ib.split_by_chunk(part, (1.0,), names=["train"])
    with ib.build_loader(part, manifest, "train", batch_size=4, stats=stats,
                         channels=["temperature", "2m_temperature"]) as ld:
        for b in ld:
            np.testing.assert_allclose(ld.denormalize(b["channels"]).numpy(),
                                       want[b["sample_index"].numpy()], rtol=1e-5)


def test_statistics_say_which_part_they_cover(wb2, tmp_path):
    """Statistics computed over a region record its points: a loader serving that region
    takes them as they are (a full circle of longitudes re-ordered from 180: the same as the
    whole store's, cut), through JSON too; over another region, or the whole grid, they
    are refused naming both parts. A region's levels are its statistics' coordinates."""
    path, ds = wb2
    whole = ib.open_source(path)
    keep = ["level", "latitude", "longitude"]

    def stats_of(src, keep_dims=keep):
        m = ib.split_by_chunk(src, (1.0,), names=["train"])
        return ib.compute_stats(src, m, keep_dims=keep_dims, progress=False)

    turned = whole.region(longitude=(180, 170))  # every longitude, from 180 east
    assert turned.variables[0].shape == whole.variables[0].shape
    own = stats_of(turned)
    (tmp_path / "s.json").write_text(json.dumps(own.to_dict()))
    own = ib.Stats.from_dict(json.loads((tmp_path / "s.json").read_text()))
    a = [b["2m_temperature"] for b in epoch(turned, stats=own, seed=1)]
    b = [b["2m_temperature"] for b in epoch(turned, stats=stats_of(whole), seed=1)]
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)
    north = stats_of(whole.region(latitude=(30, 90)))
    with pytest.raises(ib.ConfigError, match=r"statistics of '2m_temperature' were computed "
                       r"over a part of its grid \(latitude: 7 points from index 0\), and "
                       r"this loader serves latitude: 7 points from index 6"):
        epoch(whole.region(latitude=(-30, 30)), stats=north)
    with pytest.raises(ib.ConfigError, match=r"\(latitude: 7 points from index 0\), and "
                                             r"this loader serves the whole grid"):
        epoch(whole, stats=north)
    levels = stats_of(whole.region(level=(850, 1000)), None)["temperature"]
    assert levels.coords == (850, 1000)
    np.testing.assert_allclose(levels.at(1000)[0],
                               ds["temperature"].sel(level=1000).values.mean(), rtol=1e-6)


def test_static_fields_of_the_whole_grid_are_cut_as_the_region(tmp_path):
    """A land-sea mask of the whole grid (as open_static reads it, numpy or torch) beside a
    region across the antimeridian is served cut to the region's points in the region's
    order, in each rank's rows of a read group too; open_static of the region says the
    same; a mask of the region itself is taken as it is."""
    lat, lon = np.linspace(90, -90, 19), np.arange(0, 360, 10.0)
    rng = np.random.default_rng(3)
    ds = xr.Dataset({"t": (("time", "latitude", "longitude"),
                           rng.normal(0, 1, (8, 19, 36)).astype("float32")),
                     "lsm": (("latitude", "longitude"), rng.random((19, 36)).astype("float32"))},
                    coords={"time": TIMES[:8], "latitude": lat, "longitude": lon})
    ds.to_zarr(tmp_path / "s.zarr", zarr_format=2)
    whole = ib.open_source(tmp_path / "s.zarr")
    region = whole.region(latitude=(35, 72), longitude=(-25, 45))
    east = ds.sel(latitude=slice(72, 35))
    box = xr.concat([east.sel(longitude=slice(335, 360)), east.sel(longitude=slice(0, 45))],
                    "longitude")
    np.testing.assert_array_equal(ib.open_static(region)["lsm"], box["lsm"].values)
    lsm = ib.open_static(whole)["lsm"]
    for given in (lsm, torch.from_numpy(lsm), box["lsm"].values):
        for b in epoch(region, static={"lsm": given}):
            assert b["static/lsm"].shape == b["t"].shape
            np.testing.assert_array_equal(b["static/lsm"][0], box["lsm"].values)
    manifest = ib.split_by_chunk(region, (1.0,), names=["train"])
    with ib.build_loader(region, manifest, "train", batch_size=4, static={"lsm": lsm},
                         rank=1, world_size=2, read_group=2) as ld:
        b = next(iter(ld))
    np.testing.assert_array_equal(b["static/lsm"][0].numpy(),
                                  box["lsm"].values[ld.grid_part])


def _balanced(n, k, i):
    """anemoi's balanced partition, written out: sizes differ by at most one, the first
    n % k parts one larger."""
    sizes = [n // k + (j < n % k) for j in range(k)]
    start = sum(sizes[:i])
    return slice(start, start + sizes[i])


@pytest.mark.parametrize("groups", [2, 3, 4])
def test_latitude_rows_of_an_odd_grid_cut_for_a_read_group(wb2, groups):
    path, ds = wb2
    for rank in range(groups):
        part = _balanced(19, groups, rank)
        src = ib.open_source(path).grid_part(part)
        check(epoch(src), ds.isel(latitude=part), src.names)


@pytest.mark.parametrize("groups", [2, 3, 4])
def test_anemoi_cells_cut_for_a_read_group(tmp_path, groups):
    path = write_anemoi(tmp_path / "a.zarr", ("2t", "msl", "10u"), "2020-01-01", 8,
                        n_cells=37)
    stored = read_anemoi(path)
    for rank in range(groups):
        part = _balanced(37, groups, rank)
        src = ib.open_source(path).grid_part(part)
        for b in epoch(src):
            idx = b["sample_index"]
            np.testing.assert_array_equal(b["data"], stored.data[idx][..., part])


def _quarter_degree(path: Path) -> None:
    """Three steps of a 0.25-degree field, one a chunk, blosc-zstd with byte shuffle as
    ERA5 archives compress (a smooth field plus noise, not random bytes)."""
    lat = np.linspace(90, -90, 721)
    lon = np.arange(1440) * 0.25
    field = (250 + 30 * np.cos(np.deg2rad(lat))[:, None]
             + 5 * np.sin(np.deg2rad(lon))[None, :]).astype("float32")
    rng = np.random.default_rng(0)
    g = zarr.open_group(path, mode="w", zarr_format=3)
    arr = g.create_array("t2m", shape=(3, 721, 1440), chunks=(1, 721, 1440), dtype="float32",
                         compressors=BloscCodec(cname="zstd", clevel=3, shuffle="shuffle"),
                         dimension_names=("time", "latitude", "longitude"))
    arr[:] = field[None] + rng.normal(0, 0.5, (3, 721, 1440)).astype("float32")


def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def _bytes_read(src) -> int:
    """Bytes this process read from files over one epoch on the decode threads."""
    epoch(src, workers=0)  # imports and metadata read once, outside the count
    before = _rchar()
    epoch(src, workers=0, seed=1)
    return _rchar() - before


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="counts bytes by /proc")
def test_a_quarter_of_a_quarter_degree_chunk_reads_at_most_035x_locally(tmp_path):
    _quarter_degree(tmp_path / "q.zarr")
    src = ib.open_source(tmp_path / "q.zarr")
    whole = _bytes_read(src)
    for rank in range(4):
        part = _balanced(721, 4, rank)
        assert _bytes_read(src.grid_part(part)) <= 0.35 * whole


def test_a_quarter_of_a_quarter_degree_chunk_fetches_at_most_035x_on_s3(tmp_path):
    _quarter_degree(tmp_path / "q.zarr")
    values = np.asarray(zarr.open_array(tmp_path / "q.zarr" / "t2m")[:])
    with on_moto(tmp_path / "q.zarr") as (url, options):
        src = ib.open_source(url, storage_options=options)
        for rank in (0, 3):
            part = _balanced(721, 4, rank)
            cut = src.grid_part(part)
            manifest = ib.split_by_chunk(cut, (1.0,), names=["train"])
            loader = ib.build_loader(cut, manifest, "train", batch_size=3)
            for b in loader:
                np.testing.assert_array_equal(b["t2m"].numpy(),
                                              values[b["sample_index"].numpy()][:, part])
            stats = loader.stats()
            assert stats.chunks_fetched_in_part == 3
            assert stats.part_bytes_fetched <= 0.35 * stats.part_frame_bytes


def test_a_sample_dataset_of_a_grid_part_and_not_of_a_read_group(wb2):
    path, ds = wb2
    src = ib.open_source(path)
    manifest = ib.split_by_chunk(src, (1.0,), names=["train"])
    with pytest.raises(ib.ConfigError, match="read_group=2.*grid_part"):
        ib.SampleDataset(src, manifest, "train", read_group=2)
    part = src.grid_part(slice(3, 8))
    one = ib.SampleDataset(part, ib.split_by_chunk(part, (1.0,), names=["train"]), "train")
    row = one[4]
    np.testing.assert_array_equal(row["temperature"].numpy(),
                                  ds["temperature"].values[4][:, 3:8])


def test_the_device_decoder_refuses_parts_and_moved_axes(wb2, tmp_path):
    """The GPU decoder places whole stored chunks: a part of the grid, a concat's member
    stripes or a stripe gathered across a moved axis would come out wrong, so the loader
    refuses them at build, naming the variables, instead of serving them."""
    from insitubatch_nodes.testing.host_frames import HostFrameDecoder

    part = ib.open_source(wb2[0]).grid_part(slice(0, 5))
    manifest = ib.split_by_chunk(part, (1.0,), names=["train"])
    with pytest.raises(ib.ConfigError, match=r"decode='cpu'"):
        next(iter(ib.build_loader(part, manifest, "train", batch_size=2,
                                  decode=HostFrameDecoder(), in_place=False)))
    g = zarr.open_group(tmp_path / "moved.zarr", mode="w", zarr_format=3)
    g.create_array("v", shape=(3, 4, 6), chunks=(1, 4, 2), dtype="float32",
                   dimension_names=("band", "y", "time"))[:] = np.arange(72.0).reshape(3, 4, 6)
    moved = ib.open_source(tmp_path / "moved.zarr", sample_dim="time")
    manifest = ib.split_by_chunk(moved, (1.0,), names=["train"])
    with pytest.raises(ib.ConfigError, match=r"\['v'\].*decode='cpu'"):
        next(iter(ib.build_loader(moved, manifest, "train", batch_size=2,
                                  decode=HostFrameDecoder(), in_place=False)))
