"""Synthetic ERA5-like Zarr stores: the one writer that the demo, ``bench --sweep`` and
``benchmarks/`` share, so they all measure the same kind of data.

The fields are smooth synoptic-scale waves with a daily and a seasonal cycle, plus small
noise. blosc-zstd compresses them about as well as real reanalysis; pure noise or constants
would make decoding look too slow or too fast.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

VARIABLES = ("t2m", "u10", "v10", "msl")
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
            raise ValueError(f"variables must be some of {', '.join(VARIABLES)}; got "
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
        raise FileExistsError(f"{str(path)!r} exists and is not a Zarr store; give a new path "
                              "(only a Zarr store is ever replaced)")
    shutil.rmtree(path)


def write_store(path: str | Path, spec: DemoSpec, *, compressors: Any = None,
                zarr_format: int = 3, progress: bool = True) -> Path:
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

    def dims(*names: str) -> dict[str, Any]:  # zarr v2 has no dimension names
        return {"dimension_names": names} if zarr_format == 3 else {}

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
    t = g.create_array("time", shape=(spec.n_times,), chunks=(spec.n_times,), dtype="int64",
                       attributes={"units": "hours since 2000-01-01", "calendar": "standard"},
                       **dims("time"))
    t[:] = np.arange(spec.n_times, dtype=np.int64) * 6
    for name, n in (("lat", spec.n_lat), ("lon", spec.n_lon)):
        c = g.create_array(name, shape=(n,), dtype="float32", **dims(name))
        c[:] = (np.linspace(-90, 90, n) if name == "lat"
                else np.linspace(0, 360, n, endpoint=False)).astype(np.float32)
