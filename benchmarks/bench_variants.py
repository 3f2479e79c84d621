"""Loader settings side by side, each against the gather floor in the same round.

Where a setting changes speed by a few percent, runs taken minutes apart on a shared VM
cannot tell (their noise is tens of percent). Here every variant is a loader of its own in
**one** process, and each round times the gather floor ("floor + one gather copy" of
``insitubatch bench``) and then every variant, in a rotating order; a variant's figure is
the median over rounds of floor seconds / its seconds. Also per variant: the core-seconds
each epoch leaves idle (cores x wall - process CPU), and with ``--first-batch N`` the median
first batch, fresh and resumed (``bench``'s ``time_first_batch``); ``--floor-threads 2,3``
times floors of other thread counts against the first. The measurement behind the defaults
``prefetch_windows`` and ``decode_threads`` (DESIGN.md "Prefetch depth on local disks",
"Decode threads"). Run on demand, never as a test, from the repository root::

    .venv/bin/python -m benchmarks.bench_variants --store bench-out/era5-c8.zarr \\
        --variant prefetch_windows=1 --variant prefetch_windows=2 --rounds 30
    .venv/bin/python -m benchmarks.bench_variants --store bench-out/era5-c24.zarr \\
        --variant prefetch_windows=1,decode_threads=2 --variant decode_threads=3 \\
        --floor-threads 2,3 --first-batch 15

A variant is ``key=value[,key=value]`` of ``build_loader`` integer keywords; every variant
also gets ``bench``'s batch size (32), seed and ``block_chunks`` (16, not the loader's own
default: windows of one-sample chunks decoded in place are larger by default), and the
floor shuffles in windows of that size.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from functools import partial
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import insitubatch_nodes as ib  # noqa: E402
from insitubatch_nodes.bench.common import (  # noqa: E402
    OtherLoad,
    bench_manifest,
    consume,
    one_epoch_at_a_time,
    print_machine,
    rotated,
)
from insitubatch_nodes.bench.core import (  # noqa: E402
    SPLIT,
    CoreConfig,
    GatherFloor,
    alternating_first_batches,
    loader_block_chunks,
    time_first_batch,
)

_WORDS: dict[str, bool | None] = {"true": True, "false": False, "none": None}


def parse_variant(text: str) -> dict[str, int | bool | None]:
    """``"prefetch_windows=2,in_place=false"`` -> keywords; an error names the bad part."""
    out: dict[str, int | bool | None] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"--variant {text!r}: {part!r} is not key=value")
        word = value.strip().lower()
        if word in _WORDS:
            out[key.strip()] = _WORDS[word]
            continue
        try:
            out[key.strip()] = int(value)
        except ValueError:
            raise SystemExit(f"--variant {text!r}: {key.strip()}={value!r} is not an integer "
                             "nor true/false/none (variants set build_loader keywords)"
                             ) from None
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", required=True, help="a local Zarr store (path or file:// URL)")
    p.add_argument("--variant", action="append", required=True,
                   help="build_loader keywords, key=value[,key=value] (integers, "
                        "true/false/none); repeatable")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--floor-threads", default=None,
                   help="decode threads of the gather floor, comma-separated: the first is "
                        "the reference, the others are timed against it (default: bench's)")
    p.add_argument("--first-batch", type=int, default=0, metavar="ROUNDS",
                   help="also time each variant's first batch, fresh and resumed, this many "
                        "rounds (bench's time_first_batch, variants alternating)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args(argv)
    if args.rounds < 3:
        p.error(f"--rounds {args.rounds}: a median needs at least 3")
    variants = {v: parse_variant(v) for v in args.variant}
    cfg = CoreConfig(url=args.store)
    try:
        threads = ([int(t) for t in args.floor_threads.split(",")] if args.floor_threads
                   else [cfg.floor_threads])
    except ValueError:
        p.error(f"--floor-threads {args.floor_threads!r}: give integers, e.g. 2,3")
    if min(threads) < 1:
        p.error(f"--floor-threads {args.floor_threads!r}: every count must be >= 1")
    machine = print_machine()
    source = ib.open_source(args.store)
    manifest = bench_manifest(source, 1.0, cfg.seed)
    block = loader_block_chunks(source, manifest, cfg)
    floors = [GatherFloor(source, manifest.chunk_ids(SPLIT), t, block, cfg.batch_size,
                          cfg.seed) for t in threads]
    floor = floors[0]
    n_batches = -(-manifest.n_samples_in(SPLIT) // cfg.batch_size)

    cores = os.cpu_count() or 1
    idle: dict[str, list[float]] = {}  # core-seconds left idle per epoch: cores x wall - CPU

    def epoch_seconds(name: str) -> float:
        """One epoch, each batch touched as a model would (``consume``, as ``bench``)."""
        _, secs, _, used = consume(loaders[name], n_batches, "", source.names[0],
                                   progress=False)
        idle.setdefault(name, []).append(cores * secs - float(used[0]))
        return secs

    loaders: dict[str, ib.InSituLoader] = {}
    try:  # a variant that does not build still stops the floor's and the others' threads
        with OtherLoad() as other:
            for name, kw in variants.items():
                loaders[name] = ib.build_loader(source, manifest, SPLIT, **{
                    **cfg.loader_kwargs(), "block_chunks": block, **one_epoch_at_a_time(),
                    **kw})
            names = list(loaders)
            for _ in range(2):  # warm-up: threads, first touch of buffers and code
                for fl in floors:
                    fl.run_pass()
                for n in names:
                    epoch_seconds(n)
            idle.clear()
            ratios: dict[str, list[float]] = {n: [] for n in names}
            floor_s: list[float] = []
            other_floors: list[list[float]] = [[] for _ in floors[1:]]
            for r in range(args.rounds):
                f = floor.run_pass()
                floor_s.append(f)
                for k, fl in enumerate(floors[1:]):
                    other_floors[k].append(f / fl.run_pass())
                for n in rotated(names, r):
                    ratios[n].append(f / epoch_seconds(n))
            overrides: dict[str, dict[str, Any]] = {  # build_loader keywords per variant
                n: {"block_chunks": block, **variants[n]} for n in names}
            first = alternating_first_batches(
                {n: partial(time_first_batch, source, manifest, cfg, 1, **overrides[n])
                 for n in names},
                args.first_batch)
    finally:
        for fl in floors:
            fl.close()
        for ld in loaders.values():
            ld.close()
    print(f"store {source.url}: block_chunks {block}, batch {cfg.batch_size}, "
          f"{args.rounds} rounds; floor + one gather copy: median {np.median(floor_s):.3f} s; "
          f"other processes used {other.cores:.2f} cores meanwhile")
    floor_idle = [cores * s - float(u[0]) for s, u in zip(floor.seconds[-args.rounds:],
                                                          floor.usage[-args.rounds:],
                                                          strict=True)]
    print(f"  gather floor, {threads[0]} threads: idle core-ms per pass, median "
          f"{1e3 * np.median(floor_idle):.1f}")
    floor_rows = []
    for t, rel in zip(threads[1:], other_floors, strict=True):
        floor_rows.append({"threads": t, "reference_over_this": float(np.median(rel))})
        print(f"  gather floor, {t} threads: {threads[0]}-thread seconds / these, median "
              f"{np.median(rel):.3f}")
    rows = []
    for n in names:
        a = np.asarray(ratios[n])
        q1, med, q3 = np.percentile(a, [25, 50, 75])
        row: dict[str, Any] = {"variant": n, "median": float(med), "q1": float(q1),
                               "q3": float(q3), "idle_core_s": float(np.median(idle[n]))}
        line = (f"  {n:40s} x floor+copy: median {med:.3f} (IQR {q1:.3f}..{q3:.3f}); idle "
                f"core-ms per epoch {1e3 * row['idle_core_s']:.1f}")
        if args.first_batch:
            row["first_batch_s"] = {k: float(np.median(v)) for k, v in first[n].items()}
            line += (f"; first batch, median fresh / resumed "
                     f"{row['first_batch_s']['fresh']:.3f} / "
                     f"{row['first_batch_s']['resumed']:.3f} s")
        rows.append(row)
        print(line)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": machine, "store": source.url,
                                         "block_chunks": block, "rounds": args.rounds,
                                         "other_cores": other.cores,
                                         "floor_threads": threads, "floor_seconds": floor_s,
                                         "floor_idle_core_s": floor_idle,
                                         "other_floors": floor_rows, "variants": rows},
                                        indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
