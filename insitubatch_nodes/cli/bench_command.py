"""``insitubatch bench``: the loader against a naive DataLoader, floors, peers; or --sweep.

Checks what it can before anything is measured (the bench extra installed, the store,
the output folder, the batch size, the channels to stack), so a long run never fails late.
"""

from __future__ import annotations

import argparse
from typing import Any

from .open_store import fail, open_store


def cmd_bench(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Run the core benchmark (or ``--sweep``) on the store; every usage error is found
    before the first measurement, so a long run never stops on a bad option."""
    from ..bench import MISSING_HINT, missing_bench_deps

    missing = missing_bench_deps(plots=not args.no_plots)
    if missing:
        parser.error(f"{MISSING_HINT}; missing here: {', '.join(missing)}")
    source = open_store(parser, args.url, args.variables)
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {str(args.out)!r} is a file; give a folder")
    if args.batch_size > source.n_samples:
        parser.error(f"--batch-size {args.batch_size} exceeds the store's {source.n_samples} "
                     "samples")
    variables = list(source.names)
    progress = not args.quiet
    channels = bench_channels(parser, source, args.channels)
    if args.sweep:
        from ..bench.sweep import SweepConfig, run_sweep

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
    from ..bench.core import CoreConfig, run_core

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


def bench_channels(parser: argparse.ArgumentParser, source: Any,
                    names: list[str] | None) -> tuple[str, ...]:
    """``--channels``: the variables to stack (``all``: every served one), checked to share
    a dtype and a grid, so a bad choice is a usage error before anything is measured."""
    if not names:
        return ()
    chosen = tuple(source.names) if names == ["all"] else tuple(names)
    unknown = [n for n in chosen if n not in source.names]
    if unknown:
        fail(parser, f"--channels {' '.join(unknown)}: not served here; choose from "
                     f"{', '.join(source.names)} (or all)")
    geoms = [source.variable(n) for n in chosen]
    kinds = {(str(g.dtype), tuple(g.sample_shape[-2:])) for g in geoms}
    if len(kinds) > 1:
        fail(parser, f"--channels {' '.join(chosen)}: the variables differ in dtype or grid "
                     f"({', '.join(f'{g.name} {g.dtype} {g.sample_shape}' for g in geoms)}); "
                     "stack variables of one dtype on one grid")
    return chosen
