"""The insitubatch command: errors in words with exit code 2, and make-demo -> inspect -> bench."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import pytest

from insitubatch_nodes import cli

ROOT = Path(__file__).resolve().parents[1]


def _fails(capsys, argv: list[str]) -> str:
    """Run the CLI expecting a usage error; return its stderr."""
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "demo.zarr"
    assert cli.main(["make-demo", str(path), "--size-mb", "3", "--lat", "16", "--lon", "32",
                     "--time-chunk", "8", "--quiet"]) == 0
    return path


def test_console_script_is_declared():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["scripts"]["insitubatch"] == "insitubatch_nodes.cli:main"
    assert "matplotlib" in " ".join(meta["project"]["optional-dependencies"]["bench"])


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("insitubatch-nodes ")


# -- bad URLs ------------------------------------------------------------------------------
def test_missing_path(capsys, tmp_path):
    err = _fails(capsys, ["inspect", str(tmp_path / "nope.zarr")])
    assert "nope.zarr" in err and "Zarr store not found" in err
    assert "s3://" in err  # says what is valid


def test_unsupported_scheme(capsys):
    err = _fails(capsys, ["inspect", "ftp://host/data.zarr"])
    assert "'ftp'" in err and "s3://" in err and "file://" in err


def test_not_a_zarr_group(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    err = _fails(capsys, ["bench", str(tmp_path / "empty"), "--no-plots"])
    assert "no Zarr group" in err and "empty" in err


def test_unknown_variable(capsys, demo):
    err = _fails(capsys, ["inspect", str(demo), "--variables", "t2m", "sst"])
    assert "'sst'" in err and "t2m" in err and "u10" in err  # names the ones that exist


# -- bad options ---------------------------------------------------------------------------
@pytest.mark.parametrize("argv,words", [
    (["inspect", "x", "--quality", "1.5"], ["--quality", "(0, 1]", "1.5"]),
    (["inspect", "x", "--quality", "high"], ["--quality", "'high'"]),
    (["inspect", "x", "--memory", "lots"], ["--memory", "'lots'", "4GB"]),
    (["inspect", "x", "--batch-size", "0"], ["--batch-size", ">= 1", "0"]),
    (["bench", "x", "--sweep-spc", "1,x"], ["--sweep-spc", "'1,x'", "1,8,24,96"]),
    (["bench", "x", "--sweep-sample-shape", "64"], ["--sweep-sample-shape", "64x64"]),
    (["bench", "x", "--naive-workers", "-1"], ["--naive-workers", "0,2"]),
    (["bench", "x", "--split-fraction", "0"], ["--split-fraction", "(0, 1]"]),
    (["make-demo", "x", "--size-mb", "-3"], ["--size-mb", "> 0", "-3"]),
    (["make-demo", "x", "--layout", "zarr"], ["--layout", "'zarr'", "era5", "wb2"]),
    (["make-demo", "x", "--layout", "wb2", "--time-chunk", "4"],
     ["--time-chunk 4", "one time step per chunk"]),
    (["inspect", "x", "--bogus"], ["unrecognized arguments: --bogus"]),
    (["frobnicate"], ["invalid choice: 'frobnicate'", "make-demo", "inspect", "bench"]),
    ([], ["required"]),
])
def test_bad_options(capsys, argv, words):
    err = _fails(capsys, argv)
    for w in words:
        assert w in err, (w, err)


def test_make_demo_never_replaces_other_things(capsys, tmp_path, demo):
    (tmp_path / "notes.txt").write_text("precious")
    err = _fails(capsys, ["make-demo", str(tmp_path), "--size-mb", "1"])
    assert "not a Zarr store" in err and (tmp_path / "notes.txt").exists()
    err = _fails(capsys, ["make-demo", str(demo), "--size-mb", "1"])
    assert "--force" in err


def test_bench_says_how_to_install_its_extra(capsys, demo, monkeypatch):
    import insitubatch_nodes.bench as bench

    monkeypatch.setattr(bench, "missing_bench_deps", lambda plots=True: ["matplotlib"])
    err = _fails(capsys, ["bench", str(demo)])
    assert "insitubatch-nodes[bench]" in err and "matplotlib" in err


def test_bench_channels_must_be_served_variables(capsys, demo):
    err = _fails(capsys, ["bench", str(demo), "--channels", "t2m", "sst", "--no-plots"])
    assert "--channels sst" in err and "t2m, u10" in err


def test_make_demo_wb2_small(capsys, tmp_path):
    import insitubatch_nodes as ib
    from insitubatch_nodes.synthetic import WB2_VARIABLES

    path = tmp_path / "wb2.zarr"
    assert cli.main(["make-demo", str(path), "--layout", "wb2", "--small", "--n-times", "5",
                     "--quiet"]) == 0
    assert "84 channels (sea_surface_temperature NaN over land)" in capsys.readouterr().out
    assert (path / ".zmetadata").exists()
    src = ib.open_source(path, variables=list(WB2_VARIABLES))
    assert src.n_samples == 5
    assert src.variable("temperature").shape == (5, 13, 24, 12)  # small: grid shrinks only
    assert cli.main(["inspect", str(path), "--json"]) == 0  # static land_sea_mask set aside
    rep = json.loads(capsys.readouterr().out)
    names = sorted(v["name"] for v in rep["variables"])
    assert names == sorted([*WB2_VARIABLES, "sea_surface_temperature"])


def test_bench_batch_larger_than_store(capsys, demo):
    err = _fails(capsys, ["bench", str(demo), "--batch-size", "100000", "--no-plots"])
    assert "--batch-size 100000" in err


# -- end to end ----------------------------------------------------------------------------
def test_inspect_text_and_json(capsys, demo):
    assert cli.main(["inspect", str(demo), "--memory", "64MB", "--quality", "0.8"]) == 0
    text = capsys.readouterr().out
    for name in ("t2m", "u10", "v10", "msl"):
        assert f"variable {name}: shape (" in text
    assert "bytes -> blosc(zstd)" in text and "read path: local" in text
    assert "block_chunks=" in text
    assert cli.main(["inspect", str(demo), "--json", "--variables", "t2m"]) == 0
    rep = json.loads(capsys.readouterr().out)
    (v,) = rep["variables"]
    assert v["name"] == "t2m" and v["samples_per_chunk"] == 8 and v["chunks"] == [8, 16, 32]
    assert v["decoded_chunk_bytes"] == 8 * 16 * 32 * 4 and v["compressed_chunk_bytes"] > 0
    assert rep["recommendation"]["quality_target"] == 0.9


def test_bench_end_to_end(capsys, demo, tmp_path):
    out = tmp_path / "out"
    assert cli.main(["bench", str(demo), "--out", str(out), "--epochs", "2",
                     "--naive-samples", "24", "--batch-size", "8", "--block-chunks", "4",
                     "--resume-after", "2", "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "insitubatch loader, steady" in text and "naive DataLoader, 2 workers" in text
    assert "time to first batch" in text
    res = json.loads((out / "core.json").read_text())
    names = [r["name"] for r in res["rows"]]
    assert any("read floor" in n for n in names) and "zarr arr[:]" in names
    n = res["split"]["samples"]
    for ep in res["loader_epochs"]:
        assert ep["samples"] == n and 0 <= ep["starvation"] <= 1
        assert ep["bytes_delivered"] == n * res["split"]["sample_nbytes"]
        assert ep["rss_peak_bytes"] > 0
    assert res["first_batch"]["first_batch_after_resume_s"] > 0
    probe = res["memory"]["probe"]  # the loader alone in a fresh process
    assert probe["peak_rss_bytes"] > probe["import_rss_bytes"] > 0
    assert (out / "core.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "core.md").read_text().startswith("| path |")


def test_bench_sweep_end_to_end(capsys, demo, tmp_path):
    out = tmp_path / "sweep"
    assert cli.main(["bench", str(demo), "--sweep", "--out", str(out), "--epochs", "2",
                     "--sweep-spc", "1,8", "--sweep-samples", "96", "--sweep-sample-shape",
                     "8x8", "--window-samples", "16", "--sweep-block-chunks", "1,4",
                     "--sweep-inflight", "2,8", "--batch-size", "8", "--quiet"]) == 0
    res = json.loads((out / "sweep.json").read_text())
    assert [p["samples_per_chunk"] for p in res["samples_per_chunk"]] == [1, 8]
    assert [p["n_chunks"] for p in res["samples_per_chunk"]] == [96, 12]
    assert [p["block_chunks"] for p in res["block_chunks"]] == [1, 4]
    assert [p["max_inflight"] for p in res["max_inflight"]] == [2, 8]
    q = [p["shuffle_quality"] for p in res["block_chunks"]]
    assert q[0] < q[1] <= 1.0
    for name in ("samples_per_chunk", "block_chunks", "max_inflight"):
        assert (out / f"sweep_{name}.png").stat().st_size > 1000
    assert not (out / "sweep-stores" / "spc1.zarr").exists()  # removed unless --keep-stores


def test_bench_options_reach_the_sweep_loaders(monkeypatch, demo, tmp_path):
    """--decode-threads (and the other loader options) reach the sweep's loaders too."""
    from insitubatch_nodes.bench import sweep

    seen = []
    monkeypatch.setattr(sweep, "run_sweep", lambda cfg: seen.append(cfg))
    assert cli.main(["bench", str(demo), "--sweep", "--out", str(tmp_path / "o"),
                     "--decode-threads", "3", "--max-inflight", "5", "--quiet"]) == 0
    kw = seen[0].loader_kwargs()
    assert kw["decode_threads"] == 3 and kw["max_inflight"] == 5


