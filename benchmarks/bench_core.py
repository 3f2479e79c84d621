"""Core benchmark on its own synthetic store: the loader against a naive DataLoader and the
read floor.

The measurement is ``insitubatch bench URL`` (``insitubatch_nodes.bench.core.run_core``); this
entry point only writes the store the README's "original single-variable store" numbers
come from first. Run on demand, never as a test, from the repository root::

    .venv/bin/python -m benchmarks.bench_core            # or: python benchmarks/bench_core.py

The store: one variable, ``t2m``, (2000, 181, 360) float32, 8 steps per chunk, blosc-zstd
(``insitubatch_nodes.synthetic.write_store``), written to ``--path``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from insitubatch_nodes.bench.core import CoreConfig, run_core  # noqa: E402
from insitubatch_nodes.synthetic import DemoSpec, write_store  # noqa: E402

VAR = "t2m"


def store_spec(shape: tuple[int, int, int], time_chunk: int, seed: int = 0) -> DemoSpec:
    """The benchmark's store: ``t2m`` alone, no coordinates (nothing but the variable read)."""
    n_times, n_lat, n_lon = shape
    return DemoSpec(n_times=n_times, n_lat=n_lat, n_lon=n_lon, time_chunk=time_chunk,
                    seed=seed, variables=(VAR,), coords=False)


def store_matches(path: Path, spec: DemoSpec) -> bool:
    """Whether ``--reuse`` may keep the store: same variable, shape and time chunking."""
    import zarr

    try:
        arr = zarr.open_array(path / VAR, mode="r")
    except Exception:
        return False
    return tuple(arr.shape) == spec.shape and arr.chunks == (spec.time_chunk, *spec.shape[1:])


def _parse_shape(text: str) -> tuple[int, int, int]:
    parts = tuple(int(p) for p in text.replace("x", ",").split(",") if p.strip())
    if len(parts) != 3 or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"--shape wants three positive ints, got {text!r}")
    return parts  # type: ignore[return-value]


def main(argv: list[str] | None = None) -> int:
    """Write the synthetic store (unless ``--reuse`` finds a matching one), then ``run_core``."""
    p = argparse.ArgumentParser(prog="bench_core", description=__doc__.splitlines()[0])
    p.add_argument("--path", type=Path, default=Path("bench-out/bench.zarr"))
    p.add_argument("--shape", type=_parse_shape, default=(2000, 181, 360),
                   help="time,lat,lon (default 2000,181,360)")
    p.add_argument("--time-chunk", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--block-chunks", type=int, default=16)
    p.add_argument("--max-inflight", type=int, default=32)
    p.add_argument("--split-fraction", type=float, default=1.0)
    p.add_argument("--naive-samples", type=int, default=1500)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--floor-threads", type=int, default=min(4, os.cpu_count() or 2))
    p.add_argument("--decode-threads", type=int, default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench-out/core.json"),
                   help="JSON result file (a .md table and a .png plot are written beside it)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--reuse", action="store_true", help="keep an existing matching store")
    args = p.parse_args(argv)
    if not 0.0 < args.split_fraction <= 1.0:
        p.error(f"--split-fraction must be in (0, 1], got {args.split_fraction}")
    if args.epochs < 1 or args.repeats < 1 or args.naive_samples < 1:
        p.error("--epochs, --repeats and --naive-samples must be >= 1")
    spec = store_spec(args.shape, args.time_chunk, args.seed)
    if args.reuse and store_matches(args.path, spec):
        print(f"reusing {args.path}")
    else:
        write_store(args.path, spec)
    cfg = CoreConfig(url=str(args.path), variables=[VAR], batch_size=args.batch_size,
                     block_chunks=args.block_chunks, max_inflight=args.max_inflight,
                     decode_threads=args.decode_threads, epochs=args.epochs,
                     naive_samples=args.naive_samples, floor_threads=args.floor_threads,
                     repeats=args.repeats, split_fraction=args.split_fraction, seed=args.seed,
                     out_dir=args.out.parent, json_name=args.out.name, plots=not args.no_plots)
    run_core(cfg)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
