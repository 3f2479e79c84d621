"""The demo: write a synthetic ERA5-like Zarr store and train a tiny model from it in place.

``python -m insitubatch_nodes.demo --help``. The store is what the benchmarks and recipes
use too: smooth fields plus noise (so compression behaves like real reanalysis), several
variables on (time, lat, lon), blosc-zstd, chunks of ``time_chunk`` steps along time.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zarr
import zarr.codecs as zc

VARIABLES = ("t2m", "u10", "v10", "msl")


@dataclass(frozen=True)
class DemoSpec:
    """Size and layout of the demo store."""

    n_times: int
    n_lat: int = 121
    n_lon: int = 240
    time_chunk: int = 12
    seed: int = 0

    @property
    def nbytes(self) -> int:
        return len(VARIABLES) * self.n_times * self.n_lat * self.n_lon * 4

    @classmethod
    def for_size(cls, size_mb: float, **kw: int) -> DemoSpec:
        probe = cls(n_times=1, **kw)
        n = max(probe.time_chunk, int(size_mb * 1e6 / probe.nbytes))
        return cls(n_times=n, **kw)


def _fields(spec: DemoSpec, t0: int, t1: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Smooth synoptic-scale waves with a daily and seasonal cycle, plus small noise."""
    hours = (np.arange(t0, t1, dtype=np.float32) * 6.0)[:, None, None]
    lat = np.linspace(-90, 90, spec.n_lat, dtype=np.float32)[None, :, None]
    lon = np.linspace(0, 360, spec.n_lon, endpoint=False, dtype=np.float32)[None, None, :]
    rlat, rlon = np.deg2rad(lat), np.deg2rad(lon)
    season = np.sin(2 * np.pi * hours / (24 * 365.25))
    wave = np.sin(3 * rlon - 2 * np.pi * hours / 120.0) * np.cos(rlat) ** 2
    shape = (t1 - t0, spec.n_lat, spec.n_lon)

    def noise(scale: float) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float32)

    t2m = 288 - 35 * np.abs(np.sin(rlat)) + 10 * season * np.sin(rlat) + 4 * wave
    t2m = t2m + 2 * np.cos(rlon - 2 * np.pi * hours / 24.0) * np.cos(rlat)
    u10 = 8 * np.cos(2 * rlat) + 5 * wave
    v10 = 5 * np.cos(3 * rlon - 2 * np.pi * hours / 120.0) * np.cos(rlat)
    msl = 101325 + 1500 * wave - 800 * np.sin(rlat) ** 2
    return {
        "t2m": (t2m + noise(0.5)).astype(np.float32),
        "u10": (u10 + noise(0.7)).astype(np.float32),
        "v10": (v10 + noise(0.7)).astype(np.float32),
        "msl": (msl + noise(30.0)).astype(np.float32),
    }


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


def make_demo_store(path: str | Path, spec: DemoSpec, *, progress: bool = True) -> Path:
    """Write the store at ``path`` (replacing a Zarr store there) and return the path."""
    path = Path(path)
    clear_store(path)
    g = zarr.open_group(path, mode="w", zarr_format=3)
    dims = ("time", "lat", "lon")
    codec = zc.BloscCodec(cname="zstd", clevel=5, shuffle="shuffle")
    arrays = {
        name: g.create_array(name, shape=(spec.n_times, spec.n_lat, spec.n_lon),
                             chunks=(spec.time_chunk, spec.n_lat, spec.n_lon), dtype="float32",
                             compressors=codec, dimension_names=dims)
        for name in VARIABLES
    }
    time_arr = g.create_array("time", shape=(spec.n_times,), chunks=(spec.n_times,),
                              dtype="int64", dimension_names=("time",),
                              attributes={"units": "hours since 2000-01-01",
                                          "calendar": "standard"})
    time_arr[:] = np.arange(spec.n_times, dtype=np.int64) * 6
    for name, n in (("lat", spec.n_lat), ("lon", spec.n_lon)):
        c = g.create_array(name, shape=(n,), dtype="float32", dimension_names=(name,))
        c[:] = (np.linspace(-90, 90, n) if name == "lat"
                else np.linspace(0, 360, n, endpoint=False)).astype(np.float32)
    rng = np.random.default_rng(spec.seed)
    starts = range(0, spec.n_times, spec.time_chunk)
    if progress:
        from tqdm import tqdm

        starts = tqdm(starts, desc="writing demo store", unit="chunk", file=sys.stderr)
    for t0 in starts:
        t1 = min(t0 + spec.time_chunk, spec.n_times)
        for name, data in _fields(spec, t0, t1, rng).items():
            arrays[name][t0:t1] = data
    return path


