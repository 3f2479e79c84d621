import numpy as np
import pytest

import insitubatch_nodes as ib
from insitubatch_nodes.demo import VARIABLES, DemoSpec, main, make_demo_store, train


def test_demo_store_is_era5_like(tmp_path):
    spec = DemoSpec(n_times=30, n_lat=16, n_lon=32, time_chunk=12)
    path = make_demo_store(tmp_path / "d.zarr", spec, progress=False)
    src = ib.open_source(path, sample_dim="time")
    assert src.names == tuple(sorted(VARIABLES))
    t2m = src.variable("t2m")
    assert t2m.shape == (30, 16, 32) and t2m.chunks == (12, 16, 32)
    assert t2m.dimension_names == ("time", "lat", "lon")
    x = src.arrays[src.names.index("t2m")][:]
    assert 200 < x.mean() < 320 and x.std() > 1  # plausible temperatures, not constant
    # Smooth: neighbouring grid points differ much less than the field varies.
    assert np.abs(np.diff(x, axis=2)).mean() < x.std()


def test_demo_trains_and_reports(tmp_path, capsys):
    spec = DemoSpec(n_times=48, n_lat=16, n_lon=32, time_chunk=8)
    path = make_demo_store(tmp_path / "d.zarr", spec, progress=False)
    report = train(path, batch_size=8, block_chunks=2)
    assert report["samples"] == 40  # 90% of 6 chunks = 5 chunks of 8
    assert report["samples_per_s"] > 0 and 0 <= report["starvation"] <= 1
    out = capsys.readouterr().out
    assert "samples/s" in out and "MB/s" in out and "waited for data" in out


def test_demo_cli(tmp_path, capsys):
    assert main(["--path", str(tmp_path / "c.zarr"), "--size-mb", "2", "--batch-size", "4"]) == 0
    assert "samples/s" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--size-mb", "-1"])


def test_the_demo_writer_never_replaces_what_is_not_a_zarr_store(tmp_path):
    keep = tmp_path / "mine"
    keep.mkdir()
    (keep / "notes.txt").write_text("precious")
    with pytest.raises(FileExistsError, match="not a Zarr store"):
        make_demo_store(keep, DemoSpec(n_times=8, n_lat=4, n_lon=8, time_chunk=4),
                        progress=False)
    assert (keep / "notes.txt").read_text() == "precious"
    store = make_demo_store(tmp_path / "d.zarr", DemoSpec(n_times=8, n_lat=4, n_lon=8,
                                                          time_chunk=4), progress=False)
    make_demo_store(store, DemoSpec(n_times=12, n_lat=4, n_lon=8, time_chunk=4),
                    progress=False)  # a Zarr store is replaced
    assert ib.open_source(store).grid.n_samples == 12


def test_one_writer_for_the_demo_and_the_benchmarks(tmp_path, monkeypatch):
    """Benchmark stores (one variable, no coordinates, any codec) come from the demo's writer,
    and a seed's data does not depend on how many chunks go into one write."""
    import zarr

    from insitubatch_nodes import synthetic

    spec = DemoSpec(n_times=20, n_lat=8, n_lon=16, time_chunk=4, variables=("t2m",),
                    coords=False)
    whole = synthetic.write_store(tmp_path / "a.zarr", spec, progress=False)
    monkeypatch.setattr(synthetic, "WRITE_BYTES", 1)  # one chunk per write
    by_chunk = synthetic.write_store(tmp_path / "b.zarr", spec, compressors=None,
                                     zarr_format=2, progress=False)
    x = zarr.open_array(whole / "t2m", mode="r")[:]
    assert np.array_equal(x, zarr.open_array(by_chunk / "t2m", mode="r")[:])
    assert sorted(zarr.open_group(whole, mode="r").array_keys()) == ["t2m"]
    assert ib.open_source(by_chunk).variable("t2m").chunks == (4, 8, 16)
    with pytest.raises(ValueError, match="t2m, u10, v10, msl"):
        DemoSpec(n_times=4, variables=("sst",))
