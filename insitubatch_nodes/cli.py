"""The ``insitubatch`` command: ``make-demo``, ``inspect`` and ``bench``.

Bad input (a store that cannot be opened, an unknown variable, an option out of range) is
reported in one line that names the value and what is valid, with exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

EXIT_USAGE = 2


# -- option types (argparse turns ArgumentTypeError into "argument --x: ..." and exit 2) ----
def _bounded(kind: type, low: float, low_ok: bool, high: float | None, what: str):
    """An argparse type: ``kind(text)`` within bounds, else a message naming the value."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if (value != value or value < low or (value == low and not low_ok)
                or (high is not None and value > high)):
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value

    return parse


_positive_int = _bounded(int, 1, True, None, "a whole number >= 1")
_nonneg_int = _bounded(int, 0, True, None, "a whole number >= 0")
_positive_float = _bounded(float, 0, False, None, "a number > 0")
_fraction = _bounded(float, 0, False, 1, "a number in (0, 1], e.g. 0.9")


def _store_args(parser: argparse.ArgumentParser, url_help: str) -> None:
    """The store URL and the variables to read, as every store command takes them."""
    parser.add_argument("url", metavar="URL", help=url_help)
    parser.add_argument("--variables", nargs="+", metavar="NAME",
                        help="variables to read (default: every non-coordinate array)")


def _byte_size(text: str) -> int:
    from .loader import parse_bytes

    try:
        value = parse_bytes(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"cannot read a byte size from {text!r}; write e.g. 4GB, 512MiB or 1000000"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a byte size > 0, got {text!r}")
    return value


def _int_list_of(minimum: int, example: str) -> Callable[[str], tuple[int, ...]]:
    """An argparse type: comma-separated whole numbers >= ``minimum``."""

    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(p) for p in text.replace(" ", "").split(",") if p)
        except ValueError:
            values = ()
        if not values or min(values) < minimum:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated whole numbers >= {minimum}, e.g. {example}, "
                f"got {text!r}")
        return values

    return parse


_int_list = _int_list_of(1, "1,8,24,96")
_int_list0 = _int_list_of(0, "0,2")  # DataLoader worker counts


def _shape2(text: str) -> tuple[int, int]:
    try:
        values = tuple(int(p) for p in text.lower().replace("x", ",").split(",") if p)
    except ValueError:
        values = ()
    if len(values) != 2 or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected a sample shape like 64x64, got {text!r}")
    return values  # type: ignore[return-value]


