"""The loader's guarantees on composed sources where they take another path than one store:
the chunk cache per member, elastic resume, time steps beside a gap, and compositions whose
stripes straddle member stripes (copied, not read in place), threads and workers alike.
Every row is checked against xarray's own values of the same stores."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import xarray as xr
from composed_stores import on_moto, six_hourly, write_period, write_single_level

import insitubatch_nodes as ib

TIMES = six_hourly("2020-01-01", 48)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("compose-paths")
    out = {}
    for name, writer, times, kw in [
        ("a", write_period, TIMES[:18], {"zarr_format": 2, "chunk": 4}),  # 18: not a multiple
        ("b", write_period, TIMES[22:48], {"zarr_format": 3, "chunk": 3}),  # a 4-step gap
        ("single", write_single_level, TIMES, {"zarr_format": 3}),
        ("shifted", write_single_level, TIMES[5:], {"zarr_format": 2}),
    ]:
        out[name] = (root / f"{name}.zarr", writer(root / f"{name}.zarr", times, **kw))
    return out


def rows_by_time(ds: xr.Dataset, name: str, times: np.ndarray) -> np.ndarray:
    return ds[name].sel(time=times.astype("datetime64[ns]")).values


def loader(src, **kw):
    kw.setdefault("batch_size", 5)
    kw.setdefault("seed", 3)
    manifest = ib.split_by_chunk(src, (1.0,), names=["train"])
    return ib.build_loader(src, manifest, "train", **kw)


def served(batches, src, expected: dict[str, xr.Dataset]) -> list[int]:
    """Every row equals the dataset holding its time; the sample indices served."""
    seen = []
    for b in batches:
        idx = b["sample_index"].numpy()
        seen += idx.tolist()
        times = src.sample_coord[idx]
        for name, ds in expected.items():
            np.testing.assert_array_equal(b[name].numpy(), rows_by_time(ds, name, times),
                                          err_msg=name)
    return seen


def test_a_concat_with_a_gap_and_straddling_stripes_on_threads_and_workers(stores):
    """Members chunked 4 and 3, the first 18 steps long: composed stripes straddle member
    stripes and the gap; threads and 2 workers serve the same batches, each row xarray's."""
    src = ib.concat([ib.open_source(stores["a"][0]), ib.open_source(stores["b"][0])])
    both = xr.concat([stores["a"][1], stores["b"][1]], "time")
    assert set(src.missing) == {18, 19, 20, 21}
    runs = {}
    for workers in (0, 2):
        batches = list(loader(src, workers=workers))
        seen = served(batches, src, {"temperature": both, "2m_temperature": both})
        assert len(seen) == len(set(seen)) and not set(seen) & set(src.missing)
        runs[workers] = [b["sample_index"].tolist() for b in batches]
    assert runs[0] == runs[2]


def test_an_inner_join_off_the_stripe_edges(stores):
    """A member starting 5 steps later, chunked 4: its rows start mid-stripe, so they are
    copied from two member stripes; the values are xr.merge(join='inner')'s."""
    a = ib.open_source(stores["single"][0]).select(["2m_temperature"])
    b = ib.open_source(stores["shifted"][0]).rename(
        {"2m_temperature": "t2m_b", "total_precipitation": "tp_b"})
    src = ib.join([a, b], align="inner")
    assert src.n_samples == 43
    other = stores["shifted"][1].rename({"2m_temperature": "t2m_b",
                                         "total_precipitation": "tp_b"})
    merged = xr.merge([stores["single"][1][["2m_temperature"]], other], join="inner")
    seen = served(list(loader(src)), src, {n: merged for n in ("2m_temperature", "t2m_b")})
    assert sorted(seen) == list(range(43))


def test_time_steps_never_cross_the_gap(stores):
    """Anchors whose history or lead would read a gap date are not served; the steps of
    the others are the members' rows at those times."""
    src = ib.concat([ib.open_source(stores["a"][0]), ib.open_source(stores["b"][0])])
    both = xr.concat([stores["a"][1], stores["b"][1]], "time")
    steps = ib.SampleWindow(history=2, lead=(1,))
    for b in loader(src, steps=steps):
        idx = b["sample_index"].numpy()
        reads = idx[:, None] + np.array([-1, 0, 1])[None, :]
        assert not np.isin(reads, src.missing).any()
        want = rows_by_time(both, "2m_temperature", src.sample_coord[reads.ravel()])
        want = want.reshape(*reads.shape, *want.shape[1:])
        np.testing.assert_array_equal(b["2m_temperature"].numpy(), want[:, :2])
        np.testing.assert_array_equal(b["target/2m_temperature"].numpy(), want[:, 2:])


