"""Where a loader's CPU goes, thread by thread: the training thread against the decode pool.

On two cores the one-step stores' gap to tensorstore was not per-sample decode work but the
Python around it: the training thread's share of the cores, and the decode threads blocked
on the GIL it holds (each block a sleep and a wake-up). This runs the loader's epochs on
``--store`` for ``--seconds`` and reports, from ``/proc/self/task`` (Linux): samples/s, the
cores each thread ran on, the training thread's CPU per sample, and voluntary /
involuntary context switches per sample. ``--no-io`` stubs the file reads and decodes, so
what is left is the Python of the graph and the pool (the training thread's figure then is
its own work, unslowed by decode threads sharing the caches). Run on demand, never as a
test, from the repository root::

    .venv/bin/python -m benchmarks.bench_threads --store DIR/t2m-c1.zarr
    .venv/bin/python -m benchmarks.bench_threads --store DIR/t2m-c1.zarr --no-io
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import insitubatch_nodes as ib  # noqa: E402
from insitubatch_nodes.bench.common import (  # noqa: E402
    bench_manifest,
    one_epoch_at_a_time,
    print_machine,
    write_json,
)

TASKS = Path("/proc/self/task")


def thread_counters() -> dict[int, tuple[float, int, int]]:
    """Native thread id -> (CPU seconds, voluntary, involuntary context switches)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for task in TASKS.iterdir():
        try:
            stat = (task / "stat").read_text()
            status = (task / "status").read_text()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        switches = dict(line.split(":") for line in status.splitlines() if "ctxt" in line)
        out[int(task.name)] = ((int(fields[11]) + int(fields[12])) / tick,
                               int(switches["voluntary_ctxt_switches"]),
                               int(switches["nonvoluntary_ctxt_switches"]))
    return out


@contextlib.contextmanager
def stubbed_io() -> Iterator[None]:
    """Reads that return a placeholder and decodes that do nothing, for the block: the
    loader's own Python is what runs."""
    from insitubatch_nodes.io.decode import ChunkDecoder
    from insitubatch_nodes.io.read_paths import LocalFiles

    read, decode = LocalFiles.get_scratch, ChunkDecoder.decode_into
    LocalFiles.get_scratch = lambda self, key: memoryview(b"x")  # type: ignore[method-assign]
    ChunkDecoder.decode_into = lambda self, data, out: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        LocalFiles.get_scratch, ChunkDecoder.decode_into = read, decode  # type: ignore[method-assign]


def measure(args: argparse.Namespace) -> dict[str, Any]:
    if not TASKS.is_dir():
        raise SystemExit("bench_threads: per-thread CPU and switches come from /proc/self/task "
                         "(Linux); this system has none")
    source = ib.open_source(args.store)
    manifest = bench_manifest(source, 1.0, 0)
    kw: dict[str, Any] = dict(batch_size=args.batch_size, block_chunks=args.block_chunks,
                              decode_threads=args.decode_threads, seed=0)
    name = source.names[0]
    with (stubbed_io() if args.no_io else contextlib.nullcontext(),
          ib.build_loader(source, manifest, "train", **kw, **one_epoch_at_a_time()) as loader):
        for _ in loader:  # warm: threads started, buffers pooled
            pass
        names = {t.native_id: t.name for t in threading.enumerate()}
        main = threading.get_native_id()
        before, t0, c0 = thread_counters(), time.perf_counter(), time.thread_time()
        samples = 0
        while time.perf_counter() - t0 < args.seconds:
            for batch in loader:
                float(batch[name].reshape(-1)[0])  # read it, as a model would
                samples += len(batch["sample_index"])
        wall, main_cpu = time.perf_counter() - t0, time.thread_time() - c0
        after = thread_counters()
        threads = loader.node(ib.AsyncFetchNode).decode_threads
    rows = []
    for tid, (cpu, vol, inv) in sorted(after.items()):
        if tid not in before:
            continue
        d_cpu, d_vol, d_inv = (cpu - before[tid][0], vol - before[tid][1],
                               inv - before[tid][2])
        if d_cpu < 0.01 * wall and tid != main:
            continue
        label = "training thread" if tid == main else names.get(tid, f"thread {tid}")
        rows.append({"thread": label, "cores": d_cpu / wall, "voluntary_per_sample":
                     d_vol / samples, "involuntary_per_sample": d_inv / samples})
    return {"store": args.store, "no_io": args.no_io, "decode_threads": threads,
            "samples_per_s": samples / wall, "seconds": wall,
            "training_thread_cpu_us_per_sample": main_cpu / samples * 1e6,
            "cores": sum(r["cores"] for r in rows), "threads": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", required=True, help="a local Zarr store")
    p.add_argument("--seconds", type=float, default=8.0, help="epochs timed for this long")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--block-chunks", type=int, default=None, help="default: the loader's")
    p.add_argument("--decode-threads", type=int, default=None, help="default: the loader's")
    p.add_argument("--no-io", action="store_true",
                   help="stub reads and decodes: only the loader's Python runs")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args(argv)
    if args.seconds <= 0:
        p.error(f"--seconds {args.seconds}: give a positive duration")
    machine = print_machine()
    r = measure(args)
    print(f"{r['store']}{' (reads and decodes stubbed)' if r['no_io'] else ''}: "
          f"{r['samples_per_s']:,.0f} samples/s on {r['cores']:.2f} cores, "
          f"{r['decode_threads']} decode threads; training thread "
          f"{r['training_thread_cpu_us_per_sample']:.1f} us CPU per sample")
    for t in r["threads"]:
        print(f"  {t['thread']:28s} {t['cores']:5.2f} cores, switches per sample: "
              f"{t['voluntary_per_sample']:.2f} voluntary, "
              f"{t['involuntary_per_sample']:.2f} involuntary")
    if args.json is not None:
        write_json(args.json, {"machine": machine, **r})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
