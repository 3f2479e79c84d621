"""Synthetic ERA5-like Zarr stores: the one writer that the demo, ``bench --sweep`` and
``benchmarks/`` share, so they all measure the same kind of data.

Two layouts: the demo's (``write_store``: a few surface variables on (time, lat, lon)) and
WeatherBench2's ERA5 store as xarray's ``to_zarr`` writes it (``write_wb2_store``: 83
channels, Zarr v2, one time step per chunk, blosc-lz4), the layout peers are measured on.
The fields are smooth synoptic-scale waves with a daily and a seasonal cycle, plus small
noise. blosc compresses them about as well as real reanalysis; pure noise or constants
would make decoding look too slow or too fast.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypedDict

import numpy as np

from .errors import ConfigError, StoreExistsError

VARIABLES = ("t2m", "u10", "v10", "msl")
_V2_DIMS = "_ARRAY_DIMENSIONS"  # where xarray keeps a Zarr v2 array's dimension names
WRITE_BYTES = 64 * 2**20  # decoded bytes per write: whole chunks, never the whole array
_NOISE = {"t2m": 0.5, "u10": 0.7, "v10": 0.7, "msl": 30.0}


@dataclass(frozen=True)
class DemoSpec:
    """Size and layout of a synthetic store: by default the demo's four variables with their
    coordinates; benchmarks ask for one variable and no coordinates."""

    n_times: int
    n_lat: int = 121
    n_lon: int = 240
    time_chunk: int = 12
    seed: int = 0
    variables: tuple[str, ...] = VARIABLES
    coords: bool = True

    def __post_init__(self) -> None:
        unknown = [v for v in self.variables if v not in VARIABLES]
        if unknown or not self.variables:
            raise ConfigError(f"variables must be some of {', '.join(VARIABLES)}; got "
                              f"{list(self.variables)}")

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.n_times, self.n_lat, self.n_lon)

    @property
    def nbytes(self) -> int:
        """Decoded bytes of the variables (float32), coordinates aside."""
        return len(self.variables) * self.n_times * self.n_lat * self.n_lon * 4

    @classmethod
    def for_size(cls, size_mb: float, **kw: Any) -> DemoSpec:
        """The spec whose variables hold about ``size_mb`` MB decoded (one chunk at least)."""
        probe = cls(n_times=1, **kw)
        n = max(probe.time_chunk, int(size_mb * 1e6 / probe.nbytes))
        return cls(n_times=n, **kw)


def fields(spec: DemoSpec, t0: int, t1: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The spec's variables at time steps ``[t0, t1)`` (6-hourly), float32.

    Noise is drawn in ``VARIABLES`` order, only for the variables asked for, so the data for a
    seed does not depend on how the steps are split into calls.
    """
    hours = (np.arange(t0, t1, dtype=np.float32) * 6.0)[:, None, None]
    lat = np.linspace(-90, 90, spec.n_lat, dtype=np.float32)[None, :, None]
    lon = np.linspace(0, 360, spec.n_lon, endpoint=False, dtype=np.float32)[None, None, :]
    rlat, rlon = np.deg2rad(lat), np.deg2rad(lon)
    season = np.sin(2 * np.pi * hours / (24 * 365.25))
    wave = np.sin(3 * rlon - 2 * np.pi * hours / 120.0) * np.cos(rlat) ** 2
    shape = (t1 - t0, spec.n_lat, spec.n_lon)
    base: dict[str, Callable[[], np.ndarray]] = {
        "t2m": lambda: (288 - 35 * np.abs(np.sin(rlat)) + 10 * season * np.sin(rlat) + 4 * wave
                        + 2 * np.cos(rlon - 2 * np.pi * hours / 24.0) * np.cos(rlat)),
        "u10": lambda: 8 * np.cos(2 * rlat) + 5 * wave,
        "v10": lambda: 5 * np.cos(3 * rlon - 2 * np.pi * hours / 120.0) * np.cos(rlat),
        "msl": lambda: 101325 + 1500 * wave - 800 * np.sin(rlat) ** 2,
    }
    out = {}
    for name in VARIABLES:
        if name in spec.variables:
            field = base[name]()
            noise = (rng.standard_normal(shape, dtype=np.float32) * _NOISE[name]).astype(np.float32)
            out[name] = (field + noise).astype(np.float32)
    return out


