"""insitubatch inspect: the report's numbers against what is really in a small store."""

from __future__ import annotations

import numpy as np
import pytest
import zarr
from stores import BLOSC, Var

import insitubatch_nodes as ib
from insitubatch_nodes.defaults import default_prefetch_windows
from insitubatch_nodes.inspection import format_report, inspect_source, recommend
from insitubatch_nodes.memory.budget import resident_bound
from insitubatch_nodes.sampling.quality import recommend_block_chunks, shuffle_quality

VARS = [
    # chunked inside a sample: 2 stored chunks per stripe, blosc-zstd
    Var("a", (120, 10, 12), (8, 5, 12), compressors=BLOSC),
    # sharded: inner chunks (8, 4), shards (24, 16) -> 3 x 4 = 12 chunks per shard
    Var("s", (120, 16), (8, 4), shards=(24, 16)),
]


@pytest.fixture
def store(store_factory):
    path, data = store_factory(VARS)
    return path, data


def _size(path, *parts) -> int:
    return path.joinpath(*parts).stat().st_size


def test_variables_report_real_sizes(store):
    path, _ = store
    source = ib.open_source(path)
    r = inspect_source(source, quality=None, sample_objects=3)
    assert (r.n_samples, r.samples_per_chunk, r.n_chunks) == (120, 8, 15)
    assert r.sample_nbytes == (10 * 12 + 16) * 4
    a, s = r.variables
    assert (a.name, a.shape, a.dtype, a.chunks, a.shards) == ("a", (120, 10, 12), "float32",
                                                              (8, 5, 12), None)
    assert (a.samples_per_chunk, a.sample_chunks, a.chunks_per_stripe, a.stored_chunks) == (
        8, 15, 2, 30)
    assert a.decoded_chunk_bytes == 8 * 5 * 12 * 4
    assert a.decoded_stripe_bytes == 8 * 10 * 12 * 4
    # three stored chunks measured, evenly spaced along the sample axis (first inner chunk)
    picks = [0, 7, 14]
    want = np.mean([_size(path, "a", "c", str(i), "0", "0") for i in picks])
    assert a.measured_objects == 3 and a.missing_objects == 0
    assert a.compressed_chunk_bytes == pytest.approx(want)
    assert a.compression_ratio == pytest.approx(a.decoded_chunk_bytes / want)
    assert a.codecs == "bytes -> blosc(zstd)"
    assert a.fast_decoder == "bytes -> blosc"
    assert a.gpu_decode == "yes (blosc)"
    assert a.read_mode == "local"

    assert s.shards == (24, 16) and s.chunks == (8, 4)
    assert (s.sample_chunks, s.chunks_per_stripe, s.stored_chunks) == (15, 4, 60)
    assert s.decoded_chunk_bytes == 8 * 4 * 4
    shards = [0, 2, 4]  # 5 shards along the sample axis
    want_s = np.mean([_size(path, "s", "c", str(i), "0") for i in shards]) / 12
    assert s.compressed_chunk_bytes == pytest.approx(want_s)
    assert s.codecs.startswith("sharding[")
    assert s.fast_decoder is None and s.read_mode == "zarr"  # zarr reads what we don't decode
    assert s.gpu_decode.startswith("no, decoded on the CPU: sharding")


def test_missing_chunks_are_counted(tmp_path):
    g = zarr.open_group(tmp_path / "sparse.zarr", mode="w", zarr_format=3)
    arr = g.create_array("x", shape=(40, 6), chunks=(4, 6), dtype="float32")
    arr[:8] = 1.0  # chunks 0 and 1 written; 2..9 never
    r = inspect_source(ib.open_source(tmp_path / "sparse.zarr"), quality=None,
                       sample_objects=10)
    v = r.variables[0]
    assert (v.measured_objects, v.missing_objects) == (10, 8)
    assert v.codecs == "bytes -> zstd" and v.read_mode == "local"


@pytest.mark.parametrize("quality,batch,want", [(0.9, 32, 14), (0.5, 8, 4), (0.99, 4, 14),
                                                (1.0, 64, 15)])
def test_recommendation_follows_the_quality_model(store, quality, batch, want):
    source = ib.open_source(store[0])
    rec = recommend(source, quality, None, batch_size=batch)
    assert want == recommend_block_chunks(15, 8, batch, quality)
    assert rec.block_chunks == rec.block_chunks_for_quality == want
    assert rec.quality == pytest.approx(shuffle_quality(15, 8, want, batch))
    assert rec.block_chunks_memory_cap is None
    ahead = default_prefetch_windows()  # what recommend assumes when not told
    assert rec.resident_bound_bytes == resident_bound(source.grid, source.variables, want,
                                                      ahead, batch)