# -- inspect --sample / --plot -------------------------------------------------------------
def test_inspect_sample_prints_what_the_loader_serves(capsys, demo):
    import zarr

    stored = zarr.open_group(demo, mode="r")
    assert cli.main(["inspect", str(demo), "--sample", "9"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("sample 9 of ") and "(time " in text
    t2m = stored["t2m"][9]
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("t2m "))
    assert "shape (16, 32)" in line and f"min {t2m.min():.6g}" in line and "NaN 0" in line
    assert "sample_index" in text and "value 9" in text
    assert cli.main(["inspect", str(demo), "--sample", "9", "--history", "2", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    keys = {k["key"]: k for k in rep["keys"]}
    assert keys["t2m"]["shape"] == [2, 16, 32] and keys["target/t2m"]["shape"] == [1, 16, 32]
    assert keys["target/t2m"]["max"] == pytest.approx(float(stored["t2m"][10].max()))
    assert keys["msl"]["mean"] == pytest.approx(float(stored["msl"][8:10].astype("f8").mean()))


def test_inspect_sample_out_of_range_names_the_valid_ones(capsys, demo):
    import zarr

    n = zarr.open_group(demo, mode="r")["t2m"].shape[0]
    err = _fails(capsys, ["inspect", str(demo), "--sample", str(n)])
    assert f"--sample {n}" in err and f"0 to {n - 1}" in err
    err = _fails(capsys, ["inspect", str(demo), "--sample", "0", "--history", "3"])
    assert f"only anchors 2 to {n - 2} are samples" in err
    err = _fails(capsys, ["inspect", str(demo), "--plot", "x.png"])
    assert "--plot/--plot-key need --sample" in err


def test_inspect_plot_writes_a_png_of_one_field(capsys, demo, tmp_path):
    out = tmp_path / "s.png"
    assert cli.main(["inspect", str(demo), "--sample", "3", "--plot", str(out),
                     "--plot-key", "u10"]) == 0
    assert f"wrote {out}: u10, shape (16, 32)" in capsys.readouterr().out
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    err = _fails(capsys, ["inspect", str(demo), "--sample", "3", "--plot", str(out),
                          "--plot-key", "sst"])
    assert "'sst'" in err and "'t2m'" in err  # the fields there are
    err = _fails(capsys, ["inspect", str(demo), "--sample", "3", "--plot",
                          str(tmp_path / "no" / "s.png")])
    assert "does not exist" in err


def test_inspect_sample_shows_dates_and_plots_a_map_north_up(capsys, tmp_path):
    """WB2's grid is lon-major with latitude ascending: the map is drawn latitude up the
    page (south at the bottom), longitude across; the time is shown as a date."""
    pytest.importorskip("matplotlib")
    path = tmp_path / "wb2.zarr"
    assert cli.main(["make-demo", str(path), "--layout", "wb2", "--small", "--n-times", "4",
                     "--quiet"]) == 0
    capsys.readouterr()
    png = tmp_path / "sst.png"
    assert cli.main(["inspect", str(path), "--sample", "3", "--plot", str(png),
                     "--plot-key", "sea_surface_temperature"]) == 0
    out = capsys.readouterr().out
    assert "value 1959-01-01T18:00:00" in out
    assert "sea_surface_temperature, shape (12, 24), latitude up x longitude across" in out
    assert png.stat().st_size > 1000


# -- inspect --channels on a WeatherBench2-like store written by xarray ---------------------
WB2_LEVELS = [50, 500, 850, 1000]


@pytest.fixture(scope="module")
def wb2_like(tmp_path_factory) -> tuple[Path, Any]:
    """temperature on 4 levels (a ``level`` coordinate), two surface fields beside it, a
    static land_sea_mask; one step a chunk, as xarray writes WeatherBench2."""
    import numpy as np
    import pandas as pd
    import xarray as xr

    rng = np.random.default_rng(5)
    time = pd.date_range("2020-01-01", periods=12, freq="6h")
    lat, lon = np.linspace(90, -90, 5), np.arange(0, 360, 45.0)
    shape = (12, len(WB2_LEVELS), 5, 8)
    ds = xr.Dataset(
        {"temperature": (("time", "level", "latitude", "longitude"),
                         (200 + rng.standard_normal(shape)
                          + 10 * np.arange(4)[None, :, None, None]).astype("float32")),
         "2m_temperature": (("time", "latitude", "longitude"),
                            (280 + rng.standard_normal((12, 5, 8))).astype("float32")),
         "mean_sea_level_pressure": (("time", "latitude", "longitude"),
                                     (1e5 + rng.standard_normal((12, 5, 8))).astype("float32")),
         "land_sea_mask": (("latitude", "longitude"),
                           (rng.random((5, 8)) > 0.5).astype("float32"))},
        coords={"time": time, "level": np.array(WB2_LEVELS, "int64"), "latitude": lat,
                "longitude": lon})
    enc = {v: {"chunks": (1, *ds[v].shape[1:])} for v in ds.data_vars if v != "land_sea_mask"}
    path = tmp_path_factory.mktemp("wb2like") / "wb2.zarr"
    ds.to_zarr(path, zarr_format=2, consolidated=True, encoding=enc)
    return path, ds


def _one_line(err: str) -> str:
    """The error alone: one line on stderr (no usage, no traceback)."""
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize(("channels", "words"), [
    (["temperature@501"], ["'temperature@501'", "level=501 is", "levels: [50, 500, 850, 1000]"]),
    (["temperatur@500"], ["'temperatur@500'", "'temperatur'", "'2m_temperature'",
                          "'temperature'"]),
    (["land_sea_mask"], ["'land_sea_mask'", "static field", "static fields are not channels"]),
    (["temperature", "temperature@500"], ["'temperature'", "'temperature@500'", "whole"]),
    (["temperature@500", "temperature@500.0"], ["'temperature@500.0'", "same channel"]),
])
@pytest.mark.parametrize("sample", [False, True], ids=["report", "sample"])
def test_inspect_channel_mistakes_are_one_line(capsys, wb2_like, channels, words, sample):
    """A bad --channels entry (a level or variable the store lacks, a static field, a
    channel twice) exits 2 with one line naming it and what is valid, never a traceback,
    for the report and --sample alike."""
    argv = ["inspect", str(wb2_like[0]), "--channels", *channels]
    err = _one_line(_fails(capsys, argv + (["--sample", "2"] if sample else [])))
    assert err.startswith("insitubatch inspect: error: --channels: ")
    for w in words:
        assert w in err, (w, err)


def test_a_missing_store_is_one_line(capsys, tmp_path):
    err = _one_line(_fails(capsys, ["inspect", str(tmp_path / "nope.zarr")]))
    assert "nope.zarr" in err


def _report(capsys, argv: list[str]) -> dict:
    assert cli.main(argv + ["--json", "--batch-size", "4"]) == 0
    return json.loads(capsys.readouterr().out)


def test_inspect_figures_follow_channels(capsys, wb2_like):
    """With --channels the figures are a loader's given them: only the channels' variables
    read (bytes per sample, the resident bound as build_loader computes it); --variables
    naming more keeps them, as the loader does."""
    import insitubatch_nodes as ib

    url = str(wb2_like[0])
    chans = ["temperature@500", "2m_temperature"]
    whole = _report(capsys, ["inspect", url])
    picked = _report(capsys, ["inspect", url, "--channels", *chans])
    assert whole["channels"] == [] and picked["channels"] == chans
    assert [v["name"] for v in whole["variables"]] == ["2m_temperature",
                                                       "mean_sea_level_pressure", "temperature"]
    assert [v["name"] for v in picked["variables"]] == ["2m_temperature", "temperature"]
    assert whole["sample_nbytes"] == (4 + 1 + 1) * 5 * 8 * 4  # every level of temperature
    assert picked["sample_nbytes"] == (4 + 1) * 5 * 8 * 4  # a level decodes from its chunk
    only_t = _report(capsys, ["inspect", url, "--channels", "temperature@850"])
    assert [v["name"] for v in only_t["variables"]] == ["temperature"]
    assert only_t["sample_nbytes"] == 4 * 5 * 8 * 4
    rec_t, rec_all = only_t["recommendation"], whole["recommendation"]
    assert rec_t["block_chunks"] == rec_all["block_chunks"]
    assert (rec_t["resident_bound_bytes"] < picked["recommendation"]["resident_bound_bytes"]
            < rec_all["resident_bound_bytes"])
    src = ib.open_source(url)
    m = ib.split_by_chunk(src, fractions=(1.0,), names=("store",))
    with ib.build_loader(src, m, "store", batch_size=4, channels=["temperature@850"],
                         block_chunks=rec_t["block_chunks"]) as ld:
        assert ld.resident_bound == rec_t["resident_bound_bytes"]
    given = _report(capsys, ["inspect", url, "--variables", "temperature", "2m_temperature",
                             "--channels", "temperature@850"])
    assert given["sample_nbytes"] == picked["sample_nbytes"]  # named: served beside
    assert cli.main(["inspect", url, "--channels", "temperature@850"]) == 0
    text = capsys.readouterr().out
    assert "(the variables a loader given these channels reads: temperature)" in text
    assert "  channels: temperature@850" in text


def test_inspect_sample_serves_the_channels(capsys, wb2_like):
    """--sample with --channels shows the stacked channels the loader serves for it, in
    the order given, and nothing else of the store."""
    path, ds = wb2_like
    assert cli.main(["inspect", str(path), "--sample", "3", "--channels", "2m_temperature",
                     "temperature@1000", "--json"]) == 0
    keys = {k["key"]: k for k in json.loads(capsys.readouterr().out)["keys"]}
    assert set(keys) == {"channels", "sample_index", "time"}
    want = [ds["2m_temperature"].values[3], ds["temperature"].sel(level=1000).values[3]]
    got = keys["channels"]
    assert got["shape"] == [2, 5, 8]
    assert got["min"] == pytest.approx(min(float(w.min()) for w in want))
    assert got["max"] == pytest.approx(max(float(w.max()) for w in want))
    assert cli.main(["inspect", str(path), "--sample", "3", "--json"]) == 0
    keys = {k["key"] for k in json.loads(capsys.readouterr().out)["keys"]}
    assert {"temperature", "2m_temperature"} <= keys and "channels" not in keys
