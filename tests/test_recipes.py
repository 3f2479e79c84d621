"""Recipes are code users copy: they must run as their docstrings say."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from insitubatch_nodes.demo import DemoSpec, make_demo_store

ROOT = Path(__file__).resolve().parents[1]


def test_train_resume_recipe(tmp_path):
    store = make_demo_store(tmp_path / "d.zarr", DemoSpec(n_times=96, n_lat=16, n_lon=32,
                                                          time_chunk=8), progress=False)
    ckpt = tmp_path / "ck.pt"
    base = [sys.executable, str(ROOT / "recipes" / "train_resume.py"), "--store", str(store),
            "--checkpoint", str(ckpt), "--every", "1", "--epochs", "2"]
    first = subprocess.run(base + ["--stop-after", "2"], capture_output=True, text=True,
                           timeout=300)
    assert first.returncode == 0, first.stderr
    assert "stopping after 2 steps" in first.stdout
    second = subprocess.run(base + ["--resume"], capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    # 90% of 12 chunks of 8 = 80 samples = 3 batches of 32 per epoch; 2 epochs = 6 steps.
    assert "resumed at step 2" in second.stdout and "done: 6 steps" in second.stdout


def test_forecast_recipe(tmp_path):
    store = make_demo_store(tmp_path / "f.zarr", DemoSpec(n_times=645, n_lat=16, n_lon=32,
                                                          time_chunk=12), progress=False)
    res = subprocess.run([sys.executable, str(ROOT / "recipes" / "forecast.py"), "--store",
                          str(store), "--epochs", "2"], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("epoch")]
    assert len(lines) == 2 and "val loss" in lines[0]
    losses = [float(ln.split("train loss ")[1].split()[0]) for ln in lines]
    assert losses[1] < losses[0]  # it learns


def _recipe(name: str):
    """recipes/<name>.py as a module: its ``main(argv)`` runs in this process."""
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", ROOT / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_forecast_recipe_periods_from_the_command_line(tmp_path, capsys):
    """--train without --val was ignored (the default split used silently); 'None' for an
    open end was a raw datetime traceback. The recipe's ``main`` with these command lines,
    in this process (test_forecast_recipe runs it as a script)."""
    store = make_demo_store(tmp_path / "f.zarr", DemoSpec(n_times=300, n_lat=8, n_lon=16,
                                                          time_chunk=12), progress=False)
    forecast = _recipe("forecast")
    args = ["--store", str(store), "--epochs", "1"]
    with pytest.raises(SystemExit) as alone:
        forecast.main(args + ["--train", "2000-01-01", "2000-02-01"])
    assert alone.value.code == 2 and "give both --train and --val" in capsys.readouterr().err
    forecast.main(args + ["--train", "None", "2000-02-15", "--val", "2000-02-25", "None"])
    opened = capsys.readouterr().out
    assert "'train': ['None', '2000-02-15']" in opened
    # an open start is the axis' first step (the store starts on 2000-01-01): the same
    # samples as that date given
    forecast.main(args + ["--train", "2000-01-01", "2000-02-15", "--val", "2000-02-25",
                          "None"])
    dated = capsys.readouterr().out
    served = [re.search(r"served (\d+) train / (\d+) val", out).groups()
              for out in (opened, dated)]
    assert served[0] == served[1] and int(served[0][1]) > 0


@pytest.mark.parametrize("layout", ["wb2", "anemoi"])
def test_forecast_recipe_on_the_archives_people_train_on(tmp_path, capsys, layout):
    """The recipe's ``main`` in this process (test_forecast_recipe runs it as a script)."""
    from insitubatch_nodes.synthetic import WB2Spec, write_anemoi_store, write_wb2_store

    store = (write_wb2_store(tmp_path / "w.zarr", WB2Spec.small(n_times=40), progress=False)
             if layout == "wb2" else write_anemoi_store(tmp_path / "a.zarr", n_dates=40,
                                                         missing=(17,)))
    _recipe("forecast").main(["--store", str(store), "--epochs", "2", "--batch-size", "4"])
    out = capsys.readouterr().out
    assert (f"{layout if layout == 'anemoi' else 'zarr'} store" in out)
    lines = [ln for ln in out.splitlines() if ln.startswith("epoch")]
    assert len(lines) == 2 and "served" in lines[0] and "val loss" in lines[0]
    losses = [float(ln.split("train loss ")[1].split()[0]) for ln in lines]
    assert all(np.isfinite(losses))  # a missing date (NaN) never reaches the model


