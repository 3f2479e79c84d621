"""``insitubatch inspect``: a store's report and advice, or a sample as the loader serves it.

The report is what to decide the loader's knobs from; ``--sample`` shows what the model
would be given, key by key (``--plot`` draws one field of it).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from .open_store import INPUT_ERRORS, fail, message, ome_description, open_store
from .plot_sample import plot_sample


def check_channels(parser: argparse.ArgumentParser, source: Any,
                   names: list[str] | None) -> list[str] | None:
    """``--channels`` as ``build_loader(channels=)`` takes them (``t2m``, ``z@500``: a level
    by its coordinate value), checked against the store first: an unknown variable or
    level, a static field, a channel given twice exit 2 in one line naming the entry and
    what is valid."""
    if not names:
        return None
    from ..nodes.channels import resolve_channels

    try:
        resolve_channels(source, names)
    except INPUT_ERRORS as e:
        fail(parser, f"--channels: {message(e)}")
    return names


def cmd_inspect(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Print the store's report (text or JSON), or with ``--sample`` one sample of it; the
    time steps (``--history``/``--lead``) and ``--channels`` are checked first, so a bad one
    exits 2 in one line. With ``--channels`` the figures are those of a loader given them
    (only their variables read, where ``--variables`` does not name others)."""
    from ..inspection import format_report, inspect_source

    source = open_store(parser, args.url, args.variables)
    steps = None
    if args.history is not None or args.lead is not None:
        from ..sampling.windows import SampleWindow

        try:
            steps = SampleWindow(history=args.history or 1, lead=tuple(args.lead or (1,)))
        except ValueError as e:
            parser.error(f"--history/--lead: {e}")
    if args.sample is None and (args.plot is not None or args.plot_key is not None):
        parser.error("--plot/--plot-key need --sample I: the sample to plot")
    channels = check_channels(parser, source, args.channels)
    if args.sample is not None:
        return inspect_sample(parser, args, source, steps, channels)
    try:
        report = inspect_source(source, quality=args.quality, memory_budget=args.memory,
                                batch_size=args.batch_size,
                                prefetch_windows=args.prefetch_windows,
                                sample_objects=args.sample_objects, steps=steps,
                                channels=channels)
    except INPUT_ERRORS as e:
        fail(parser, message(e))
    if args.json:
        print(json.dumps(report.as_dict(), indent=1))
    else:
        ome = ome_description(args.url)
        if ome is not None:
            print(ome)
        print(format_report(report))
    return 0


def inspect_sample(parser: argparse.ArgumentParser, args: argparse.Namespace, source: Any,
                   steps: Any, channels: list[str] | None = None) -> int:
    """``inspect --sample I``: sample I over the whole store as ``SampleDataset`` (so as the
    loader) serves it, key by key, with ``--channels`` stacked into ``channels`` as the
    loader stacks them; ``--plot`` draws one of its fields."""
    import numpy as np

    from ..dataset import SampleDataset, summarize_sample
    from ..store.splits import split_by_chunk

    try:
        ds = SampleDataset(source, split_by_chunk(source, (1.0,), names=("store",)), "store",
                           steps=steps, channels=channels)
        sample = ds[ds.index_of(args.sample)]
    except (KeyError, ValueError, *INPUT_ERRORS) as e:
        fail(parser, f"--sample {args.sample}: {message(e)}")
    source = ds.source  # with --channels over discovered variables: only theirs
    where = f"sample {args.sample} of {source.url}"
    if source.sample_coord is not None and source.sample_dim is not None:
        value = source.sample_coord[args.sample]
        if isinstance(value, np.datetime64):
            value = value.astype("datetime64[s]")
        where += f" ({source.sample_dim} {value})"
    keys = summarize_sample(sample)
    plotted = (plot_sample(parser, sample, args.plot, args.plot_key, where, source)
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
