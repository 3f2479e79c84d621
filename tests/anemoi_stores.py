"""Stores in anemoi-datasets' layout (``anemoi-datasets create``), written with zarr alone, and
read back by hand for the tests of ``open_anemoi`` (tests/test_anemoi_spec.py).

The layout: a Zarr v2 group with ``data (dates, variables, ensemble, cells)`` float32 one
date a chunk (NaN fill; a missing date's field is NaN), ``dates`` datetime64[s],
``latitudes`` / ``longitudes``, the per-variable statistics ``mean`` / ``stdev`` /
``minimum`` / ``maximum`` (over the dates that are not missing) and the root attributes
``variables``, ``frequency``, ``missing_dates``, ``field_shape``, ``resolution``,
``start_date``, ``end_date``. The value of (date t, variable v, member e, cell c) is
``offset + 1000 v + hours since 2020-01-01 / 6 + c / 1000 + e / 10``: a store (its offset),
a variable, a date and a cell are told apart by value alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numcodecs
import numpy as np
import zarr

EPOCH = np.datetime64("2020-01-01T00:00:00", "s")


def write_anemoi(path: Path | str, variables: tuple[str, ...], start: str, n_dates: int, *,
                 frequency_hours: int = 6, missing: tuple[int, ...] = (), offset: float = 0.0,
                 n_cells: int = 12, n_ensemble: int = 1, dates_chunk: int | None = None) -> Path:
    """An anemoi dataset of ``n_dates`` dates from ``start``, ``frequency_hours`` apart,
    with ``missing`` (indices) listed in ``missing_dates``; its chunking along the dates is
    one date a chunk (``dates_chunk`` changes it, as ``anemoi-datasets copy`` may)."""
    path = Path(path)
    step = np.timedelta64(frequency_hours, "h").astype("m8[s]")
    dates = np.datetime64(start, "s") + np.arange(n_dates) * step
    hours = ((dates - EPOCH) / np.timedelta64(1, "h")).astype(np.float64)
    nv = len(variables)
    data = (offset + 1000 * np.arange(nv)[None, :, None, None]
            + (hours / 6)[:, None, None, None]
            + np.arange(n_cells)[None, None, None, :] / 1000
            + np.arange(n_ensemble)[None, None, :, None] / 10).astype("float32")
    data[list(missing)] = np.nan
    blosc = numcodecs.Blosc(cname="lz4", clevel=5, shuffle=numcodecs.Blosc.SHUFFLE)
    g = zarr.open_group(path, mode="w", zarr_format=2)
    g.create_array("data", shape=data.shape, chunks=(dates_chunk or 1, nv, n_ensemble, n_cells),
                   dtype="float32", compressors=blosc, fill_value=np.nan,
                   attributes={"_ARRAY_DIMENSIONS": ["time", "variable", "ensemble", "cell"]}
                   )[:] = data
    kept = np.delete(data, list(missing), axis=0).astype(np.float64)
    axes = (0, 2, 3)
    small = {"dates": dates, "latitudes": np.linspace(-60, 60, n_cells),
             "longitudes": np.linspace(0, 330, n_cells),
             "mean": kept.mean(axis=axes), "stdev": kept.std(axis=axes),
             "minimum": kept.min(axis=axes), "maximum": kept.max(axis=axes)}
    for name, values in small.items():
        g.create_array(name, shape=values.shape, chunks=values.shape, dtype=values.dtype,
                       compressors=blosc)[:] = values
    g.attrs.update({
        "variables": list(variables), "frequency": f"{frequency_hours}h",
        "missing_dates": [str(dates[i]) for i in missing], "field_shape": [n_cells],
        "ensemble_dimension": n_ensemble, "resolution": "o12", "flatten_grid": True,
        "start_date": str(dates[0]), "end_date": str(dates[-1]), "version": "0.30",
    })
    zarr.consolidate_metadata(path, zarr_format=2)
    return path


@dataclass(frozen=True)
class Stored:
    """What a store holds, read with zarr directly."""

    data: np.ndarray  # (dates, variables, ensemble, cells)
    dates: np.ndarray  # datetime64[s]
    variables: tuple[str, ...]
    missing_dates: tuple[np.datetime64, ...]
    statistics: dict[str, np.ndarray]

    def column(self, name: str) -> np.ndarray:
        """The values of variable ``name`` over all dates: (dates, ensemble, cells)."""
        return self.data[:, self.variables.index(name)]


def read_anemoi(path: Path | str) -> Stored:
    g = zarr.open_group(path, mode="r")
    return Stored(data=np.asarray(g["data"][:]), dates=np.asarray(g["dates"][:]),
                  variables=tuple(g.attrs["variables"]),
                  missing_dates=tuple(np.datetime64(d, "s") for d in g.attrs["missing_dates"]),
                  statistics={k: np.asarray(g[k][:])
                              for k in ("mean", "stdev", "minimum", "maximum")})
