"""OME-Zarr images as stored (NGFF 0.4 on Zarr v2, 0.5 on Zarr v3, written by ngff-zarr):
the image and its label images sampled along z and along t of a tczyx image, every row
equal to zarr's own read of the level array with that axis moved first, each sample once,
threads and worker processes alike, an exact resume mid-epoch; a (band, y, x, time) stack
along time; the refusals, each naming what is wrong and what is there."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zarr

import insitubatch_nodes as ib
from insitubatch_nodes.store.ome_zarr import describe_ome_zarr, open_ome_zarr

pytest.importorskip("ngff_zarr")
from ome_stores import add_labels, segmentation, volume, write_image  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
AXES = "tczyx"
SHAPE = (4, 2, 8, 16, 16)
CHUNKS = {"t": 2, "c": 1, "z": 4, "y": 8, "x": 8}
SCALE = {"t": 0.5, "z": 2.0, "y": 0.25, "x": 0.25}
SHIFT = {"t": 10.0, "z": 3.0}


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """tczyx images with two label images: ``cells`` (tzyx) and ``nuclei`` (tczyx, c of
    size 1 as the spec allows), 2 levels, in NGFF 0.4 and 0.5."""
    root = tmp_path_factory.mktemp("ome")
    out = {}
    for version in ("0.4", "0.5"):
        path = root / f"tczyx-{version}.ome.zarr"
        data = volume(SHAPE, seed=int(version[-1]))
        write_image(path, data, AXES, version, chunks=CHUNKS, scale=SCALE, translation=SHIFT)
        add_labels(path, version, {"cells": (segmentation(data[:, 0]), "tzyx"),
                                   "nuclei": (segmentation(data[:, 1:]), AXES)},
                   chunks=CHUNKS, scale=SCALE, translation=SHIFT)
        out[version] = path
    return out


def stored(path: Path, name: str, level: int, dim: str) -> np.ndarray:
    """zarr's own read of the level array of ``name`` (the image or a label), ``dim`` moved
    first: what the batches' rows must equal."""
    group = zarr.open_group(path if name == "image" else path / "labels" / name, mode="r")
    attrs = group.attrs.asdict()
    ms = attrs.get("ome", attrs)["multiscales"][0]
    axes = [a["name"] for a in ms["axes"]]
    arr = zarr.open_array(group.store, path=_join(group.path, ms["datasets"][level]["path"]),
                          mode="r")
    return np.moveaxis(arr[...], axes.index(dim), 0)


def _join(*parts: str) -> str:
    return "/".join(p for p in parts if p)


def loader(src, **kw):
    kw.setdefault("batch_size", 3)
    kw.setdefault("seed", 5)
    manifest = ib.split_by_chunk(src, (1.0,), names=["train"])
    return ib.build_loader(src, manifest, "train", **kw)


def epoch(lo, limit: int | None = None) -> list[dict[str, np.ndarray]]:
    out = []
    for b in lo:
        out.append({k: v.numpy() for k, v in b.items() if hasattr(v, "numpy")})
        if limit is not None and len(out) == limit:
            break
    return out


def check_rows(batches, path: Path, names, level: int, dim: str) -> list[int]:
    """Every row is the stored plane at its sample index; the indices served."""
    want = {name: stored(path, name, level, dim) for name in names}
    seen: list[int] = []
    for b in batches:
        idx = b["sample_index"]
        seen += idx.tolist()
        for name in names:
            np.testing.assert_array_equal(b[name], want[name][idx], err_msg=name)
    return seen


@pytest.mark.parametrize("version", ["0.4", "0.5"])
@pytest.mark.parametrize("dim", ["z", "t"])
def test_image_and_labels_along_an_axis_once_each(images, version, dim):
    path = images[version]
    src = open_ome_zarr(path, sample_dim=dim)
    assert [v.name for v in src.variables] == ["image", "cells", "nuclei"]
    n = SHAPE[AXES.index(dim)]
    assert src.n_samples == n and src.sample_dim == dim
    np.testing.assert_allclose(src.sample_coord, SHIFT[dim] + SCALE[dim] * np.arange(n))
    seen = check_rows(epoch(loader(src)), path, ["image", "cells", "nuclei"], 0, dim)
    assert sorted(seen) == list(range(n))


