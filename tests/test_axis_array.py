"""A sample axis that is not the stored first (``store/axis_array``): what the loader serves
along it is the stored array with that axis moved first (``np.moveaxis``), through every stage
that works along the sample axis: chunk-aligned splits, in-place decode, time windows,
patches, channels, decode workers, exact and elastic resume."""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import insitubatch_nodes as ib

N_TIME = 40


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """A satellite-like stack: ``refl`` stored (band, y, x, time) 4 steps a chunk, ``sst``
    stored (y, time, x) 8 steps a chunk; served along time, each with time moved first."""
    path = tmp_path_factory.mktemp("axis") / "stack.zarr"
    rng = np.random.default_rng(7)
    refl = rng.integers(0, 1000, (3, 10, 12, N_TIME)).astype("float32")
    sst = rng.normal(280, 5, (10, N_TIME, 12)).astype("float32")
    g = zarr.open_group(path, mode="w", zarr_format=3)
    g.create_array("refl", shape=refl.shape, chunks=(1, 5, 12, 4), dtype="float32",
                   dimension_names=("band", "y", "x", "time"))[:] = refl
    g.create_array("sst", shape=sst.shape, chunks=(5, 8, 12), dtype="float32",
                   dimension_names=("y", "time", "x"))[:] = sst
    src = ib.open_source(path, sample_dim="time")
    want = {"refl": np.moveaxis(refl, 3, 0), "sst": np.moveaxis(sst, 1, 0)}
    return src, want


def _epoch(loader) -> list[dict[str, np.ndarray]]:
    return [{k: v.numpy() for k, v in b.items()} for b in loader]


def _indices(batches) -> list[int]:
    return [int(i) for b in batches for i in b["sample_index"]]


