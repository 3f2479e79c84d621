"""Recipe: compose the node graph by hand, checkpoint every N steps, resume mid-epoch.

Copy this file into your project. Run it twice to see the resume:
    python recipes/train_resume.py --store demo-data/era5.zarr --stop-after 10
    python recipes/train_resume.py --store demo-data/era5.zarr --resume
    python recipes/train_resume.py --store wb2.zarr --channels temperature@500 \
        2m_temperature --stop-after 10
The loader state is a handful of integers stored beside the model in the checkpoint; the
resumed run continues with exactly the batches the first run would have produced next.
Any store with a sample (time) axis: ``--channels`` picks what is read and stacked (a
variable alone: every level of it; ``temperature@500``: one level; an anemoi variable by
name; default: the demo's four when the store has them, else every variable it serves),
checked before anything is read. (Make the demo store first with ``scripts/demo`` or
``python -m insitubatch_nodes.demo``.)
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from torch import nn

import insitubatch_nodes as ib
from insitubatch_nodes.demo import VARIABLES
from insitubatch_nodes.io.device_decode import NvcompFrameDecoder
from insitubatch_nodes.memory.layout import Channel
from insitubatch_nodes.nodes import (
    AsyncFetchNode,
    ChunkPermuteNode,
    GatherNode,
    PinOrCudaNode,
    ReadPlanNode,
    ShuffleBufferNode,
    SplitNode,
)
from insitubatch_nodes.nodes.channels import StackChannelsNode, resolve_channels


def make_loader(source: ib.Source, manifest: ib.SplitManifest, channels: list[Channel],
                seed: int, device: torch.device, gpu_decode: bool = False) -> ib.InSituLoader:
    """The standard graph, spelled out so that any stage can be swapped for an experiment.
    ``source`` serves the channels' variables only: nothing else is read."""
    node = SplitNode(manifest, "train")
    node = ChunkPermuteNode(node, source.grid, seed=seed, block_chunks=16)
    node = ReadPlanNode(node, source.variables)
    # gpu_decode: zstd/LZ4/gzip/blosc chunks decoded by nvCOMP on the GPU (see README "GPU")
    decoder = NvcompFrameDecoder(device) if gpu_decode else None
    # batch_size: the fetch submits the windows of the first batch before those ahead.
    node = AsyncFetchNode(node, source, max_inflight=32, device_decode=decoder, batch_size=32)
    node = ShuffleBufferNode(node, source.variables, batch_size=32)
    # On CUDA the gather writes straight into PinOrCudaNode's pinned buffers: hand both the
    # same seam (only when every stage between keeps the batch's tensors, as here).
    staging = ib.StagingSeam() if device.type == "cuda" else None
    node = GatherNode(node, source.variables, staging=staging)
    node = PinOrCudaNode(node, device=device, staging=staging)
    # batch["channels"]: (batch, C, *space), stacked on the device, in the order given
    node = StackChannelsNode(node, channels)
    return ib.InSituLoader(node)


def pick_channels(p: argparse.ArgumentParser, source: ib.Source,
                  given: list[str] | None) -> list[Channel]:
    """The channels asked for (default: the demo's four when the store has them all, else
    every variable it serves), checked against the store: a mistake is a usage error."""
    if given:
        names = list(given)
    elif set(VARIABLES) <= set(source.names):
        names = list(VARIABLES)
    elif source.format == "anemoi":
        names = list(source.variables[0].labels or ())
    else:
        names = list(source.names)
    try:
        return resolve_channels(source, names)
    except (KeyError, ValueError, TypeError) as e:
        p.error(f"--channels: {e.args[0] if e.args else e}")


