"""Recipe: DDP training with torchrun, checkpoints every N steps, exact (and elastic) resume.

Every rank reads its own share of each epoch straight from the store; no coordinator. Run
on CPU with the gloo backend (make the store first with ``scripts/demo``):

    torchrun --nproc_per_node=2 recipes/ddp_torchrun.py --store demo-data/era5.zarr --stop-after 6
    torchrun --nproc_per_node=2 recipes/ddp_torchrun.py --store demo-data/era5.zarr --resume
    torchrun --nproc_per_node=3 recipes/ddp_torchrun.py --store demo-data/era5.zarr --resume

The checkpoint holds the model, the optimizer and the loader state of *every* rank. Resumed on
the same number of ranks, each rank continues exactly where it was; on another number, the
ranks' states are merged and the rest of the epoch is re-dealt, so no sample of the epoch is
lost or repeated, wherever in the epoch the job stopped. ``--record DIR`` writes the sample
indices of every step, one file per rank.

``--uneven`` is the loader's policy for ranks whose shares of an epoch differ in size. DDP
needs every rank to take the same number of steps: ``pad`` (default) repeats a few samples
of a short rank, ``drop`` leaves a few out; ``none`` serves every sample exactly once and
keeps the steps equal here instead: a rank whose share is done takes zero-weight steps (its
gradient is zero, as under torch's ``Join``) until the last rank is done.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import insitubatch_nodes as ib


def lockstep(batches: Iterable[dict]) -> Iterator[dict | None]:
    """This rank's batches, then ``None`` while any other rank still has some: with
    uneven="none" shares differ, and every rank must keep meeting DDP's all-reduce and the
    checkpoint's gather until the last one is done."""
    it = iter(batches)
    while True:
        batch = next(it, None)
        busy = torch.tensor([batch is not None], dtype=torch.int64)
        dist.all_reduce(busy)  # how many ranks still have a batch
        if not busy.item():
            return
        yield batch


def shut_down() -> None:
    """Leave the process group together: every rank waits at a barrier, then destroys it.
    A rank that tears gloo down while another is still leaving its last collective can
    abort the other at exit (seen once in CI: "terminate called without an active
    exception" on rank 1 after the job had finished)."""
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", default="demo-data/era5.zarr")
    p.add_argument("--checkpoint", default="demo-data/ddp-checkpoint.pt")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--block-chunks", type=int, default=8)
    p.add_argument("--every", type=int, default=5, help="checkpoint every N steps")
    p.add_argument("--stop-after", type=int, default=None, help="simulate a crash after N steps")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--record", default=None, help="directory for per-rank sample_index logs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--uneven", choices=["pad", "drop", "none"], default="pad",
                   help="unequal shares: pad (repeat a few samples), drop (leave a few out), "
                        "or none (each sample exactly once; finished ranks take zero-weight "
                        "steps until all are done)")
    args = p.parse_args()
    if args.resume and not Path(args.checkpoint).is_file():
        p.error(f"--resume: there is no checkpoint at {args.checkpoint!r}; run once without "
                "--resume to write one (every --every steps), or give its path with --checkpoint")

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)

    source = ib.open_source(args.store, variables=["t2m", "u10", "v10", "msl"])
    manifest = ib.split_by_chunk(source, fractions=(0.9, 0.1, 0.0), seed=args.seed)
    # rank/world_size come from the process group; uneven="pad" or "drop" gives every rank
    # the same number of steps, so DDP's all-reduce never waits for a rank that has finished.
    loader = ib.build_loader(source, manifest, "train", batch_size=args.batch_size,
                             block_chunks=args.block_chunks, seed=args.seed,
                             uneven=args.uneven)
    height, width = source.variables[0].shape[1:]
    model = DistributedDataParallel(nn.Sequential(
        nn.AvgPool2d(4), nn.Conv2d(3, 8, 3, padding=1), nn.GELU(), nn.Conv2d(8, 1, 3, padding=1)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    step = 0
    if args.resume:
        ckpt = torch.load(args.checkpoint, weights_only=False)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        states = ckpt["loader_states"]
        if len(states) == world:
            loader.load_state_dict(states[rank])  # the same ranks: exact continuation
        else:
            loader.load_state_dict(ib.merge_rank_states(states))  # elastic
        step = ckpt["step"]
        if rank == 0:
            print(f"resumed at step {step} from {len(states)} ranks onto {world}", flush=True)

    record = None
    if args.record:
        Path(args.record).mkdir(parents=True, exist_ok=True)
        record = open(Path(args.record) / f"rank{rank}.jsonl", "a")  # noqa: SIM115

    offset = torch.tensor([0.0, 0.0, 101325.0]).view(1, 3, 1, 1)
    scale = torch.tensor([8.0, 5.0, 1500.0]).view(1, 3, 1, 1)
    with loader:
        while True:
            batches = iter(loader)
            if loader.epoch >= args.epochs:
                break
            for batch in (lockstep(batches) if args.uneven == "none" else batches):
                if batch is None:  # this rank's share is done, another rank's is not
                    x, y = torch.zeros(1, 3, height, width), torch.zeros(1, 1, height // 4,
                                                                         width // 4)
                else:
                    x = (torch.stack([batch["u10"], batch["v10"], batch["msl"]], 1)
                         - offset) / scale
                    y = nn.functional.avg_pool2d(((batch["t2m"] - 288.0) / 20.0)[:, None], 4)
                loss = nn.functional.mse_loss(model(x), y) * (batch is not None)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                step += 1
                if record is not None and batch is not None:
                    record.write(json.dumps({"step": step, "epoch": loader.epoch,
                                             "samples": batch["sample_index"].tolist()}) + "\n")
                    record.flush()
                if step % args.every == 0:
                    states = [None] * world
                    dist.all_gather_object(states, loader.state_dict())
                    if rank == 0:
                        tmp = args.checkpoint + ".tmp"
                        torch.save({"model": model.module.state_dict(),
                                    "optimizer": opt.state_dict(), "loader_states": states,
                                    "step": step}, tmp)
                        os.replace(tmp, args.checkpoint)  # never leave a torn checkpoint
                        print(f"step {step}: loss {loss.item():.4f} (checkpoint)", flush=True)
                    dist.barrier()
                if args.stop_after is not None and step >= args.stop_after:
                    if rank == 0:
                        print(f"stopping after {step} steps", flush=True)
                    shut_down()
                    return
    if rank == 0:
        print(f"done: {step} steps", flush=True)
    shut_down()


if __name__ == "__main__":
    main()
