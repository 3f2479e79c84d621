"""GPU decode vs CPU decode, per codec, and the loader end to end with each.

Run on demand (never as a test), from the repository root::

    .venv/bin/python -m benchmarks.bench_gpu_decode              # CUDA machine, ~2 minutes
    .venv/bin/python -m benchmarks.bench_gpu_decode --cpu-smoke  # no GPU: the CPU rows, and
                                                                 # the GPU code path run with
                                                                 # the numcodecs stand-in

For each codec (blosc with zstd and with lz4 streams, zstd, lz4, gzip) one float32
ERA5-like variable, (n, 181, 360) in (8, 181, 360) chunks (2 MB decoded), is written once;
its chunk files are read into memory so that only decoding is timed:

- ``cpu``: ``ChunkDecoder`` (the loader's CPU decode) over every chunk on a pool of
  ``--threads`` threads, as the fetcher's decode pool runs it;
- ``gpu``: ``WindowDecoder`` + ``NvcompFrameDecoder`` over windows of ``--block-chunks``
  chunks: host frame checks, packing into pinned memory, one host-to-device copy of the
  compressed bytes, one batched nvCOMP decode, stripe assembly, stream synchronise.

Both report decoded GB/s; the ratio is gpu / cpu from the same run. Then, with ``--loader``
(default on CUDA), one epoch of ``build_loader(device="cuda")`` with ``decode="cpu"`` and
``decode="gpu"`` (samples/s, batches on the GPU either way). blosc frames are laid out on the
host, their streams decoded by nvCOMP and unshuffled on the GPU (``io/blosc_frame.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numcodecs
import numpy as np
import torch
import zarr.codecs as zc

import insitubatch_nodes as ib
from insitubatch_nodes import synthetic
from insitubatch_nodes.bench.common import one_epoch_at_a_time, print_machine, write_json
from insitubatch_nodes.io.decode import decoder_for
from insitubatch_nodes.io.device_chain import DeviceChain, device_chain_for
from insitubatch_nodes.io.device_decode import NvcompFrameDecoder, StripeFrames, WindowDecoder
from insitubatch_nodes.io.reader import StripeReader

CODECS: dict[str, dict[str, Any]] = {
    "blosc": dict(zarr_format=3, compressors=zc.BloscCodec(cname="zstd", clevel=5,
                                                           shuffle="shuffle")),
    "blosc-lz4": dict(zarr_format=3, compressors=zc.BloscCodec(cname="lz4", clevel=5,
                                                               shuffle="shuffle")),
    "zstd": dict(zarr_format=3, compressors=zc.ZstdCodec(level=3)),
    "lz4": dict(zarr_format=2, compressors=numcodecs.LZ4()),
    "gzip": dict(zarr_format=3, compressors=zc.GzipCodec(level=5)),
}


def write_store(path: Path, codec: str, n_times: int, time_chunk: int) -> Path:
    """One ERA5-like ``t2m`` (``synthetic.write_store``) compressed with ``codec``."""
    spec = synthetic.DemoSpec(n_times=n_times, n_lat=181, n_lon=360, time_chunk=time_chunk,
                              variables=("t2m",), coords=False)
    kw = CODECS[codec]
    return synthetic.write_store(path, spec, compressors=kw["compressors"],
                                 zarr_format=kw["zarr_format"], progress=False)


def chunk_frames(reader: StripeReader) -> list[bytes]:
    frames = []
    for i in range(reader.geom.n_sample_chunks):
        key = reader.chunk_key((i, 0, 0))
        data = reader._read_file(key)
        if data is None:  # write_store writes every chunk
            raise FileNotFoundError(f"chunk {key!r} of {reader.source_url} is not stored")
        frames.append(data)
    return frames


def bench_cpu(reader: StripeReader, frames: list[bytes], threads: int, repeats: int) -> float:
    dec = decoder_for(reader.arr)
    assert dec is not None
    outs = [np.empty(reader.geom.stripe_shape, reader.geom.dtype) for _ in range(threads)]

    def work(i: int) -> None:
        dec.decode_into(frames[i], outs[i % threads])

    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(work, range(min(len(frames), 2 * threads))))  # warm up
        for _ in range(repeats):
            t0 = time.perf_counter()
            list(pool.map(work, range(len(frames))))
            best = min(best, time.perf_counter() - t0)
    return len(frames) * reader.chunk_nbytes / best / 1e9


def bench_device(reader: StripeReader, frames: list[bytes], decoder: Any, block: int,
                 repeats: int) -> float:
    chain = device_chain_for(reader.arr)
    assert isinstance(chain, DeviceChain)
    wd = WindowDecoder(decoder, [reader], {0: chain})
    windows = [[StripeFrames(0, i, [frames[i]]) for i in range(s, min(s + block, len(frames)))]
               for s in range(0, len(frames), block)]

    def one_pass() -> None:
        for w in windows:
            for st in w:  # the host checks the fetcher runs on every frame
                frame = st.frames[0]
                assert frame is not None  # chunk_frames made every frame
                chain.check(frame, reader.chunk_nbytes)
            wd.decode(w)

    one_pass()  # warm up: codecs, pinned staging, caching allocator
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        one_pass()
        best = min(best, time.perf_counter() - t0)
    return len(frames) * reader.chunk_nbytes / best / 1e9


def profile_device(reader: StripeReader, frames: list[bytes], decoder: Any, block: int,
                   top: int) -> str:
    """cProfile of ``bench_device``'s passes (warm): where the host time of the device path
    goes, by cumulative time."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    bench_device(reader, frames, decoder, block, 2)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def bench_loader(path: Path, decode: str, block: int, batch: int) -> float:
    src = ib.open_source(path)
    m = ib.split_by_chunk(src, (1.0,))
    with ib.build_loader(src, m, "train", batch_size=batch, block_chunks=block,
                         device="cuda", decode=decode, **one_epoch_at_a_time()) as loader:
        for _ in loader:  # warm-up epoch: page cache, allocator, codecs
            pass
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        n = sum(len(b["sample_index"]) for b in loader)
        torch.cuda.synchronize()
        return n / (time.perf_counter() - t0)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_gpu_decode", description=__doc__.splitlines()[0])
    p.add_argument("--codecs", nargs="+", default=list(CODECS), choices=list(CODECS))
    p.add_argument("--n-times", type=int, default=768, help="samples per store (2 MB each)")
    p.add_argument("--time-chunk", type=int, default=8)
    p.add_argument("--block-chunks", type=int, default=16)
    p.add_argument("--threads", type=int, default=min(4, os.cpu_count() or 2),
                   help="CPU decode threads (the loader's default)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--loader", action=argparse.BooleanOptionalAction, default=None,
                   help="also time one loader epoch per decode (default: on CUDA)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="no GPU: time the GPU code path with the numcodecs stand-in")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="also print the N functions taking most cumulative time in the "
                        "device path, per codec (cProfile)")
    p.add_argument("--dir", type=Path, default=Path("bench-out/gpu-decode"))
    p.add_argument("--out", type=Path, default=Path("bench-out/gpu-decode.json"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.cpu_smoke:
        print("bench_gpu_decode: no CUDA device here; pass --cpu-smoke to time the CPU rows "
              "and run the GPU code path with the numcodecs stand-in.")
        return 0
    if cuda:
        decoder: Any = NvcompFrameDecoder("cuda")
        label = "gpu"
    else:
        from insitubatch_nodes.testing.host_frames import HostFrameDecoder

        decoder, label = HostFrameDecoder(), "stand-in"
    machine = print_machine()
    report: dict[str, Any] = {"machine": machine, "args": {k: str(v) for k, v in
                                                          vars(args).items()}, "codecs": {}}
    print(f"\ndecode only, {args.n_times} x (181, 360) float32 in {args.time_chunk}-sample "
          f"chunks, best of {args.repeats} (decoded GB/s):")
    print(f"  {'codec':<9} {'ratio':>6} {'cpu':>8} {label:>9}   compressed/decoded")
    for codec in args.codecs:
        path = write_store(args.dir / f"{codec}.zarr", codec, args.n_times, args.time_chunk)
        src = ib.open_source(path)
        reader = StripeReader(src.arrays[0], src.variables[0], str(path))
        frames = chunk_frames(reader)
        row: dict[str, Any] = {"ratio_compressed": sum(map(len, frames))
                               / (len(frames) * reader.chunk_nbytes)}
        row["cpu_gb_per_s"] = bench_cpu(reader, frames, args.threads, args.repeats)
        if isinstance(device_chain_for(reader.arr), DeviceChain):
            row[f"{label}_gb_per_s"] = bench_device(reader, frames, decoder, args.block_chunks,
                                                    args.repeats)
            row["device_vs_cpu"] = row[f"{label}_gb_per_s"] / row["cpu_gb_per_s"]
        if cuda and (args.loader is None or args.loader):
            row["loader_cpu_decode_samples_per_s"] = bench_loader(path, "cpu",
                                                                  args.block_chunks,
                                                                  args.batch_size)
            row["loader_gpu_decode_samples_per_s"] = bench_loader(path, "gpu",
                                                                  args.block_chunks,
                                                                  args.batch_size)
        report["codecs"][codec] = row
        dev = row.get(f"{label}_gb_per_s")
        print(f"  {codec:<9} {row.get('device_vs_cpu', float('nan')):6.2f} "
              f"{row['cpu_gb_per_s']:8.2f} {dev if dev is not None else float('nan'):9.2f}"
              f"   {row['ratio_compressed']:.2f}"
              + ("" if dev is not None else "   (no device decoder: CPU fallback)"))
        if args.profile and dev is not None:
            print(profile_device(reader, frames, decoder, args.block_chunks, args.profile))
        if "loader_gpu_decode_samples_per_s" in row:
            print(f"         loader epoch: decode=cpu "
                  f"{row['loader_cpu_decode_samples_per_s']:,.0f} samples/s, decode=gpu "
                  f"{row['loader_gpu_decode_samples_per_s']:,.0f} samples/s")
    write_json(args.out, report)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