def _same_batches(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert sorted(x) == sorted(y)
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def test_the_variables_put_the_sample_axis_first(stack):
    src, _ = stack
    assert src.sample_dim == "time" and src.n_samples == N_TIME
    assert [v.dimension_names for v in src.variables] == [("time", "band", "y", "x"),
                                                          ("time", "y", "x")]


@pytest.mark.parametrize("in_place", [True, False])
def test_time_windows_along_a_moved_axis(stack, in_place):
    """Inputs are the steps before and at the anchor, targets the leads after it, each the
    stored array at that time index; every anchor with its whole window once."""
    src, want = stack
    win = ib.SampleWindow(2, (1, 3))
    m = ib.split_by_chunk(src, (1.0,), names=["train"])
    with ib.build_loader(src, m, "train", batch_size=5, block_chunks=3, seed=2, steps=win,
                         in_place=in_place, keep_decoded=0) as ld:
        batches = _epoch(ld)
    for b in batches:
        idx = b["sample_index"]
        for name, values in want.items():
            np.testing.assert_array_equal(b[name][:, 0], values[idx - 1])
            np.testing.assert_array_equal(b[name][:, 1], values[idx])
            np.testing.assert_array_equal(b[f"target/{name}"][:, 0], values[idx + 1])
            np.testing.assert_array_equal(b[f"target/{name}"][:, 1], values[idx + 3])
    assert sorted(_indices(batches)) == list(range(1, N_TIME - 3))


def test_patches_along_a_moved_axis(stack):
    """Each patch is the stored values of its sample's plane at its corner; each (sample,
    corner) once."""
    src, want = stack
    m = ib.split_by_chunk(src, (1.0,), names=["train"])
    with ib.build_loader(src, m, "train", batch_size=4, block_chunks=4, seed=3,
                         patch_size=(5, 6)) as ld:
        batches = _epoch(ld)
    seen = []
    for b in batches:
        for row, (s, (y, x)) in enumerate(zip(b["sample_index"], b["patch"], strict=True)):
            np.testing.assert_array_equal(b["refl"][row], want["refl"][s, :, y:y + 5, x:x + 6])
            np.testing.assert_array_equal(b["sst"][row], want["sst"][s, y:y + 5, x:x + 6])
            seen.append((int(s), int(y), int(x)))
    corners = [(y, x) for y in (0, 5) for x in (0, 6)]
    assert sorted(seen) == [(s, y, x) for s in range(N_TIME) for y, x in corners]


def test_channels_along_a_moved_axis(stack):
    """``channels`` stacks the variables in the order asked: a 2-D field one channel, each
    band of the 3-D one a channel."""
    src, want = stack
    m = ib.split_by_chunk(src, (1.0,), names=["train"])
    with ib.build_loader(src, m, "train", batch_size=6, block_chunks=2, seed=4,
                         channels=["sst", "refl"]) as ld:
        batches = _epoch(ld)
    for b in batches:
        idx = b["sample_index"]
        np.testing.assert_array_equal(
            b["channels"], np.concatenate([want["sst"][idx][:, None], want["refl"][idx]], 1))
    assert sorted(_indices(batches)) == list(range(N_TIME))


def test_decode_workers_serve_what_the_threads_serve(stack):
    src, _ = stack
    m = ib.split_by_chunk(src, (0.75, 0.25), seed=1)
    kw = dict(batch_size=4, block_chunks=2, seed=5, steps=ib.SampleWindow(1, (1,)))
    with ib.build_loader(src, m, "train", workers=0, **kw) as ld:
        threads = _epoch(ld)
    with ib.build_loader(src, m, "train", workers=2, **kw) as ld:
        workers = _epoch(ld)
    _same_batches(threads, workers)


def _stopped_and_resumed(src, m, kw, stop: int) -> list[dict[str, np.ndarray]]:
    """An epoch stopped after ``stop`` batches, its state loaded into a new loader that
    serves the rest: the batches of both."""
    with ib.build_loader(src, m, "train", **kw) as ld:
        it = iter(ld)
        head = [{k: v.numpy() for k, v in next(it).items()} for _ in range(stop)]
        state = ld.state_dict()
    with ib.build_loader(src, m, "train", **kw) as ld:
        ld.load_state_dict(state)
        return head + _epoch(ld)


def test_an_exact_resume_mid_epoch_along_a_moved_axis(stack):
    src, _ = stack
    m = ib.split_by_chunk(src, (1.0,), names=["train"])
    kw = dict(batch_size=3, block_chunks=2, seed=6, steps=ib.SampleWindow(2, (1,)))
    with ib.build_loader(src, m, "train", **kw) as ld:
        whole = _epoch(ld)
    _same_batches(_stopped_and_resumed(src, m, kw, 5), whole)


def test_an_elastic_resume_from_two_ranks_to_three_along_a_moved_axis(stack):
    """Two ranks stop after the same step; three ranks given their merged state serve the
    rest: together every sample of the split exactly once, each row its stored values."""
    src, want = stack
    m = ib.split_by_chunk(src, (1.0,), names=["train"])
    kw = dict(batch_size=3, block_chunks=2, seed=8, uneven="none")
    before = [ib.build_loader(src, m, "train", rank=r, world_size=2, **kw) for r in range(2)]
    seen: list[int] = []
    for ld in before:
        it = iter(ld)
        for _ in range(2):
            b = next(it)
            np.testing.assert_array_equal(b["sst"].numpy(), want["sst"][b["sample_index"]])
            seen += b["sample_index"].tolist()
    merged = ib.merge_rank_states([ld.state_dict() for ld in before])
    for ld in before:
        ld.close()
    for r in range(3):
        with ib.build_loader(src, m, "train", rank=r, world_size=3, **kw) as ld:
            ld.load_state_dict(merged)
            ld.restart_on_stop_iteration = False
            for b in _epoch(ld):
                np.testing.assert_array_equal(b["refl"], want["refl"][b["sample_index"]])
                seen += b["sample_index"].tolist()
    assert sorted(seen) == list(range(N_TIME))


@st.composite
def layouts(draw):
    """A stored array of 2-4 dims with the sample axis anywhere, chunked anyhow."""
    ndim = draw(st.integers(2, 4))
    shape = [draw(st.integers(2, 7)) for _ in range(ndim)]
    axis = draw(st.integers(0, ndim - 1))
    shape[axis] = draw(st.integers(6, 20))
    chunks = [draw(st.integers(1, n)) for n in shape]
    dtype = draw(st.sampled_from(["float32", "int16", "uint8"]))
    return tuple(shape), tuple(chunks), axis, dtype


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(layout=layouts(), in_place=st.sampled_from([None, True, False]),
       batch=st.integers(1, 6), block=st.integers(1, 4))
def test_any_axis_serves_the_stored_array_with_that_axis_first(tmp_path_factory, layout,
                                                               in_place, batch, block):
    shape, chunks, axis, dtype = layout
    dims = tuple(f"d{i}" for i in range(len(shape)))
    values = np.random.default_rng(0).integers(0, 100, shape).astype(dtype)
    path = tmp_path_factory.mktemp("any") / "a.zarr"
    g = zarr.open_group(path, mode="w", zarr_format=3)
    g.create_array("v", shape=shape, chunks=chunks, dtype=dtype, dimension_names=dims)[:] = values
    src = ib.open_source(path, sample_dim=dims[axis])
    m = ib.split_by_chunk(src, (0.6, 0.4), seed=2)
    want = set(m.grid.samples_of(m.chunk_ids("train")).tolist())
    moved = np.moveaxis(values, axis, 0)
    with ib.build_loader(src, m, "train", batch_size=batch, block_chunks=block, seed=1,
                         in_place=in_place) as ld:
        batches = _epoch(ld)
    for b in batches:
        np.testing.assert_array_equal(b["v"], moved[b["sample_index"]])
    assert sorted(_indices(batches)) == sorted(want)


# -- composed with other stores (join at other dates, concat, period) ----------------------
def _write(path, name: str, dims: tuple[str, ...], start: str, n: int, chunk: int, seed: int):
    """``name`` stored with ``dims`` (time among them, ``chunk`` steps a chunk) by xarray,
    hourly from ``start``; returns the dataset written."""
    shape = {"band": 2, "y": 4, "x": 5, "time": n}
    data = np.random.default_rng(seed).normal(0, 1, [shape[d] for d in dims]).astype("float32")
    times = np.datetime64(start, "ns") + np.arange(n) * np.timedelta64(1, "h")
    ds = xr.Dataset({name: (dims, data)}, coords={"time": times})
    ds.to_zarr(path, encoding={name: {"chunks": [chunk if d == "time" else shape[d]
                                                 for d in dims]}}, mode="w")
    return ds


def _rows_equal(batches, want: xr.Dataset, names: list[str]) -> list[int]:
    """Every row is the dataset's values at its sample (time first); the samples served."""
    for b in batches:
        idx = b["sample_index"]
        for name in names:
            values = want[name].transpose("time", ...).values
            np.testing.assert_array_equal(b[name], values[idx], err_msg=name)
    return sorted(_indices(batches))


@pytest.fixture(scope="module")
def composed(tmp_path_factory):
    root = tmp_path_factory.mktemp("composed")
    era = _write(root / "era.zarr", "t2m", ("time", "y", "x"), "2020-01-01", 24, 4, 1)
    sat = _write(root / "sat.zarr", "refl", ("band", "y", "x", "time"), "2020-01-01T06", 30,
                 4, 2)
    late = _write(root / "late.zarr", "refl", ("band", "time", "y", "x"), "2020-01-02T12",
                  10, 3, 3)
    other = _write(root / "other.zarr", "refl", ("y", "time", "band", "x"), "2020-01-02T12",
                   10, 3, 3)
    return root, {"era": era, "sat": sat, "late": late, "other": other}


def test_an_inner_join_with_a_time_first_store_at_other_dates(composed):
    """ERA5-like fields stored time first joined with a satellite stack stored time last
    that starts 6 steps later (off its 4-step chunk edge): the common times, each member at
    its own indices, as xarray's inner merge."""
    root, ds = composed
    src = ib.join([ib.open_source(root / "era.zarr", sample_dim="time"),
                   ib.open_source(root / "sat.zarr", sample_dim="time")], align="inner")
    want = xr.merge([ds["era"], ds["sat"]], join="inner")
    assert src.n_samples == want.sizes["time"] == 18
    np.testing.assert_array_equal(src.sample_coord, want["time"].values)
    m = ib.split_by_chunk(src, (1.0,), names=["train"])
    kw = dict(batch_size=4, block_chunks=2, seed=3)
    with ib.build_loader(src, m, "train", workers=0, **kw) as ld:
        threads = _epoch(ld)
    assert _rows_equal(threads, want, ["t2m", "refl"]) == list(range(18))
    with ib.build_loader(src, m, "train", workers=2, **kw) as ld:
        _same_batches(threads, _epoch(ld))
    _same_batches(_stopped_and_resumed(src, m, kw, 2), threads)


@pytest.mark.parametrize("in_place", [True, False])
def test_a_concat_of_periods_stored_with_time_at_different_axes(composed, in_place):
    """One variable whose first period is stored (band, y, x, time) 4 steps a chunk and the
    next (band, time, y, x) 3 a chunk: served as xarray's concat along time. A period whose
    other axes are stored in another order serves other samples: refused, naming them."""
    root, ds = composed
    src = ib.concat([ib.open_source(root / "sat.zarr", sample_dim="time"),
                     ib.open_source(root / "late.zarr", sample_dim="time")])
    with pytest.raises(ib.StoreError, match=r"'refl' of member 1 .*other.zarr\) is float32 "
                       r"samples of \(4, 2, 5\) \(y, band, x\), of member 0 .* \(2, 4, 5\) "
                       r"\(band, y, x\)"):
        ib.concat([ib.open_source(root / "sat.zarr", sample_dim="time"),
                   ib.open_source(root / "other.zarr", sample_dim="time")])
    want = xr.concat([ds["sat"], ds["late"].transpose("band", "y", "x", "time")], "time")
    assert src.n_samples == want.sizes["time"] == 40
    m = ib.split_by_chunk(src, (1.0,), names=["train"])
    with ib.build_loader(src, m, "train", batch_size=5, block_chunks=3, seed=4,
                         in_place=in_place, steps=ib.SampleWindow(2, (1,))) as ld:
        batches = _epoch(ld)
    values = want["refl"].transpose("time", ...).values
    for b in batches:
        idx = b["sample_index"]
        np.testing.assert_array_equal(b["refl"][:, 0], values[idx - 1])
        np.testing.assert_array_equal(b["refl"][:, 1], values[idx])
        np.testing.assert_array_equal(b["target/refl"][:, 0], values[idx + 1])
    assert sorted(_indices(batches)) == list(range(1, 39))


def test_a_period_and_a_frequency_of_a_moved_axis(composed):
    root, ds = composed
    src = ib.open_source(root / "sat.zarr", sample_dim="time")
    part = src.period(start="2020-01-01T09", end="2020-01-02T08", frequency="2h")
    want = ds["sat"].sel(time=slice("2020-01-01T09", "2020-01-02T08")).isel(
        time=slice(None, None, 2))
    np.testing.assert_array_equal(part.sample_coord, want["time"].values)
    m = ib.split_by_chunk(part, (1.0,), names=["train"])
    with ib.build_loader(part, m, "train", batch_size=4, block_chunks=2, seed=5) as ld:
        assert _rows_equal(_epoch(ld), want, ["refl"]) == list(range(want.sizes["time"]))
