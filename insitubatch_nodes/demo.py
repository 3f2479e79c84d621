"""The demo: write a synthetic ERA5-like Zarr store and train a tiny model from it in place.

``python -m insitubatch_nodes.demo --help``. The store comes from ``synthetic.write_store``,
the writer the benchmarks and recipes use too: four variables on (time, lat, lon),
blosc-zstd, chunks of ``time_chunk`` steps along time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .synthetic import VARIABLES, DemoSpec, write_store

if TYPE_CHECKING:
    import torch

# The demo store is the synthetic store with ``DemoSpec``'s defaults: one writer for all.
make_demo_store = write_store


def _build_model() -> torch.nn.Module:
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