def test_elastic_resume_of_a_concat_on_another_world_size(stores):
    """Two ranks stopped mid-epoch, merged, resumed on three: with what the two served
    before, every sample exactly once."""
    src = ib.concat([ib.open_source(stores["a"][0]), ib.open_source(stores["b"][0])])
    manifest = ib.split_by_chunk(src, (1.0,), names=["train"])

    def rank_loader(rank, world):
        return ib.build_loader(src, manifest, "train", batch_size=2, seed=1, rank=rank,
                               world_size=world, uneven="none")

    before, states = [], []
    for rank in range(2):
        lo = rank_loader(rank, 2)
        it = iter(lo)
        for _ in range(2):
            before += next(it)["sample_index"].tolist()
        states.append(lo.state_dict())
    merged = ib.merge_rank_states(states)
    after = []
    for rank in range(3):
        lo = rank_loader(rank, 3)
        lo.load_state_dict(merged)
        after += [i for b in lo for i in b["sample_index"].tolist()]
    whole = sorted(i for b in rank_loader(0, 1) for i in b["sample_index"].tolist())
    assert sorted(before + after) == whole
    assert not set(whole) & set(src.missing)


def test_the_chunk_cache_keeps_each_members_chunks_apart(stores, tmp_path):
    """One member on S3 (moto), cached: a second epoch reads the cache, not the store, and
    serves the same rows (each member cached under its own store)."""
    cache = ib.ChunkCache(tmp_path / "cache", "1GB")
    with on_moto(stores["b"][0]) as (url, options):
        late = ib.open_source(url, storage_options=options)
        src = ib.concat([ib.open_source(stores["a"][0]), late])
        both = xr.concat([stores["a"][1], stores["b"][1]], "time")
        lo = loader(src, cache=cache, prefetch_next_epoch=False)
        first = list(lo)
        cache.flush()  # entries are written in the background
        cold = lo.stats()
        second = list(lo)
        warm = lo.stats()
    expected = {"temperature": both, "2m_temperature": both}
    assert sorted(served(first, src, expected)) == sorted(served(second, src, expected))
    assert cold.cache_misses > 0 and warm.cache_misses == cold.cache_misses
    assert warm.cache_hits - cold.cache_hits >= cold.cache_misses


def test_a_period_reads_only_its_dates(stores):
    src = ib.open_source(stores["single"][0]).period("2020-01-03", "2020-01-08T12", "12h")
    times = pd.date_range("2020-01-03", "2020-01-08T12", freq="12h")
    np.testing.assert_array_equal(src.sample_coord, times.values)
    np.testing.assert_array_equal(src.arrays[0][:], rows_by_time(
        stores["single"][1], src.names[0], times.values))
    with pytest.raises(ib.ConfigError, match="not a multiple"):
        ib.open_source(stores["single"][0]).period(frequency="5h")


def test_a_join_of_anemoi_joins_keeps_each_members_data_apart(tmp_path):
    """An anemoi join inside another: every member's ``data`` stays its own variable (no
    two named alike), batch["data"] holds each name from its member, in order."""
    from anemoi_stores import read_anemoi, write_anemoi

    paths = [write_anemoi(tmp_path / f"{n}.zarr", (n,), "2020-01-01", 8, offset=10 * k)
             for k, n in enumerate(("2t", "msl", "q"))]
    inner = ib.join([ib.open_source(paths[0]), ib.open_source(paths[1])])
    src = ib.join([inner, ib.open_source(paths[2])])
    assert len(set(src.names)) == 3 and src.selection == ("2t", "msl", "q")
    want = np.stack([read_anemoi(p).column(n) for p, n in zip(paths, ("2t", "msl", "q"),
                                                                strict=True)], axis=1)
    for b in loader(src, batch_size=4):
        np.testing.assert_array_equal(b["data"].numpy(), want[b["sample_index"].numpy()])


@pytest.mark.parametrize("workers", [0, 2])
def test_a_part_of_the_grid_of_a_concat(stores, workers):
    """Composed first, then cut: each member's chunks are read for the box alone and the
    rows served are xarray's of the same latitude rows, across the gap's both sides."""
    src = ib.concat([ib.open_source(stores["a"][0]),
                     ib.open_source(stores["b"][0])]).grid_part(slice(2, 6))
    both = xr.concat([stores["a"][1], stores["b"][1]], "time").isel(latitude=slice(2, 6))
    seen = served(list(loader(src, workers=workers)), src,
                  {"temperature": both, "2m_temperature": both})
    assert seen and not set(seen) & set(src.missing)
