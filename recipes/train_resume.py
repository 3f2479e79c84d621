"""Recipe: compose the node graph by hand, checkpoint every N steps, resume mid-epoch.

Copy this file into your project. Run it twice to see the resume:
    python recipes/train_resume.py --store demo-data/era5.zarr --stop-after 10
    python recipes/train_resume.py --store demo-data/era5.zarr --resume
The loader state is a handful of integers stored beside the model in the checkpoint; the
resumed run continues with exactly the batches the first run would have produced next.
(Make the store first with ``scripts/demo`` or ``python -m insitubatch_nodes.demo``.)
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from torch import nn

import insitubatch_nodes as ib
from insitubatch_nodes.io.device_decode import NvcompFrameDecoder
from insitubatch_nodes.nodes import (
    AsyncFetchNode,
    ChunkPermuteNode,
    GatherNode,
    PinOrCudaNode,
    ReadPlanNode,
    ShuffleBufferNode,
    SplitNode,
)


def make_loader(source: ib.Source, manifest: ib.SplitManifest, seed: int,
                device: torch.device, gpu_decode: bool = False) -> ib.InSituLoader:
    """The standard graph, spelled out so that any stage can be swapped for an experiment."""
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
    return ib.InSituLoader(node)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", default="demo-data/era5.zarr")
    p.add_argument("--checkpoint", default="demo-data/checkpoint.pt")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--every", type=int, default=5, help="checkpoint every N steps")
    p.add_argument("--stop-after", type=int, default=None, help="simulate a crash after N steps")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gpu-decode", action="store_true",
                   help="decode on the GPU (needs CUDA and the gpu-cu12/gpu-cu13 extra)")
    args = p.parse_args()
    if args.resume and not Path(args.checkpoint).is_file():
        p.error(f"--resume: there is no checkpoint at {args.checkpoint!r}; run once without "
                "--resume to write one (every --every steps), or give its path with --checkpoint")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    source = ib.open_source(args.store, variables=["t2m", "u10", "v10", "msl"])
    manifest_path = Path(args.checkpoint).with_suffix(".split.json")
    if args.resume and manifest_path.exists():
        manifest = ib.SplitManifest.from_json(manifest_path)
    else:
        manifest = ib.split_by_chunk(source, fractions=(0.9, 0.1, 0.0), seed=args.seed)
        manifest_path.parent.mkdir(parents=True, exist_ok=True)
        manifest.to_json(manifest_path)

    loader = make_loader(source, manifest, args.seed, device, args.gpu_decode)
    model = nn.Sequential(nn.AvgPool2d(4), nn.Conv2d(3, 16, 3, padding=1), nn.GELU(),
                          nn.Conv2d(16, 1, 3, padding=1)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = 0
    if args.resume:
        ckpt = torch.load(args.checkpoint, weights_only=False, map_location=device)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        loader.load_state_dict(ckpt["loader"])
        step = ckpt["step"]
        print(f"resumed at step {step}")

    scale = torch.tensor([8.0, 5.0, 1500.0], device=device).view(1, 3, 1, 1)
    offset = torch.tensor([0.0, 0.0, 101325.0], device=device).view(1, 3, 1, 1)
    with loader:
        while True:
            batches = iter(loader)  # one epoch; after a restore, the rest of that epoch
            if loader.epoch >= args.epochs:
                break
            for batch in batches:
                x = (torch.stack([batch["u10"], batch["v10"], batch["msl"]], 1) - offset) / scale
                y = nn.functional.avg_pool2d(((batch["t2m"] - 288.0) / 20.0)[:, None], 4)
                loss = nn.functional.mse_loss(model(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                step += 1
                if step % args.every == 0:
                    # write then rename: a crash mid-save leaves the last checkpoint whole
                    tmp = f"{args.checkpoint}.tmp"
                    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                                "loader": loader.state_dict(), "step": step}, tmp)
                    os.replace(tmp, args.checkpoint)
                    print(f"step {step}: loss {loss.item():.4f} (checkpoint saved)")
                if args.stop_after is not None and step >= args.stop_after:
                    print(f"stopping after {step} steps; rerun with --resume")
                    return
    print(f"done: {step} steps, {args.epochs} epochs")


if __name__ == "__main__":
    main()
