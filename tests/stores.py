"""Test helpers: write real zarr stores whose values make a wrong row obvious."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import zarr
import zarr.codecs as zc


@dataclass(frozen=True)
class Var:
    """How to write one test variable."""

    name: str
    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    dtype: str = "float32"
    compressors: Any = "default"
    shards: tuple[int, ...] | None = None
    zarr_format: int = 3
    extra: dict = field(default_factory=dict)


def values(shape: tuple[int, ...], dtype: str, seed: int = 0) -> np.ndarray:
    """Distinct, checkable values: row i starts near i * 1000 so a wrong row is obvious."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    base = np.arange(n, dtype=np.float64).reshape(shape)
    if np.dtype(dtype).kind == "f":
        return (base + rng.random(shape)).astype(dtype)
    if np.dtype(dtype).kind == "b":
        return (base.astype(np.int64) % 3 == 0)
    info = np.iinfo(dtype)
    return (base.astype(np.int64) % int(min(info.max, 10**9))).astype(dtype)


def write_store(path: Path, variables: list[Var], seed: int = 0) -> dict[str, np.ndarray]:
    """Write the variables into a zarr group at ``path``; return what was written."""
    fmt = variables[0].zarr_format if variables else 3
    g = zarr.open_group(path, mode="w", zarr_format=fmt)
    data = {}
    for i, v in enumerate(variables):
        kw: dict[str, Any] = dict(shape=v.shape, chunks=v.chunks, dtype=v.dtype, **v.extra)
        if v.compressors != "default":
            kw["compressors"] = v.compressors
        if v.shards is not None:
            kw["shards"] = v.shards
        arr = g.create_array(v.name, **kw)
        d = values(v.shape, v.dtype, seed + i)
        arr[:] = d
        data[v.name] = d
    return data


BLOSC = zc.BloscCodec(cname="zstd", clevel=3, shuffle="shuffle")


@contextmanager
def stores_on_s3(folder: Path, stores: dict[str, list[Var]],
                 bucket: str = "data") -> Iterator[tuple[Any, dict[str, dict[str, np.ndarray]]]]:
    """moto on loopback serving each store (written under ``folder``) at
    ``s3://bucket/<name>``: yields (server, {name: the data written}); stopped on exit."""
    from insitubatch_nodes.testing.s3server import serving

    local = {name: folder / f"local-{name}" for name in stores}
    data = {name: write_store(local[name], variables) for name, variables in stores.items()}
    with serving(folder, bucket, local) as server:
        yield server, data


def write_x_y(path: Path) -> dict[str, np.ndarray]:
    """160 samples of one sample per chunk: x (float32, 4x3) and y (int16, 3): the store the
    worker fault and recovery tests run on."""
    return write_store(path, [Var("x", (160, 4, 3), (1, 4, 3), compressors=BLOSC),
                              Var("y", (160, 3), (1, 3), dtype="int16")])


def write_weather(path: Path, steps_per_chunk: int) -> Path:
    """A small ERA5-like store: t2m (80, 6, 8) and z (80, 3, 6, 8) on levels 500, 850 and
    1000, ``steps_per_chunk`` time steps per chunk, blosc."""
    n = steps_per_chunk
    dims = ("time", "lat", "lon")
    write_store(path, [
        Var("t2m", (80, 6, 8), (n, 6, 8), compressors=BLOSC,
            extra=dict(dimension_names=dims)),
        Var("z", (80, 3, 6, 8), (n, 3, 6, 8), compressors=BLOSC,
            extra=dict(dimension_names=("time", "level", *dims[1:])))])
    g = zarr.open_group(path)
    g.create_array("level", shape=(3,), dtype="int64", dimension_names=("level",))[:] = \
        [500, 850, 1000]
    return path


def assert_rows_stored(batches: list[dict[str, Any]], data: dict[str, np.ndarray]) -> None:
    """Every row of ``batches`` is the stored sample its ``sample_index`` names."""
    for b in batches:
        for name, arr in data.items():
            np.testing.assert_array_equal(b[name], arr[b["sample_index"]], err_msg=name)


def state_after(loader: Any, batches: int, epochs: int = 0) -> dict[str, Any]:
    """``loader``'s state after ``epochs`` whole epochs and ``batches`` batches of the next,
    through JSON as a checkpoint keeps it."""
    for _ in range(epochs):
        for _ in loader:
            pass
    it = iter(loader)
    for _ in range(batches):
        next(it)
    return json.loads(json.dumps(loader.state_dict()))


def write_wb2_like(path: Path, n_times: int = 24, levels: tuple[int, ...] = (50, 500, 850, 1000),
                   seed: int = 3) -> Path:
    """A small WeatherBench2-like store as xarray writes it (Zarr v2, consolidated):
    ``temperature`` (time, level, latitude, longitude) on ``levels`` with a ``level``
    coordinate, ``2m_temperature`` (time, latitude, longitude), a static ``land_sea_mask``;
    6-hourly from 2020-01-01, 5x8 grid, one step a chunk."""
    import pandas as pd
    import xarray as xr

    rng = np.random.default_rng(seed)
    lat, lon = np.linspace(90, -90, 5), np.arange(0, 360, 45.0)
    shape = (n_times, len(levels), 5, 8)
    ds = xr.Dataset(
        {"temperature": (("time", "level", "latitude", "longitude"),
                         (200 + 10 * rng.standard_normal(shape)).astype("float32")),
         "2m_temperature": (("time", "latitude", "longitude"),
                            (280 + 5 * rng.standard_normal((n_times, 5, 8))).astype("float32")),
         "land_sea_mask": (("latitude", "longitude"),
                           (rng.random((5, 8)) > 0.5).astype("float32"))},
        coords={"time": pd.date_range("2020-01-01", periods=n_times, freq="6h"),
                "level": np.array(levels, dtype="int64"), "latitude": lat, "longitude": lon})
    enc = {v: {"chunks": (1, *ds[v].shape[1:])} for v in ("temperature", "2m_temperature")}
    ds.to_zarr(path, zarr_format=2, consolidated=True, encoding=enc)
    return path
