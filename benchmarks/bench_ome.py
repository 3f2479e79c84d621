"""OME-Zarr z-planes: this loader (``open_ome_zarr(..., sample_dim="z")``) against insitubatch
0.2.0 (``open_geometries(..., sample_axis=1)``) on the same store, in paired rounds.

Store: a (2, 256, 512, 512) uint16 ``czyx`` volume chunked (1, 32, 256, 256), one level of
an NGFF 0.5 image on Zarr v3 written by ngff-zarr (its default zstd), smooth blobs plus noise
(``--small``: (2, 64, 128, 128) chunked (1, 16, 64, 64)). A sample is one z-plane, (2, 512,
512) uint16 (1 MiB); an epoch reads every chunk once, each holding 32 planes.

insitubatch 0.2.0 needs Python >= 3.12, so it runs in its own virtual environment
(``--peer-python``; ``--make-peer-venv`` makes bench-out/venv-insitubatch-0.2.0 with the
``--python312`` interpreter and pip). Each round runs one process per loader and one for the
floor (``FLOOR``: the same work in plain numpy, no loader; the order rotating between rounds),
each timing ``--epochs`` epochs, same batch size, shuffle block and seed, the files in the page
cache. Each loader's first epoch is also given against the floor's of the same round (1: at
the floor). Three ratios of ours / the peer's samples per second,
per round and their medians: the first epoch of a process (every chunk read and decoded),
the later ones, where insitubatch 0.2.0 serves chunks its pool kept decoded from the
epoch before (its pool holds two shuffle blocks; at 16 chunks a block, this 8-chunk volume
stays whole) and this loader its stripes kept decoded (``fetch.keep_decoded``: the split
fits in one window), and all the epochs of a process together. Run on demand, never as a
test::

    .venv/bin/python -m benchmarks.bench_ome --make-peer-venv --out bench-out/ome   # ~4 min
    .venv/bin/python -m benchmarks.bench_ome --small --out /tmp/ome-bench            # seconds
    .venv/bin/python -m benchmarks.bench_ome --ours '{"in_place": true}' --rounds 3  # in place
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[1]
PEER = "insitubatch==0.2.0"
PEER_VENV = ROOT / "bench-out" / "venv-insitubatch-0.2.0"
LEVEL = "scale0/image"  # where ngff-zarr writes level 0

OURS = r"""
import json, sys, time
import insitubatch_nodes as ib
path, batch, block, epochs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
options = json.loads(sys.argv[5])  # --ours: other build_loader keywords
src = ib.open_ome_zarr(path, sample_dim="z", labels=[])
manifest = ib.split_by_chunk(src, (1.0,), names=["train"])
loader = ib.build_loader(src, manifest, "train", batch_size=batch, block_chunks=block, seed=0,
                         **options)
times, cpu, shape = [], [], None
with loader:
    for e in range(epochs + 1):
        t, c, n = time.perf_counter(), time.process_time(), 0
        for b in loader:
            n += b["image"].shape[0]
            shape = tuple(b["image"].shape)
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
print(json.dumps({"samples": n, "seconds": times, "cpu": cpu, "shape": shape}))
"""

# The floor: what any loader must do in a fresh process, in plain numpy on as many threads as
# cores, no loader around it: each chunk file read and zstd-decoded (numcodecs, as both
# loaders) into a buffer of its thread, its planes copied into memory kept for later epochs
# (z first: (z, c, y, x) per z-chunk), then batches of shuffled planes copied out of it;
# later epochs only the batch copies. Its first epoch bounds what a decode-bound first
# epoch can reach on this machine.
FLOOR = r"""
import json, os, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
import numcodecs, numpy as np, zarr
path, batch, block, epochs, level = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]),
                                     int(sys.argv[4]), sys.argv[5])
