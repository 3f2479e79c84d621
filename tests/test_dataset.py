"""SampleDataset: a sample by index is the loader's row for it, over every sample option,
reading only its stripes, in DataLoader workers too."""

import pickle
import re

import numpy as np
import pytest
import torch
import zarr
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from stores import BLOSC
from torch.utils.data import DataLoader

import insitubatch_nodes as ib
from insitubatch_nodes.synthetic import WB2Spec, write_anemoi_store, write_wb2_store


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """Three layouts: variables chunked differently in time with a level axis, a static
    field and a CF time coordinate; an anemoi dataset with a missing date (opened whole and
    with a variable selection); WeatherBench2's one step per chunk (decoded in place)."""
    root = tmp_path_factory.mktemp("dataset")
    g = zarr.open_group(root / "w.zarr", mode="w")
    n = 48
    rng = np.random.default_rng(0)
    t2m = g.create_array("t2m", shape=(n, 5, 6), chunks=(4, 5, 6), dtype="float32",
                         compressors=BLOSC, dimension_names=("time", "lat", "lon"))
    z = g.create_array("z", shape=(n, 3, 5, 6), chunks=(6, 3, 5, 6), dtype="float32",
                       dimension_names=("time", "level", "lat", "lon"))
    t2m[:] = rng.standard_normal((n, 5, 6)).astype("f4") + np.arange(n)[:, None, None]
    z[:] = rng.standard_normal((n, 3, 5, 6)).astype("f4") * 10 + 500
    g.create_array("time", shape=(n,), dtype="int64", dimension_names=("time",),
                   attributes={"units": "hours since 2000-01-01"})[:] = np.arange(n) * 6
    g.create_array("level", shape=(3,), dtype="int64",
                   dimension_names=("level",))[:] = [500, 850, 1000]
    g.create_array("lsm", shape=(5, 6), dtype="float32",
                   dimension_names=("lat", "lon"))[:] = rng.random((5, 6))
    weather = ib.open_source(root / "w.zarr")
    wm = ib.split_by_chunk(weather, (0.5, 0.5), names=("train", "val"))
    apath = write_anemoi_store(root / "a.zarr", n_dates=24, n_cells=12, missing=(9,))
    anemoi = ib.open_source(apath)
    sel = ib.open_source(apath, variables=["t_500", "2t", "msl"])
    wb2 = ib.open_source(write_wb2_store(root / "wb2.zarr", WB2Spec(n_times=8, n_lon=6,
                                                                    n_lat=4), progress=False))
    out = {
        "weather": (weather, wm, {"stats": ib.compute_stats(weather, wm, progress=False),
                                  "static": ib.open_static(weather)}),
        "anemoi": (anemoi, ib.split_by_chunk(anemoi, (0.6, 0.4), names=("train", "val")),
                   {"stats": ib.dataset_stats(anemoi)}),
        "anemoi_sel": (sel, ib.split_by_chunk(sel, (0.6, 0.4), names=("train", "val")),
                       {"stats": ib.dataset_stats(sel)}),
        "wb2": (wb2, ib.split_by_chunk(wb2, (0.5, 0.5), names=("train", "val")),
                {"static": ib.open_static(wb2)}),
    }
    return out


WINDOWS = [None, ib.SampleWindow(2, (1,)), ib.SampleWindow(1, (3,)), ib.SampleWindow(3, (), 2)]
CHANNELS = {
    "weather": [None, ["t2m", ("z", 850)], ["z", "t2m"], [("z", 500), ("z", 850)]],
    "anemoi": [None, ["2t", "10u", "z_500"]],
    "anemoi_sel": [None],
    "wb2": [None, ["temperature", "2m_temperature"], [("temperature", 500), "geopotential"]],
}
PATCHES = {"weather": [None, ((2, 3), None), ((3, 4), (2, 2))],
           "anemoi": [None, ((1, 4), None)], "anemoi_sel": [None, ((1, 6), (1, 3))],
           "wb2": [None, ((2, 2), None)]}
NORMALIZE = {"weather": [None, {"default": "min-max", "t2m": "std"}],
             "anemoi": [None, {"default": "mean-std", "msl": "min-max", "lsm": "none"}],
             "anemoi_sel": [None, {"2t": "max"}], "wb2": [None]}


