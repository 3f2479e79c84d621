"""Loader settings side by side, each against the gather floor in the same round.

Where a setting changes speed by a few percent, runs taken minutes apart on a shared VM
cannot tell (their noise is tens of percent). Here every variant is a loader of its own in
**one** process, and each round times the gather floor ("floor + one gather copy" of
``insitubatch bench``) and then every variant, in a rotating order; a variant's figure is
the median over rounds of floor seconds / its seconds. The measurement behind the default
``prefetch_windows`` (DESIGN.md "Prefetch depth on local disks"). Run on demand, never as a
test, from the repository root::

    .venv/bin/python -m benchmarks.bench_variants --store bench-out/era5-c8.zarr \\
        --variant prefetch_windows=1 --variant prefetch_windows=2 --rounds 30

A variant is ``key=value[,key=value]`` of ``build_loader`` integer keywords; every variant
also gets the benchmark's batch size, seed, decode threads and the ``block_chunks`` the
loader picks by default (the floor shuffles in windows of that size).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import insitubatch_nodes as ib  # noqa: E402
from insitubatch_nodes.bench.common import (  # noqa: E402
    OtherLoad,
    bench_manifest,
    consume,
    print_machine,
)
from insitubatch_nodes.bench.core import (  # noqa: E402
    SPLIT,
    CoreConfig,
    GatherFloor,
    loader_block_chunks,
)


def parse_variant(text: str) -> dict[str, int]:
    """``"prefetch_windows=2,max_inflight=64"`` -> keywords; an error names the bad part."""
    out: dict[str, int] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"--variant {text!r}: {part!r} is not key=value")
        try:
            out[key.strip()] = int(value)
        except ValueError:
            raise SystemExit(f"--variant {text!r}: {key.strip()}={value!r} is not an integer "
                             "(variants set integer build_loader keywords)") from None
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", required=True, help="a local Zarr store (path or file:// URL)")
    p.add_argument("--variant", action="append", required=True,
                   help="build_loader integer keywords, key=value[,key=value]; repeatable")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args(argv)
    if args.rounds < 3:
        p.error(f"--rounds {args.rounds}: a median needs at least 3")
    variants = {v: parse_variant(v) for v in args.variant}
    machine = print_machine()
    cfg = CoreConfig(url=args.store)
    source = ib.open_source(args.store)
    manifest = bench_manifest(source, 1.0, cfg.seed)
    block = loader_block_chunks(source, manifest, cfg)
    floor = GatherFloor(source, manifest.chunk_ids(SPLIT), cfg.floor_threads, block,
                        cfg.batch_size, cfg.seed)
    n_batches = -(-manifest.n_samples_in(SPLIT) // cfg.batch_size)

    def epoch_seconds(loader: ib.InSituLoader) -> float:
        """One epoch, each batch touched as a model would (``consume``, as ``bench``)."""
        return consume(loader, n_batches, "", source.names[0], progress=False)[1]

    loaders: dict[str, ib.InSituLoader] = {}
    other = OtherLoad().__enter__()
    try:  # a variant that does not build still stops the floor's and the others' threads
        for name, kw in variants.items():
            loaders[name] = ib.build_loader(source, manifest, SPLIT, **{
                **cfg.loader_kwargs(), "block_chunks": block, **kw})
        for _ in range(2):  # warm-up: threads, first touch of buffers and code
            floor.run_pass()
            for ld in loaders.values():
                epoch_seconds(ld)
        names = list(loaders)
        ratios: dict[str, list[float]] = {n: [] for n in names}
        floor_s = []
        for r in range(args.rounds):
            f = floor.run_pass()
            floor_s.append(f)
            for n in names[r % len(names):] + names[: r % len(names)]:
                ratios[n].append(f / epoch_seconds(loaders[n]))
    finally:
        other.__exit__()
        floor.close()
        for ld in loaders.values():
            ld.close()
    print(f"store {source.url}: block_chunks {block}, batch {cfg.batch_size}, "
          f"{args.rounds} rounds; floor + one gather copy: median {np.median(floor_s):.3f} s; "
          f"other processes used {other.cores:.2f} cores meanwhile")
    rows = []
    for n in names:
        a = np.asarray(ratios[n])
        q1, med, q3 = np.percentile(a, [25, 50, 75])
        rows.append({"variant": n, "median": float(med), "q1": float(q1), "q3": float(q3)})
        print(f"  {n:40s} x floor+copy: median {med:.3f} (IQR {q1:.3f}..{q3:.3f})")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": machine, "store": source.url,
                                         "block_chunks": block, "rounds": args.rounds,
                                         "other_cores": other.cores,
                                         "floor_seconds": floor_s, "variants": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
