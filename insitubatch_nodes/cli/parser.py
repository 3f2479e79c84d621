"""The ``insitubatch`` command's argparse parser: one function per subcommand, each a flat
list of its ``add_argument`` calls.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from ..bench import BELUGA_MODES, PEER_NAMES, PEERS_HINT
from .make_demo import LAYOUTS, SMALL_GRID, SMALL_TIMES
from .option_types import (
    beluga_modes,
    byte_size,
    fraction,
    int_list,
    int_list0,
    nonneg_int,
    peer_list,
    positive_float,
    positive_int,
    positive_int_or_auto,
    shape2,
)


def store_args(parser: argparse.ArgumentParser, url_help: str) -> None:
    """The store URL and the variables to read, as every store command takes them."""
    parser.add_argument("url", metavar="URL", help=url_help)
    parser.add_argument("--variables", nargs="+", metavar="NAME",
                        help="variables to read (default: every non-coordinate array)")


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``insitubatch``: each subcommand's parser is its args' ``parser``,
    so a command reports its usage errors under its own name."""
    p = argparse.ArgumentParser(
        prog="insitubatch",
        description="Train in place on Zarr: make a demo store, inspect a store, benchmark the "
                    "loader on it.")
    from .. import __version__

    p.add_argument("--version", action="version", version=f"insitubatch-nodes {__version__}")
    sub = p.add_subparsers(dest="command", metavar="{make-demo,inspect,bench}")
    sub.required = True

    make_demo_parser(sub)
    inspect_parser(sub)
    bench_parser(sub)
    for command in sub.choices.values():
        command.set_defaults(parser=command)  # errors are reported by the subcommand's parser
    return p


def make_demo_parser(sub: Any) -> None:
    """``insitubatch make-demo``: write a synthetic store."""
    d = sub.add_parser("make-demo", help="write a synthetic ERA5-like store (demo or WB2 "
                                         "layout)",
                       description="Write a synthetic ERA5-like store. --layout era5 (default): "
                                   "the demo's t2m, u10, v10, msl on time x lat x lon, "
                                   "blosc-zstd, --time-chunk steps per chunk (Zarr v3). "
                                   "--layout wb2: WeatherBench2's ERA5 layout as xarray writes "
                                   "it: Zarr v2, consolidated, 6 pressure-level variables x 13 "
                                   "levels + 5 surface variables (83 channels) on time x "
                                   "[level] x longitude x latitude, one step per chunk, "
                                   "blosc-lz4, plus a static land_sea_mask. --layout anemoi: "
                                   "the anemoi-datasets layout: one data array (dates, "
                                   "variables, ensemble, cells), one date per chunk, dates, "
                                   "latitudes/longitudes, stored statistics, missing_dates.")
    d.add_argument("path", metavar="PATH", help="directory to write (a new one, or an existing "
                   "Zarr store with --force)")
    d.add_argument("--layout", choices=LAYOUTS, default="era5",
                   help="era5: the demo store (default); wb2: the WeatherBench2 ERA5 layout; "
                        "anemoi: an anemoi dataset (--lat x --lon cells, flattened)")
    d.add_argument("--size-mb", type=positive_float, default=300.0,
                   help="decoded size of the store in MB (default 300); --n-times overrides it")
    d.add_argument("--n-times", type=positive_int, default=None,
                   help="time steps (samples) to write, instead of --size-mb")
    d.add_argument("--time-chunk", type=positive_int, default=None,
                   help="time steps (samples) per chunk (default 12; era5 layout only: wb2 "
                        "stores hold one step per chunk)")
    d.add_argument("--lat", type=positive_int, default=None,
                   help="latitudes, grid rows (default 121)")
    d.add_argument("--lon", type=positive_int, default=None,
                   help="longitudes, grid columns (default 240)")
    d.add_argument("--small", action="store_true",
                   help=f"a tiny store for tests: a {SMALL_GRID[1]}x{SMALL_GRID[0]} (lon x lat) "
                        f"grid, {SMALL_TIMES} steps unless --n-times (every variable and level "
                        "kept)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--force", action="store_true", help="replace an existing Zarr store")
    d.add_argument("--quiet", action="store_true", help="no progress bar")