# -- the parser ---------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="insitubatch",
        description="Train in place on Zarr: make a demo store, inspect a store, benchmark the "
                    "loader on it.")
    from . import __version__

    p.add_argument("--version", action="version", version=f"insitubatch-nodes {__version__}")
    sub = p.add_subparsers(dest="command", metavar="{make-demo,inspect,bench}")
    sub.required = True

    d = sub.add_parser("make-demo", help="write the synthetic ERA5-like demo store",
                       description="Write the synthetic ERA5-like store (t2m, u10, v10, msl on "
                                   "time x lat x lon, blosc-zstd) used by the demo and "
                                   "benchmarks.")
    d.add_argument("path", metavar="PATH", help="directory to write (a new one, or an existing "
                   "Zarr store with --force)")
    d.add_argument("--size-mb", type=_positive_float, default=300.0,
                   help="decoded size of the store in MB (default 300)")
    d.add_argument("--time-chunk", type=_positive_int, default=12,
                   help="time steps (samples) per chunk (default 12)")
    d.add_argument("--lat", type=_positive_int, default=121, help="grid rows (default 121)")
    d.add_argument("--lon", type=_positive_int, default=240, help="grid columns (default 240)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--force", action="store_true", help="replace an existing Zarr store")
    d.add_argument("--quiet", action="store_true", help="no progress bar")

    i = sub.add_parser("inspect", help="describe a store and recommend block_chunks",
                       description="Variables, shapes, dtypes, chunks/shards, bytes per chunk "
                                   "(decoded, and compressed as measured on the store), codecs, "
                                   "the loader's read path, and a block_chunks recommendation "
                                   "for a target shuffle quality within a memory budget.")
    _store_args(i, "local path, file://, s3://, gs://, az://, http(s)://")
    i.add_argument("--quality", type=_fraction, default=0.9,
                   help="target shuffle quality in (0, 1] (1.0 = a global shuffle; default 0.9)")
    i.add_argument("--memory", type=_byte_size, default=None, metavar="BYTES",
                   help="memory budget for resident decoded data, e.g. 4GB (default: none)")
    i.add_argument("--batch-size", type=_positive_int, default=32)
    i.add_argument("--prefetch-windows", type=_nonneg_int, default=None,
                   help="windows fetched ahead (default: the loader's, 1 local / 2 remote)")
    i.add_argument("--sample-objects", type=_positive_int, default=5,
                   help="stored chunks per variable whose compressed size is measured")
    i.add_argument("--json", action="store_true", help="print JSON instead of text")

    b = sub.add_parser("bench", help="benchmark the loader against a naive DataLoader and the "
                                     "read floor (or --sweep the knobs)",
                       description="Side by side on one store, in one run: this loader, a naive "
                                   "per-sample DataLoader (0 and 2 workers), the read floor and "
                                   "the floor plus one gather copy. Prints a table, writes JSON "
                                   "and PNG plots to --out. With --sweep: throughput, shuffle "
                                   "quality and peak memory against samples per chunk, "
                                   "block_chunks and max_inflight. Needs the 'bench' extra.")
    _store_args(b, "the store to benchmark on")
    b.add_argument("--out", type=Path, default=Path("bench-out"), metavar="DIR",
                   help="output folder for JSON, Markdown and PNG (default bench-out)")
    b.add_argument("--batch-size", type=_positive_int, default=32)
    b.add_argument("--block-chunks", type=_positive_int, default=16)
    b.add_argument("--max-inflight", type=_positive_int, default=32)
    b.add_argument("--decode-threads", type=_positive_int, default=None)
    b.add_argument("--epochs", type=_positive_int, default=None,
                   help="loader epochs per measurement (default 5; 3 with --sweep); the best "
                        "after the first is the steady state")
    b.add_argument("--naive-samples", type=_positive_int, default=1500,
                   help="samples the naive DataLoaders read (a random subset; default 1500)")
    b.add_argument("--naive-workers", type=_int_list0, default=(0, 2), metavar="N,N",
                   help="DataLoader worker counts for the naive path (default 0,2)")
    b.add_argument("--floor-threads", type=_positive_int, default=min(4, os.cpu_count() or 2))
    b.add_argument("--split-fraction", type=_fraction, default=1.0,
                   help="fraction of the chunks in the benchmarked split (default 1.0)")
    b.add_argument("--resume-after", type=_positive_int, default=10,
                   help="batches before the state is taken for time-to-first-batch-after-"
                        "resume (default 10)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--no-plots", action="store_true", help="skip the PNG plots (no matplotlib)")
    b.add_argument("--quiet", action="store_true", help="no progress bars")
    s = b.add_argument_group("sweep (--sweep)")
    s.add_argument("--sweep", action="store_true",
                   help="sweep samples per chunk, block_chunks and max_inflight instead")
    s.add_argument("--sweep-spc", type=_int_list, default=(1, 8, 24, 96), metavar="N,N",
                   help="samples per chunk of the synthetic stores (default 1,8,24,96)")
    s.add_argument("--sweep-samples", type=_positive_int, default=4000,
                   help="samples in each synthetic store (default 4000)")
    s.add_argument("--sweep-sample-shape", type=_shape2, default=(64, 64), metavar="HxW",
                   help="sample shape of the synthetic stores (default 64x64)")
    s.add_argument("--window-samples", type=_positive_int, default=256,
                   help="windows hold at least this many samples in the samples-per-chunk "
                        "sweep (default 256)")
    s.add_argument("--sweep-block-chunks", type=_int_list, default=(1, 2, 4, 8, 16, 32, 64),
                   metavar="N,N", help="default 1,2,4,8,16,32,64")
    s.add_argument("--sweep-inflight", type=_int_list, default=(1, 2, 4, 8, 16, 32, 64),
                   metavar="N,N", help="default 1,2,4,8,16,32,64")
    s.add_argument("--keep-stores", action="store_true",
                   help="keep the synthetic stores under DIR/sweep-stores")
    for command in sub.choices.values():
        command.set_defaults(parser=command)  # errors are reported by the subcommand's parser
    return p


