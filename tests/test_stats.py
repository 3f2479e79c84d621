"""Statistics over the finite values, and missing values served as the archive holds them:
a WeatherBench2-layout store whose sea-surface temperature is NaN over land, as ERA5's."""

import json

import numpy as np
import pytest
import torch
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import insitubatch_nodes as ib
from insitubatch_nodes.store.statistics import Stats
from insitubatch_nodes.synthetic import (
    WB2_SST,
    WB2_VARIABLES,
    WB2Spec,
    wb2_land_sea_mask,
    write_wb2_store,
)

SST = WB2_SST
SPEC = WB2Spec.small(n_times=10, seed=2)


@pytest.fixture(scope="module")
def wb2(tmp_path_factory):
    spec = WB2Spec(**{**SPEC.__dict__, "sea_surface_temperature": True})
    path = write_wb2_store(tmp_path_factory.mktemp("wb2") / "wb2.zarr", spec, progress=False)
    src = ib.open_source(path, variables=["2m_temperature", "temperature", SST])
    m = ib.split_by_chunk(src, (0.8, 0.2))
    land = wb2_land_sea_mask(SPEC) >= 0.5
    return src, m, zarr.open_group(path, mode="r"), land


def _train_values(g, m, name):
    ids = m.chunk_ids("train")  # one step per chunk
    return np.asarray(g[name][np.sort(ids)], dtype=np.float64)


def test_the_store_holds_nan_exactly_over_land(wb2):
    _, _, g, land = wb2
    sst = g[SST][:]
    assert 0.1 < land.mean() < 0.9
    np.testing.assert_array_equal(np.isnan(sst), np.broadcast_to(land, sst.shape))


def test_statistics_are_over_the_finite_values(wb2):
    src, m, g, land = wb2
    stats = ib.compute_stats(src, m, "train", progress=False)
    x = _train_values(g, m, SST)
    s = stats[SST]
    assert np.isfinite([s.mean, s.std, s.min, s.max]).all()
    np.testing.assert_allclose(s.mean, np.nanmean(x), rtol=1e-12)
    np.testing.assert_allclose(s.std, np.nanstd(x), rtol=1e-10)
    assert s.min == np.nanmin(x) and s.max == np.nanmax(x)
    assert s.count == int(np.isfinite(x).sum())
    assert s.nan_fraction == pytest.approx(land.mean())
    t = stats["temperature"]  # a variable without missing values, per level by default
    assert t.nan_fraction == 0.0 and t.kept_dims == ("level",)
    assert t.coords == tuple(g["level"][:].tolist())
    np.testing.assert_allclose(t.mean, _train_values(g, m, "temperature").mean(axis=(0, 2, 3)),
                               rtol=1e-12)
    pooled = ib.compute_stats(src, m, "train", keep_dims=(), progress=False)["temperature"]
    assert pooled.kept_dims == () and np.shape(pooled.mean) == ()
    np.testing.assert_allclose(pooled.mean, _train_values(g, m, "temperature").mean(),
                               rtol=1e-12)
    again = Stats.from_dict(json.loads(json.dumps(stats.to_dict())))
    assert again[SST].nan_fraction == s.nan_fraction
    old = stats.to_dict()  # statistics saved before nan_fraction existed still load
    del old["variables"][SST]["nan_fraction"]
    assert Stats.from_dict(old)[SST].nan_fraction == 0.0


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(2, 30), chunk=st.integers(1, 7), levels=st.integers(1, 3),
       nan_at=st.lists(st.tuples(st.integers(0, 29), st.integers(0, 2), st.integers(0, 4)),
                       max_size=40),
       keep=st.booleans(), seed=st.integers(0, 9))
