"""Channels as a new user names them, on a WeatherBench2-like store written by xarray
(temperature and geopotential on levels, two surface fields, a static mask, one step a
chunk): what ``channels=`` names is what is read, decoded, normalized and served."""

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import xarray as xr

import insitubatch_nodes as ib

LEVELS = np.array([50, 500, 850, 1000], dtype="int64")
N_TIMES = 24
PICKED = [("temperature", 500), ("temperature", 850), "2m_temperature"]


def _wb2_like(path: Path) -> xr.Dataset:
    rng = np.random.default_rng(3)
    time = pd.date_range("2020-01-01", periods=N_TIMES, freq="6h")
    lat = np.linspace(90, -90, 5)
    lon = np.arange(0, 360, 45.0)
    shape = (N_TIMES, len(LEVELS), 5, 8)
    # level by level very different scales, as geopotential's 50 hPa and 1000 hPa are
    scale = (1.0 + np.arange(len(LEVELS)) * 10.0)[None, :, None, None]
    ds = xr.Dataset(
        {
            "temperature": (("time", "level", "latitude", "longitude"),
                            (200 + scale * rng.standard_normal(shape)).astype("float32")),
            "geopotential": (("time", "level", "latitude", "longitude"),
                             (scale * 1000 + scale * rng.standard_normal(shape))
                             .astype("float32")),
            "2m_temperature": (("time", "latitude", "longitude"),
                               (280 + 5 * rng.standard_normal((N_TIMES, 5, 8)))
                               .astype("float32")),
            "mean_sea_level_pressure": (("time", "latitude", "longitude"),
                                        (1e5 + 100 * rng.standard_normal((N_TIMES, 5, 8)))
                                        .astype("float32")),
            "land_sea_mask": (("latitude", "longitude"),
                              (rng.random((5, 8)) > 0.5).astype("float32")),
        },
        coords={"time": time, "level": LEVELS, "latitude": lat, "longitude": lon},
    )
    enc = {v: {"chunks": (1, *ds[v].shape[1:])} for v in ds.data_vars if v != "land_sea_mask"}
    ds.to_zarr(path, zarr_format=2, consolidated=True, encoding=enc)
    return ds


@pytest.fixture(scope="module")
def wb2(tmp_path_factory) -> tuple[Path, xr.Dataset]:
    path = tmp_path_factory.mktemp("wb2like") / "wb2.zarr"
    return path, _wb2_like(path)


def _epoch(loader) -> tuple[list[dict], int]:
    with loader:
        batches = [{k: v.clone() for k, v in b.items()} for b in loader]
    return batches, loader.stats().bytes_fetched


def test_the_channels_are_the_read(wb2):
    """``open_source(url)`` finds every variable; ``channels=`` then reads, decodes and
    serves only the channels' variables: the batch holds the channels alone, and the bytes
    read are those of a source opened with the channels' variables named."""
    path, ds = wb2
    src = ib.open_source(path)
    assert set(src.names) == {"temperature", "geopotential", "2m_temperature",
                              "mean_sea_level_pressure"}
    m = ib.split_by_chunk(src, (1.0,))
    got, read = _epoch(ib.build_loader(src, m, "train", batch_size=6, channels=PICKED))
    named = ib.open_source(path, variables=["temperature", "2m_temperature"])
    want, read_named = _epoch(ib.build_loader(named, m, "train", batch_size=6,
                                              channels=PICKED))
    assert {tuple(sorted(b)) for b in got} == {("channels", "sample_index", "time")}
    assert read == read_named > 0
    # a whole temperature sample, 4 levels, and 2m_temperature's, per step: nothing else
    assert read == N_TIMES * 4 * (len(LEVELS) + 1) * 5 * 8
    for g, w in zip(got, want, strict=True):
        for k in g:
            np.testing.assert_array_equal(g[k].numpy(), w[k].numpy())
        idx = g["sample_index"].numpy()
        np.testing.assert_array_equal(g["channels"][:, 0].numpy(),
                                      ds.temperature.sel(level=500).values[idx])
        np.testing.assert_array_equal(g["channels"][:, 2].numpy(),
                                      ds["2m_temperature"].values[idx])


def test_static_fields_beside_the_channels_and_named_variables_beside_them(wb2):
    """Static fields named in ``static=`` come beside the channels; variables named in
    ``open_source(variables=)`` are all served, the ones not in a channel in their key."""
    path, _ = wb2
    src = ib.open_source(path)
    m = ib.split_by_chunk(src, (1.0,))
    with ib.build_loader(src, m, "train", batch_size=6, channels=PICKED,
                         static=ib.open_static(src, ["land_sea_mask"])) as ld:
        assert set(next(iter(ld))) == {"channels", "static/land_sea_mask", "sample_index",
                                       "time"}
    named = ib.open_source(path, variables=["temperature", "2m_temperature",
                                            "mean_sea_level_pressure"])
    with ib.build_loader(named, m, "train", batch_size=6, channels=PICKED) as ld:
        assert set(next(iter(ld))) == {"channels", "mean_sea_level_pressure",
                                       "sample_index", "time"}