# -- commands -----------------------------------------------------------------------------
def _open(parser: argparse.ArgumentParser, url: str, variables: list[str] | None) -> Any:
    """Open the store or exit 2 with the error in words (it names the value and what is
    valid: missing path, unsupported scheme, unknown variable and the ones that exist)."""
    import insitubatch_nodes as ib

    try:
        return ib.open_source(url, variables=variables)
    except (FileNotFoundError, KeyError, ValueError, TypeError, OSError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        parser.error(f"cannot open {url!r}: {msg}")


def cmd_make_demo(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from .synthetic import VARIABLES, DemoSpec, is_zarr_store, write_store

    path = Path(args.path)
    if path.exists():
        if not is_zarr_store(path):
            parser.error(f"{str(path)!r} exists and is not a Zarr store; give a new path "
                         "(make-demo never replaces anything else)")
        if not args.force:
            parser.error(f"{str(path)!r} is an existing Zarr store; add --force to replace it")
    spec = DemoSpec.for_size(args.size_mb, n_lat=args.lat, n_lon=args.lon,
                             time_chunk=args.time_chunk, seed=args.seed)
    write_store(path, spec, progress=not args.quiet)
    print(f"wrote {path}: {', '.join(VARIABLES)} on (time, lat, lon) = ({spec.n_times}, "
          f"{spec.n_lat}, {spec.n_lon}) float32, {spec.time_chunk} time steps per chunk, "
          f"{spec.nbytes / 1e6:,.0f} MB decoded")
    return 0


def cmd_inspect(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from .inspection import format_report, inspect_source

    source = _open(parser, args.url, args.variables)
    report = inspect_source(source, quality=args.quality, memory_budget=args.memory,
                            batch_size=args.batch_size, prefetch_windows=args.prefetch_windows,
                            sample_objects=args.sample_objects)
    if args.json:
        print(json.dumps(report.as_dict(), indent=1))
    else:
        print(format_report(report))
    return 0


def cmd_bench(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from .bench import MISSING_HINT, missing_bench_deps

    missing = missing_bench_deps(plots=not args.no_plots)
    if missing:
        parser.error(f"{MISSING_HINT}; missing here: {', '.join(missing)}")
    source = _open(parser, args.url, args.variables)
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {str(args.out)!r} is a file; give a folder")
    if args.batch_size > source.n_samples:
        parser.error(f"--batch-size {args.batch_size} exceeds the store's {source.n_samples} "
                     "samples")
    variables = list(source.names)
    progress = not args.quiet
    if args.sweep:
        from .bench.sweep import SweepConfig, run_sweep

        run_sweep(SweepConfig(
            url=args.url, variables=variables, batch_size=args.batch_size,
            block_chunks=args.block_chunks, max_inflight=args.max_inflight,
            decode_threads=args.decode_threads, samples_per_chunk=args.sweep_spc,
            block_chunks_values=args.sweep_block_chunks,
            max_inflight_values=args.sweep_inflight, spc_samples=args.sweep_samples,
            spc_sample_shape=args.sweep_sample_shape, window_samples=args.window_samples,
            epochs=args.epochs or 3, seed=args.seed, out_dir=args.out,
            keep_stores=args.keep_stores, plots=not args.no_plots, progress=progress))
        return 0
    from .bench.core import CoreConfig, run_core

    run_core(CoreConfig(
        url=args.url, variables=variables, batch_size=args.batch_size,
        block_chunks=args.block_chunks, max_inflight=args.max_inflight,
        decode_threads=args.decode_threads, epochs=args.epochs or 5,
        naive_samples=args.naive_samples, naive_workers=args.naive_workers,
        floor_threads=args.floor_threads, split_fraction=args.split_fraction, seed=args.seed,
        resume_after=args.resume_after, out_dir=args.out, plots=not args.no_plots,
        progress=progress))
    return 0


COMMANDS = {"make-demo": cmd_make_demo, "inspect": cmd_inspect, "bench": cmd_bench}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command](args.parser, args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
