"""One rank of a reader-group job, run by test_read_groups under torchrun (CPU, gloo).

Every rank builds the loader with ``read_group``, serves one epoch, and saves what it got
(its part of each variable, each batch's samples) and what ``gather_grid`` rebuilt inside
its group from the parts, in ``OUT/rank<r>.npz`` and ``OUT/rank<r>.json``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch.distributed as dist

import insitubatch_nodes as ib


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--store", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--read-group", type=int, default=2)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, g = dist.get_rank(), args.read_group
    group = ib.read_groups(g)
    src = ib.open_source(args.store)
    manifest = ib.split_by_chunk(src, (1.0,))
    loader = ib.build_loader(src, manifest, "train", batch_size=4, block_chunks=2, seed=3,
                             read_group=g, uneven="none", workers=0)
    arrays: dict[str, np.ndarray] = {}
    samples = []
    for k, batch in enumerate(loader):
        samples.append(batch["sample_index"].tolist())
        for name, axis in sorted(loader.grid_axes.items()):
            part = batch[name]
            arrays[f"part/{name}/{k}"] = part.numpy()
            # t: the axis from the end, parts' lengths found by a collective; z: the stored
            # axis with the lengths given
            whole = (ib.gather_grid(part, group, axis=loader.grid_axis) if name == "t" else
                     ib.gather_grid(part, group, axis=axis,
                                    sizes=ib.balanced_sizes(src.variable(name).shape[axis], g)))
            arrays[f"whole/{name}/{k}"] = whole.numpy()
    out = Path(args.out)
    np.savez(out / f"rank{rank}.npz", **arrays)
    part = loader.grid_part
    (out / f"rank{rank}.json").write_text(json.dumps({
        "samples": samples, "grid_part": [part.start, part.stop], "axes": loader.grid_axes,
        "axis": loader.grid_axis}))
    loader.shutdown()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
