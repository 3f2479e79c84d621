"""Chunks split across channels decode in place, on the decode threads and in worker
processes alike (memory/slots.py): some levels of an ARCO-ERA5 / WeatherBench2 variable, an
anemoi variable subset, channels of mixed dtypes, several samples per chunk on S3 under
``workers="auto"``. Each is the stored values, read by zarr itself, row by row by
``sample_index`` (in the order the channels are given), with threads and with workers; and
bit for bit the batches of ``workers=0``, two epochs."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from stores import BLOSC, Var, assert_rows_stored

import insitubatch_nodes as ib
from insitubatch_nodes import defaults
from insitubatch_nodes.synthetic import ANEMOI_VARIABLES, write_anemoi_store

ARCO_LEVELS = [1, 2, 3, 5, 7, 10, 20, 30, 50, 70, 100, 125, 150, 175, 200, 225, 250, 300,
               350, 400, 450, 500, 550, 600, 650, 700, 750, 775, 800, 825, 850, 875, 900,
               925, 950, 975, 1000]
GRAPHCAST = [50, 100, 150, 200, 250, 300, 400, 500, 600, 700, 850, 925, 1000]


@pytest.fixture(scope="module")
def arco(tmp_path_factory):
    """An ARCO-ERA5-like store as xarray writes it: Zarr v2, blosc lz4 + shuffle, all 37
    levels of a variable in one chunk, one step per chunk, a surface variable beside."""
    import numcodecs
    import xarray as xr

    path = tmp_path_factory.mktemp("arco") / "arco.zarr"
    rng = np.random.default_rng(7)
    n, lat, lon = 30, 5, 8
    level = ("time", "level", "latitude", "longitude")
    ds = xr.Dataset(
        {"geopotential": (level, rng.standard_normal((n, 37, lat, lon), dtype="f4") * 900),
         "temperature": (level, rng.standard_normal((n, 37, lat, lon), dtype="f4") + 250),
         "2m_temperature": (("time", "latitude", "longitude"),
                            rng.standard_normal((n, lat, lon), dtype="f4") + 280)},
        coords={"time": np.arange(n) * np.timedelta64(1, "h") + np.datetime64("2020-01-01"),
                "level": np.asarray(ARCO_LEVELS, np.int64),
                "latitude": np.linspace(90, -90, lat), "longitude": np.linspace(0, 315, lon)})
    blosc = numcodecs.Blosc("lz4", 5, numcodecs.Blosc.SHUFFLE)
    enc = {"geopotential": {"chunks": (1, 37, lat, lon), "compressors": [blosc]},
           "temperature": {"chunks": (1, 37, lat, lon), "compressors": [blosc]},
           "2m_temperature": {"chunks": (1, lat, lon), "compressors": [blosc]}}
    ds.to_zarr(path, zarr_format=2, encoding=enc, consolidated=True)
    src = ib.open_source(path, variables=["geopotential", "temperature", "2m_temperature"])
    return src, ib.split_by_chunk(src, (0.8, 0.2)), ds, path


def _epochs(loader, n=2):
    return [[{k: v.clone() for k, v in b.items()} for b in loader] for _ in range(n)]


def _assert_same(got, want):
    assert len(got) == len(want)
    for eg, ew in zip(got, want, strict=True):
        assert len(eg) == len(ew) > 0
        for g, w in zip(eg, ew, strict=True):
            assert g.keys() == w.keys()
            for k in g:
                assert g[k].dtype == w[k].dtype, k
                torch.testing.assert_close(g[k], w[k], rtol=0, atol=0, equal_nan=True, msg=k)


def _stored(path, name: str) -> np.ndarray:
    """A variable as stored, read by zarr itself (not through the loader's readers)."""
    import zarr

    return zarr.open_array(store=str(path), path=name, mode="r")[...]


def _at_steps(values: np.ndarray, i: np.ndarray, offsets: np.ndarray | None) -> np.ndarray:
    """``values`` of samples ``i`` (a batch's ``sample_index``), at each step of ``offsets``
    (``None``: no time steps, one row a sample)."""
    return values[i] if offsets is None else values[i[:, None] + offsets[None, :]]


def _assert_stored(epochs, want_of) -> None:
    """Every batch of ``epochs`` holds, per key, ``want_of(sample_index)[key]``: the stored
    values of its rows."""
    for epoch in epochs:
        assert epoch
        for b in epoch:
            want = want_of(b["sample_index"].numpy())
            assert set(want) <= set(b)
            for k, w in want.items():
                np.testing.assert_array_equal(b[k].numpy(), w, err_msg=k)


def _level_rows(path, name: str, levels: list[int], surface: str | None, surface_first: bool,
                steps: ib.SampleWindow | None):
    """What batches of ``channels`` = ``name``'s ``levels`` (indices, in that order) and
    ``surface`` (first or last) hold: the stored values of their rows, inputs and targets."""
    var = _stored(path, name)[:, levels]
    sfc = None if surface is None else _stored(path, surface)[:, None]
    parts = [var] if sfc is None else ([sfc, var] if surface_first else [var, sfc])
    stacked = np.concatenate(parts, axis=1)

    def want_of(i: np.ndarray) -> dict[str, np.ndarray]:
        if steps is None:
            return {"channels": _at_steps(stacked, i, None)}
        return {"channels": _at_steps(stacked, i, steps.input_offsets),
                "target/channels": _at_steps(stacked, i, steps.target_offsets)}

    return want_of


def _on_workers_and_threads(src, m, split="train", **kw):
    """Two epochs of ``kw`` with 2 workers, and with the decode threads."""
    with ib.build_loader(src, m, split, workers=2, **kw) as ld, \
            ib.build_loader(src, m, split, workers=0, **kw) as ref:
        assert ld.node(ib.AsyncFetchNode).workers == 2
        assert ld.node(ib.AsyncFetchNode).arena is not None  # in place
        return _epochs(ld), _epochs(ref)


def test_graphcast_levels_of_two_variables_and_a_surface_field(arco):
    """13 of 37 levels of geopotential and temperature plus 2m_temperature: the rows are
    the stored levels, the same with workers as with threads."""
    src, m, ds, _ = arco
    channels = ([("geopotential", lv) for lv in GRAPHCAST]
                + [("temperature", lv) for lv in GRAPHCAST] + ["2m_temperature"])
    got, want = _on_workers_and_threads(src, m, batch_size=4, seed=3, channels=channels)
    _assert_same(got, want)
    idx = [ARCO_LEVELS.index(lv) for lv in GRAPHCAST]
    for b in got[0]:
        i = b["sample_index"].numpy()
        stored = np.concatenate([ds["geopotential"].values[i][:, idx],
                                 ds["temperature"].values[i][:, idx],
                                 ds["2m_temperature"].values[i][:, None]], axis=1)
        np.testing.assert_array_equal(b["channels"].numpy(), stored)


@settings(max_examples=3, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(levels=st.lists(st.sampled_from(ARCO_LEVELS), min_size=1, max_size=12, unique=True),
       surface_first=st.booleans(), batch=st.integers(1, 9),
       window=st.sampled_from([None, (2, (1,)), (1, (1, 3))]))
def test_random_level_subsets_with_and_without_time_steps(arco, levels, surface_first, batch,
                                                          window):
    """Levels in any order, the surface field first or last: the stored values, in the
    order given, on workers and threads."""
    src, m, _, path = arco
    channels = [("temperature", lv) for lv in levels]
    channels = (["2m_temperature", *channels] if surface_first
                else [*channels, "2m_temperature"])
    steps = None if window is None else ib.SampleWindow(window[0], window[1])
    got, want = _on_workers_and_threads(src, m, batch_size=batch, seed=batch,
                                        channels=channels, steps=steps)
    rows = _level_rows(path, "temperature", [ARCO_LEVELS.index(lv) for lv in levels],
                       "2m_temperature", surface_first, steps)
    _assert_stored(got, rows)
    _assert_stored(want, rows)
    _assert_same(got, want)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("steps", [None, ib.SampleWindow(2, (1,))])
def test_a_level_subset_is_the_stored_levels_in_the_order_given(arco, workers, steps):
    """Levels 30, 2 and 17 of temperature's 37, in that order (no two adjacent: three
    parts), are ``zarr.open_array("temperature")[sample_index][:, [30, 2, 17]]``, on the
    threads and on two workers, inputs and targets."""
    src, m, _, path = arco
    idx = [30, 2, 17]
    channels = [("temperature", ARCO_LEVELS[k]) for k in idx]
    with ib.build_loader(src, m, "train", workers=workers, batch_size=4, seed=5,
                         channels=channels, steps=steps) as ld:
        assert ld.node(ib.AsyncFetchNode).workers == workers
        assert ld.node(ib.AsyncFetchNode).arena is not None  # in place
        got = _epochs(ld)
    _assert_stored(got, _level_rows(path, "temperature", idx, None, False, steps))


@pytest.mark.parametrize("options", [
    dict(channels_last=True),
    dict(channels_last=True, drop_ensemble=True, steps=ib.SampleWindow(2, (1,))),
])
def test_anemoi_variable_subsets(tmp_path_factory, options):
    """``open_source(variables=[...])`` on an anemoi dataset (its ``data`` chunk holds every
    variable of a date): the subset, in the order given (not the store's), is the stored
    ``data[sample_index][:, subset]`` on workers and threads, inputs and targets."""
    path = write_anemoi_store(tmp_path_factory.mktemp("an") / "an.zarr", n_dates=24)
    src = ib.open_source(path, variables=["z_850", "2t", "t_500", "10u"])
    m = ib.split_by_chunk(src, (1.0,))
    got, want = _on_workers_and_threads(src, m, batch_size=5, seed=2, **options)
    _assert_same(got, want)
    assert "data" in got[0][0]
    names = list(ANEMOI_VARIABLES)
    idx = [names.index(v) for v in ("z_850", "2t", "t_500", "10u")]
    data = _stored(path, "data")[:, idx]  # (dates, the subset, ensemble, cells)
    steps = options.get("steps")

    def want_of(i: np.ndarray) -> dict[str, np.ndarray]:
        def shaped(x: np.ndarray) -> np.ndarray:  # as the options lay a sample out
            x = np.moveaxis(x, -3, -1)  # channels last: (..., ensemble, cells, variables)
            return x[..., 0, :, :] if options.get("drop_ensemble") else x

        if steps is None:
            return {"data": shaped(_at_steps(data, i, None))}
        return {"data": shaped(_at_steps(data, i, steps.input_offsets)),
                "target/data": shaped(_at_steps(data, i, steps.target_offsets))}

    _assert_stored(got, want_of)
    _assert_stored(want, want_of)


def test_float32_and_float64_channels(store_factory):
    """Mixed dtypes stack in the dtype torch promotes them to, converted as written."""
    import zarr

    dims = ("time", "lat", "lon")
    path, data = store_factory([
        Var("a", (40, 4, 5), (1, 4, 5), compressors=BLOSC, extra=dict(dimension_names=dims)),
        Var("b", (40, 2, 4, 5), (1, 2, 4, 5), dtype="float64", compressors=BLOSC,
            extra=dict(dimension_names=("time", "level", *dims[1:])))])
    zarr.open_group(path).create_array("level", shape=(2,), dtype="int64",
                                       dimension_names=("level",))[:] = [500, 850]
    src = ib.open_source(path, variables=["a", "b"])
    m = ib.split_by_chunk(src, (1.0,))
    got, want = _on_workers_and_threads(src, m, batch_size=6, seed=1,
                                        channels=["a", ("b", 850)])
    _assert_same(got, want)
    for b in got[0]:
        i = b["sample_index"].numpy()
        assert b["channels"].dtype == torch.float64
        np.testing.assert_array_equal(b["channels"][:, 0].numpy(), data["a"][i])
        np.testing.assert_array_equal(b["channels"][:, 1].numpy(), data["b"][i][:, 1])


def test_auto_takes_workers_for_several_samples_per_chunk_on_s3(tmp_path, monkeypatch):
    """On a node with 4+ cores, ``workers="auto"`` starts workers for an object store whose
    chunks hold several samples (the worker makes the copies the event loop would)."""
    from stores import stores_on_s3

    monkeypatch.setattr(defaults, "WORKERS_FROM_CORES", 4)
    monkeypatch.setattr(defaults, "cores_per_rank", lambda: 4)
    variables = [Var("x", (40, 3, 4), (4, 3, 4), compressors=BLOSC),
                 Var("y", (40, 2), (8, 2), dtype="int16")]
    with stores_on_s3(tmp_path / "s3", {"s.zarr": variables}) as (server, stored):
        src = ib.open_source("s3://data/s.zarr", storage_options=server.options())
        m = ib.split_by_chunk(src, (1.0,))
        kw = dict(batch_size=6, block_chunks=3, seed=3)
        with ib.build_loader(src, m, "train", **kw) as auto, \
                ib.build_loader(src, m, "train", workers=0, **kw) as threads:
            assert auto.node(ib.AsyncFetchNode).workers == 3
            assert threads.node(ib.AsyncFetchNode).arena is None  # gathered, as before
            got, want = _epochs(auto), _epochs(threads)
    _assert_same(got, want)
    assert_rows_stored([{k: v.numpy() for k, v in b.items()} for b in got[0]],
                       stored["s.zarr"])


def test_auto_says_why_it_keeps_the_threads(weather, caplog):
    src, m = weather
    with caplog.at_level("INFO", logger="insitubatch_nodes"), \
            ib.build_loader(src, m, "train", batch_size=4):
        pass
    assert any("decode threads, not worker processes" in r.getMessage()
               and "cores per rank" in r.getMessage() for r in caplog.records)


def test_split_chunks_fill_only_their_channels(weather):
    """A level subset writes every byte of its batch: no row keeps a value of an earlier
    batch (batch memory is reused from the pool), on threads and workers."""
    src, m = weather
    z = src.arrays[src.names.index("z")][:]
    for workers in (0, 2):
        with ib.build_loader(src, m, "train", batch_size=4, workers=workers,
                             channels=[("z", 1000), ("z", 500)]) as ld:
            for _ in range(2):
                for b in ld:
                    i = b["sample_index"].numpy()
                    np.testing.assert_array_equal(b["channels"].numpy(), z[i][:, [2, 0]])


@pytest.fixture(scope="module")
def many_blocks(tmp_path_factory):
    """37 levels a chunk in blosc-zstd frames of 2 KiB blocks (about a level and a third a
    block), as ARCO-ERA5's 0.25 degree frames are many blocks: a level subset decodes only
    the blocks holding it."""
    import numcodecs
    import zarr

    path = tmp_path_factory.mktemp("blocks") / "z.zarr"
    g = zarr.open_group(path, mode="w", zarr_format=2)
    rng = np.random.default_rng(11)
    z = (rng.standard_normal((24, 37, 16, 24)) * 100 + 5000).astype("f4")
    blosc = numcodecs.Blosc("zstd", 3, numcodecs.Blosc.SHUFFLE, blocksize=2048)
    g.create_array("z", shape=z.shape, chunks=(1, 37, 16, 24), dtype="f4", compressors=blosc,
                   attributes={"_ARRAY_DIMENSIONS": ["time", "level", "lat", "lon"]})[:] = z
    g.create_array("level", shape=(37,), dtype="i8", compressors=None,
                   attributes={"_ARRAY_DIMENSIONS": ["level"]})[:] = ARCO_LEVELS
    src = ib.open_source(path, variables=["z"])
    return src, ib.split_by_chunk(src, (1.0,)), z


@pytest.mark.parametrize("window", [None, ib.SampleWindow(2, (1,))])
def test_level_subsets_decode_only_their_blocks(many_blocks, window):
    """GraphCast's 13 levels read in part (block by block) on threads and workers, bit for
    bit the stored levels; ``loader.stats()`` counts the chunks read in part."""
    src, m, z = many_blocks
    channels = [("z", lv) for lv in GRAPHCAST]
    idx = [ARCO_LEVELS.index(lv) for lv in GRAPHCAST]
    with ib.build_loader(src, m, "train", batch_size=5, seed=4, workers=0, steps=window,
                         channels=channels) as ld:
        got = _epochs(ld)
        stats = ld.stats()
        assert stats.chunks_read_in_part == 2 * 24 and stats.chunks_read_whole == 0
        assert "read in part" in stats.summary()
    with ib.build_loader(src, m, "train", batch_size=5, seed=4, workers=2, steps=window,
                         channels=channels) as ld:
        _assert_same(_epochs(ld), got)
        # the workers' counters come back with their read times, at most every 50 ms
        for _ in range(20):
            if ld.stats().chunks_read_in_part:
                break
            time.sleep(0.06)
            _epochs(ld, 1)
        assert 0 < ld.stats().chunks_read_in_part <= 22 * 24
        assert ld.stats().chunks_read_whole == 0
    for b in got[0]:
        i = b["sample_index"].numpy()
        want = z[i][:, idx] if window is None else z[i[:, None] + np.arange(-1, 1)][:, :, idx]
        np.testing.assert_array_equal(b["channels"].numpy(), want)


def test_a_decode_worker_imports_neither_torch_nor_xarray():
    """A worker's start is its imports (torch alone ~0.9 s on 2 cores): the slot writer and
    the partial reads it runs must not pull torch in (mixed dtypes import it lazily)."""
    import subprocess
    import sys

    code = ("import sys, insitubatch_nodes.workers.child\n"
            "print(sorted(m for m in ('torch', 'xarray') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"