@st.composite
def cases(draw):
    kind = draw(st.sampled_from(sorted(CHANNELS)))
    opts: dict = {"window": draw(st.sampled_from(WINDOWS)),
                  "dtype": draw(st.sampled_from([None, torch.bfloat16, torch.float64])),
                  "channels": draw(st.sampled_from(CHANNELS[kind]))}
    patch = draw(st.sampled_from(PATCHES[kind]))
    if patch is not None:
        opts["patch_size"], opts["patch_stride"] = patch
    if kind != "wb2" and draw(st.booleans()):
        opts["stats"] = "stats"
        opts["normalize"] = draw(st.sampled_from(NORMALIZE[kind]))
    if kind in ("weather", "wb2") and draw(st.booleans()):
        opts["static"] = "static"
    if opts["channels"] is not None or kind.startswith("anemoi"):
        opts["channels_last"] = draw(st.booleans())
    if kind.startswith("anemoi"):
        opts["drop_ensemble"] = draw(st.booleans())
    return kind, draw(st.sampled_from(["train", "val"])), draw(st.integers(1, 7)), opts


def _rows(batch: dict, patches: bool) -> dict[int, dict[str, torch.Tensor]]:
    """The loader's rows by sample: one row each, or all of a sample's patches."""
    idx = batch["sample_index"]
    if not patches:
        return {int(s): {k: v[i] for k, v in batch.items()} for i, s in enumerate(idx)}
    out: dict[int, dict[str, torch.Tensor]] = {}
    for s in dict.fromkeys(idx.tolist()):
        rows = torch.nonzero(idx == s).flatten()
        out[s] = {k: v[rows[0]:rows[-1] + 1] for k, v in batch.items()}
    return out


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], where: str) -> None:
    assert sorted(got) == sorted(want), where
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, equal_nan=True,
                                   msg=lambda m, key=key: f"{where}, key {key!r}: {m}")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
@example(case=("wb2", "train", 3, {"channels": ["temperature", "2m_temperature"],
                                   "static": "static", "dtype": torch.bfloat16}))
@example(case=("anemoi_sel", "val", 4, {"window": ib.SampleWindow(2, (1,)),
                                        "stats": "stats", "normalize": {"2t": "max"},
                                        "channels_last": True, "drop_ensemble": True}))
@example(case=("weather", "val", 5, {"window": ib.SampleWindow(3, (1, 2)),
                                     "channels": [("z", 500), "t2m"], "static": "static",
                                     "patch_size": (2, 3), "stats": "stats",
                                     "channels_last": True}))
def test_every_sample_is_the_loaders_row_for_it(stores, case):
    kind, split, batch_size, opts = case
    src, manifest, extra = stores[kind]
    opts = {k: extra[v] if k in ("stats", "static") else v for k, v in opts.items()}
    where = f"{kind} {split} {opts}"
    try:
        loader = ib.build_loader(src, manifest, split, batch_size=batch_size, seed=3, **opts)
    except ValueError as e:
        # These small stores' splits are a few chunks: a long window may reach the other
        # split from every one of them. The dataset refuses the same.
        # Or hold no anchor of the window at all (a split at the start of the axis).
        why = "is left out|holds no sample of the time window"
        assert re.search(why, str(e)) and opts.get("window") is not None, where
        with pytest.raises(ValueError, match=why):
            ib.SampleDataset(src, manifest, split, **opts)
        return
    ds = ib.SampleDataset(src, manifest, split, **opts)
    assert np.all(np.diff(ds.sample_indices) > 0)
    patches = opts.get("patch_size") is not None
    served = []
    for batch in loader:
        for s, row in _rows(batch, patches).items():
            served.append(s)
            _same(ds[ds.index_of(s)], row, f"{where}, sample {s}")
    # the loader serves each of the dataset's samples exactly once
    assert sorted(served) == ds.sample_indices.tolist(), where
    loader.shutdown()


def test_anchors_and_missing_dates_decide_the_samples(stores):
    src, manifest, _ = stores["anemoi"]
    w = ib.SampleWindow(2, (1,))
    # train: dates 0..13, 9 missing; 13's target is val's first date
    ds = ib.SampleDataset(src, manifest, "train", steps=w)
    assert ds.sample_indices.tolist() == [1, 2, 3, 4, 5, 6, 7, 11, 12]
    assert len(ds) == 9 and ds[-1]["sample_index"].item() == 12
    with pytest.raises(KeyError, match=r"sample 9 is not in split 'train'.*missing steps \[9\]"):
        ds.index_of(9)
    with pytest.raises(KeyError, match="only anchors 1 to 22 are samples"):
        ds.index_of(0)
    with pytest.raises(IndexError, match=r"position 9 is out of range .* \(0 to 8\)"):
        ds[9]
    with pytest.raises(TypeError, match="integer positions"):
        ds["2t"]


