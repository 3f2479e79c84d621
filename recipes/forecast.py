"""Recipe: forecast t+1 from (t-1, t) on the demo store, normalized, with a time split.

    python recipes/forecast.py --store demo-data/era5.zarr --epochs 3

Samples are time windows (``SampleWindow(history=2, lead=(1,))``); the split is by dates,
with a gap so that no target of the training period is an input of the validation period;
statistics come from the training period only; the four variables are stacked as channels.
Prints train and validation loss per epoch. (Make the store with ``scripts/demo`` first, or
pass ``--make-store`` to write it.)
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import insitubatch_nodes as ib
from insitubatch_nodes.demo import VARIABLES, DemoSpec, make_demo_store


class Forecaster(nn.Module):
    """Residual CNN: the next state is the current one plus a learned increment."""

    def __init__(self, channels: int, history: int, width: int = 24) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(channels * history, width, 3, padding=1), nn.GELU(),
            nn.Conv2d(width, width, 3, padding=1), nn.GELU(),
            nn.Conv2d(width, channels, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, history, C, y, x)
        return x[:, -1] + self.net(x.flatten(1, 2))


def run_epoch(model: nn.Module, loader: ib.InSituLoader, opt: torch.optim.Optimizer | None,
              ) -> float:
    total, n = 0.0, 0
    model.train(opt is not None)
    for batch in loader:
        x, y = batch["channels"], batch["target/channels"][:, 0]
        with torch.set_grad_enabled(opt is not None):
            loss = nn.functional.mse_loss(model(x), y)
        if opt is not None:
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        total += loss.item() * len(x)
        n += len(x)
    return total / max(n, 1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", default="demo-data/era5.zarr")
    p.add_argument("--make-store", action="store_true", help="write the demo store first")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--train", nargs=2, default=["2000-01", "2000-04"], metavar=("FROM", "TO"))
    p.add_argument("--val", nargs=2, default=["2000-05", "2000-06"], metavar=("FROM", "TO"))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.make_store:
        make_demo_store(args.store, DemoSpec.for_size(300))

    torch.manual_seed(args.seed)
    window = ib.SampleWindow(history=2, lead=(1,))
    source = ib.open_source(args.store, variables=list(VARIABLES), sample_dim="time")
    split = ib.split_by_coordinate(source, {"train": tuple(args.train), "val": tuple(args.val)},
                                   window=window)
    stats = ib.compute_stats(source, split, "train")
    # One config for both loaders: same samples, channels and normalisation.
    config = ib.LoaderConfig(
        sampling=ib.SamplingConfig(batch_size=args.batch_size, block_chunks=8, seed=args.seed),
        sample=ib.SampleConfig(steps=window, stats=stats, channels=tuple(VARIABLES)),
    )
    train = ib.build_loader(source, split, "train", config)
    val = ib.build_loader(source, split, "val", config)
    model = Forecaster(len(VARIABLES), window.history)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    print(f"train {split.n_samples_in('train')} / val {split.n_samples_in('val')} anchors; "
          f"gap {split.gap} steps between them")
    with train, val:
        for epoch in range(args.epochs):
            t0 = time.perf_counter()
            tl = run_epoch(model, train, opt)
            vl = run_epoch(model, val, None)
            print(f"epoch {epoch}: train loss {tl:.4f} | val loss {vl:.4f} | "
                  f"{time.perf_counter() - t0:.1f} s | waited for data "
                  f"{100 * train.stats().starvation:.0f}%", flush=True)


if __name__ == "__main__":
    main()