def test_statistics_are_needed_only_for_what_is_served(wb2):
    """Statistics of the channels' variables normalize a loader over every variable the
    store has: the others are not served, so they need none."""
    path, _ = wb2
    src = ib.open_source(path)
    m = ib.split_by_chunk(src, (1.0,))
    stats = ib.compute_stats(src, m, variables=["temperature", "2m_temperature"],
                             progress=False)
    with ib.build_loader(src, m, "train", batch_size=6, channels=PICKED, stats=stats) as ld:
        b = next(iter(ld))
    assert b["channels"].shape == (6, 3, 5, 8)


def test_a_sample_dataset_serves_the_channels_only(wb2):
    path, _ = wb2
    src = ib.open_source(path)
    m = ib.split_by_chunk(src, (1.0,))
    ds = ib.SampleDataset(src, m, "train", channels=PICKED)
    assert set(ds[0]) == {"channels", "sample_index", "time"}
    assert ds.source.names == ("2m_temperature", "temperature")


# -- channel names, one way ---------------------------------------------------------------


def test_a_level_written_any_way_is_one_channel_named_as_stored(wb2):
    """``"temperature@500"`` (the form ``channel_names`` gives), ``("temperature", 500)``,
    500.0 and "500" pick the same level, named as stored; the batches are identical."""
    path, _ = wb2
    src = ib.open_source(path)
    m = ib.split_by_chunk(src, (1.0,))
    ways = [PICKED,
            ["temperature@500", "temperature@850", "2m_temperature"],
            [("temperature", 500.0), ("temperature", "850"), "2m_temperature"],
            [("temperature", np.int64(500)), "temperature@850.0", "2m_temperature"]]
    epochs = []
    for channels in ways:
        loader = ib.build_loader(src, m, "train", batch_size=5, seed=1, channels=channels)
        assert loader.channel_names == ("temperature@500", "temperature@850", "2m_temperature")
        epochs.append(_epoch(loader))
    for batches, read in epochs[1:]:
        assert read == epochs[0][1]
        for g, w in zip(batches, epochs[0][0], strict=True):
            assert g.keys() == w.keys()
            for k in g:
                np.testing.assert_array_equal(g[k].numpy(), w[k].numpy())
    # the names a loader gives are channels it takes
    again = ib.build_loader(src, m, "train", batch_size=5, channels=list(loader.channel_names))
    assert again.channel_names == loader.channel_names
    whole = ib.build_loader(src, m, "train", batch_size=5, channels=["temperature"])
    assert whole.channel_names == tuple(f"temperature@{v}" for v in LEVELS)


@pytest.mark.parametrize("channels,err,match", [
    ([("temperature", 500)] * 2, ValueError,
     r"channel \('temperature', 500\) \(temperature@500\) is given twice: give each channel "
     r"once"),
    ([("temperature", 500), "temperature@500.0"], ValueError,
     r"channel 'temperature@500.0' \(temperature@500\) is the same channel as "
     r"\('temperature', 500\)"),
    (["temperature", ("temperature", 500)], ValueError,
     r"channels= gives 'temperature' whole \(every level\) and \('temperature', 500\), one "
     r"of its levels.*give 'temperature' alone for every level, or only the levels to keep"),
    (["temperature@850", "2m_temperature", "temperature"], ValueError,
     r"gives 'temperature' whole \(every level\) and 'temperature@850'"),
    (["land_sea_mask"], ValueError,
     r"channel 'land_sea_mask': 'land_sea_mask' is a static field \(no time axis\).*"
     r"static=ib.open_static\(source, \['land_sea_mask'\]\).*on the command line, static "
     r"fields are not channels"),
    ([("temperature", 501)], KeyError,
     r"channel \('temperature', 501\): level=501 is not a level of 'temperature'; levels: "
     r"\[50, 500, 850, 1000\] \(write e.g. \('temperature', 50\) or 'temperature@50'\)"),
    (["temperature@501"], KeyError,
     r"channel 'temperature@501': level=501 is not a level of 'temperature'; levels: "
     r"\[50, 500, 850, 1000\] \(write e.g. 'temperature@50' or \('temperature', 50\)\)"),
    (["temperatur@500"], KeyError,
     r"unknown channel 'temperatur@500': 'temperatur' is not a variable served.*variables: "
     r"\['2m_temperature', 'geopotential', .*static fields \(static=\): \['land_sea_mask'\]"),
    ([("2m_temperature", 500)], ValueError,
     r"channel \('2m_temperature', 500\): picking level 500 of '2m_temperature' needs samples "
     r"shaped \(level, y, x\); its dims are \('time', 'latitude', 'longitude'\): give it "
     r"alone, '2m_temperature'"),
    ([("temperature", 500, 1)], TypeError, r"a channel is a name .*or a pair"),
])
def test_bad_channels_are_refused_naming_the_entry(wb2, channels, err, match):
    path, _ = wb2
    src = ib.open_source(path)
    m = ib.split_by_chunk(src, (1.0,))
    with pytest.raises(err, match=match):
        ib.build_loader(src, m, "train", batch_size=4, channels=channels)