def test_statistics_equal_numpys_nan_statistics(tmp_path_factory, n, chunk, levels, nan_at,
                                                keep, seed):
    x = np.random.default_rng(seed).normal(5, 3, (n, levels, 5))
    for t, lv, i in nan_at:
        x[t % n, lv % levels, i] = np.nan if (t + i) % 3 else np.inf
    finite_per_level = np.isfinite(x).sum(axis=(0, 2))
    path = tmp_path_factory.mktemp("h") / "s.zarr"
    g = zarr.open_group(path, mode="w")
    g.create_array("v", shape=x.shape, chunks=(chunk, levels, 5), dtype="float64",
                   dimension_names=("time", "level", "cell"))[:] = x
    src = ib.open_source(path)
    m = ib.split_by_chunk(src, (1.0,))
    f = np.where(np.isfinite(x), x, np.nan)
    axes = (0, 2) if keep else None
    if (finite_per_level == 0).any() if keep else not np.isfinite(x).any():
        with pytest.raises(ValueError, match="'v' has no finite value"):
            ib.compute_stats(src, m, keep_dims=("level",) if keep else (), progress=False)
        return
    s = ib.compute_stats(src, m, keep_dims=("level",) if keep else (), progress=False)["v"]
    np.testing.assert_allclose(s.mean, np.nanmean(f, axis=axes), rtol=1e-10)
    np.testing.assert_allclose(s.std, np.nanstd(f, axis=axes), rtol=1e-9, atol=1e-12)
    np.testing.assert_array_equal(s.min, np.nanmin(f, axis=axes))
    np.testing.assert_array_equal(s.max, np.nanmax(f, axis=axes))
    assert s.nan_fraction == pytest.approx(1 - np.isfinite(x).mean())


def test_a_variable_without_a_finite_value_is_named(tmp_path):
    g = zarr.open_group(tmp_path / "s.zarr", mode="w")
    g.create_array("ok", shape=(8, 3), chunks=(2, 3), dtype="float32")[:] = 1.0
    g.create_array("gone", shape=(8, 3), chunks=(2, 3), dtype="float32")[:] = np.nan
    src = ib.open_source(tmp_path / "s.zarr")
    with pytest.raises(ValueError, match=r"variable 'gone' has no finite value in split "
                       r"'train'.*variables=\[\.\.\.\]"):
        ib.compute_stats(src, ib.split_by_chunk(src, (1.0,)), progress=False)


# -- batches ---------------------------------------------------------------------------
def _expected(g, name, index, stats):
    s = stats[name]
    return (np.asarray(g[name][index.numpy()], np.float64) - s.mean) / s.std