def test_configuration_errors_are_the_loaders(stores):
    src, manifest, _ = stores["weather"]
    for bad in ({"channels_last": True}, {"channels": ["t2m", ("z", 700)]},
                {"patch_size": (9, 9)}):
        with pytest.raises((ValueError, KeyError)) as loader_err:
            ib.build_loader(src, manifest, "train", **bad)
        with pytest.raises(type(loader_err.value)) as ds_err:
            ib.SampleDataset(src, manifest, "train", **bad)
        assert str(ds_err.value) == str(loader_err.value)
    with pytest.raises(KeyError, match="unknown split 'test'"):
        ib.SampleDataset(src, manifest, "test")


def test_only_the_samples_stripes_are_read_and_neighbours_come_from_the_cache(stores):
    src, manifest, _ = stores["weather"]
    ds = ib.SampleDataset(src, manifest, "val")  # samples 24..47: t2m in 4s, z in 6s
    first = ds[0]
    assert first["sample_index"].item() == 24
    info = ds.cache_info()
    assert (info.hits, info.misses, info.stripes) == (0, 2, 2)  # one stripe per variable
    for k in range(len(ds)):
        ds[k]
    info = ds.cache_info()
    assert info.misses == 24 // 4 + 24 // 6  # every stripe of the split read once
    assert info.hits == 2 * 25 - info.misses  # ds[0] twice
    stripe = 4 * 5 * 6 * 4  # a t2m stripe: the smallest; z's is 6 * 3 * 5 * 6 * 4
    small = ib.SampleDataset(src, manifest, "val", cache_bytes=stripe)
    for k in range(len(ds)):
        _same(small[k], ds[k], f"position {k}")
        assert small.cache_info().nbytes <= stripe
    assert small.cache_info().misses > info.misses  # evicted stripes were read again


def test_dataloader_workers_open_their_own_clients(stores):
    src, manifest, extra = stores["weather"]
    opts = {"window": ib.SampleWindow(2, (1,)), "channels": ["z", "t2m"],
            "static": extra["static"]}
    ds = ib.SampleDataset(src, manifest, "train", **opts)
    assert ds.multiprocessing_context is None  # local files: plain fork is fine
    want = [ds[k] for k in range(len(ds))]  # the parent's loop thread runs before the fork
    got = []
    for batch in DataLoader(ds, batch_size=5, num_workers=2):
        got += [{k: v[i] for k, v in batch.items()} for i in range(len(batch["sample_index"]))]
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        _same(g, w, f"position {k}")
    back = pickle.loads(pickle.dumps(ds))  # what a spawned worker gets
    _same(back[3], want[3], "unpickled")
    assert back.cache_info().misses > 0  # its own cache, its own reads


def test_object_store_workers_start_clean_and_a_forked_one_says_how(tmp_path):
    """obstore clients hang in a forked child (the runtime's threads stay in the parent,
    fresh clients included): forkserver workers open their own; a forked one raises."""
    from stores import Var, stores_on_s3

    with stores_on_s3(tmp_path, {"s.zarr": [Var("x", (40, 4, 4), (4, 4, 4),
                                                compressors=BLOSC)]}) as (server, stored):
        data = stored["s.zarr"]
        src = ib.open_source("s3://data/s.zarr", storage_options=server.options())
        cache = ib.ChunkCache(tmp_path / "cache", max_bytes="10MB")
        ds = ib.SampleDataset(src, ib.split_by_chunk(src, (1.0,)), "train", cache=cache)
        np.testing.assert_array_equal(ds[5]["x"].numpy(), data["x"][5])  # the parent reads
        assert ds.multiprocessing_context == "forkserver"
        got = torch.cat([b["x"] for b in DataLoader(
            ds, batch_size=8, num_workers=2, timeout=120,
            multiprocessing_context=ds.multiprocessing_context)])
        np.testing.assert_array_equal(got.numpy(), data["x"])
        with pytest.raises(RuntimeError, match="multiprocessing_context=ds.multiprocessing"):
            next(iter(DataLoader(ds, batch_size=8, num_workers=1, timeout=120,
                                 multiprocessing_context="fork")))
        for k in range(len(ds)):  # whatever the workers cached, the parent completes it
            ds[k]
        cache.flush()
    # the loader's chunk cache (cache=) was filled by the workers: with the store gone, a
    # fresh dataset (empty stripe LRU) still reads every sample, from local disk
    again = ib.SampleDataset(src, ib.split_by_chunk(src, (1.0,)), "train", cache=cache,
                             retry=ib.RetryPolicy(attempts=1))
    np.testing.assert_array_equal(np.stack([again[k]["x"].numpy() for k in range(40)]),
                                  data["x"])