def test_memory_budget_caps_and_the_result_builds(store):
    source = ib.open_source(store[0])
    manifest = ib.split_by_chunk(source, fractions=(1.0,))
    free = recommend(source, 1.0, None, batch_size=32)
    # room for 4 chunks, not 5
    budget = resident_bound(source.grid, source.variables, 4,
                            default_prefetch_windows(), 32) + 10
    rec = recommend(source, 1.0, budget, batch_size=32)
    assert rec.block_chunks_memory_cap == 4 and rec.block_chunks == 4 < free.block_chunks
    assert rec.quality < 1.0 and "caps block_chunks at 4" in rec.note
    # build_loader checks the same bound: the recommendation fits, one more does not
    ib.build_loader(source, manifest, "train", block_chunks=4, memory_budget=budget).close()
    with pytest.raises(ValueError, match="block_chunks=4 fits"):
        ib.build_loader(source, manifest, "train", block_chunks=5, memory_budget=budget)
    # string budgets are parsed as build_loader parses them
    assert recommend(source, 1.0, "1GB", 32).block_chunks == free.block_chunks


@pytest.mark.parametrize("in_place", [False, True])
def test_cap_is_the_largest_that_builds_when_batches_span_windows(tmp_path, in_place):
    """With one-sample chunks and batches larger than a window the bound is not monotone in
    block_chunks (windows held whole): the cap must still be the largest value build_loader
    accepts, with and without decoding straight into the batches."""
    from stores import write_store

    write_store(tmp_path / "g.zarr", [Var("x", (200, 4), (1, 4))])
    source = ib.open_source(tmp_path / "g.zarr")
    manifest = ib.split_by_chunk(source, fractions=(1.0,))
    budget = resident_bound(source.grid, source.variables, 15, 1, 100, None, in_place)
    rec = recommend(source, 1.0, budget, batch_size=100, prefetch_windows=1, in_place=in_place)
    cap = rec.block_chunks_memory_cap
    assert cap >= 15
    ib.build_loader(source, manifest, "train", batch_size=100, block_chunks=cap,
                    prefetch_windows=1, memory_budget=budget, in_place=in_place).close()
    with pytest.raises(ValueError, match=f"block_chunks={cap} fits"):
        ib.build_loader(source, manifest, "train", batch_size=100, block_chunks=cap + 1,
                        prefetch_windows=1, memory_budget=budget, in_place=in_place)
    # left to decide, the loader and the recommendation agree on decoding in place
    assert recommend(source, 1.0, budget, batch_size=100, prefetch_windows=1
                     ).block_chunks_memory_cap == (cap if in_place else
                                                   recommend(source, 1.0, budget, 100, 1,
                                                             True).block_chunks_memory_cap)


def test_budget_too_small_for_anything(store):
    source = ib.open_source(store[0])
    rec = recommend(source, 0.9, 100, batch_size=32)
    assert rec.block_chunks is None and "even block_chunks=1" in rec.note
    assert "nothing fits" in format_report(inspect_source(source, memory_budget=100))


def test_bad_quality(store):
    with pytest.raises(ValueError, match=r"quality must be in \(0, 1\]"):
        recommend(ib.open_source(store[0]), 1.5)


def test_text_report(store):
    text = format_report(inspect_source(ib.open_source(store[0]), memory_budget="4GB"))
    assert "variable a: shape (120, 10, 12) float32" in text
    assert "8 samples per chunk" in text and "shards (24, 16)" in text
    assert "read path: local" in text and "read path: zarr" in text
    assert "decode='gpu': yes" in text and "decode='gpu': no" in text
    assert "block_chunks=" in text and "modelled quality" in text