@pytest.mark.parametrize("in_place", [None, False], ids=["in-place", "gathered"])
def test_batches_are_nan_exactly_over_land_and_the_rest_untouched(wb2, in_place):
    src, m, g, land = wb2
    stats = ib.compute_stats(src, m, "train", progress=False)
    with ib.build_loader(src, m, "train", batch_size=3, stats=stats, in_place=in_place,
                         channels=["temperature", "2m_temperature", SST]) as ld:
        for b in ld:
            ch = b["channels"]
            assert ch.shape[1] == 13 + 1 + 1
            sst = ch[:, -1]
            np.testing.assert_array_equal(torch.isnan(sst).numpy(),
                                          np.broadcast_to(land, sst.shape))
            assert torch.isfinite(ch[:, :-1]).all()  # the other channels: no NaN
            np.testing.assert_allclose(ch[:, -1].numpy(),
                                       _expected(g, SST, b["sample_index"], stats), rtol=1e-5)
            np.testing.assert_allclose(ch[:, 13].numpy(), _expected(
                g, "2m_temperature", b["sample_index"], stats), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("channels", [None, ["temperature", SST, "2m_temperature"]],
                         ids=["per-variable", "stacked"])
def test_filled_with_a_mask_that_says_where(wb2, channels):
    src, m, g, land = wb2
    stats = ib.compute_stats(src, m, "train", progress=False)
    kw = dict(batch_size=4, stats=stats, fill_nan=0.0, mask=[SST], channels=channels)
    with ib.build_loader(src, m, "train", **kw) as ld:
        batches = list(ld)
    ds = ib.SampleDataset(src, m, "train", **kw)
    for b in batches:
        valid = b[f"mask/{SST}"]
        assert valid.dtype == torch.bool
        np.testing.assert_array_equal(valid.numpy(), np.broadcast_to(~land, valid.shape))
        assert "mask/temperature" not in b
        sst = b["channels"][:, 13] if channels else b[SST]
        assert torch.isfinite(sst).all() and (sst[~valid] == 0).all()
        want = _expected(g, SST, b["sample_index"], stats)
        np.testing.assert_allclose(sst[valid].numpy(), want[~np.isnan(want)], rtol=1e-5)
        # the same row through SampleDataset
        k = int(np.searchsorted(ds.sample_indices, int(b["sample_index"][0])))
        row = ds[k]
        for key in b:
            np.testing.assert_array_equal(np.asarray(row[key]), b[key][0].numpy(), err_msg=key)


def test_mask_true_covers_every_variable_and_names_are_checked(wb2):
    src, m, _, land = wb2
    with ib.build_loader(src, m, "train", batch_size=2, mask=True) as ld:
        b = next(iter(ld))
    assert {k for k in b if k.startswith("mask/")} == {f"mask/{n}" for n in src.names}
    assert b["mask/temperature"].all()
    assert torch.isnan(b[SST][~b[f"mask/{SST}"]]).all()  # no stats, no fill: NaN served
    with pytest.raises(KeyError, match=r"mask names \['sst'\].*variables"):
        ib.build_loader(src, m, "train", mask=["sst"])
    for bad in (float("nan"), "0", True):
        with pytest.raises(ValueError, match="sample.fill_nan must be a finite number"):
            ib.build_loader(src, m, "train", fill_nan=bad)


def test_stored_statistics_that_are_not_finite_are_refused(tmp_path):
    from insitubatch_nodes.synthetic import ANEMOI_VARIABLES, write_anemoi_store

    path = write_anemoi_store(tmp_path / "a.zarr")
    g = zarr.open_group(path, mode="r+")
    mean = g["mean"][:]
    mean[2] = np.nan
    g["mean"][:] = mean
    src = ib.open_source(path)
    with pytest.raises(ValueError, match=rf"not finite for \['{ANEMOI_VARIABLES[2]}'\].*"
                       "compute_stats"):
        ib.dataset_stats(src)


def test_wb2_variables_are_unchanged_without_sst():
    assert SST not in WB2_VARIABLES and SPEC.channels == 83
    assert WB2Spec(**{**SPEC.__dict__, "sea_surface_temperature": True}).channels == 84


@pytest.mark.parametrize("keep", [(), ("level",)], ids=["scalar-stats", "per-level"])
def test_channel_names_and_denormalize_give_back_the_stored_values(wb2, keep):
    src, m, g, land = wb2
    stats = ib.compute_stats(src, m, "train", keep_dims=keep, progress=False)
    channels = ["2m_temperature", "temperature", SST]
    with ib.build_loader(src, m, "train", batch_size=3, stats=stats, channels=channels,
                         normalize={"2m_temperature": "min-max"}) as ld:
        b = next(iter(ld))
        names = ld.channel_names
        assert names[0] == "2m_temperature" and names[-1] == SST
        assert names[1:14] == tuple(f"temperature@{lv}" for lv in g["level"][:])
        back = ld.denormalize(b["channels"].double())
        assert back.dtype == torch.float64
        idx = b["sample_index"].numpy()
        np.testing.assert_allclose(back[:, 0].numpy(), g["2m_temperature"][idx], rtol=1e-6)
        np.testing.assert_allclose(back[:, 1:14].numpy(), g["temperature"][idx], rtol=1e-6)
        sst = back[:, 14].numpy()
        np.testing.assert_allclose(sst[~np.isnan(sst)], g[SST][idx][~np.isnan(sst)],
                                   rtol=1e-6)
        with pytest.raises(KeyError, match="not normalized here"):
            ld.denormalize(b["channels"], key="nope")
    with ib.build_loader(src, m, "train", batch_size=3) as raw:
        assert raw.channel_names is None
        with pytest.raises(ValueError, match="does not normalize"):
            raw.denormalize(torch.zeros(1))


def test_stats_denormalize_by_channel_names_and_through_json(wb2, tmp_path):
    src, m, g, _ = wb2
    per_level = ib.compute_stats(src, m, "train", keep_dims=["level"], progress=False)
    stats = Stats.from_json(_saved(per_level, tmp_path / "s.json"))  # coords survive JSON
    channels = ["2m_temperature", ("temperature", 850), SST]
    with ib.build_loader(src, m, "train", batch_size=4, stats=stats, channels=channels) as ld:
        b = next(iter(ld))
        names = ld.channel_names
        assert names == ("2m_temperature", "temperature@850", SST)
        mean, std = stats.mean_std(names)
        k = list(g["level"][:]).index(850)
        assert mean[1] == per_level["temperature"].mean[k]
        assert std[0] == per_level["2m_temperature"].std
        x = b["channels"].double()
        back = stats.denormalize(x, names)
        assert isinstance(back, torch.Tensor) and back.dtype == torch.float64
        torch.testing.assert_close(back, ld.denormalize(x), equal_nan=True)
        np.testing.assert_allclose(stats.denormalize(x.numpy(), names), back.numpy())
        idx = b["sample_index"].numpy()
        np.testing.assert_allclose(back[:, 1].numpy(), g["temperature"][idx, k], rtol=1e-6)
    with pytest.raises(KeyError, match=r"temperature@123.*they hold \['50'"):
        stats.mean_std(["temperature@123"])
    with pytest.raises(KeyError, match="13 rows.*temperature@50"):
        stats.mean_std(["temperature"])
    with pytest.raises(KeyError, match="no statistics for 'nope'"):
        stats.mean_std(["nope"])
    with pytest.raises(ValueError, match=r"shape \(2, 3, 4, 5\).*2 channel names"):
        stats.denormalize(torch.zeros(2, 3, 4, 5), ["a", "b"])


def _saved(stats: Stats, path):
    stats.to_json(path)
    return path


@pytest.mark.parametrize("workers", [0, 2], ids=["threads", "workers"])
def test_masks_and_filled_values_go_to_the_gpu_path(wb2, workers):
    """The CUDA path (PinOrCudaNode staging through the pinned ring; CPU fakes for the CUDA
    calls): the bool masks and the filled values arrive as on the CPU."""
    from test_pin_or_cuda import FakeOps

    from insitubatch_nodes.graph import build_graph, resolve

    src, m, _, land = wb2
    stats = ib.compute_stats(src, m, "train", progress=False)
    kw = dict(batch_size=3, stats=stats, fill_nan=0.0, mask=[SST], seed=4)
    cfg = ib.LoaderConfig.of(ring_size=2, workers=workers, **kw)
    node = build_graph(src, m, "train", resolve(src, m, "train", cfg), ops=FakeOps(eager=True)).root
    node.reset(None)
    with ib.build_loader(src, m, "train", workers=0, **kw) as cpu:
        for want in cpu:
            got = next(node)
            assert got.keys() == want.keys()
            for k in want:
                np.testing.assert_array_equal(got[k].numpy(), want[k].numpy(), err_msg=k)
            np.testing.assert_array_equal(got[f"mask/{SST}"].numpy(),
                                          np.broadcast_to(~land, got[SST].shape))
    node.shutdown()


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "gather"])
def test_default_statistics_normalize_every_level_to_mean_0_std_1(wb2, in_place):
    """``compute_stats`` keeps the levels by default: each normalized channel of the train
    split has mean 0 and std 1 (pooling the levels left each level's std far from 1)."""
    src, m, g, _ = wb2
    stats = ib.compute_stats(src, m, "train", progress=False)
    assert stats["temperature"].kept_dims == ("level",)
    assert stats["2m_temperature"].kept_dims == () and stats[SST].kept_dims == ()
    channels = ["temperature", "2m_temperature", SST]
    with ib.build_loader(src, m, "train", batch_size=4, stats=stats, channels=channels,
                         in_place=in_place) as ld:
        x = torch.cat([b["channels"] for b in ld]).double().numpy()
    assert x.shape[1] == 13 + 2
    axes = (0, 2, 3)
    np.testing.assert_allclose(np.nanmean(x, axis=axes), 0.0, atol=1e-5)
    np.testing.assert_allclose(np.nanstd(x, axis=axes), 1.0, rtol=1e-5)
    pooled = ib.compute_stats(src, m, "train", keep_dims=(), progress=False)
    with ib.build_loader(src, m, "train", batch_size=4, stats=pooled,
                         channels=["temperature"]) as ld:
        y = torch.cat([b["channels"] for b in ld]).double().numpy()
    assert np.ptp(y.mean(axis=axes)) > 0.5  # pooled: the levels are not each standardised


def test_statistics_by_channel_name_written_either_way(wb2):
    src, m, g, _ = wb2
    stats = ib.compute_stats(src, m, "train", progress=False)
    k = list(g["level"][:]).index(850)
    want = (stats["temperature"].mean[k], stats["temperature"].std[k])
    for name in ("temperature@850", ("temperature", 850), ("temperature", 850.0),
                 ("temperature", "850"), "temperature@850.0"):
        mean, std = stats.mean_std([name])
        assert (mean[0], std[0]) == want, name
    with pytest.raises(KeyError, match=r"temperature@123: 123 is not a level.*they hold "
                                        r"\['50'"):
        stats.mean_std([("temperature", 123)])
