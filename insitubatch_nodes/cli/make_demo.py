"""``insitubatch make-demo``: a synthetic store in the demo's, WB2's or anemoi's layout.

Refuses to overwrite anything but a Zarr store (and that only with --force), so a typo in
the path never costs a folder.
"""

from __future__ import annotations

import argparse
from pathlib import Path

LAYOUTS = ("era5", "wb2", "anemoi")  # make-demo --layout
SMALL_GRID = (12, 24)  # make-demo --small: (lat, lon)
SMALL_TIMES = 16


def cmd_make_demo(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Write the store ``args`` describe; usage errors (a layout's fixed time chunk, a path
    that is no Zarr store, one without --force) exit 2 before anything is written."""
    from ..synthetic import is_zarr_store

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
        return make_wb2(parser, args, path, n_times, n_lat, n_lon)
    if args.layout == "anemoi":
        return make_anemoi(args, path, n_times, n_lat * n_lon)
    from ..synthetic import VARIABLES, DemoSpec, write_store

    time_chunk = args.time_chunk or 12
    kw = dict(n_lat=n_lat, n_lon=n_lon, time_chunk=time_chunk, seed=args.seed)
    spec = (DemoSpec(n_times=n_times, **kw) if n_times
            else DemoSpec.for_size(args.size_mb, **kw))
    write_store(path, spec, progress=not args.quiet)
    print(f"wrote {path}: {', '.join(VARIABLES)} on (time, lat, lon) = ({spec.n_times}, "
          f"{spec.n_lat}, {spec.n_lon}) float32, {spec.time_chunk} time steps per chunk, "
          f"{spec.nbytes / 1e6:,.0f} MB decoded")
    return 0


def make_wb2(parser: argparse.ArgumentParser, args: argparse.Namespace, path: Path,
              n_times: int | None, n_lat: int, n_lon: int) -> int:
    """``--layout wb2``: WeatherBench2's ERA5 layout, sea-surface temperature NaN over land
    as ERA5 has it, so the missing-value paths are exercised."""
    from ..synthetic import WB2Spec, write_wb2_store

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


def make_anemoi(args: argparse.Namespace, path: Path, n_times: int | None, n_cells: int,
                 ) -> int:
    """``--layout anemoi``: an anemoi dataset of ``n_cells`` flattened cells; without
    ``n_times``, as many dates as ``--size-mb`` holds."""
    from ..synthetic import ANEMOI_VARIABLES, write_anemoi_store

    per_date = len(ANEMOI_VARIABLES) * n_cells * 4
    n = n_times or max(1, int(args.size_mb * 1e6 / per_date))
    write_anemoi_store(path, n_dates=n, n_cells=n_cells, seed=args.seed)
    print(f"wrote {path}: anemoi layout, data (dates, variables, ensemble, cells) = ({n}, "
          f"{len(ANEMOI_VARIABLES)}, 1, {n_cells}) float32, one date per chunk, variables "
          f"{', '.join(ANEMOI_VARIABLES)}, {n * per_date / 1e6:,.0f} MB decoded")
    return 0
