"""Recipe: forecast t+1 from (t-1, t), normalized, with a time split, on any store.

    python recipes/forecast.py --store demo-data/era5.zarr --epochs 3
    insitubatch make-demo wb2.zarr --layout wb2 --small && \
        python recipes/forecast.py --store wb2.zarr
    insitubatch make-demo an.zarr --layout anemoi --small && \
        python recipes/forecast.py --store an.zarr --channels 2t msl t_500
    python recipes/forecast.py --store wb2.zarr --channels temperature@500 \
        temperature@850 2m_temperature

Samples are time steps (``steps=SampleWindow(history=2, lead=(1,))``); the split is by dates
(default: the first 80% of the store's dates train, the rest validate), with a gap so that
no target of the training period is an input of the validation period; statistics come
from the training period only, per channel (each pressure level on its own; an anemoi
dataset's own stored statistics); the channels are stacked (a variable alone: every level
of it; ``temperature@500``: one level; anemoi variables by name), and only their variables
are read. The channels are checked before anything is read. The model is a
per-point residual MLP, so it runs on lat-lon grids and anemoi's flattened cells alike.
Prints what the loaders serve, then train and validation loss per epoch. (Make the store
with ``scripts/demo`` first, or pass ``--make-store`` to write the demo store.)
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import insitubatch_nodes as ib
from insitubatch_nodes.demo import VARIABLES, DemoSpec, make_demo_store


class Forecaster(nn.Module):
    """Per-point residual MLP: the next state is the current one plus a learned increment
    from every channel of every input step at that point (any spatial layout)."""

    def __init__(self, channels: int, history: int, width: int = 32) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv1d(channels * history, width, 1), nn.GELU(),
            nn.Conv1d(width, width, 1), nn.GELU(),
            nn.Conv1d(width, channels, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, history, C, *space)
        flat = x.flatten(1, 2).flatten(2)  # (batch, history * C, points)
        return x[:, -1] + self.net(flat).reshape(x[:, -1].shape)


def run_epoch(model: nn.Module, loader: ib.InSituLoader, opt: torch.optim.Optimizer | None,
              ) -> tuple[float, int]:
    """Mean loss over the epoch and the number of samples the loader served."""
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
    return total / max(n, 1), n


def default_periods(source: ib.Source) -> dict[str, tuple]:
    """The first 80% of the store's dates train, the rest validate."""
    coord = source.sample_coord
    if coord is None:
        raise SystemExit(f"{source.url} has no time coordinate: give --train and --val")
    cut = int(len(coord) * 0.8)
    return {"train": (None, coord[cut - 1]), "val": (coord[cut], None)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", default="demo-data/era5.zarr")
    p.add_argument("--make-store", action="store_true", help="write the demo store first")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--channels", "--variables", nargs="+", default=None, dest="channels",
                   help="channels to stack: a variable (every level of it), a level "
                        "(temperature@500) or an anemoi variable (2t); default: the demo's "
                        "four, else every variable of the store")
    p.add_argument("--train", nargs=2, default=None, metavar=("FROM", "TO"),
                   help="dates; 'None' leaves that end open (give --val too)")
    p.add_argument("--val", nargs=2, default=None, metavar=("FROM", "TO"))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if (args.train is None) != (args.val is None):
        p.error("give both --train and --val (or neither, for the default 80/20 split by "
                "date)")
    if args.make_store:
        make_demo_store(args.store, DemoSpec.for_size(300))

    torch.manual_seed(args.seed)
    steps = ib.SampleWindow(history=2, lead=(1,))
    source = ib.open_source(args.store)
    if args.channels:
        names = list(args.channels)
    elif source.format == "anemoi":
        names = list(source.variables[0].labels or ())
    else:
        names = [n for n in VARIABLES if n in source.names] or list(source.names)
    try:  # every name checked before the statistics' pass over the training period
        picked = ib.resolve_channels(source, names)
    except (KeyError, ValueError, TypeError) as e:
        p.error(f"--channels: {e.args[0] if e.args else e}")

    def period(dates: list[str]) -> tuple[str | None, str | None]:
        a, b = (None if d.lower() in ("none", "") else d for d in dates)
        return a, b

    periods = ({"train": period(args.train), "val": period(args.val)} if args.train
               else default_periods(source))
    splits = ib.split_by_coordinate(source, periods, steps=steps)
    # per channel (every level on its own), over the channels' variables only
    stats = (ib.dataset_stats(source) if source.format == "anemoi"
             else ib.compute_stats(source, splits, "train", progress=False,
                                   variables=sorted({c.variable for c in picked})))
    # One config for both loaders: same samples, channels and normalisation.
    config = ib.LoaderConfig(
        sampling=ib.SamplingConfig(batch_size=args.batch_size, seed=args.seed),
        sample=ib.SampleConfig(steps=steps, stats=stats, channels=tuple(names)),
    )
    train = ib.build_loader(source, splits, "train", config)
    val = ib.build_loader(source, splits, "val", config)
    print(f"{source.url}: {source.format} store, channels {names} ({len(picked)} stacked)"
          f"; split periods "
          f"{ {k: [str(v) for v in p] for k, p in periods.items()} }, gap {splits.gap} steps")
    model = Forecaster(len(picked), steps.history)  # a variable alone: one per level
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    with train, val:
        for epoch in range(args.epochs):
            t0 = time.perf_counter()
            tl, n_train = run_epoch(model, train, opt)
            vl, n_val = run_epoch(model, val, None)
            print(f"epoch {epoch}: served {n_train} train / {n_val} val samples | train loss "
                  f"{tl:.4f} | val loss {vl:.4f} | "
                  f"{time.perf_counter() - t0:.1f} s | waited for data "
                  f"{100 * train.stats().starvation:.0f}%", flush=True)


if __name__ == "__main__":
    main()