def inspect_parser(sub: Any) -> None:
    """``insitubatch inspect``: describe a store, recommend ``block_chunks``, show a sample."""
    i = sub.add_parser("inspect", help="describe a store and recommend block_chunks",
                       description="Variables, shapes, dtypes, chunks/shards, bytes per chunk "
                                   "(decoded, and compressed as measured on the store), codecs, "
                                   "the loader's read path, and a block_chunks recommendation "
                                   "for a target shuffle quality within a memory budget.")
    store_args(i, "local path, file://, s3://, gs://, az://, http(s)://")
    i.add_argument("--quality", type=fraction, default=0.9,
                   help="target shuffle quality in (0, 1] (1.0 = a global shuffle; default 0.9)")
    i.add_argument("--memory", type=byte_size, default=None, metavar="BYTES",
                   help="memory budget for resident decoded data, e.g. 4GB (default: none)")
    i.add_argument("--batch-size", type=positive_int, default=32)
    i.add_argument("--prefetch-windows", type=nonneg_int, default=None,
                   help="windows fetched ahead (default 2, the loader's with decode threads; "
                        "decode workers fetch deeper)")
    i.add_argument("--sample-objects", type=positive_int, default=5,
                   help="stored chunks per variable whose compressed size is measured")
    i.add_argument("--history", type=positive_int, default=None,
                   help="samples are anchors with this many input steps: recommend the "
                        "run length (run_chunks) and block_chunks for them")
    i.add_argument("--lead", type=int, nargs="+", default=None, metavar="STEP",
                   help="target steps after the last input (with --history; default 1)")
    i.add_argument("--channels", nargs="+", metavar="NAME[@LEVEL]", default=None,
                   help="the channels a model takes, as build_loader(channels=) takes them "
                        "(z@500 picks one level by its coordinate value): the figures are "
                        "then those of a loader given them (only their variables read, "
                        "unless --variables names more) and say how much of each chunk they "
                        "read (blosc blocks, bytes); with --sample, the sample's stacked "
                        "'channels' as the loader serves them")
    i.add_argument("--json", action="store_true", help="print JSON instead of text")
    i.add_argument("--sample", type=nonneg_int, default=None, metavar="I",
                   help="show sample I (its global index; with --history/--lead the anchor) "
                        "as the loader serves it: every key's shape, dtype, min/max/mean and "
                        "NaN count, instead of the store report")
    i.add_argument("--plot", type=Path, default=None, metavar="PNG",
                   help="with --sample: write a PNG of one variable of it (needs matplotlib, "
                        "the 'bench' extra)")
    i.add_argument("--plot-key", default=None, metavar="KEY",
                   help="the key of the sample to plot (default: the first field); leading "
                        "axes beyond the last two are shown at index 0 (an anemoi dataset's "
                        "variable: pick it with --variables NAME)")


