"""GPU benchmark: the loader's pinned ring vs a plain pinned copy, and GPU starvation.

Run on demand on a CUDA machine, never as a test, from the repository root::

    .venv/bin/python -m benchmarks.bench_gpu                 # both parts, ~1-2 minutes
    .venv/bin/python -m benchmarks.bench_gpu --part h2d      # only the copy benchmark
    .venv/bin/python -m benchmarks.bench_gpu --cpu-smoke     # no GPU: exercise the code paths

1. **H2D** (issue 7 target: the pinned path >= 0.8x a plain pinned ``copy_``). In the loader,
   ``GatherNode`` writes each batch straight into the pinned ring slot that ``PinOrCudaNode``
   leased for it; ``pin_or_cuda_ring`` reproduces that (the producer hands over tensors
   over the slot, as the gather does) and measures the ring, events and side-stream copies;
   the reference, in the same run, copies one pinned buffer of the same size to a
   preallocated device buffer in a loop. For context: pageable batches through the ring
   (one host memcpy each, the path for batches a transform made), the memcpy alone,
   ``pin_memory()`` per batch and a pageable ``.to("cuda")``.
2. **Starvation** (target: < 5 % at a data rate the CPU path can feed). A synthetic model step
   of ``--step-ms`` (``torch.cuda._sleep`` calibrated with CUDA events, or chained matmuls)
   consumes batches from ``build_loader(device="cuda")`` on an ERA5-like demo store. The
   batch size is chosen from the loader's measured rate so the data rate is ~70 % of what the
   CPU path can produce (or give ``--batch-size``). Reported: the GPU idle fraction
   (1 - sum of the steps' GPU time / wall time) and the fraction of wall time the loop spent
   in ``next()``; the same loop with ``device=None`` + a blocking ``.to("cuda")`` is the
   comparison, and, where nvCOMP is installed, the ring with ``decode="gpu"`` too. The CPU
   is allowed ``--lag`` steps ahead of the GPU, as a real loop is.

GPU decode vs CPU decode is ``benchmarks/bench_gpu_decode.py``.
Exits 0 with a message on a machine without CUDA.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torchdata.nodes import BaseNode

import insitubatch_nodes as ib
from insitubatch_nodes.bench.common import print_machine, write_json
from insitubatch_nodes.io.device_decode import gpu_decode_available
from insitubatch_nodes.memory.staging import StagingSeam
from insitubatch_nodes.synthetic import VARIABLES, DemoSpec, write_store

H2D_TARGET = 0.8
STARVATION_TARGET = 0.05


# -- H2D ------------------------------------------------------------------------------------

class _Cycle(BaseNode):
    """Yields ``n`` batches cycling through a few premade ones (no work per item)."""

    def __init__(self, batches: list[dict[str, torch.Tensor]], n: int) -> None:
        super().__init__()
        self.batches, self.n = batches, n

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        self.i = 0

    def next(self) -> dict[str, torch.Tensor]:
        if self.i >= self.n:
            raise StopIteration
        self.i += 1
        return self._item(self.batches[(self.i - 1) % len(self.batches)])

    def _item(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return batch

    def get_state(self) -> dict:
        return {"i": self.i}


class _InSlot(_Cycle):
    """Yields ``n`` batches made in the ring slot ``PinOrCudaNode`` leased, as ``GatherNode``
    does (through the ``StagingSeam`` both share); the rows are not rewritten, so only the
    pinned path itself is timed."""

    def __init__(self, like: dict[str, torch.Tensor], n: int, seam: StagingSeam) -> None:
        super().__init__([like], n)
        self.seam = seam

    def _item(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for k, v in batch.items():
            slot = self.seam.array(k, tuple(v.shape), v.numpy().dtype)
            if slot is None:
                raise RuntimeError(f"bench_gpu: no ring slot for {k!r}: the seam is not "
                                   "attached to a PinOrCudaNode on a CUDA device")
            out[k] = torch.from_numpy(slot)
        return out


def in_slot_ring(like: dict[str, torch.Tensor], n: int, device: torch.device,
                 ring_size: int, ops: Any = None) -> ib.PinOrCudaNode:
    """``PinOrCudaNode`` over batches made in its own ring slots (``ops``: tests' fake)."""
    seam = StagingSeam()
    return ib.PinOrCudaNode(_InSlot(like, n, seam), device=device, ring_size=ring_size,
                            ops=ops, staging=seam)


def make_batches(batch_mb: float, count: int) -> list[dict[str, torch.Tensor]]:
    """Pageable batches shaped like the demo's: four (B, lat, lon) float32 fields."""
    lat, lon = DemoSpec.n_lat, DemoSpec.n_lon
    sample = lat * lon * 4
    b = max(1, int(batch_mb * 1e6 / (sample * len(VARIABLES))))
    out = []
    for i in range(count):
        batch = {v: torch.full((b, lat, lon), float(i + j), dtype=torch.float32)
                 for j, v in enumerate(VARIABLES)}
        batch["sample_index"] = torch.arange(i * b, (i + 1) * b, dtype=torch.int64)
        out.append(batch)
    return out


def _nbytes(batch: dict[str, torch.Tensor]) -> int:
    return sum(v.numel() * v.element_size() for v in batch.values())


def _gpu_seconds(fn: Callable[[], None]) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def bench_h2d(args: argparse.Namespace) -> dict[str, Any]:
    dev = torch.device("cuda")
    batches = make_batches(args.h2d_batch_mb, 6)
    nb = _nbytes(batches[0])
    n = max(8, int(args.h2d_total_gb * 1e9 / nb))
    total = n * nb
    res: dict[str, Any] = {"batch_bytes": nb, "batches": n}

    # reference: one pinned buffer -> one preallocated device buffer, copy_ in a loop
    src = torch.empty(nb, dtype=torch.uint8, pin_memory=True)
    src.copy_(torch.cat([v.reshape(-1).view(torch.uint8) for v in batches[0].values()]))
    dst = torch.empty(nb, dtype=torch.uint8, device=dev)

    def plain() -> None:
        for _ in range(n):
            dst.copy_(src, non_blocking=True)

    def ring_path() -> None:
        node = in_slot_ring(batches[0], n, dev, args.ring_size)
        node.reset(None)
        for _ in node:
            pass
        assert node.bytes_copied == 0 and node.bytes_in_place == n * nb, "not in the slot"

    def ring_pageable() -> None:
        node = ib.PinOrCudaNode(_Cycle(batches, n), device=dev, ring_size=args.ring_size)
        node.reset(None)
        for _ in node:
            pass

    def staging_only() -> None:
        slot = torch.empty(nb, dtype=torch.uint8, pin_memory=True)
        for i in range(n):
            off = 0
            for v in batches[i % len(batches)].values():
                k = v.numel() * v.element_size()
                slot[off:off + k].view(v.dtype).view(v.shape).copy_(v)
                off += k

    def pin_per_batch() -> None:
        for i in range(n):
            for v in batches[i % len(batches)].values():
                v.pin_memory().to(dev, non_blocking=True)

    def pageable() -> None:
        for i in range(n):
            for v in batches[i % len(batches)].values():
                v.to(dev)

    cases = [("plain_pinned_copy", plain), ("pin_or_cuda_ring", ring_path),
             ("ring_from_pageable", ring_pageable), ("staging_memcpy_only", staging_only),
             ("pin_memory_per_batch", pin_per_batch),
             ("pageable_to_cuda", pageable)]
    for name, fn in cases:
        fn()  # warm up: allocator, pinned pools, page faults
        secs = min(_gpu_seconds(fn) for _ in range(args.repeats))
        res[name] = {"seconds": secs, "gb_per_s": total / secs / 1e9}
    res["ratio"] = res["pin_or_cuda_ring"]["gb_per_s"] / res["plain_pinned_copy"]["gb_per_s"]
    res["pass"] = res["ratio"] >= H2D_TARGET
    print(f"\nH2D, {n} batches of {nb / 1e6:.1f} MB ({total / 1e9:.2f} GB), ring_size "
          f"{args.ring_size}, best of {args.repeats}:")
    for name, _ in cases:
        print(f"  {name:<22} {res[name]['gb_per_s']:7.2f} GB/s")
    print(f"  ring / plain = {res['ratio']:.2f} (target >= {H2D_TARGET}): "
          f"{'PASS' if res['pass'] else 'FAIL'}")
    return res


# -- starvation -----------------------------------------------------------------------------

class Clock:
    """Marks on the GPU stream (CUDA events) or, in the CPU smoke run, on the host."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def wait(self, mark: Any) -> None:
        if self.cuda:
            mark.synchronize()

    def ms(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3


def make_step(kind: str, step_ms: float, cuda: bool, var: str) -> Callable[[dict], None]:
    """A synthetic model step of ~``step_ms`` that reads the batch (so it waits for it)."""
    if not cuda:
        def cpu_step(batch: dict) -> None:
            batch[var].sum()
            time.sleep(step_ms / 1e3)
        return cpu_step
    acc = torch.zeros((), device="cuda")

    def timed(fn: Callable[[], None], reps: int = 5) -> float:
        fn()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / reps

    if kind == "sleep":
        probe = 10_000_000
        ms = timed(lambda: torch.cuda._sleep(probe))
        cycles = int(probe * step_ms / ms)

        def sleep_step(batch: dict) -> None:
            acc.add_(batch[var].float().mean())
            torch.cuda._sleep(cycles)
        return sleep_step

    n = 2048
    w = torch.randn(n, n, device="cuda") / n**0.5
    ms = timed(lambda: w @ w)
    reps = max(1, round(step_ms / ms))

    def matmul_step(batch: dict) -> None:
        h = w * (1 + 0 * batch[var].float().mean())
        for _ in range(reps):
            h = h @ w
        acc.add_(h[0, 0])
    return matmul_step


def train_loop(batches: Iterator[dict], step: Callable[[dict], None], steps: int, warmup: int,
               lag: int, clock: Clock, to_device: Callable[[dict], dict] | None) -> dict:
    """Run ``warmup + steps`` steps; measure the last ``steps``. The CPU runs at most
    ``lag`` steps ahead of the GPU (it waits on the mark of step k - lag)."""
    marks: collections.deque = collections.deque()
    if steps < 1:
        raise ValueError(f"train_loop: steps must be >= 1, got {steps}")
    busy_ms = waited = 0.0
    pairs: list[tuple[Any, Any]] = []  # (mark before, mark after) each step
    t_start = time.perf_counter()  # set again when the measured steps begin
    for i in range(warmup + steps):
        if i == warmup:
            if marks:
                clock.wait(marks[-1])
            t_start = time.perf_counter()
            waited, pairs = 0.0, []
        t0 = time.perf_counter()
        batch = next(batches)
        if to_device is not None:
            batch = to_device(batch)
        waited += time.perf_counter() - t0
        a = clock.mark()
        step(batch)
        b = clock.mark()
        pairs.append((a, b))
        marks.append(b)
        if len(marks) > lag:
            clock.wait(marks.popleft())
    clock.wait(marks[-1])
    wall = time.perf_counter() - t_start
    busy_ms = sum(clock.ms(a, b) for a, b in pairs)
    return {"steps": steps, "wall_s": wall, "gpu_busy_s": busy_ms / 1e3,
            "step_ms": busy_ms / steps, "gpu_idle_fraction": max(0.0, 1 - busy_ms / 1e3 / wall),
            "next_wait_fraction": waited / wall}


def forever(loader: ib.InSituLoader) -> Iterator[dict]:
    while True:
        yield from loader


def open_store(args: argparse.Namespace) -> tuple[ib.Source, ib.SplitManifest]:
    path = Path(args.path)
    if not (args.reuse and (path / "zarr.json").exists()):
        spec = DemoSpec.for_size(args.size_mb, time_chunk=args.time_chunk)
        t0 = time.perf_counter()
        write_store(path, spec, progress=False)
        print(f"wrote {path} ({spec.nbytes / 1e6:,.0f} MB decoded) in "
              f"{time.perf_counter() - t0:.1f} s")
    source = ib.open_source(path, variables=list(VARIABLES))
    return source, ib.split_by_chunk(source, fractions=(1.0,), seed=0)


def loader_rate(source: ib.Source, manifest: ib.SplitManifest, device: str | None,
                batch_size: int, args: argparse.Namespace) -> float:
    """Samples/s the loader alone delivers (after one warm-up window)."""
    with ib.build_loader(source, manifest, "train", batch_size=batch_size,
                         block_chunks=args.block_chunks, device=device, rank=0,
                         world_size=1) as loader:
        it = forever(loader)
        for _ in range(max(4, args.block_chunks * source.grid.chunk_size // batch_size)):
            next(it)
        n = max(20, args.rate_batches)
        t0 = time.perf_counter()
        for _ in range(n):
            b = next(it)
        if device is not None:
            torch.cuda.synchronize()
        del b
        return n * batch_size / (time.perf_counter() - t0)


def bench_starvation(args: argparse.Namespace, cuda: bool) -> dict[str, Any]:
    source, manifest = open_store(args)
    device = "cuda" if cuda else None
    probe_bs = 32
    sps = loader_rate(source, manifest, device, probe_bs, args)
    sample_mb = source.sample_nbytes / 1e6
    print(f"\nloader alone (device={device}, batch {probe_bs}): {sps:,.0f} samples/s, "
          f"{sps * sample_mb:,.0f} MB/s")
    bs = args.batch_size or max(1, int(0.7 * sps * args.step_ms / 1e3))
    need = bs / (args.step_ms / 1e3)
    print(f"model step {args.step_ms:.1f} ms ({args.step}), batch {bs}: the model consumes "
          f"{need:,.0f} samples/s = {need / sps:.0%} of the loader-alone rate")
    clock = Clock(cuda)
    step = make_step(args.step, args.step_ms, cuda, VARIABLES[0])
    res: dict[str, Any] = {"loader_samples_per_s": sps, "batch_size": bs,
                           "required_samples_per_s": need}
    # (name, device, to_device, decode, prefetch_next_epoch); the store's epochs are short
    # (~20 steps), so the empty pipeline at each epoch start shows in the second row
    runs: list[tuple[str, str | None, Any, str, bool]] = [
        ("ring", device, None, "cpu", True), ("ring_no_epoch_prefetch", device, None, "cpu",
                                              False)]
    if cuda:
        runs.append(("blocking_to_cuda", None,
                     lambda b: {k: v.to("cuda") for k, v in b.items()}, "cpu", True))
        if gpu_decode_available():
            runs.append(("ring_gpu_decode", device, None, "gpu", True))
    for name, dev, to_device, decode, next_epoch in runs:
        with ib.build_loader(source, manifest, "train", batch_size=bs,
                             block_chunks=args.block_chunks, device=dev, rank=0,
                             world_size=1, decode=decode,
                             prefetch_next_epoch=next_epoch) as loader:
            r = train_loop(forever(loader), step, args.steps, args.warmup, args.lag, clock,
                           to_device)
        res[name] = r
        print(f"  {name:<22} {r['steps']} steps in {r['wall_s']:.2f} s, step {r['step_ms']:.2f} "
              f"ms on the GPU | GPU idle {r['gpu_idle_fraction']:.1%} | in next() "
              f"{r['next_wait_fraction']:.1%}")
    res["pass"] = res["ring"]["gpu_idle_fraction"] < STARVATION_TARGET
    print(f"  starvation (GPU idle, ring) {res['ring']['gpu_idle_fraction']:.1%} "
          f"(target < {STARVATION_TARGET:.0%}): {'PASS' if res['pass'] else 'FAIL'}")
    return res


# -- main -----------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_gpu", description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=["all", "h2d", "starvation"], default="all")
    p.add_argument("--ring-size", type=int, default=3)
    p.add_argument("--h2d-batch-mb", type=float, default=16.0, help="bytes per H2D batch")
    p.add_argument("--h2d-total-gb", type=float, default=2.0, help="bytes copied per case")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--path", default="bench-out/gpu-demo.zarr")
    p.add_argument("--size-mb", type=float, default=600.0)
    p.add_argument("--time-chunk", type=int, default=12)
    p.add_argument("--reuse", action="store_true", help="keep an existing store at --path")
    p.add_argument("--block-chunks", type=int, default=16)
    p.add_argument("--step", choices=["sleep", "matmul"], default="sleep")
    p.add_argument("--step-ms", type=float, default=10.0)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--lag", type=int, default=2, help="steps the CPU may run ahead")
    p.add_argument("--batch-size", type=int, default=None,
                   help="default: 70%% of what the loader alone delivers in one step")
    p.add_argument("--rate-batches", type=int, default=60)
    p.add_argument("--cpu-smoke", action="store_true",
                   help="no GPU: run the starvation loop on CPU (device=None, sleep step)")
    p.add_argument("--out", type=Path, default=Path("bench-out/gpu.json"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.cpu_smoke:
        print(f"bench_gpu: no CUDA device here (torch {torch.__version__}, "
              f"torch.cuda.is_available() is False); nothing to measure. Run it on a machine "
              "with a GPU (or pass --cpu-smoke to exercise the code paths on CPU).")
        return 0
    machine = print_machine()
    if not cuda:
        print("CPU smoke run: the step is a host sleep and nothing overlaps it, so the numbers "
              "below only show the code runs; they say nothing about the GPU path.")
    report: dict[str, Any] = {"machine": machine, "args": {k: str(v) for k, v in
                                                          vars(args).items()}}
    if cuda and args.part in ("all", "h2d"):
        report["h2d"] = bench_h2d(args)
    if args.part in ("all", "starvation"):
        report["starvation"] = bench_starvation(args, cuda)
    write_json(args.out, report)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