# ome-zarr-py >= 0.19 (the OME's own writer) needs Python >= 3.12: it writes in a process of
# its own, with OME_ZARR_PYTHON or bench-out/venv-ome-zarr made by
#   python3.12 -m venv bench-out/venv-ome-zarr
#   bench-out/venv-ome-zarr/bin/python -m pip install "ome-zarr>=0.19"
OME_ZARR_WRITER = r"""
import sys, numpy as np, zarr
from ome_zarr.format import FormatV04, FormatV05
from ome_zarr.writer import write_image, write_labels
data, cells = np.load(sys.argv[1]), np.load(sys.argv[2])
scale = {"t": 0.5, "z": 2.0, "y": 0.25, "x": 0.25}
for path, fmt in [(sys.argv[3], FormatV04()), (sys.argv[4], FormatV05())]:
    root = zarr.open_group(path, mode="w", zarr_format=fmt.zarr_format)
    write_image(data, root, scale_factors=[2], axes="tczyx", fmt=fmt, scale=scale,
                storage_options={"chunks": (2, 1, 4, 8, 8)})
    write_labels(cells, root, name="cells", scale_factors=[2], axes="tzyx", fmt=fmt,
                 scale=scale, storage_options={"chunks": (2, 4, 8, 8)})
"""


def ome_zarr_python() -> str | None:
    for exe in (os.environ.get("OME_ZARR_PYTHON"),
                str(ROOT / "bench-out" / "venv-ome-zarr" / "bin" / "python")):
        if exe and Path(exe).exists() and subprocess.run(
                [exe, "-c", "import ome_zarr"], capture_output=True).returncode == 0:
            return exe
    return None


