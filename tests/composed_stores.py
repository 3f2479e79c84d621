"""Test stores for composed sources (issue 42), written by xarray in the layouts people
train on: a WeatherBench2 / ARCO-ERA5-like pressure-level store (Zarr v2, 13 levels a
chunk), a single-level store (Zarr v3, 4 steps a chunk), an ERA5 invariants store (static
fields only) and periods of one archive to concatenate (ERA5 and ERA5T).

Every writer returns the ``xr.Dataset`` it wrote, so a test compares what a loader serves
with ``xr.merge`` / ``xr.concat`` of the same datasets, that is with xarray's own values.

Values make a wrong row obvious: a time-dependent field at time ``t`` is
``step(t) * 10_000 + offset + level_index * 200 + cell`` where ``step(t)`` counts 6-hour
steps from 2020-01-01 (so two periods of one archive never hold the same value, and a
row read from the wrong member, time or level shows in its thousands), ``cell`` the grid
point (0..127) and ``offset`` a per-variable fraction. All values are exact in float32.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import xarray as xr

N_LAT, N_LON = 8, 16
LATITUDE = np.linspace(90.0, -90.0, N_LAT)  # descending, as ERA5 / WB2 store it
LONGITUDE = np.arange(N_LON) * (360.0 / N_LON)
LEVELS = np.array([50, 100, 150, 200, 250, 300, 400, 500, 600, 700, 850, 925, 1000],
                  dtype="int64")  # WeatherBench2's 13 pressure levels
PERIOD_LEVELS = np.array([500, 850, 1000], dtype="int64")
ORIGIN = np.datetime64("2020-01-01T00", "ns")
STEP = np.timedelta64(6, "h")


def six_hourly(start: str, periods: int) -> pd.DatetimeIndex:
    """``periods`` 6-hourly times from ``start``."""
    return pd.date_range(start, periods=periods, freq="6h")


def _steps(times: Sequence[Any]) -> np.ndarray:
    t = np.asarray(pd.DatetimeIndex(times).values, dtype="datetime64[ns]")
    return ((t - ORIGIN) / STEP).astype(np.float64)


def _cells() -> np.ndarray:
    return np.arange(N_LAT * N_LON, dtype=np.float64).reshape(N_LAT, N_LON)


def _field(times: Sequence[Any], offset: float, levels: int | None = None) -> np.ndarray:
    """(time, [level,] lat, lon) float32 values: step * 10_000 + offset + level * 200 + cell."""
    steps = _steps(times)[:, None, None]
    if levels is None:
        v = steps * 10_000 + offset + _cells()[None]
    else:
        lv = np.arange(levels, dtype=np.float64)[None, :, None, None]
        v = steps[:, None] * 10_000 + offset + lv * 200 + _cells()[None, None]
    out = v.astype(np.float32)
    assert np.array_equal(out.astype(np.float64), v), "a value not exact in float32"
    return out


def _coords(times: Sequence[Any], levels: np.ndarray | None = None) -> dict[str, Any]:
    coords: dict[str, Any] = {"time": pd.DatetimeIndex(times), "latitude": LATITUDE,
                              "longitude": LONGITUDE}
    if levels is not None:
        coords["level"] = levels
    return coords


def _write(ds: xr.Dataset, path: Path | str, zarr_format: int,
           chunks: Mapping[str, tuple[int, ...]]) -> xr.Dataset:
    encoding = {name: {"chunks": c} for name, c in chunks.items()}
    ds.to_zarr(path, mode="w", zarr_format=zarr_format, encoding=encoding,
               consolidated=zarr_format == 2)
    return ds


def write_pressure_levels(path: Path | str, times: Sequence[Any], zarr_format: int = 2,
                          steps_per_chunk: int = 1) -> xr.Dataset:
    """WeatherBench2 / ARCO-ERA5-like: ``temperature`` and ``geopotential`` (time, level,
    latitude, longitude) on 13 pressure levels, the 13 levels in one chunk,
    ``steps_per_chunk`` times a chunk; Zarr v2 consolidated as WB2 is by default."""
    dims = ("time", "level", "latitude", "longitude")
    n = len(LEVELS)
    ds = xr.Dataset({"temperature": (dims, _field(times, 0.25, n)),
                     "geopotential": (dims, _field(times, 0.5, n))},
                    coords=_coords(times, LEVELS))
    chunk = (steps_per_chunk, n, N_LAT, N_LON)
    return _write(ds, path, zarr_format, {"temperature": chunk, "geopotential": chunk})


def write_single_level(path: Path | str, times: Sequence[Any], zarr_format: int = 3,
                       steps_per_chunk: int = 4) -> xr.Dataset:
    """Single-level fields: ``2m_temperature`` and ``total_precipitation`` (time, latitude,
    longitude), ``steps_per_chunk`` times a chunk; Zarr v3 unless told."""
    dims = ("time", "latitude", "longitude")
    ds = xr.Dataset({"2m_temperature": (dims, _field(times, 5000.75)),
                     "total_precipitation": (dims, _field(times, 7000.125))},
                    coords=_coords(times))
    chunk = (steps_per_chunk, N_LAT, N_LON)
    return _write(ds, path, zarr_format, {"2m_temperature": chunk, "total_precipitation": chunk})


def invariants_dataset() -> xr.Dataset:
    """The values ``write_invariants`` writes: a 0/1 land-sea mask and the surface geopotential
    (cell * 10 + 3)."""
    dims = ("latitude", "longitude")
    cells = _cells()
    return xr.Dataset(
        {"land_sea_mask": (dims, (cells % 3 == 0).astype(np.float32)),
         "geopotential_at_surface": (dims, (cells * 10 + 3).astype(np.float32))},
        coords={"latitude": LATITUDE, "longitude": LONGITUDE})


def write_invariants(path: Path | str, zarr_format: int = 2) -> xr.Dataset:
    """An ERA5 invariants store: ``land_sea_mask`` and ``geopotential_at_surface``
    (latitude, longitude) and their coordinates, nothing along time."""
    ds = invariants_dataset()
    ds.to_zarr(path, mode="w", zarr_format=zarr_format, consolidated=zarr_format == 2)
    return ds


def write_period(path: Path | str, times: Sequence[Any], zarr_format: int = 3,
                 chunk: int = 4) -> xr.Dataset:
    """One period of an archive (ERA5, ERA5T), to concatenate with others: ``temperature``
    (time, level, latitude, longitude) on 3 levels and ``2m_temperature`` (time, latitude,
    longitude), ``chunk`` times a chunk. Periods of one archive have the same variables,
    levels and grid; their values follow their times, so they never repeat."""
    ds = xr.Dataset(
        {"temperature": (("time", "level", "latitude", "longitude"),
                         _field(times, 0.25, len(PERIOD_LEVELS))),
         "2m_temperature": (("time", "latitude", "longitude"), _field(times, 5000.75))},
        coords=_coords(times, PERIOD_LEVELS))
    return _write(ds, path, zarr_format,
                  {"temperature": (chunk, len(PERIOD_LEVELS), N_LAT, N_LON),
                   "2m_temperature": (chunk, N_LAT, N_LON)})


@contextmanager
def on_moto(path: Path | str, key: str | None = None,
            bucket: str = "data") -> Iterator[tuple[str, dict[str, Any]]]:
    """Serve the local store at ``path`` on S3 through moto on 127.0.0.1 (the suite's
    ``testing.s3server``, with signature checks): yields ``(url, storage_options)`` to open
    it with, ``s3://<bucket>/<key>`` (``key``: the store's folder name unless given);
    the server stops on exit."""
    from insitubatch_nodes.testing.s3server import serving

    local = Path(path)
    key = key or local.name
    with serving(local.parent, bucket, {key: local}) as server:
        yield f"s3://{bucket}/{key}", server.options()


def sample_rows(ds: xr.Dataset, name: str, coord_values: np.ndarray) -> np.ndarray:
    """``ds[name]`` at the given times (datetime64 values), as a numpy array: what a batch's
    rows must equal."""
    return ds[name].sel(time=np.asarray(coord_values, dtype="datetime64[ns]")).values
