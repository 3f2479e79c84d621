"""Where the training process's CPU goes per sample with decode workers: each thread's CPU
time (``time.pthread_getcpuclockid``, by thread name) and the whole process's
(``time.process_time``) over several epochs of one loader, after a warm epoch. Run on
demand, never as a test::

    .venv/bin/python -m benchmarks.profile_workers --store S/t2m-c1.zarr --workers 2
    .venv/bin/python -m benchmarks.profile_workers --store S/t2m-c1.zarr --workers 2 \\
        --profile /tmp/main.prof      # cProfile of the training thread as well
    .venv/bin/python -m benchmarks.profile_workers --store S/t2m-c1.zarr --workers 2 \\
        --block-chunks 256            # another window size than the loader's default

``--store`` is written as bench_workers writes it when it does not exist.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import insitubatch_nodes as ib  # noqa: E402
from insitubatch_nodes.synthetic import DemoSpec, write_store  # noqa: E402


def thread_cpu() -> dict[str, float]:
    """CPU seconds of every live thread of this process, by name (numbers folded away)."""
    out: dict[str, float] = defaultdict(float)
    for t in threading.enumerate():
        if t.ident is None:
            continue
        with contextlib.suppress(OSError, ValueError):
            name = t.name.rstrip("0123456789").rstrip("-_ ")
            out[name] += time.clock_gettime(time.pthread_getcpuclockid(t.ident))
    return out


def measure(loader: Any, epochs: int, profile: Path | None = None) -> dict[str, Any]:
    """CPU per sample of the process and of each thread over ``epochs`` epochs."""
    prof = None
    if profile is not None:
        import cProfile

        prof = cProfile.Profile()
    n = 0
    t0, c0, w0 = thread_cpu(), time.process_time(), time.perf_counter()
    if prof is not None:
        prof.enable()
    for _ in range(epochs):
        for batch in loader:
            n += int(batch["sample_index"].shape[0])
    if prof is not None:
        prof.disable()
        prof.dump_stats(str(profile))
    wall, cpu, t1 = time.perf_counter() - w0, time.process_time() - c0, thread_cpu()
    threads = {k: 1e6 * (t1[k] - t0.get(k, 0.0)) / n for k in t1}
    return {"samples": n, "samples_per_s": n / wall, "process_us": 1e6 * cpu / n,
            "threads_us": dict(sorted(threads.items(), key=lambda kv: -kv[1]))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", type=Path, default=Path("bench-out/workers/t2m-c1.zarr"))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=1, help="measurements of --epochs each")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--block-chunks", type=int, default=None,
                    help="chunks per shuffle window (default: the loader's own)")
    ap.add_argument("--stack", action="store_true",
                    help="stack every variable into 'channels' (a WB2-like store)")
    ap.add_argument("--profile", type=Path, default=None,
                    help="write a cProfile of the training thread here")
    a = ap.parse_args(argv)
    if not a.store.exists():
        write_store(a.store, DemoSpec(n_times=2000, n_lat=181, n_lon=360, time_chunk=1,
                                      seed=0, variables=("t2m",)), zarr_format=2)
    src = ib.open_source(str(a.store))
    manifest = ib.split_by_chunk(src, fractions=(1.0, 0.0, 0.0))
    kw: dict[str, Any] = {"workers": a.workers, "batch_size": a.batch_size, "seed": 0}
    if a.stack:
        kw["channels"] = list(src.names)
    if a.block_chunks is not None:
        kw["block_chunks"] = a.block_chunks
    with ib.build_loader(src, manifest, "train", **kw) as loader:
        for _ in loader:  # warm: workers started, pools filled, page cache
            pass
        runs = []
        for _ in range(a.repeat):
            r = measure(loader, a.epochs, a.profile)
            runs.append(r)
            threads = ", ".join(f"{k} {v:.2f}" for k, v in r["threads_us"].items() if v > 0.05)
            print(f"workers={a.workers}: {r['samples_per_s']:.0f} samples/s, process "
                  f"{r['process_us']:.2f} us/sample; threads: {threads}")
    if len(runs) > 1:
        print(f"median of {len(runs)}: " + median_line(runs))
    return 0


def median_line(runs: list[dict[str, Any]]) -> str:
    """The runs' medians: samples/s, process and per-thread CPU per sample (a machine
    shared with other work spreads single runs by a third)."""
    names = sorted({k for r in runs for k, v in r["threads_us"].items() if v > 0.05})
    threads = ", ".join(f"{k} {statistics.median(r['threads_us'].get(k, 0.0) for r in runs):.2f}"
                        for k in names)
    return (f"{statistics.median(r['samples_per_s'] for r in runs):.0f} samples/s, process "
            f"{statistics.median(r['process_us'] for r in runs):.2f} us/sample; threads: "
            f"{threads}")


if __name__ == "__main__":
    sys.exit(main())