def _build_model():
    import torch.nn as nn

    # Pool first so the demo measures the loader, not a 2-core convolution.
    return nn.Sequential(
        nn.AvgPool2d(4), nn.Conv2d(3, 16, 3, padding=1), nn.GELU(), nn.Conv2d(16, 1, 3, padding=1),
    )


def train(path: str | Path, *, batch_size: int = 32, block_chunks: int = 16, epochs: int = 1,
          seed: int = 0, max_inflight: int = 32) -> dict[str, float]:
    """Train the tiny model (t2m from winds and pressure) and report the data rate."""
    import torch
    from tqdm import tqdm

    import insitubatch_nodes as ib

    torch.manual_seed(seed)
    source = ib.open_source(path, variables=list(VARIABLES))
    manifest = ib.split_by_chunk(source, fractions=(0.9, 0.1, 0.0), seed=seed)
    loader = ib.build_loader(source, manifest, "train", batch_size=batch_size,
                             block_chunks=block_chunks, seed=seed, max_inflight=max_inflight)
    model = _build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mean = torch.tensor([0.0, 0.0, 101325.0]).view(1, 3, 1, 1)
    std = torch.tensor([8.0, 5.0, 1500.0]).view(1, 3, 1, 1)
    n_train = manifest.n_samples_in("train")
    n_batches = -(-n_train // batch_size)
    report: dict[str, float] = {}
    with loader:
        for epoch in range(epochs):
            waited = samples = 0.0
            loss_val = float("nan")
            start = time.perf_counter()
            it = iter(loader)
            bar = tqdm(total=n_batches, desc=f"epoch {epoch}", unit="batch", file=sys.stderr)
            while True:
                t0 = time.perf_counter()
                try:
                    batch = next(it)
                except StopIteration:
                    waited += time.perf_counter() - t0
                    break
                waited += time.perf_counter() - t0
                x = (torch.stack([batch["u10"], batch["v10"], batch["msl"]], 1) - mean) / std
                # Target: t2m on the model's 4x coarser grid.
                y = torch.nn.functional.avg_pool2d(((batch["t2m"] - 288.0) / 20.0)[:, None], 4)
                pred = model(x)
                loss = torch.nn.functional.mse_loss(pred, y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                samples += len(batch["sample_index"])
                loss_val = loss.item()
                bar.update(1)
                bar.set_postfix(loss=f"{loss_val:.4f}")
            bar.close()
            wall = time.perf_counter() - start
            mb = samples * source.sample_nbytes / 1e6
            report = {"epoch": epoch, "samples": samples, "seconds": wall,
                      "samples_per_s": samples / wall, "mb_per_s": mb / wall,
                      "starvation": waited / wall, "loss": loss_val}
            print(f"epoch {epoch}: {int(samples)} samples in {wall:.1f} s | "
                  f"{samples / wall:,.0f} samples/s | {mb / wall:,.0f} MB/s decoded | "
                  f"waited for data {100 * waited / wall:.1f}% of the time | "
                  f"loss {loss_val:.4f}")
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="insitubatch-demo", description=__doc__.splitlines()[0])
    p.add_argument("--path", default="demo-data/era5.zarr", help="where to write the store")
    p.add_argument("--size-mb", type=float, default=300.0, help="decoded size of the store")
    p.add_argument("--time-chunk", type=int, default=12, help="time steps per chunk (8-24)")
    p.add_argument("--reuse", action="store_true", help="train on an existing store at --path")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--block-chunks", type=int, default=16)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.size_mb <= 0:
        p.error(f"--size-mb must be > 0, got {args.size_mb}")
    path = Path(args.path)
    if not (args.reuse and path.exists()):
        spec = DemoSpec.for_size(args.size_mb, time_chunk=args.time_chunk, seed=args.seed)
        t0 = time.perf_counter()
        make_demo_store(path, spec)
        print(f"wrote {path} ({spec.nbytes / 1e6:,.0f} MB decoded, {spec.n_times} steps of "
              f"{len(VARIABLES)} variables on {spec.n_lat}x{spec.n_lon}) in "
              f"{time.perf_counter() - t0:.1f} s")
    train(path, batch_size=args.batch_size, block_chunks=args.block_chunks, epochs=args.epochs,
          seed=args.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