class PointModel(nn.Module):
    """Per-point MLP from the other channels to the first (from the first itself when it
    is the only one): runs on lat-lon grids and flattened cells alike."""

    def __init__(self, channels: int, width: int = 16) -> None:
        super().__init__()
        inputs = max(channels - 1, 1)
        self.net = nn.Sequential(nn.Conv1d(inputs, width, 1), nn.GELU(),
                                 nn.Conv1d(width, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (batch, C, points) -> (batch, 1, ...)
        return self.net(x[:, 1:] if x.shape[1] > 1 else x)


def standardize(channels: torch.Tensor) -> torch.Tensor:
    """(batch, C, *space) -> (batch, C, points), each channel standardized over the batch.
    A stand-in that needs no statistics pass: for real training normalize with the
    training split's statistics (``ib.compute_stats``, ``stats=`` of ``build_loader``)."""
    x = channels.flatten(2).float()
    mean = x.mean(dim=(0, 2), keepdim=True)
    std = x.std(dim=(0, 2), keepdim=True)
    return (x - mean) / (std + 1e-6)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", default="demo-data/era5.zarr")
    p.add_argument("--checkpoint", default="demo-data/checkpoint.pt")
    p.add_argument("--channels", "--variables", nargs="+", default=None, dest="channels",
                   help="channels to stack: a variable (every level of it), a level "
                        "(temperature@500) or an anemoi variable (2t); default: the demo's "
                        "four when the store has them, else every variable of the store")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--every", type=int, default=5, help="checkpoint every N steps")
    p.add_argument("--stop-after", type=int, default=None, help="simulate a crash after N steps")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gpu-decode", action="store_true",
                   help="decode on the GPU (needs CUDA and the gpu-cu12/gpu-cu13 extra)")
    args = p.parse_args(argv)
    if args.resume and not Path(args.checkpoint).is_file():
        p.error(f"--resume: there is no checkpoint at {args.checkpoint!r}; run once without "
                "--resume to write one (every --every steps), or give its path with --checkpoint")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    source = ib.open_source(args.store)
    channels = pick_channels(p, source, args.channels)  # before anything is read
    labels = [ch.label for ch in channels]
    ckpt = (torch.load(args.checkpoint, weights_only=False, map_location=device)
            if args.resume else None)
    if ckpt is not None and ckpt.get("channels", labels) != labels:
        p.error(f"--resume: the checkpoint was trained on channels {ckpt['channels']}, not "
                f"{labels}: give --channels {' '.join(ckpt['channels'])}")
    # serve (read, decode) the channels' variables only
    source = source.narrowed(sorted({ch.variable for ch in channels}))
    manifest_path = Path(args.checkpoint).with_suffix(".split.json")
    if args.resume and manifest_path.exists():
        manifest = ib.SplitManifest.from_json(manifest_path)
    else:
        manifest = ib.split_by_chunk(source, fractions=(0.9, 0.1, 0.0), seed=args.seed)
        manifest_path.parent.mkdir(parents=True, exist_ok=True)
        manifest.to_json(manifest_path)

    loader = make_loader(source, manifest, channels, args.seed, device, args.gpu_decode)
    print(f"{source.url}: channels {labels}")
    model = PointModel(len(channels)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = 0
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        loader.load_state_dict(ckpt["loader"])
        step = ckpt["step"]
        print(f"resumed at step {step}")

    with loader:
        while True:
            batches = iter(loader)  # one epoch; after a restore, the rest of that epoch
            if loader.epoch >= args.epochs:
                break
            for batch in batches:
                x = standardize(batch["channels"])
                loss = nn.functional.mse_loss(model(x), x[:, :1])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                step += 1
                if step % args.every == 0:
                    # write then rename: a crash mid-save leaves the last checkpoint whole
                    tmp = f"{args.checkpoint}.tmp"
                    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                                "loader": loader.state_dict(), "step": step,
                                "channels": labels}, tmp)
                    os.replace(tmp, args.checkpoint)
                    print(f"step {step}: loss {loss.item():.4f} (checkpoint saved)")
                if args.stop_after is not None and step >= args.stop_after:
                    print(f"stopping after {step} steps; rerun with --resume")
                    return
    print(f"done: {step} steps, {args.epochs} epochs")


if __name__ == "__main__":
    main()