def bench_parser(sub: Any) -> None:
    """``insitubatch bench``: the loader against a naive ``DataLoader``, the read floors, peers."""
    b = sub.add_parser("bench", help="benchmark the loader against a naive DataLoader and the "
                                     "read floor (or --sweep the knobs)",
                       description="Side by side on one store, in one run: this loader, a naive "
                                   "per-sample DataLoader (0 and 2 workers), the read floor, "
                                   "the floor plus one gather copy, and peer readers "
                                   "(zarr-beluga, tensorstore: the 'peers' extra; local stores) "
                                   "one epoch after each loader epoch, with ratios ours/peer; "
                                   "--channels adds the loader stacking channels. Prints a "
                                   "table, writes JSON "
                                   "and PNG plots to --out. With --sweep: throughput, shuffle "
                                   "quality and peak memory against samples per chunk, "
                                   "block_chunks and max_inflight. Needs the 'bench' extra.")
    store_args(b, "the store to benchmark on")
    b.add_argument("--out", type=Path, default=Path("bench-out"), metavar="DIR",
                   help="output folder for JSON, Markdown and PNG (default bench-out)")
    b.add_argument("--batch-size", type=positive_int, default=32)
    b.add_argument("--block-chunks", type=positive_int_or_auto, default=16,
                   help="chunks per loader window (default 16); 'auto': the loader's own "
                        "default (~64 MB windows when it decodes one sample per chunk in "
                        "place)")
    b.add_argument("--max-inflight", type=positive_int, default=32)
    b.add_argument("--decode-threads", type=positive_int, default=None,
                   help="the loader's decode threads (default: the loader's, cores + 1, at most 4)")
    b.add_argument("--epochs", type=positive_int, default=None,
                   help="loader epochs per measurement (default 5; 3 with --sweep); the best "
                        "after the first is the steady state")
    b.add_argument("--naive-samples", type=positive_int, default=1500,
                   help="samples the naive DataLoaders read (a random subset; default 1500)")
    b.add_argument("--naive-workers", type=int_list0, default=(0, 2), metavar="N,N",
                   help="DataLoader worker counts for the naive path (default 0,2)")
    b.add_argument("--floor-threads", type=positive_int, default=min(4, os.cpu_count() or 2))
    b.add_argument("--split-fraction", type=fraction, default=1.0,
                   help="fraction of the chunks in the benchmarked split (default 1.0)")
    b.add_argument("--resume-after", type=positive_int, default=10,
                   help="batches before the state is taken for time-to-first-batch-after-"
                        "resume (default 10)")
    b.add_argument("--channels", nargs="+", metavar="NAME", default=None,
                   help="also run the loader stacking these variables (every level) into one "
                        "(B, C, H, W) 'channels' tensor, epoch by epoch beside the "
                        "per-variable loader, and report the stacking cost; 'all': every "
                        "served variable")
    b.add_argument("--peers", type=peer_list, default=PEER_NAMES, metavar="NAME,NAME",
                   help="other readers run on the same store and samples, one epoch after "
                        f"each loader epoch (default {','.join(PEER_NAMES)}; 'none'); local "
                        f"stores only; not installed ones say so ({PEERS_HINT})")
    b.add_argument("--beluga-modes", type=beluga_modes, default=BELUGA_MODES,
                   metavar="MODE,MODE",
                   help="zarr-beluga zarr_read modes to run, the best reported (default "
                        f"{','.join(BELUGA_MODES)}; also fetch_decode)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--no-plots", action="store_true", help="skip the PNG plots (no matplotlib)")
    b.add_argument("--quiet", action="store_true", help="no progress bars")
    sweep_args(b)


def sweep_args(b: argparse.ArgumentParser) -> None:
    """``insitubatch bench --sweep``: the knobs swept and the synthetic stores."""
    s = b.add_argument_group("sweep (--sweep)")
    s.add_argument("--sweep", action="store_true",
                   help="sweep samples per chunk, block_chunks and max_inflight instead")
    s.add_argument("--sweep-spc", type=int_list, default=(1, 8, 24, 96), metavar="N,N",
                   help="samples per chunk of the synthetic stores (default 1,8,24,96)")
    s.add_argument("--sweep-samples", type=positive_int, default=4000,
                   help="samples in each synthetic store (default 4000)")
    s.add_argument("--sweep-sample-shape", type=shape2, default=(64, 64), metavar="HxW",
                   help="sample shape of the synthetic stores (default 64x64)")
    s.add_argument("--window-samples", type=positive_int, default=256,
                   help="windows hold at least this many samples in the samples-per-chunk "
                        "sweep (default 256)")
    s.add_argument("--sweep-block-chunks", type=int_list, default=(1, 2, 4, 8, 16, 32, 64),
                   metavar="N,N", help="default 1,2,4,8,16,32,64")
    s.add_argument("--sweep-inflight", type=int_list, default=(1, 2, 4, 8, 16, 32, 64),
                   metavar="N,N", help="default 1,2,4,8,16,32,64")
    s.add_argument("--keep-stores", action="store_true",
                   help="keep the synthetic stores under DIR/sweep-stores")