def is_zarr_store(path: Path) -> bool:
    return path.is_dir() and any((path / f).exists() for f in ("zarr.json", ".zgroup", ".zarray"))


def clear_store(path: str | Path) -> None:
    """Remove the Zarr store at ``path`` so it can be written anew; anything else that is
    there is an error (a mistyped ``--path`` must never wipe a directory)."""
    path = Path(path)
    if not path.exists():
        return
    if not is_zarr_store(path):
        raise StoreExistsError(f"{str(path)!r} exists and is not a Zarr store; give a new path "
                               "(only a Zarr store is ever replaced)")
    shutil.rmtree(path)


def write_store(path: str | Path, spec: DemoSpec, *, compressors: Any = None,
                zarr_format: Literal[2, 3] = 3, progress: bool = True) -> Path:
    """Write the store at ``path`` (replacing a Zarr store there) and return the path.

    Variables are (time, lat, lon) float32 in chunks of ``time_chunk`` steps, blosc-zstd
    unless ``compressors`` says otherwise. Writes go in blocks of whole chunks (about
    ``WRITE_BYTES``), so writing never holds the whole array and small chunks are not
    written one call at a time.
    """
    import zarr

    path = Path(path)
    clear_store(path)
    if compressors is None:
        compressors = _blosc_zstd(zarr_format)
    g = zarr.open_group(path, mode="w", zarr_format=zarr_format)

    def dims(*names: str) -> dict[str, Any]:  # zarr v2 keeps them as xarray does
        if zarr_format == 3:
            return {"dimension_names": names}
        return {"attributes": {_V2_DIMS: list(names)}}

    arrays = {
        name: g.create_array(name, shape=spec.shape, chunks=(spec.time_chunk, *spec.shape[1:]),
                             dtype="float32", compressors=compressors,
                             **dims("time", "lat", "lon"))
        for name in spec.variables
    }
    if spec.coords:
        _write_coords(g, spec, dims)
    rng = np.random.default_rng(spec.seed)
    chunk_bytes = max(1, spec.nbytes // spec.n_times * spec.time_chunk)
    step = spec.time_chunk * max(1, WRITE_BYTES // chunk_bytes)
    n_chunks = -(-spec.n_times // spec.time_chunk)
    from tqdm import tqdm

    with tqdm(total=n_chunks, desc=f"writing {path.name}", unit="chunk", file=sys.stderr,
              disable=not progress) as bar:
        for b0 in range(0, spec.n_times, step):
            b1 = min(b0 + step, spec.n_times)
            parts = [fields(spec, t0, min(t0 + spec.time_chunk, b1), rng)
                     for t0 in range(b0, b1, spec.time_chunk)]  # noise drawn chunk by chunk
            for name, arr in arrays.items():
                arr[b0:b1] = np.concatenate([p[name] for p in parts])
            bar.update(len(parts))
    if zarr_format == 2:
        zarr.consolidate_metadata(path, zarr_format=2)
    return path


def _blosc_zstd(zarr_format: int) -> Any:
    """blosc-zstd, byte shuffle, level 5, in either Zarr format: one default codec for every
    synthetic store, so their decode costs compare."""
    if zarr_format == 3:
        import zarr.codecs as zc

        return zc.BloscCodec(cname="zstd", clevel=5, shuffle="shuffle")
    import numcodecs

    return numcodecs.Blosc(cname="zstd", clevel=5, shuffle=numcodecs.Blosc.SHUFFLE)


def _write_coords(g: Any, spec: DemoSpec, dims: Callable[..., dict[str, Any]]) -> None:
    """time (hours since 2000-01-01, 6-hourly), lat and lon, as CF readers expect them."""
    kw = dims("time")
    attrs = {"units": "hours since 2000-01-01", "calendar": "standard",
             **kw.pop("attributes", {})}
    t = g.create_array("time", shape=(spec.n_times,), chunks=(spec.n_times,), dtype="int64",
                       attributes=attrs, **kw)
    t[:] = np.arange(spec.n_times, dtype=np.int64) * 6
    for name, n in (("lat", spec.n_lat), ("lon", spec.n_lon)):
        c = g.create_array(name, shape=(n,), dtype="float32", **dims(name))
        c[:] = (np.linspace(-90, 90, n) if name == "lat"
                else np.linspace(0, 360, n, endpoint=False)).astype(np.float32)


# -- the WeatherBench2 layout ---------------------------------------------------------------
WB2_LEVELS = (50, 100, 150, 200, 250, 300, 400, 500, 600, 700, 850, 925, 1000)
WB2_LEVEL_VARIABLES = ("geopotential", "temperature", "u_component_of_wind",
                       "v_component_of_wind", "specific_humidity", "vertical_velocity")
WB2_SURFACE_VARIABLES = ("2m_temperature", "10m_u_component_of_wind", "10m_v_component_of_wind",
                         "mean_sea_level_pressure", "total_precipitation_6hr")
WB2_VARIABLES = WB2_LEVEL_VARIABLES + WB2_SURFACE_VARIABLES
# NaN over land, as ERA5's is (WB2Spec.sea_surface_temperature): the store's missing values
WB2_SST = "sea_surface_temperature"
WB2_TIME_UNITS = "hours since 1959-01-01"
class _Grid(TypedDict):
    n_lon: int
    n_lat: int


WB2_SMALL: _Grid = {"n_lon": 24, "n_lat": 12}  # the test preset: every channel, a tiny grid
_WB2_UNITS = {"geopotential": "m**2 s**-2", "temperature": "K", "u_component_of_wind": "m s**-1",
              "v_component_of_wind": "m s**-1", "specific_humidity": "kg kg**-1",
              "vertical_velocity": "Pa s**-1", "2m_temperature": "K",
              "10m_u_component_of_wind": "m s**-1", "10m_v_component_of_wind": "m s**-1",
              "mean_sea_level_pressure": "Pa", "total_precipitation_6hr": "m", WB2_SST: "K"}
# noise per variable, in its units (a few percent of its variation: smooth, not constant)
_WB2_NOISE = {"geopotential": 20.0, "temperature": 0.3, "u_component_of_wind": 0.8,
              "v_component_of_wind": 0.8, "specific_humidity": 1e-4, "vertical_velocity": 0.05,
              "2m_temperature": 0.5, "10m_u_component_of_wind": 0.7,
              "10m_v_component_of_wind": 0.7, "mean_sea_level_pressure": 30.0,
              "total_precipitation_6hr": 1e-3}


@dataclass(frozen=True)
class WB2Spec:
    """Size of a WeatherBench2-layout store. Every variable and all 13 levels are always
    written (83 channels): only the grid and the number of time steps shrink, so a small
    store for tests has the same layout and channel count as the real one."""

    n_times: int
    n_lon: int = 240
    n_lat: int = 121
    seed: int = 0
    # also write sea_surface_temperature, NaN over land (land_sea_mask >= 0.5) as in ERA5:
    # one more variable and channel, with missing values (make-demo --layout wb2 writes it)
    sea_surface_temperature: bool = False

    def __post_init__(self) -> None:
        for name in ("n_times", "n_lon", "n_lat"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"WB2Spec.{name} must be an integer >= 1, got {value!r}")

    @property
    def variables(self) -> tuple[str, ...]:
        return WB2_VARIABLES + ((WB2_SST,) if self.sea_surface_temperature else ())

    @property
    def channels(self) -> int:
        return (len(WB2_LEVEL_VARIABLES) * len(WB2_LEVELS) + len(WB2_SURFACE_VARIABLES)
                + self.sea_surface_temperature)

    @property
    def sample_nbytes(self) -> int:
        """Decoded bytes of one time step, every channel (float32)."""
        return self.channels * self.n_lon * self.n_lat * 4

    @property
    def nbytes(self) -> int:
        return self.n_times * self.sample_nbytes

    @classmethod
    def small(cls, n_times: int = 8, seed: int = 0) -> WB2Spec:
        """The test preset: all 83 channels on a 24 x 12 grid."""
        return cls(n_times=n_times, seed=seed, **WB2_SMALL)

    @classmethod
    def for_size(cls, size_mb: float, **kw: Any) -> WB2Spec:
        """The spec holding about ``size_mb`` MB decoded (one time step at least)."""
        probe = cls(n_times=1, **kw)
        return cls(n_times=max(1, int(size_mb * 1e6 / probe.sample_nbytes)), **kw)


def wb2_grid(spec: WB2Spec) -> tuple[np.ndarray, np.ndarray]:
    """(longitude, latitude) in degrees: WB2's equiangular grid with poles, latitude from
    -90 to 90, longitude from 0 eastwards (float64, as xarray writes them)."""
    return (np.linspace(0, 360, spec.n_lon, endpoint=False),
            np.linspace(-90, 90, spec.n_lat))


def wb2_fields(spec: WB2Spec, t0: int, t1: int) -> dict[str, np.ndarray]:
    """Every WB2 variable at time steps ``[t0, t1)`` (6-hourly), float32, lon-major:
    ``(steps, 13, lon, lat)`` with levels, ``(steps, lon, lat)`` without.

    Noise comes from one generator per time step (``(seed, step)``), so a step's values do
    not depend on how the steps are split into writes.
    """
    lon, lat = wb2_grid(spec)
    rlon = np.deg2rad(lon).astype(np.float32)[None, :, None]
    rlat = np.deg2rad(lat).astype(np.float32)[None, None, :]
    hours = (np.arange(t0, t1, dtype=np.float32) * 6.0)[:, None, None]
    phase = 2 * np.pi * hours / 120.0
    season = np.sin(2 * np.pi * hours / (24 * 365.25))
    coslat, sinlat = np.cos(rlat), np.sin(rlat)
    wave = np.sin(3 * rlon - phase) * coslat ** 2
    wave2 = np.cos(2 * rlon + 2 * rlat - 2 * np.pi * hours / 200.0) * coslat
    diurnal = np.cos(rlon - 2 * np.pi * hours / 24.0) * coslat
    p = np.asarray(WB2_LEVELS, np.float32)[None, :, None, None]
    x = np.log(1000.0 / p)  # 0 at the surface, ~3 at 50 hPa
    w, w2, s = wave[:, None], wave2[:, None], season[:, None]
    clat, slat = coslat[:, None], sinlat[:, None]
    levelled = {
        "geopotential": (9.80665 * 7400 * np.log(1013.25 / p) + (500 + 300 * x) * w
                         - 2000 * (1 + 0.3 * x) * slat ** 2),
        "temperature": (np.maximum(215.0, 288 * (p / 1013.25) ** 0.19) + 20 * clat ** 2 * p / 1000
                        - 10 + 3 * w + 5 * s * slat),
        "u_component_of_wind": (10 * np.cos(2 * rlat)[:, None] * (1 + 2 * np.exp(-((p - 250)
                                / 200) ** 2)) + 6 * w2),
        "v_component_of_wind": (6 * np.cos(3 * rlon - phase)[:, None] * clat
                                * (1 + np.exp(-((p - 300) / 250) ** 2))),
        "specific_humidity": 0.018 * (p / 1000) ** 3 * clat ** 2 * (1 + 0.2 * w) + 2e-6,
        "vertical_velocity": (0.3 * np.sin(3 * rlon - phase)[:, None] * np.sin(2 * rlat)[:, None]
                              * np.exp(-((p - 500) / 300) ** 2)),
    }
    surface = {
        "2m_temperature": (288 - 35 * np.abs(sinlat) + 10 * season * sinlat + 4 * wave
                           + 2 * diurnal),
        "10m_u_component_of_wind": 8 * np.cos(2 * rlat) + 5 * wave,
        "10m_v_component_of_wind": 5 * np.cos(3 * rlon - phase) * coslat,
        "mean_sea_level_pressure": 101325 + 1500 * wave - 800 * sinlat ** 2,
        "total_precipitation_6hr": 0.004 * (wave2 - 0.3),  # clipped at 0 below: half dry
    }
    plane = (spec.n_lon, spec.n_lat)
    noise = np.stack([np.random.default_rng((spec.seed, t)).standard_normal(
        (spec.channels, *plane), dtype=np.float32) for t in range(t0, t1)])
    out: dict[str, np.ndarray] = {}
    c = 0
    for name in WB2_VARIABLES:
        if name in levelled:
            n = len(WB2_LEVELS)
            field = np.broadcast_to(levelled[name], (t1 - t0, n, *plane))
            value = field + _WB2_NOISE[name] * noise[:, c:c + n] * (
                (p / 1000) ** 3 if name == "specific_humidity" else 1)
        else:
            n = 1
            field = np.broadcast_to(surface[name], (t1 - t0, *plane))
            value = field + _WB2_NOISE[name] * noise[:, c]
        if name in ("specific_humidity", "total_precipitation_6hr"):
            value = np.maximum(value, 0.0)
        out[name] = np.ascontiguousarray(value, dtype=np.float32)
        c += n
    return out


def wb2_sea_surface_temperature(spec: WB2Spec, t0: int, t1: int) -> np.ndarray:
    """``(steps, lon, lat)`` float32: warm at the equator, near freezing at the poles, a
    slow seasonal swing, and NaN wherever ``wb2_land_sea_mask`` is 0.5 or more (land)."""
    lon, lat = wb2_grid(spec)
    sinlat = np.sin(np.deg2rad(lat)).astype(np.float32)[None, None, :]
    hours = (np.arange(t0, t1, dtype=np.float32) * 6.0)[:, None, None]
    season = np.sin(2 * np.pi * hours / (24 * 365.25))
    noise = np.stack([np.random.default_rng((spec.seed, t, 1)).standard_normal(
        (spec.n_lon, spec.n_lat), dtype=np.float32) for t in range(t0, t1)])
    sst = 301.0 - 29.0 * sinlat ** 2 + 1.5 * season * sinlat + 0.2 * noise
    land = wb2_land_sea_mask(spec) >= 0.5
    return np.where(land[None], np.float32(np.nan), sst).astype(np.float32)


def wb2_land_sea_mask(spec: WB2Spec) -> np.ndarray:
    """A static (lon, lat) field in [0, 1]: smooth continents, sharp coasts."""
    lon, lat = (np.deg2rad(a) for a in wb2_grid(spec))
    f = (np.sin(2 * lon + 1)[:, None] * np.cos(3 * lat)[None, :]
         + 0.5 * np.sin(5 * lon)[:, None] * np.cos(lat)[None, :])
    return np.clip((f - 0.1) * 4, 0.0, 1.0).astype(np.float32)


def _blosc_lz4() -> Any:
    """WB2's codec, zarr-python 2's default: blosc lz4, level 5, byte shuffle."""
    import numcodecs

    return numcodecs.Blosc(cname="lz4", clevel=5, shuffle=numcodecs.Blosc.SHUFFLE)


def write_wb2_store(path: str | Path, spec: WB2Spec, *, progress: bool = True) -> Path:
    """Write the WeatherBench2 ERA5 layout at ``path`` (replacing a Zarr store there).

    As xarray's ``to_zarr`` writes it: Zarr v2, consolidated ``.zmetadata``, one array per
    variable with ``_ARRAY_DIMENSIONS``, dims ``(time, level, longitude, latitude)`` (WB2's
    240x121 grid is lon-major), one time step per chunk, blosc lz4 + byte shuffle, float32
    with NaN fill; int64 ``time`` (CF units, 6-hourly) and ``level``, float64 ``latitude``
    and ``longitude``, and the static ``land_sea_mask (longitude, latitude)``; with
    ``spec.sea_surface_temperature``, that variable too, NaN over land as in ERA5.
    """
    import zarr

    path = Path(path)
    clear_store(path)
    g = zarr.open_group(path, mode="w", zarr_format=2)
    plane = (spec.n_lon, spec.n_lat)

    def array(name: str, dims: tuple[str, ...], shape: tuple[int, ...],
              chunks: tuple[int, ...], dtype: str, **attrs: Any) -> Any:
        return g.create_array(name, shape=shape, chunks=chunks, dtype=dtype,
                              compressors=_blosc_lz4(),
                              fill_value=np.nan if dtype.startswith("float") else None,
                              attributes={_V2_DIMS: list(dims), **attrs})

    arrays = {}
    for name in spec.variables:
        levels = (len(WB2_LEVELS),) if name in WB2_LEVEL_VARIABLES else ()
        dims = ("time", *(("level",) if levels else ()), "longitude", "latitude")
        arrays[name] = array(name, dims, (spec.n_times, *levels, *plane),
                             (1, *levels, *plane), "float32", units=_WB2_UNITS[name])
    lon, lat = wb2_grid(spec)
    coords = {
        "time": (np.arange(spec.n_times, dtype=np.int64) * 6,
                 {"units": WB2_TIME_UNITS, "calendar": "proleptic_gregorian"}),
        "level": (np.asarray(WB2_LEVELS, np.int64),
                  {"units": "millibars", "long_name": "pressure_level"}),
        "longitude": (lon, {"units": "degrees_east", "long_name": "longitude"}),
        "latitude": (lat, {"units": "degrees_north", "long_name": "latitude"}),
    }
    for name, (values, attrs) in coords.items():
        array(name, (name,), values.shape, values.shape, str(values.dtype), **attrs)[:] = values
    mask = wb2_land_sea_mask(spec)
    array("land_sea_mask", ("longitude", "latitude"), plane, plane, "float32")[:] = mask
    step = max(1, WRITE_BYTES // spec.sample_nbytes)
    from tqdm import tqdm

    with tqdm(total=spec.n_times, desc=f"writing {path.name}", unit="step", file=sys.stderr,
              disable=not progress) as bar:
        for t0 in range(0, spec.n_times, step):
            t1 = min(t0 + step, spec.n_times)
            for name, values in wb2_fields(spec, t0, t1).items():
                arrays[name][t0:t1] = values
            if spec.sea_surface_temperature:
                arrays[WB2_SST][t0:t1] = wb2_sea_surface_temperature(spec, t0, t1)
            bar.update(t1 - t0)
    zarr.consolidate_metadata(path, zarr_format=2)
    return path


# -- anemoi datasets ---------------------------------------------------------------------
ANEMOI_VARIABLES = ("10u", "10v", "2t", "msl", "t_500", "t_850", "z_500", "z_850", "lsm")


def write_anemoi_store(path: str | Path, *, n_dates: int = 16, n_cells: int = 40,
                       variables: tuple[str, ...] = ANEMOI_VARIABLES, n_ensemble: int = 1,
                       missing: tuple[int, ...] = (), dimensions_attr: bool = True,
                       frequency_hours: int = 6, seed: int = 0) -> Path:
    """Write the layout ``anemoi-datasets create`` makes, without depending on it (it pins
    zarr 2): a Zarr v2 group with ``data (dates, variables, ensemble, cells)`` float32, one
    date per chunk, blosc lz4, NaN fill; ``dates`` datetime64[s]; ``latitudes``,
    ``longitudes``; ``mean``/``stdev``/``minimum``/``maximum``/``sums``/``squares``/
    ``count``/``has_nans`` per variable (over the dates that are not missing); root attrs
    ``variables``, ``frequency``, ``missing_dates`` (the dates at ``missing``, whose fields
    are NaN, as anemoi writes them), ``field_shape``, ``ensemble_dimension``, ``resolution``.
    ``dimensions_attr=False`` drops ``_ARRAY_DIMENSIONS`` as ``anemoi-datasets copy`` does.
    The value of (date t, variable v, member e, cell c) is ``1000 v + t + c / 1000 + e / 10``
    plus noise, so a test can tell any two apart."""
    import zarr

    path = Path(path)
    clear_store(path)
    rng = np.random.default_rng(seed)
    nv = len(variables)
    t = np.arange(n_dates, dtype=np.float64)[:, None, None, None]
    v = np.arange(nv, dtype=np.float64)[None, :, None, None]
    e = np.arange(n_ensemble, dtype=np.float64)[None, None, :, None]
    c = np.arange(n_cells, dtype=np.float64)[None, None, None, :]
    data = (1000 * v + t + c / 1000 + e / 10
            + rng.standard_normal((n_dates, nv, n_ensemble, n_cells)) * 0.01).astype("float32")
    data[list(missing)] = np.nan
    start = np.datetime64("2020-01-01T00:00:00", "s")
    dates = start + np.arange(n_dates) * np.timedelta64(frequency_hours, "h").astype("m8[s]")
    present = np.setdiff1d(np.arange(n_dates), np.asarray(missing, dtype=np.int64))
    x = data[present].astype(np.float64)
    g = zarr.open_group(path, mode="w", zarr_format=2)
    dims: dict[str, Any] = {"_ARRAY_DIMENSIONS": ["time", "variable", "ensemble", "cell"]}
    g.create_array("data", shape=data.shape, chunks=(1, nv, n_ensemble, n_cells),
                   dtype="float32", compressors=_blosc_lz4(), fill_value=np.nan,
                   attributes=dims if dimensions_attr else {})[:] = data

    def small(name: str, values: np.ndarray, dim: str) -> None:
        attrs: dict[str, Any] = {"_ARRAY_DIMENSIONS": [dim]} if dimensions_attr else {}
        g.create_array(name, shape=values.shape, chunks=values.shape, dtype=values.dtype,
                       compressors=_blosc_lz4(), attributes=attrs)[:] = values

    small("dates", dates, "time")
    small("latitudes", np.linspace(-90, 90, n_cells), "cell")
    small("longitudes", np.linspace(0, 360, n_cells, endpoint=False), "cell")
    axes = (0, 2, 3)
    stats = {"mean": x.mean(axis=axes), "stdev": x.std(axis=axes),
             "minimum": x.min(axis=axes), "maximum": x.max(axis=axes),
             "sums": x.sum(axis=axes), "squares": (x ** 2).sum(axis=axes),
             "count": np.full(nv, x.shape[0] * n_ensemble * n_cells, dtype=np.int64),
             "has_nans": np.zeros(nv, dtype=bool)}
    for name, values in stats.items():
        small(name, values, "variable")
    g.attrs.update({
        "variables": list(variables), "frequency": f"{frequency_hours}h",
        "missing_dates": [str(dates[i]) for i in missing], "field_shape": [n_cells],
        "ensemble_dimension": n_ensemble, "resolution": "synthetic", "flatten_grid": True,
        "start_date": str(dates[0]), "end_date": str(dates[-1]), "version": "0.30",
    })
    zarr.consolidate_metadata(path, zarr_format=2)
    return path