def test_images_written_by_ome_zarr_py(tmp_path):
    """NGFF 0.4 and 0.5 as ome-zarr-py 0.21 writes them (levels "s0", "s1", labels by
    write_labels): image and label along t and z equal zarr's reads, once each."""
    exe = ome_zarr_python()
    if exe is None:
        pytest.skip("no Python >= 3.12 with ome-zarr >= 0.19: set OME_ZARR_PYTHON or make "
                    "bench-out/venv-ome-zarr")
    data = volume(SHAPE, seed=7)
    np.save(tmp_path / "d.npy", data)
    np.save(tmp_path / "c.npy", segmentation(data[:, 0]))
    paths = [tmp_path / "v04.ome.zarr", tmp_path / "v05.ome.zarr"]
    res = subprocess.run([exe, "-c", OME_ZARR_WRITER, str(tmp_path / "d.npy"),
                          str(tmp_path / "c.npy"), *map(str, paths)], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    for path, version in zip(paths, ("0.4", "0.5"), strict=True):
        assert describe_ome_zarr(path).startswith(f"OME-Zarr {version} image")
        for dim in ("t", "z"):
            src = open_ome_zarr(path, sample_dim=dim)
            assert [v.name for v in src.variables] == ["image", "cells"]
            seen = check_rows(epoch(loader(src)), path, ["image", "cells"], 0, dim)
            assert sorted(seen) == list(range(SHAPE[AXES.index(dim)]))
        src = open_ome_zarr(path, level=1)
        check_rows(epoch(loader(src)), path, ["image", "cells"], 1, "z")
        np.testing.assert_allclose(src.sample_coord, 2.0 * np.arange(8))


@pytest.mark.parametrize("version", ["0.4", "0.5"])
def test_a_coarser_level_and_labels_picked(images, version):
    """level=1 reads datasets[1] of the image and of the label picked (labels=[...] picks
    and orders); its z coordinate is level 1's scale and translation (z halved)."""
    path = images[version]
    src = open_ome_zarr(path, level=1, labels=["nuclei"])
    assert [v.name for v in src.variables] == ["image", "nuclei"]
    assert src.n_samples == SHAPE[2] // 2
    np.testing.assert_allclose(src.sample_coord, 4.0 + 4.0 * np.arange(4))
    seen = check_rows(epoch(loader(src, batch_size=2)), path, ["image", "nuclei"], 1, "z")
    assert sorted(seen) == [0, 1, 2, 3]
    assert [v.name for v in open_ome_zarr(path, labels=[]).variables] == ["image"]


@pytest.mark.parametrize("level", [0, 1])
def test_a_region_in_physical_units_of_the_level(images, level):
    """``region(y=(1.0, 2.0), x=...)`` takes the axes' physical positions at the level served
    (translation + scale * index, from its coordinateTransformations), both ends included;
    the image and the labels are cut alike."""
    path = images["0.5"]
    ms = zarr.open_group(path, mode="r").attrs.asdict()["ome"]["multiscales"][0]
    tf = {t["type"]: t[t["type"]] for t in ms["datasets"][level]["coordinateTransformations"]}
    src = open_ome_zarr(path, level=level, sample_dim="z").region(y=(1.0, 2.0), x=(0.5, 1.25))
    pos = {d: tf.get("translation", [0.0] * 5)[AXES.index(d)] + tf["scale"][AXES.index(d)]
           * np.arange(SHAPE[AXES.index(d)] >> level) for d in "yx"}
    ys = np.flatnonzero((pos["y"] >= 1.0) & (pos["y"] <= 2.0))
    xs = np.flatnonzero((pos["x"] >= 0.5) & (pos["x"] <= 1.25))
    assert ys.size and xs.size
    names = ["image", "cells", "nuclei"]
    want = {n: stored(path, n, level, "z")[..., ys[0]:ys[-1] + 1, xs[0]:xs[-1] + 1]
            for n in names}
    seen = []
    for b in epoch(loader(src, batch_size=2)):
        seen += b["sample_index"].tolist()
        for n in names:
            np.testing.assert_array_equal(b[n], want[n][b["sample_index"]], err_msg=n)
    assert sorted(seen) == list(range(SHAPE[2] >> level))
    with pytest.raises(ib.UnknownNameError, match="no coordinate array 'c'"):
        open_ome_zarr(path).region(c=(0, 1))


def test_a_join_of_images_takes_a_region_in_each_ones_units(images):
    """Two images joined (one per NGFF version) keep their own physical positions: a region
    by value cuts each as it would alone."""
    a = open_ome_zarr(images["0.4"], labels=[])
    b = open_ome_zarr(images["0.5"], labels=[]).rename({"image": "other"})
    box = {"y": (1.0, 2.0), "x": (0.5, 1.25)}
    joined = ib.join([a, b]).region(**box)
    for name, alone in (("image", a.region(**box)), ("other", b.region(**box))):
        assert joined.variable(name).shape == alone.variables[0].shape
        np.testing.assert_array_equal(joined.coordinate("y", name), alone.coordinate("y", name))


def test_worker_processes_serve_what_threads_serve(images):
    path = images["0.5"]
    src = open_ome_zarr(path, sample_dim="z")
    runs = {w: epoch(loader(src, workers=w, batch_size=2)) for w in (0, 2)}
    assert len(runs[0]) == len(runs[2]) == 4
    for a, b in zip(runs[0], runs[2], strict=True):
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    check_rows(runs[2], path, ["image", "cells", "nuclei"], 0, "z")


@pytest.mark.parametrize("version", ["0.4", "0.5"])
def test_a_resume_mid_epoch_is_exact(images, version):
    """Stopped after 2 of 4 batches along t, its state loaded into a new loader: the rest
    of the epoch is the batches one uninterrupted run serves next."""
    src = open_ome_zarr(images[version], sample_dim="t", labels=["cells"])
    kw = dict(batch_size=1, seed=11)
    whole = epoch(loader(src, **kw))
    first = loader(src, **kw)
    before = epoch(first, limit=2)
    state = first.state_dict()
    resumed = loader(src, **kw)
    resumed.load_state_dict(state)
    after = epoch(resumed)
    assert len(whole) == 4 and len(before) + len(after) == 4
    for a, b in zip(before + after, whole, strict=True):
        for key in ("sample_index", "image", "cells"):
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_a_band_y_x_time_stack_along_time(tmp_path):
    """A satellite stack stored (band, y, x, time) is served along time, bands first; a
    field without time is static (Source.static, open_static), refused as a variable."""
    g = zarr.open_group(tmp_path / "stack.zarr", mode="w", zarr_format=3)
    refl = g.create_array("reflectance", shape=(3, 10, 12, 20), chunks=(1, 5, 12, 4),
                          dtype="int16", dimension_names=("band", "y", "x", "time"))
    values = volume((3, 10, 12, 20), seed=3, dtype="int16")
    refl[:] = values
    mask = g.create_array("mask", shape=(10, 12), chunks=(10, 12), dtype="uint8",
                          dimension_names=("y", "x"))
    mask[:] = np.eye(10, 12, dtype="uint8")
    src = ib.open_source(tmp_path / "stack.zarr", sample_dim="time")
    assert src.variables[0].dimension_names == ("time", "band", "y", "x")
    assert src.static == ("mask",)
    np.testing.assert_array_equal(ib.open_static(src)["mask"], mask[:])
    seen = []
    for b in epoch(loader(src, batch_size=6)):
        seen += b["sample_index"].tolist()
        np.testing.assert_array_equal(b["reflectance"],
                                      np.moveaxis(values, 3, 0)[b["sample_index"]])
    assert sorted(seen) == list(range(20))
    with pytest.raises(ib.StoreError, match=r"'mask' has dimensions \('y', 'x'\), none of "
                                            r"them the sample dimension 'time'.*open_static"):
        ib.open_source(tmp_path / "stack.zarr", ["reflectance", "mask"], sample_dim="time")


def test_refusals_name_the_input_and_what_is_valid(images, tmp_path):
    path = images["0.4"]
    with pytest.raises(ib.UnknownNameError,
                       match=r"sample_dim='q'.*axes are \('t', 'c', 'z', 'y', 'x'\)"):
        open_ome_zarr(path, sample_dim="q")
    with pytest.raises(ib.ConfigError, match=r"level=2 .* levels are 0: 'scale0/image' "
                                             r"\(4, 2, 8, 16, 16\), 1: 'scale1/image' "
                                             r"\(4, 2, 4, 8, 8\)"):
        open_ome_zarr(path, level=2)
    with pytest.raises(ib.UnknownNameError, match=r"\['nucleus'\].*lists \['cells', "
                                                  r"'nuclei'\]"):
        open_ome_zarr(path, labels=["nucleus"])
    with pytest.raises(ib.StoreError, match=r"label image 'cells' has axes \('t', 'z', 'y', "
                                            r"'x'\), not the sample axis 'c'"):
        open_ome_zarr(path, sample_dim="c")
    with pytest.raises(ib.StoreError, match="not an OME-Zarr image: its attributes hold no "
                                            "'multiscales'"):
        open_ome_zarr(path / "labels")
    # a label image on another grid (y halved): refused naming the axis and both sizes
    other = tmp_path / "grid.ome.zarr"
    data = volume((6, 8, 8))
    write_image(other, data, "zyx", "0.5", chunks={"z": 2, "y": 8, "x": 8}, levels=1)
    add_labels(other, "0.5", {"half": (segmentation(data[:, :4]), "zyx")},
               chunks={"z": 2, "y": 8, "x": 8}, levels=1)
    with pytest.raises(ib.StoreError, match=r"'half' at level 0 is on another grid than the "
                                            r"image: axis 'y' has 4 points, the image 8"):
        open_ome_zarr(other)
    assert open_ome_zarr(other, labels=[]).n_samples == 6


def test_transforms_of_the_multiscale_apply_after_the_levels(tmp_path):
    """A hand-written NGFF 0.4 group (the spec's own layout: levels "0", "1") whose
    multiscale carries coordinateTransformations of its own: applied after the level's,
    z = (5 + 2 i) * 0.5 + 100; metadata that is not NGFF is refused saying what is wrong."""
    g = zarr.open_group(tmp_path / "hand.zarr", mode="w", zarr_format=2)
    data = volume((3, 10, 4, 4))
    g.create_array("0", shape=data.shape, chunks=(1, 5, 4, 4), dtype=data.dtype)[:] = data
    axes = [{"name": "c", "type": "channel"}, {"name": "z", "type": "space"},
            {"name": "y", "type": "space"}, {"name": "x", "type": "space"}]
    g.attrs["multiscales"] = [{"version": "0.4", "axes": axes, "datasets": [
        {"path": "0", "coordinateTransformations": [
            {"type": "scale", "scale": [1, 2, 1, 1]},
            {"type": "translation", "translation": [0, 5, 0, 0]}]}],
        "coordinateTransformations": [{"type": "scale", "scale": [1, 0.5, 1, 1]},
                                      {"type": "translation", "translation": [0, 100, 0, 0]}]}]
    src = open_ome_zarr(tmp_path / "hand.zarr")
    np.testing.assert_allclose(src.sample_coord, 102.5 + np.arange(10))
    [b] = epoch(loader(src, batch_size=10))
    np.testing.assert_array_equal(b["image"], np.moveaxis(data, 1, 0)[b["sample_index"]])
    g.attrs["multiscales"] = [{"version": "0.4", "axes": axes, "datasets": [
        {"path": "0", "coordinateTransformations": [{"type": "scale", "scale": [1, 2]}]}]}]
    with pytest.raises(ib.StoreError, match="multiscales metadata of .* is malformed"):
        open_ome_zarr(tmp_path / "hand.zarr")


def test_an_image_on_s3(images):
    """An object-store URL opens as a local path does (moto, signatures checked)."""
    from composed_stores import on_moto

    with on_moto(images["0.5"]) as (url, options):
        src = open_ome_zarr(url, sample_dim="t", storage_options=options)
        assert src.url.startswith("s3://")
        seen = check_rows(epoch(loader(src)), images["0.5"], ["image", "cells", "nuclei"], 0,
                          "t")
        assert "labels: cells, nuclei" in describe_ome_zarr(url, storage_options=options)
    assert sorted(seen) == [0, 1, 2, 3]


def test_describe_says_axes_levels_and_labels(images):
    text = describe_ome_zarr(images["0.5"])
    assert "OME-Zarr 0.5 image" in text and "(Zarr v3)" in text
    assert ("axes: t (time, second), c (channel), z (space, micrometer), y (space, "
            "micrometer), x (space, micrometer)") in text
    assert ("0: scale0/image shape (4, 2, 8, 16, 16) chunks (2, 1, 4, 8, 8) uint16, scale "
            "(0.5, 1, 2, 0.25, 0.25) translation (10, 0, 3, 0, 0)") in text
    assert "1: scale1/image shape (4, 2, 4, 8, 8)" in text
    assert text.endswith("labels: cells, nuclei")
    assert "OME-Zarr 0.4 image" in describe_ome_zarr(images["0.4"])


def test_segment_ome_recipe_stops_and_resumes(tmp_path):
    """The recipe as a user runs it: train, stop after 3 steps saving the loader state;
    run again with --resume: it continues at step 3 with the batch the first run would
    have served next, and ends after the planned steps."""
    base = [sys.executable, str(ROOT / "recipes" / "segment_ome.py"), "--work",
            str(tmp_path), "--epochs", "2"]
    first = subprocess.run(base + ["--stop-after", "3"], capture_output=True, text=True,
                           timeout=300)
    assert first.returncode == 0, first.stderr
    assert "stopping after 3 steps" in first.stdout
    nxt = [ln for ln in first.stdout.splitlines() if ln.startswith("next batch")]
    second = subprocess.run(base + ["--resume"], capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    assert "resumed at step 3" in second.stdout
    served = [ln for ln in second.stdout.splitlines() if ln.startswith("step 4:")]
    assert nxt and served and served[0].split("z=")[1] == nxt[0].split("z=")[1]
    assert "done: 8 steps" in second.stdout


def test_segment_ome_recipe_usage_errors(images, tmp_path, capsys):
    """A wrong label, level or a resume without a checkpoint is a usage error saying what
    there is, before anything is read or trained."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("segment_ome",
                                                  ROOT / "recipes" / "segment_ome.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    for argv, said in [
            (["--resume"], "--resume: there is no checkpoint at"),
            (["--image", str(images["0.5"]), "--label", "nucleus"],
             "labels ['nucleus'] are not label images of .* lists ['cells', 'nuclei']"),
            (["--image", str(images["0.4"]), "--level", "3"],
             "level=3 is not a level of the OME-Zarr image .* levels are 0: 'scale0/image'")]:
        with pytest.raises(SystemExit) as e:
            recipe.main(["--work", str(tmp_path), *argv])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert re.search(said.replace("[", r"\[").replace("]", r"\]"), err), err
    assert not (tmp_path / "segment.pt").exists()
