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

from .bench import BELUGA_MODES, BELUGA_ZARR_READ, PEER_NAMES, PEERS_HINT

EXIT_USAGE = 2
LAYOUTS = ("era5", "wb2", "anemoi")  # make-demo --layout
SMALL_GRID = (12, 24)  # make-demo --small: (lat, lon)
SMALL_TIMES = 16


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


def _positive_int_or_auto(text: str) -> int | None:
    """A whole number >= 1, or ``auto`` (``None``: the loader decides)."""
    if text.strip().lower() == "auto":
        return None
    return _positive_int(text)


def _choices_list(known: tuple[str, ...], what: str, allow_none: bool):
    """An argparse type: comma-separated names out of ``known`` (``none``: no name)."""

    def parse(text: str) -> tuple[str, ...]:
        names = tuple(n for n in text.replace(" ", "").split(",") if n)
        if allow_none and names == ("none",):
            return ()
        bad = [n for n in names if n not in known]
        if bad or not names:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated {what} out of {', '.join(known)}"
                + (" (or none)" if allow_none else "") + f", got {text!r}")
        return names

    return parse


_peer_list = _choices_list(PEER_NAMES, "peers", True)
_beluga_modes = _choices_list(BELUGA_ZARR_READ, "zarr_read modes", False)


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
    d.add_argument("--size-mb", type=_positive_float, default=300.0,
                   help="decoded size of the store in MB (default 300); --n-times overrides it")
    d.add_argument("--n-times", type=_positive_int, default=None,
                   help="time steps (samples) to write, instead of --size-mb")
    d.add_argument("--time-chunk", type=_positive_int, default=None,
                   help="time steps (samples) per chunk (default 12; era5 layout only: wb2 "
                        "stores hold one step per chunk)")
    d.add_argument("--lat", type=_positive_int, default=None,
                   help="latitudes, grid rows (default 121)")
    d.add_argument("--lon", type=_positive_int, default=None,
                   help="longitudes, grid columns (default 240)")
    d.add_argument("--small", action="store_true",
                   help=f"a tiny store for tests: a {SMALL_GRID[1]}x{SMALL_GRID[0]} (lon x lat) "
                        f"grid, {SMALL_TIMES} steps unless --n-times (every variable and level "
                        "kept)")
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
                   help="windows fetched ahead (default: the loader's, 2)")
    i.add_argument("--sample-objects", type=_positive_int, default=5,
                   help="stored chunks per variable whose compressed size is measured")
    i.add_argument("--history", type=_positive_int, default=None,
                   help="samples are time windows of this many input steps: recommend the "
                        "run length (run_chunks) and block_chunks for them")
    i.add_argument("--lead", type=int, nargs="+", default=None, metavar="STEP",
                   help="target steps after the last input (with --history; default 1)")
    i.add_argument("--json", action="store_true", help="print JSON instead of text")
    i.add_argument("--sample", type=_nonneg_int, default=None, metavar="I",
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
    _store_args(b, "the store to benchmark on")
    b.add_argument("--out", type=Path, default=Path("bench-out"), metavar="DIR",
                   help="output folder for JSON, Markdown and PNG (default bench-out)")
    b.add_argument("--batch-size", type=_positive_int, default=32)
    b.add_argument("--block-chunks", type=_positive_int_or_auto, default=16,
                   help="chunks per loader window (default 16); 'auto': the loader's own "
                        "default (~64 MB windows when it decodes one sample per chunk in "
                        "place)")
    b.add_argument("--max-inflight", type=_positive_int, default=32)
    b.add_argument("--decode-threads", type=_positive_int, default=None,
                   help="the loader's decode threads (default: the loader's, cores + 1, at most 4)")
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
    b.add_argument("--channels", nargs="+", metavar="NAME", default=None,
                   help="also run the loader stacking these variables (every level) into one "
                        "(B, C, H, W) 'channels' tensor, epoch by epoch beside the "
                        "per-variable loader, and report the stacking cost; 'all': every "
                        "served variable")
    b.add_argument("--peers", type=_peer_list, default=PEER_NAMES, metavar="NAME,NAME",
                   help="other readers run on the same store and samples, one epoch after "
                        f"each loader epoch (default {','.join(PEER_NAMES)}; 'none'); local "
                        f"stores only; not installed ones say so ({PEERS_HINT})")
    b.add_argument("--beluga-modes", type=_beluga_modes, default=BELUGA_MODES,
                   metavar="MODE,MODE",
                   help="zarr-beluga zarr_read modes to run, the best reported (default "
                        f"{','.join(BELUGA_MODES)}; also fetch_decode)")
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
    from .synthetic import is_zarr_store

    if args.layout != "era5" and args.time_chunk not in (None, 1):
        parser.error(f"--time-chunk {args.time_chunk}: the {args.layout} layout holds one time "
                     "step per chunk (as WeatherBench2 and anemoi do); leave --time-chunk out")
    path = Path(args.path)
    if path.exists():
        if not is_zarr_store(path):
            parser.error(f"{str(path)!r} exists and is not a Zarr store; give a new path "
                         "(make-demo never replaces anything else)")
        if not args.force:
            parser.error(f"{str(path)!r} is an existing Zarr store; add --force to replace it")
    n_lat, n_lon = SMALL_GRID if args.small else (121, 240)
    n_lat, n_lon = args.lat or n_lat, args.lon or n_lon
    n_times = args.n_times or (SMALL_TIMES if args.small else None)
    if args.layout == "wb2":
        return _make_wb2(parser, args, path, n_times, n_lat, n_lon)
    if args.layout == "anemoi":
        return _make_anemoi(args, path, n_times, n_lat * n_lon)
    from .synthetic import VARIABLES, DemoSpec, write_store

    time_chunk = args.time_chunk or 12
    kw = dict(n_lat=n_lat, n_lon=n_lon, time_chunk=time_chunk, seed=args.seed)
    spec = (DemoSpec(n_times=n_times, **kw) if n_times
            else DemoSpec.for_size(args.size_mb, **kw))
    write_store(path, spec, progress=not args.quiet)
    print(f"wrote {path}: {', '.join(VARIABLES)} on (time, lat, lon) = ({spec.n_times}, "
          f"{spec.n_lat}, {spec.n_lon}) float32, {spec.time_chunk} time steps per chunk, "
          f"{spec.nbytes / 1e6:,.0f} MB decoded")
    return 0


def _make_wb2(parser: argparse.ArgumentParser, args: argparse.Namespace, path: Path,
              n_times: int | None, n_lat: int, n_lon: int) -> int:
    from .synthetic import WB2Spec, write_wb2_store

    # as ERA5 has it: sea-surface temperature is NaN over land (README "Missing values")
    kw = dict(n_lon=n_lon, n_lat=n_lat, seed=args.seed, sea_surface_temperature=True)
    spec = WB2Spec(n_times=n_times, **kw) if n_times else WB2Spec.for_size(args.size_mb, **kw)
    write_wb2_store(path, spec, progress=not args.quiet)
    print(f"wrote {path}: WeatherBench2 layout, {len(spec.variables)} variables = "
          f"{spec.channels} channels (sea_surface_temperature NaN over land) on "
          "(time, [level], longitude, latitude) = "
          f"({spec.n_times}, [13], {spec.n_lon}, {spec.n_lat}) float32, one time step per "
          f"chunk, {spec.sample_nbytes / 1e6:,.2f} MB per step, {spec.nbytes / 1e6:,.0f} MB "
          "decoded")
    return 0


def _make_anemoi(args: argparse.Namespace, path: Path, n_times: int | None, n_cells: int,
                 ) -> int:
    from .synthetic import ANEMOI_VARIABLES, write_anemoi_store

    per_date = len(ANEMOI_VARIABLES) * n_cells * 4
    n = n_times or max(1, int(args.size_mb * 1e6 / per_date))
    write_anemoi_store(path, n_dates=n, n_cells=n_cells, seed=args.seed)
    print(f"wrote {path}: anemoi layout, data (dates, variables, ensemble, cells) = ({n}, "
          f"{len(ANEMOI_VARIABLES)}, 1, {n_cells}) float32, one date per chunk, variables "
          f"{', '.join(ANEMOI_VARIABLES)}, {n * per_date / 1e6:,.0f} MB decoded")
    return 0


def cmd_inspect(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from .inspection import format_report, inspect_source

    source = _open(parser, args.url, args.variables)
    steps = None
    if args.history is not None or args.lead is not None:
        from .sampling.windows import SampleWindow

        try:
            steps = SampleWindow(history=args.history or 1, lead=tuple(args.lead or (1,)))
        except ValueError as e:
            parser.error(f"--history/--lead: {e}")
    if args.sample is None and (args.plot is not None or args.plot_key is not None):
        parser.error("--plot/--plot-key need --sample I: the sample to plot")
    if args.sample is not None:
        return _inspect_sample(parser, args, source, steps)
    report = inspect_source(source, quality=args.quality, memory_budget=args.memory,
                            batch_size=args.batch_size, prefetch_windows=args.prefetch_windows,
                            sample_objects=args.sample_objects, steps=steps)
    if args.json:
        print(json.dumps(report.as_dict(), indent=1))
    else:
        print(format_report(report))
    return 0


def _inspect_sample(parser: argparse.ArgumentParser, args: argparse.Namespace, source: Any,
                    steps: Any) -> int:
    """``inspect --sample I``: sample I over the whole store as ``SampleDataset`` (so as the
    loader) serves it, key by key; ``--plot`` draws one of its fields."""
    import numpy as np

    from .dataset import SampleDataset, summarize_sample
    from .store.splits import split_by_chunk

    try:
        ds = SampleDataset(source, split_by_chunk(source, (1.0,), names=("store",)), "store",
                           window=steps)
        sample = ds[ds.index_of(args.sample)]
    except (KeyError, ValueError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        parser.error(f"--sample {args.sample}: {msg}")
    where = f"sample {args.sample} of {source.url}"
    if source.sample_coord is not None and source.sample_dim is not None:
        value = source.sample_coord[args.sample]
        if isinstance(value, np.datetime64):
            value = value.astype("datetime64[s]")
        where += f" ({source.sample_dim} {value})"
    keys = summarize_sample(sample)
    plotted = (_plot_sample(parser, sample, args.plot, args.plot_key, where, source)
               if args.plot is not None else None)
    if args.json:
        print(json.dumps({"sample": args.sample, "where": where,
                          "keys": [k.as_dict() for k in keys],
                          "plot": None if plotted is None else str(args.plot)}, indent=1))
        return 0
    print(where)

    def num(x: float | None, exact: bool) -> str:
        return "-" if x is None else str(int(x)) if exact else f"{x:.6g}"

    dated = (source.sample_coord is not None
             and np.issubdtype(np.asarray(source.sample_coord).dtype, np.datetime64))
    for k in keys:
        ints = k.dtype.startswith(("int", "uint"))
        if not k.shape:  # one value: the sample index, a coordinate
            value = num(k.min, ints)
            if dated and k.key == source.sample_dim and k.min is not None:
                # served as int64 nanoseconds (torch has no datetime): shown as the date
                value = f"{np.datetime64(int(k.min), 'ns').astype('datetime64[s]')} ({value})"
            print(f"  {k.key:<20} shape {'()':<18} {k.dtype:<9} value {value}")
            continue
        print(f"  {k.key:<20} shape {str(k.shape):<18} {k.dtype:<9} min {num(k.min, ints):<11} "
              f"max {num(k.max, ints):<11} mean {num(k.mean, False):<11} NaN {k.nan}")
    if plotted is not None:
        print(f"wrote {args.plot}: {plotted}")
    return 0


def _plot_axes(source: Any, key: str) -> list[tuple[str, Any]]:
    """(dim, coordinate values or None) of the last two axes of variable ``key``'s samples
    (``target/`` too), as the store names them; [] for another key."""
    name = key.removeprefix("target/")
    if name not in source.names:
        return []
    dims = source.variable(name).dimension_names or ()
    out = []
    for d in list(dims)[-2:]:
        try:
            values = source.coordinate(d) if d else None
        except (KeyError, ValueError):
            values = None
        out.append((str(d), values))
    return out if len(out) == 2 else []


def _plot_sample(parser: argparse.ArgumentParser, sample: dict[str, Any], path: Path,
                 key: str | None, where: str, source: Any = None) -> str:
    """One field of ``sample`` as a PNG at ``path`` (axes of size 1 dropped, further leading
    axes at index 0, a 1-D field as a line); returns what was drawn. A map is drawn on its
    coordinates: latitude up the page (north up, whichever way the store orders it or
    which of its axes comes first, as WB2's lon-major grid), longitude across."""
    import textwrap

    import numpy as np

    try:
        from matplotlib.figure import Figure
    except ImportError:
        parser.error("--plot needs matplotlib: pip install 'insitubatch-nodes[bench]'")
    fields = [k for k, t in sample.items() if t.dim() >= 1 and k != "patch"]
    if key is None:
        key = next((k for k in fields if sample[k].squeeze().dim() >= 2), None) or (
            fields[0] if fields else None)
        if key is None:
            parser.error(f"--plot: the sample has no field to plot (keys {list(sample)})")
    elif key not in fields:
        parser.error(f"--plot-key {key!r} is not a field of the sample; fields: {fields}")
    if not path.parent.is_dir():
        parser.error(f"--plot {str(path)!r}: folder {str(path.parent)!r} does not exist")
    x = sample[key].detach().cpu().float().numpy().squeeze()
    what, taken = key, []
    while x.ndim > 2:
        x = x[0]
        taken.append("0")
    if taken:
        what += f"[{', '.join(taken)}]"
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    drawn = ""
    if x.ndim == 2:
        axes = _plot_axes(source, key) if source is not None else []
        if axes and tuple(x.shape) != tuple(len(v) for _, v in axes if v is not None):
            axes = []  # patched, or no coordinates: index axes
        if axes and "lat" in axes[1][0].lower():  # (lon, lat): latitude to the rows
            x, axes = x.T, axes[::-1]
        if axes:
            (ydim, yv), (xdim, xv) = axes
            north_up = bool(yv[-1] >= yv[0])  # ascending: first row at the bottom
            extent = [float(xv[0]), float(xv[-1]), float(yv[0]), float(yv[-1])]
            im = ax.imshow(x, aspect="auto", interpolation="nearest",
                           origin="lower" if north_up else "upper",
                           extent=extent if north_up else [extent[0], extent[1], extent[3],
                                                           extent[2]])
            ax.set_xlabel(xdim)
            ax.set_ylabel(ydim)
            drawn = f", {ydim} up x {xdim} across"
        else:
            im = ax.imshow(x, aspect="auto", interpolation="nearest")
        fig.colorbar(im, ax=ax)
    else:
        ax.plot(np.asarray(x).reshape(-1))
    ax.set_title("\n".join(textwrap.wrap(f"{what}, {where}", 80)), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return f"{what}, shape {tuple(x.shape)}{drawn}"


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
    channels = _bench_channels(parser, source, args.channels)
    if args.sweep:
        from .bench.sweep import SweepConfig, run_sweep

        run_sweep(SweepConfig(
            url=args.url, variables=variables, batch_size=args.batch_size,
            block_chunks=args.block_chunks or 16, max_inflight=args.max_inflight,
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
        progress=progress, channels=channels, peers=args.peers,
        beluga_modes=args.beluga_modes))
    return 0


def _bench_channels(parser: argparse.ArgumentParser, source: Any,
                    names: list[str] | None) -> tuple[str, ...]:
    """``--channels``: the variables to stack (``all``: every served one), checked to share
    a dtype and a grid, so a bad choice is a usage error before anything is measured."""
    if not names:
        return ()
    chosen = tuple(source.names) if names == ["all"] else tuple(names)
    unknown = [n for n in chosen if n not in source.names]
    if unknown:
        parser.error(f"--channels {' '.join(unknown)}: not served here; choose from "
                     f"{', '.join(source.names)} (or all)")
    geoms = [source.variable(n) for n in chosen]
    kinds = {(str(g.dtype), tuple(g.sample_shape[-2:])) for g in geoms}
    if len(kinds) > 1:
        parser.error(f"--channels {' '.join(chosen)}: the variables differ in dtype or grid "
                     f"({', '.join(f'{g.name} {g.dtype} {g.sample_shape}' for g in geoms)}); "
                     "stack variables of one dtype on one grid")
    return chosen


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
