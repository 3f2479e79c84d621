"""The loader at two git revisions side by side: epochs and first batches, paired.

A change to the loader's own code (not a setting ``bench_variants`` can vary) is measured
here: both versions of the package are extracted (``git archive``) under different names and
loaded into **one** process, as ``metrics_overhead`` does, each with its own loader on the
same store and its own defaults but ``bench``'s batch size, seed and ``max_inflight``, and
the ``block_chunks`` the working tree's ``bench`` picks (16; larger windows in place).
Epochs alternate between the two (ABBA...); then first batches, fresh and resumed
(``bench``'s ``time_first_batch``, each version's ``build_loader``), alternating as well.
Figures are medians over rounds; the epoch figure is the median of baseline seconds /
current seconds (> 1: the current version is faster). Run on demand, never as a test, from
the repository root::

    .venv/bin/python -m benchmarks.bench_revisions --store /path/t2m-c8.zarr \\
        --baseline-rev 7b33b8a --rounds 20 --first-batch 20
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import insitubatch_nodes as ib  # noqa: E402
from benchmarks.metrics_overhead import imported_revisions, paired_epochs  # noqa: E402
from insitubatch_nodes.bench.common import (  # noqa: E402
    bench_manifest,
    one_epoch_at_a_time,
    print_machine,
    write_json,
)
from insitubatch_nodes.bench.core import (  # noqa: E402
    SPLIT,
    CoreConfig,
    alternating_first_batches,
    loader_block_chunks,
    time_first_batch,
)

NAMES = ("baseline", "current")


def compare(mods: dict[str, Any], store: str, rounds: int, first_batch: int,
            cfg: CoreConfig, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """One store: paired epochs, then paired first batches, of each version's loader;
    ``extra`` options go to both (``workers``, ``channels``)."""
    srcs = {n: mods[n].open_source(store) for n in NAMES}
    mans = {n: bench_manifest(srcs[n], 1.0, cfg.seed, mods[n]) for n in NAMES}
    here = ib.open_source(store)
    block = loader_block_chunks(here, bench_manifest(here, 1.0, cfg.seed), cfg)
    extra = dict(extra or {})
    if extra.pop("stack", False):  # every variable stacked into "channels" (WB2: 83)
        extra["channels"] = list(here.names)
    kw = {**cfg.loader_kwargs(), "block_chunks": block, **extra}
    loaders: dict[str, Any] = {}
    try:  # a version that does not build still stops the other's threads
        for n in NAMES:
            loaders[n] = mods[n].build_loader(srcs[n], mans[n], SPLIT, **kw,
                                              **one_epoch_at_a_time(mods[n]))
        modules = {n: type(loaders[n]).__module__ for n in NAMES}
        times, _, _ = paired_epochs(loaders, rounds, NAMES)
    finally:
        for ld in loaders.values():
            ld.close()
    first = alternating_first_batches(
        {n: partial(time_first_batch, srcs[n], mans[n], cfg, 1, build=mods[n].build_loader,
                    block_chunks=block, **extra) for n in NAMES}, first_batch)
    ratio = np.asarray(times["baseline"]) / np.asarray(times["current"])
    q1, med, q3 = np.percentile(ratio, [25, 50, 75])
    out: dict[str, Any] = {"store": store, "block_chunks": block, "rounds": rounds,
                           "options": {k: (len(v) if k == "channels" else v)
                                       for k, v in extra.items()},
                           "batch_size": cfg.batch_size, "loader_modules": modules,
                           "epoch_s": {n: float(np.median(times[n])) for n in NAMES},
                           "baseline_over_current": {"median": float(med), "q1": float(q1),
                                                     "q3": float(q3)}}
    line = (f"{store} {out['options']}: epoch median baseline "
            f"{out['epoch_s']['baseline']:.3f} s, current "
            f"{out['epoch_s']['current']:.3f} s; paired baseline / current {med:.3f} "
            f"(IQR {q1:.3f}..{q3:.3f}) over {rounds} pairs")
    if first_batch:
        out["first_batch_s"] = {n: {k: float(np.median(v)) for k, v in first[n].items()}
                                for n in NAMES}
        fb = out["first_batch_s"]
        line += (f"; first batch, median fresh / resumed: baseline "
                 f"{fb['baseline']['fresh']:.4f} / {fb['baseline']['resumed']:.4f} s, current "
                 f"{fb['current']['fresh']:.4f} / {fb['current']['resumed']:.4f} s "
                 f"({first_batch} rounds)")
    print(line, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", action="append", required=True, help="a local Zarr store")
    p.add_argument("--baseline-rev", required=True, help="the git revision to compare with")
    p.add_argument("--current-rev", default=None,
                   help="the revision measured against it (default: the working tree)")
    p.add_argument("--rounds", type=int, default=20, help="epochs per version, alternating")
    p.add_argument("--first-batch", type=int, default=0, metavar="ROUNDS",
                   help="also time first batches, fresh and resumed, this many rounds")
    p.add_argument("--batch-size", type=int, default=CoreConfig.batch_size)
    p.add_argument("--block-chunks", default=str(CoreConfig.block_chunks),
                   help="chunks per shuffle window of both loaders, or 'auto' for what the "
                        f"current loader picks (default {CoreConfig.block_chunks}, as figures "
                        "measured before this option were)")
    p.add_argument("--resume-after", type=int, default=CoreConfig.resume_after,
                   help="batches taken before the state a resumed first batch starts from")
    p.add_argument("--workers", type=int, default=None,
                   help="decode worker processes of both loaders (default: theirs)")
    p.add_argument("--stack", action="store_true",
                   help="stack every variable into 'channels' (the WB2 store: 83 channels)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args(argv)
    if args.rounds < 3:
        p.error(f"--rounds {args.rounds}: a median needs at least 3")
    if args.block_chunks != "auto" and not args.block_chunks.isdigit():
        p.error(f"--block-chunks {args.block_chunks!r}: give a whole number of chunks or 'auto'")
    block_chunks = None if args.block_chunks == "auto" else int(args.block_chunks)
    repo = Path(__file__).resolve().parents[1]
    for rev in (args.baseline_rev, args.current_rev):
        if rev is not None and subprocess.run(
                ["git", "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"], cwd=repo,
                capture_output=True).returncode != 0:
            p.error(f"{rev!r} is not a commit of the repository at {repo} (give a hash, tag "
                    "or branch that `git log` shows)")
    machine = print_machine()
    results = []
    with imported_revisions(repo, args.baseline_rev, args.current_rev) as mods:
        print(f"baseline {args.baseline_rev}, current {args.current_rev or 'working tree'}")
        for store in args.store:
            cfg = CoreConfig(url=store, batch_size=args.batch_size,
                             resume_after=args.resume_after, block_chunks=block_chunks)
            extra: dict[str, Any] = {"stack": args.stack}
            if args.workers is not None:
                extra["workers"] = args.workers
            results.append(compare(mods, store, args.rounds, args.first_batch, cfg, extra))
    if args.json is not None:
        write_json(args.json, {"machine": machine, "baseline_rev": args.baseline_rev,
                               "current_rev": args.current_rev, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
