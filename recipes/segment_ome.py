"""Recipe: a small segmentation model trained on the z-planes of an OME-Zarr volume (the
image and a label image of the same planes together), stopped, then resumed exactly.

Copy this file into your project. Run it twice to see the resume:
    python recipes/segment_ome.py --stop-after 5     # writes a small volume first
    python recipes/segment_ome.py --resume
    python recipes/segment_ome.py --image cells.ome.zarr --label nuclei --level 1
The image is read as stored (NGFF 0.4 or 0.5, ``czyx`` or ``tczyx``): a sample is one
z-plane, ``batch["image"]`` is (batch, c, y, x) and ``batch[label]`` (batch, y, x); the
z coordinate of each plane (``source.sample_coord``) is its position in micrometers, from
the image's scale and translation. Without ``--image`` a (1, 32, 64, 64) volume of blobs
and their labels is written under ``--work`` with ngff-zarr (``pip install ngff-zarr``).
``--stop-after N`` saves the model, the optimizer and the loader state after N steps and
shows the batch a resumed run starts with; ``--resume`` continues from there.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np
import torch
from torch import nn

import insitubatch_nodes as ib


def write_volume(path: Path, shape: tuple[int, int, int] = (32, 64, 64), seed: int = 0) -> None:
    """A czyx image of bright blobs over noise and its ``labels/blobs`` (1 inside a blob),
    both NGFF 0.5 with two levels, z chunked by 4."""
    import ngff_zarr as nz
    import zarr

    rng = np.random.default_rng(seed)
    z, y, x = np.indices(shape)
    blobs = np.zeros(shape, dtype=bool)
    for _ in range(12):
        c = rng.uniform(0, shape)
        r = rng.uniform(4, 10)
        blobs |= ((z - c[0]) / 2) ** 2 + (y - c[1]) ** 2 + (x - c[2]) ** 2 < r**2
    image = (blobs * 600 + rng.normal(400, 120, shape)).clip(0).astype("uint16")[None]
    chunks = {"c": 1, "z": 4, "y": 64, "x": 64}
    scale, shift = {"z": 2.0, "y": 0.5, "x": 0.5}, {"z": 0.0, "y": 0.0, "x": 0.0}
    for where, data, dims, method in [
            (path, image, "czyx", nz.Methods.ITKWASM_GAUSSIAN),
            (path / "labels" / "blobs", blobs.astype("uint8"), "zyx",
             nz.Methods.ITKWASM_LABEL_IMAGE)]:
        img = nz.to_ngff_image(data, dims=tuple(dims), scale=scale, translation=shift,
                               axes_units={d: "micrometer" for d in "zyx"})
        ms = nz.to_multiscales(img, scale_factors=[{"z": 1, "y": 2, "x": 2}], method=method,
                               chunks={d: chunks[d] for d in dims})
        nz.to_ome_zarr(str(where), ms, version="0.5")
    label = zarr.open_group(path / "labels" / "blobs", mode="a")
    label.attrs["ome"] = {**label.attrs["ome"], "image-label": {
        "version": "0.5", "source": {"image": "../../"},
        "colors": [{"label-value": 1, "rgba": [255, 200, 0, 160]}]}}
    zarr.open_group(path / "labels", mode="a").attrs["ome"] = {"version": "0.5",
                                                               "labels": ["blobs"]}


class TinyUNet(nn.Module):
    """Three 3x3 convolutions and a 1x1 classifier: a stand-in for a real U-Net."""

    def __init__(self, channels: int, classes: int, width: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(channels, width, 3, padding=1), nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=2, dilation=2), nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1), nn.ReLU(),
            nn.Conv2d(width, classes, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (b, c, y, x) -> (b, classes, y, x)
        return self.net(x)


def open_volume(p: argparse.ArgumentParser, args: argparse.Namespace) -> ib.Source:
    """The image and the label image asked for, checked before anything is read: a wrong
    name or level is a usage error that says what there is."""
    try:
        return ib.open_ome_zarr(args.image, level=args.level, sample_dim="z",
                             labels=None if args.label is None else [args.label])
    except ib.InsitubatchError as e:
        p.error(f"--image {args.image}: {e}")


def label_of(source: ib.Source, p: argparse.ArgumentParser) -> str:
    names = [v.name for v in source.variables if v.name != "image"]
    if not names:
        p.error(f"--image {source.url} has no label images to train on")
    return names[0]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--image", default=None, help="OME-Zarr image (path or URL); default: a "
                   "small volume written under --work")
    p.add_argument("--label", default=None, help="label image (default: the first listed)")
    p.add_argument("--level", type=int, default=0, help="multiscale level (0: full size)")
    p.add_argument("--work", default="demo-data/segment-ome",
                   help="directory for the written volume and the checkpoint")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--stop-after", type=int, default=None, help="stop after N steps")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    work = Path(args.work)
    ckpt_path = work / "segment.pt"
    if args.resume and not ckpt_path.is_file():
        p.error(f"--resume: there is no checkpoint at {str(ckpt_path)!r}; run once with "
                "--stop-after N to write one (or give its --work directory)")
    if args.image is None:
        args.image = str(work / "blobs.ome.zarr")
        if not Path(args.image).exists():
            print(f"writing a small OME-Zarr volume to {args.image}")
            partial = Path(args.image + ".partial")  # renamed when whole
            write_volume(partial)
            os.replace(partial, args.image)

    source = open_volume(p, args)
    label = label_of(source, p)
    source = source.select(["image", label])
    print(ib.describe_ome_zarr(args.image))
    print(f"training on {source.n_samples} z-planes: image and label {label!r}")
    manifest = ib.split_by_chunk(source, (1.0,), names=["train"], seed=args.seed)
    loader = ib.build_loader(source, manifest, "train", batch_size=args.batch_size,
                             seed=args.seed)
    channels = source.variables[0].shape[1]
    model = TinyUNet(channels, classes=2)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    step = 0
    if args.resume:
        ckpt = torch.load(ckpt_path, weights_only=False)
        if (ckpt["image"], ckpt["label"], ckpt["level"]) != (args.image, label, args.level):
            p.error(f"--resume: the checkpoint trained on {ckpt['image']} label "
                    f"{ckpt['label']!r} level {ckpt['level']}; give those")
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
                x = batch["image"].float()
                x = (x - x.mean(dim=(0, 2, 3), keepdim=True)) / (
                    x.std(dim=(0, 2, 3), keepdim=True) + 1e-6)
                y = batch[label].long()
                y = y[:, 0] if y.ndim == 4 else y  # a label stored with c of size 1
                loss = nn.functional.cross_entropy(model(x), (y > 0).long())
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                step += 1
                z = source.sample_coord[batch["sample_index"].numpy()]
                print(f"step {step}: loss {loss.item():.4f} z={z.tolist()}")
                if args.stop_after is not None and step >= args.stop_after:
                    save(ckpt_path, model, opt, loader, step, args, label)
                    print(f"stopping after {step} steps; rerun with --resume")
                    after = next(batches, None)  # shown, not trained on
                    if after is not None:
                        z = source.sample_coord[after["sample_index"].numpy()]
                        print(f"next batch z={z.tolist()}")
                    return
    print(f"done: {step} steps, {args.epochs} epochs")


def save(path: Path, model: nn.Module, opt: torch.optim.Optimizer, loader: ib.InSituLoader,
         step: int, args: argparse.Namespace, label: str) -> None:
    """Model, optimizer and loader state in one file (written, then renamed: a crash while
    saving leaves the previous checkpoint whole)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                "loader": loader.state_dict(), "step": step, "image": args.image,
                "label": label, "level": args.level}, tmp)
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