@pytest.mark.parametrize("recipe", ["train_resume", "ddp_torchrun", "lightning_datamodule"])
def test_resume_without_a_checkpoint_is_a_clear_usage_error(tmp_path, capsys, monkeypatch,
                                                            recipe):
    """The recipe's ``main`` in this process: argparse's usage error (SystemExit 2), not
    another exception (a traceback); ddp_torchrun's ``main`` reads ``sys.argv``."""
    missing = tmp_path / "none.pt"
    argv = ["--resume", "--checkpoint", str(missing)]
    module = _recipe(recipe)
    monkeypatch.setattr(sys, "argv", [f"{recipe}.py", *argv])
    with pytest.raises(SystemExit) as done:
        module.main() if recipe == "ddp_torchrun" else module.main(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert f"--resume: there is no checkpoint at {str(missing)!r}" in err
    assert "Traceback" not in err


@pytest.fixture(scope="module")
def wb2_like(tmp_path_factory):
    from stores import write_wb2_like

    return write_wb2_like(tmp_path_factory.mktemp("wb2") / "wb2.zarr", n_times=48)


WB2_CHANNELS = ["--channels", "temperature@500", "2m_temperature"]


def test_train_resume_recipe_on_a_store_with_levels(wb2_like, tmp_path, capsys):
    """Not the demo's names: a level and a surface field of a WB2-like store, stopped and
    resumed; the recipe's ``main`` in this process."""
    train_resume = _recipe("train_resume")
    args = ["--store", str(wb2_like), "--checkpoint", str(tmp_path / "ck.pt"), "--every", "1",
            "--epochs", "2", *WB2_CHANNELS]
    train_resume.main([*args, "--stop-after", "1"])
    first = capsys.readouterr().out
    assert "channels ['temperature@500', '2m_temperature']" in first
    assert "stopping after 1 steps" in first
    train_resume.main([*args, "--resume"])
    # 90% of 48 one-step chunks: 43 samples, 2 batches of 32 an epoch; 2 epochs: 4 steps
    second = capsys.readouterr().out
    assert "resumed at step 1" in second and "done: 4 steps" in second


def test_lightning_recipe_on_a_store_with_levels(wb2_like, tmp_path):
    """The Lightning recipe on a WB2-like store's level and surface field; its progress
    bar shows the epoch's batches (43 samples, 3 batches of 16) and a finite epoch count."""
    pytest.importorskip("lightning")
    res = subprocess.run([sys.executable, str(ROOT / "recipes" / "lightning_datamodule.py"),
                          "--store", str(wb2_like), "--checkpoint", str(tmp_path / "l.ckpt"),
                          "--max-steps", "4", *WB2_CHANNELS], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    out = res.stdout + res.stderr
    assert "saved" in out and "at step 4" in out
    bar = re.findall(r"Epoch (\d+)/(-?\d+)\D+?(\d+)/(\d+)", out)
    assert bar and all(total == "3" and last == "1" for _, last, _, total in bar), bar[-3:]


@pytest.mark.parametrize("recipe", ["train_resume", "lightning_datamodule"])
def test_a_misspelled_channel_is_a_usage_error_before_anything_is_read(wb2_like, tmp_path,
                                                                       capsys, recipe):
    module = _recipe(recipe)
    ckpt = tmp_path / "ck.pt"
    with pytest.raises(SystemExit) as e:
        module.main(["--store", str(wb2_like), "--checkpoint", str(ckpt), "--channels",
                     "temperature@501", "2m_temperature"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"{Path(sys.argv[0]).name}: error: --channels: ")
    assert "'temperature@501'" in line and "levels: [50, 500, 850, 1000]" in line
    # nothing written: no split manifest, no checkpoint
    assert list(tmp_path.iterdir()) == []


def test_forecast_recipe_on_a_store_with_levels(wb2_like, tmp_path, capsys):
    """The forecast recipe with levels from the command line, in this process: it trains
    on them; a misspelled level is a usage error before the statistics' pass."""
    forecast = _recipe("forecast")
    args = ["--store", str(wb2_like), "--epochs", "1", "--batch-size", "4"]
    with pytest.raises(SystemExit) as bad:
        forecast.main(args + ["--channels", "temperature@501", "2m_temperature"])
    err = capsys.readouterr().err
    assert bad.value.code == 2 and "temperature@501" in err.strip().splitlines()[-1]
    forecast.main(args + WB2_CHANNELS)
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("epoch")]
    assert len(lines) == 1 and "val loss" in lines[0]


def test_netcdf_virtual_recipe_trains_from_a_netcdf_file(tmp_path):
    """The README's NetCDF example, run as a user would: alone, in an empty folder, twice
    (a rerun must work too), warnings as errors."""
    pytest.importorskip("virtualizarr")
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "netcdf_virtual.py"
    for _ in range(2):
        done = subprocess.run([sys.executable, "-W", "error", str(recipe)], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
    assert (tmp_path / "t2m.nc").exists() and (tmp_path / "t2m-virtual").is_dir()