def test_a_variable_left_out_of_variables_is_named_so(wb2):
    path, _ = wb2
    src = ib.open_source(path, variables=["2m_temperature"])
    m = ib.split_by_chunk(src, (1.0,))
    with pytest.raises(KeyError, match=r"'temperature' is in the store but not in "
                       r"open_source\(variables=...\): add it there"):
        ib.build_loader(src, m, "train", channels=["temperature@500"])


def test_default_statistics_standardise_each_level_of_the_channels(wb2):
    """Statistics computed with no arguments normalize every channel picked, each level
    on its own (levels 30 times apart in scale, as geopotential's are)."""
    path, _ = wb2
    src = ib.open_source(path)
    m = ib.split_by_chunk(src, (1.0,))
    stats = ib.compute_stats(src, m, progress=False)
    assert stats["geopotential"].kept_dims == ("level",)
    channels = ["geopotential", "temperature@50", "temperature@1000", "2m_temperature"]
    with ib.build_loader(src, m, "train", batch_size=6, stats=stats, channels=channels) as ld:
        x = np.concatenate([b["channels"].double().numpy() for b in ld])
    assert x.shape[1] == len(LEVELS) + 3
    np.testing.assert_allclose(x.mean(axis=(0, 2, 3)), 0.0, atol=1e-4)
    np.testing.assert_allclose(x.std(axis=(0, 2, 3)), 1.0, rtol=1e-4)


def test_schemes_and_masks_of_variables_left_out_apply_to_nothing(wb2):
    """``normalize=`` and ``mask=`` naming a variable of the store that the channels leave
    out (so it is not served) apply to nothing, as statistics of it do; a name the store
    lacks is still refused."""
    path, _ = wb2
    src = ib.open_source(path)
    m = ib.split_by_chunk(src, (1.0,))
    stats = ib.compute_stats(src, m, progress=False)
    with ib.build_loader(src, m, "train", batch_size=6, stats=stats, channels=PICKED,
                         normalize={"mean_sea_level_pressure": "none"},
                         mask=["mean_sea_level_pressure"]) as ld:
        assert set(next(iter(ld))) == {"channels", "sample_index", "time"}
    with pytest.raises(KeyError, match=r"scheme given for 'msl', which is not served"):
        ib.build_loader(src, m, "train", stats=stats, channels=PICKED, normalize={"msl": "none"})


# -- an epoch that yields nothing ----------------------------------------------------------


def test_a_split_that_yields_no_batch_is_refused_at_build(wb2):
    """``batch_size=100`` on a 24-sample split with ``drop_last=True`` gave ``len(loader)
    == 0`` and epochs that yield nothing: refused, naming the split, its size, the batch
    size and ``drop_last``, and what would do; on several ranks, this rank's share."""
    path, _ = wb2
    src = ib.open_source(path)
    m = ib.split_by_chunk(src, (1.0,))
    with pytest.raises(ValueError, match=r"split 'train' yields no batch: its 24 samples make "
                       r"no batch of batch_size=100 with drop_last=True; use batch_size <= "
                       r"24, or drop_last=False \(one batch of 24\)"):
        ib.build_loader(src, m, "train", batch_size=100, drop_last=True, channels=PICKED)
    with ib.build_loader(src, m, "train", batch_size=100, channels=PICKED) as ld:
        assert len(ld) == 1 and len(list(ld)) == 1
    with ib.build_loader(src, m, "train", batch_size=24, drop_last=True) as ld:
        assert len(ld) == 1
    with pytest.raises(ValueError, match=r"its 24 samples \(rank 1 of 2 gets 12\) make no "
                       r"batch of batch_size=13 with drop_last=True; use batch_size <= 12"):
        ib.build_loader(src, m, "train", batch_size=13, drop_last=True, rank=1, world_size=2)
    with ib.build_loader(src, m, "train", batch_size=12, drop_last=True, rank=1,
                         world_size=2) as ld:
        assert len(ld) == 1