arr = zarr.open_array(f"{path}/{level}", mode="r")
(c, z, y, x), (cc, cz, cy, cx) = arr.shape, arr.chunks
assert cc == 1 and [type(k).__name__ for k in arr.compressors] == ["ZstdCodec"], arr.metadata
zstd, local = numcodecs.Zstd(), threading.local()
root = f"{path}/{level}"
grid = [(i, k, j, m) for k in range(z // cz) for i in range(c) for j in range(y // cy)
        for m in range(x // cx)]
times, cpu, kept = [], [], []

def chunk(coords):
    i, k, j, m = coords
    buf = getattr(local, "buf", None)
    if buf is None:
        buf = local.buf = np.empty((cz, cy, cx), arr.dtype)
    with open(f"{root}/{arr.metadata.encode_chunk_key(coords)}", "rb") as f:
        zstd.decode(f.read(), out=buf)
    kept[k][:, i, j * cy:(j + 1) * cy, m * cx:(m + 1) * cx] = buf

with ThreadPoolExecutor(os.cpu_count()) as pool:
    for e in range(epochs + 1):
        t, cpu0, n = time.perf_counter(), time.process_time(), 0
        if e == 0:
            kept = [np.empty((cz, c, y, x), arr.dtype) for _ in range(z // cz)]
            list(pool.map(chunk, grid))
        order = np.random.default_rng(e).permutation(z)
        for b in range(0, z, batch):
            rows = order[b:b + batch]
            out = np.empty((len(rows), c, y, x), arr.dtype)
            for r, s in enumerate(rows):
                out[r] = kept[s // cz][s % cz]
            n += len(rows)
            shape = out.shape
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - cpu0)
print(json.dumps({"samples": n, "seconds": times, "cpu": cpu, "shape": shape}))
"""

PEER_SCRIPT = r"""
import json, sys, time
import insitubatch as ib
path, batch, block, epochs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
level = sys.argv[5]
store = ib.obstore_store("file://" + path)
geoms = ib.open_geometries(store, variables=[level], sample_axis=1)  # c z y x: z-planes
manifest = ib.split_by_chunk(geoms[level], fractions=(1.0, 0.0, 0.0))
ds = ib.InSituDataset(store, manifest, geometries=geoms, batch_size=batch,
                      block_chunks=block, seed=0)
times, cpu, shape = [], [], None
for e in range(epochs + 1):
    ds.set_epoch(e)
    t, c, n = time.perf_counter(), time.process_time(), 0
    for b in ds.train:
        x = b.arrays[level]
        n += x.shape[0]
        shape = tuple(x.shape)
    times.append(time.perf_counter() - t)
    cpu.append(time.process_time() - c)
print(json.dumps({"samples": n, "seconds": times, "cpu": cpu, "shape": shape,
                  "warm_hits": ds.cache_hits, "warm_misses": ds.cache_misses}))
"""


def write_volume(path: Path, shape: tuple[int, ...], chunks: tuple[int, ...]) -> None:
    """The czyx volume as an NGFF 0.5 image (one level), by ngff-zarr."""
    import ngff_zarr as nz
    import numpy as np

    rng = np.random.default_rng(0)
    c, z, y, x = shape
    zz, yy, xx = np.ogrid[:z, :y, :x]
    base = (np.sin(zz / 9.0) * np.cos(yy / 17.0) * np.sin(xx / 23.0) * 2000 + 3000)
    data = np.empty(shape, dtype="uint16")
    for k in range(c):
        data[k] = (base * (k + 1) + rng.normal(0, 60, (z, y, x))).clip(0, 65535)
    image = nz.to_ngff_image(data, dims=("c", "z", "y", "x"),
                             scale={"z": 2.0, "y": 0.5, "x": 0.5},
                             translation={"z": 0.0, "y": 0.0, "x": 0.0})
    ms = nz.to_multiscales(image, scale_factors=[], chunks=dict(zip("czyx", chunks, strict=True)))
    nz.to_ome_zarr(str(path), ms, version="0.5")


def make_peer_venv(venv: Path, python: str) -> Path:
    """A virtual environment with insitubatch 0.2.0 (from the package index, by pip)."""
    exe = venv / "bin" / "python"
    if not exe.exists():
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(exe), "-m", "pip", "install", "-q", PEER], check=True)
    return exe


def run_one(python: str, script: str, args: list[str]) -> dict:
    res = subprocess.run([python, "-c", script, *args], capture_output=True, text=True,
                         timeout=1800, cwd=ROOT)
    if res.returncode != 0:
        raise SystemExit(f"{python} failed:\n{res.stderr[-3000:]}")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    out["first"] = out["samples"] / out["seconds"][0]  # decodes every chunk
    out["warm"] = out["samples"] / median(out["seconds"][1:])
    out["overall"] = out["samples"] * len(out["seconds"]) / sum(out["seconds"])  # a run
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench-out/ome")
    p.add_argument("--small", action="store_true", help="a small volume: a smoke run")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--epochs", type=int, default=3, help="timed epochs per process")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--block-chunks", type=int, default=16)
    p.add_argument("--ours", default="{}", metavar="JSON",
                   help='other build_loader keywords for ours, e.g. \'{"in_place": true}\' '
                        'or \'{"keep_decoded": 0}\'')
    p.add_argument("--peer-python", default=str(PEER_VENV / "bin" / "python"))
    p.add_argument("--make-peer-venv", action="store_true")
    p.add_argument("--python312", default="python3.12")
    args = p.parse_args(argv)
    if args.make_peer_venv:
        args.peer_python = str(make_peer_venv(Path(args.peer_python).parents[1],
                                              args.python312))
    try:
        if not isinstance(json.loads(args.ours), dict):
            raise ValueError("not an object")
    except ValueError as e:
        p.error(f"--ours {args.ours!r} is not a JSON object of build_loader keywords ({e})")
    if not Path(args.peer_python).exists():
        p.error(f"--peer-python {args.peer_python!r} does not exist: give a Python >= 3.12 "
                f"with {PEER} installed, or pass --make-peer-venv")
    shape, chunks = ((2, 64, 128, 128), (1, 16, 64, 64)) if args.small else (
        (2, 256, 512, 512), (1, 32, 256, 256))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    store = (out / f"volume-{'x'.join(map(str, shape))}.ome.zarr").resolve()
    if not store.exists():
        print(f"writing {store}")
        write_volume(store, shape, chunks)
    common = [str(store), str(args.batch_size), str(args.block_chunks), str(args.epochs)]
    rounds = []
    for r in range(args.rounds):
        order = ["ours", "peer", "floor"][r % 3:] + ["ours", "peer", "floor"][:r % 3]
        got = {who: (run_one(sys.executable, OURS, [*common, args.ours]) if who == "ours" else
                     run_one(sys.executable, FLOOR, [*common, LEVEL]) if who == "floor" else
                     run_one(args.peer_python, PEER_SCRIPT, [*common, LEVEL]))
               for who in order}
        ours, peer, floor = got["ours"], got["peer"], got["floor"]
        row = {"ours": ours, "peer": peer, "floor": floor,
               "first": ours["first"] / peer["first"],
               "warm": ours["warm"] / peer["warm"],
               "overall": ours["overall"] / peer["overall"],
               # the peer's CPU seconds / ours: work done, whatever the machine's load
               "first_cpu": peer["cpu"][0] / ours["cpu"][0],
               "warm_cpu": median(peer["cpu"][1:]) / median(ours["cpu"][1:]),
               # each loader's first epoch against the floor's in the same round (1: at it)
               "first_ours_to_floor": ours["first"] / floor["first"],
               "first_peer_to_floor": peer["first"] / floor["first"]}
        rounds.append(row)
        print(f"round {r}: first epoch ours {ours['first']:.0f}, insitubatch 0.2.0 "
              f"{peer['first']:.0f}, floor {floor['first']:.0f} samples/s: {row['first']:.2f}x "
              f"(ours / floor {row['first_ours_to_floor']:.2f}, the peer's "
              f"{row['first_peer_to_floor']:.2f}); warm epochs ours "
              f"{ours['warm']:.0f}, insitubatch 0.2.0 {peer['warm']:.0f} samples/s "
              f"({peer['warm_hits']} of {peer['warm_hits'] + peer['warm_misses']} z-chunks "
              f"from its pool): {row['warm']:.2f}x (batches {ours['shape']} / "
              f"{peer['shape']}); all {args.epochs + 1} epochs: {row['overall']:.2f}x; "
              f"the peer's CPU time / ours: first epoch {row['first_cpu']:.2f}x, later "
              f"{row['warm_cpu']:.2f}x", flush=True)
    summary: dict = {"store": str(store), "shape": shape, "chunks": chunks, "ours": args.ours,
                     "batch_size": args.batch_size, "block_chunks": args.block_chunks,
                     "cpus": os.cpu_count(), "machine": platform.platform(), "rounds": rounds}
    for key, what in [("first", "first epoch (every chunk decoded)"),
                      ("warm", "later epochs (both keep the decoded volume)"),
                      ("overall", f"all {args.epochs + 1} epochs of a process"),
                      ("first_cpu", "the peer's CPU seconds / ours, first epoch"),
                      ("warm_cpu", "the peer's CPU seconds / ours, later epochs"),
                      ("first_ours_to_floor", "ours / the floor, first epoch"),
                      ("first_peer_to_floor", "insitubatch 0.2.0 / the floor, first epoch")]:
        ratios = sorted(x[key] for x in rounds)
        summary[key] = {"median": median(ratios), "min": ratios[0], "max": ratios[-1]}
        who = "" if "floor" in key else "ours / insitubatch 0.2.0, "
        print(f"{who}z-planes of {shape} chunked {chunks}, "
              f"{os.cpu_count()} CPUs, {what}: median {median(ratios):.2f}x (rounds "
              f"{ratios[0]:.2f}-{ratios[-1]:.2f}x)")
    (out / "bench_ome.json").write_text(json.dumps(summary, indent=1))

if __name__ == "__main__":
    main()