def test_recommendation_for_time_windows_gives_runs_and_windows(tmp_path):
    from stores import write_store

    write_store(tmp_path / "w.zarr", [Var("x", (2000, 8, 8), (1, 8, 8))])
    src = ib.open_source(tmp_path / "w.zarr")
    w = ib.SampleWindow(history=2, lead=(1,))
    rec = recommend(src, 0.9, batch_size=8, steps=w)
    assert rec.run_chunks == 8  # 2 halo chunks per run: <= 25% extra reads
    assert rec.block_chunks % 8 == 0 and rec.quality >= 0.9
    # what the loader built with it scores the same
    loader = ib.build_loader(src, ib.split_by_chunk(src, (1.0,)), "train", batch_size=8,
                             steps=w, block_chunks=rec.block_chunks, run_chunks=rec.run_chunks)
    assert loader.shuffle_quality == pytest.approx(rec.quality, abs=0.05)
    capped = recommend(src, 0.9, batch_size=8, steps=w, memory_budget="200kB")
    # the budget caps the window below what quality asks, in whole runs, within the budget
    assert capped.block_chunks is not None and capped.block_chunks % 8 == 0
    assert capped.block_chunks < rec.block_chunks and capped.quality < 0.9
    assert capped.resident_bound_bytes <= 200_000
    # and it builds under that budget, with the bound the recommendation gave (the loader
    # decodes one-sample chunks in place with time steps too: the bound is that path's)
    with ib.build_loader(src, ib.split_by_chunk(src, (1.0,)), "train", batch_size=8, steps=w,
                         block_chunks=capped.block_chunks, run_chunks=capped.run_chunks,
                         memory_budget="200kB") as ld:
        assert ld.resident_bound == capped.resident_bound_bytes
        assert ld.node(ib.AsyncFetchNode).arena is not None


def test_the_report_speaks_in_the_terms_of_the_data(tmp_path):
    """ISO dates, their range and step, the levels and other coordinates, the static
    fields, and the share of missing values of a variable that has them."""
    from insitubatch_nodes.synthetic import WB2_SST, WB2Spec, wb2_land_sea_mask, write_wb2_store

    spec = WB2Spec(n_times=6, n_lon=24, n_lat=12, sea_surface_temperature=True)
    path = write_wb2_store(tmp_path / "wb2.zarr", spec, progress=False)
    src = ib.open_source(path, variables=["temperature", WB2_SST])
    r = inspect_source(src, quality=None, sample_objects=3)
    assert r.sample_axis == "time 1959-01-01T00:00 .. 1959-01-02T06:00, every 6h"
    assert r.coordinates["level"].startswith("50, 100, 150") and "1000" in r.coordinates["level"]
    lat = r.coordinates["latitude"]
    assert lat.startswith("-90, ") and lat.endswith(", 90")
    assert r.static == ("land_sea_mask",)
    by = {v.name: v for v in r.variables}
    assert by["temperature"].nan_fraction == 0.0
    land = (wb2_land_sea_mask(spec) >= 0.5).mean()
    assert by[WB2_SST].nan_fraction == pytest.approx(land)
    text = format_report(r)
    for line in ("time 1959-01-01T00:00 .. 1959-01-02T06:00, every 6h", "  level: 50, 100",
                 "static fields (ib.open_static): land_sea_mask",
                 f"missing values: {land:.1%} NaN"):
        assert line in text, line


def test_inspect_says_how_much_of_each_chunk_a_channel_subset_reads(tmp_path):
    """``channels=`` on a store of 37 levels a chunk: blosc frames of many blocks are read
    in part (blocks and bytes named), a zstd chunk whole, saying why."""
    import numcodecs

    levels = list(range(100, 137))
    for name, comp in (("blosc", numcodecs.Blosc("zstd", 3, 1, blocksize=2048)),
                       ("zstd", numcodecs.Zstd())):
        g = zarr.open_group(tmp_path / f"{name}.zarr", mode="w", zarr_format=2)
        z = np.arange(4 * 37 * 16 * 24, dtype="f4").reshape(4, 37, 16, 24)
        g.create_array("z", shape=z.shape, chunks=(1, 37, 16, 24), dtype="f4",
                       compressors=comp, attributes={
                           "_ARRAY_DIMENSIONS": ["time", "level", "lat", "lon"]})[:] = z
        g.create_array("level", shape=(37,), dtype="i8",
                       attributes={"_ARRAY_DIMENSIONS": ["level"]})[:] = levels
        src = ib.open_source(tmp_path / f"{name}.zarr", variables=["z"])
        # "z@100" as loader.channel_names writes it, or ("z", 100): one channel
        picks = ["z@100", ("z", 101), "z@130"]
        report = inspect_source(src, quality=None, channels=picks)
        assert report.channels == ("z@100", "z@101", "z@130")
        v = report.variables[0]
        assert v.partial_read is not None and v.partial_read.startswith("3 of 37 levels")
        if name == "blosc":
            assert "blosc blocks a chunk" in v.partial_read
            assert "of the compressed" in v.partial_read
        else:
            assert "whole chunks" in v.partial_read and "not a lone blosc" in v.partial_read
        assert inspect_source(src, quality=None).variables[0].partial_read is None
