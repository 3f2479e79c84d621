"""Epoch edges: consecutive epochs with and without the next epoch fetched ahead, paired.

``fetch.prefetch_next_epoch`` (default on) fetches the next epoch's first windows while an
epoch's last batches are drawn, so the next ``iter()`` does not start an empty pipeline. This
times what a training job sees: ``--epochs`` consecutive epochs of one loader, a model step
of ``--step-ms`` per batch (a sleep: the cores are free meanwhile, as under a GPU step), for
each setting in turn, ``--rounds`` rounds in rotating order; each round builds both loaders
fresh, closes each before the other runs (close stops its work ahead; untimed) and collects
it before the next clock starts. Reports per setting the median wait for the first batch of
the epochs after the first and the median wall time of a run, and the median (quartiles) of
the per-round ratios off / on (all rounds in the JSON). Stores with one sample per chunk
are refused: decoded in place, they never fetch ahead. Run on demand, never as a test, from
the repository root::

    .venv/bin/python -m benchmarks.bench_epoch_edges --store DIR/t2m-c8.zarr --rounds 10
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import insitubatch_nodes as ib  # noqa: E402
from insitubatch_nodes.bench.common import (  # noqa: E402
    bench_manifest,
    print_machine,
    rotated,
    write_json,
)

SETTINGS = {"ahead": True, "empty": False}  # name -> prefetch_next_epoch


def run(source: ib.Source, manifest: ib.SplitManifest, ahead: bool, args: argparse.Namespace,
        ) -> tuple[float, list[float]]:
    """Seconds for ``args.epochs`` epochs, and the wait for each epoch's first batch."""
    step = args.step_ms / 1e3
    firsts = []
    with ib.build_loader(source, manifest, "train", batch_size=args.batch_size,
                         block_chunks=args.block_chunks, prefetch_next_epoch=ahead,
                         seed=0) as loader:
        if loader.node(ib.AsyncFetchNode).prefetch_next_epoch is not ahead:
            raise SystemExit(f"bench_epoch_edges: {args.store} is decoded in place (one "
                             "sample per chunk), which never fetches the next epoch ahead: "
                             "both settings would be the same loader")
        t0 = time.perf_counter()
        for _ in range(args.epochs):
            t_iter = time.perf_counter()
            first = True
            for batch in loader:
                if first:
                    firsts.append(time.perf_counter() - t_iter)
                    first = False
                float(batch[source.names[0]].reshape(-1)[0])  # read it, as a model would
                if step:
                    time.sleep(step)
        secs = time.perf_counter() - t0
    return secs, firsts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", required=True, help="a local Zarr store (path or file:// URL)")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--rounds", type=int, default=10, help="even: each setting starts half")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--block-chunks", type=int, default=16)
    p.add_argument("--step-ms", type=float, default=5.0,
                   help="the model's step per batch (a sleep; 0: the loader alone)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args(argv)
    if args.epochs < 2 or args.rounds < 3:
        p.error("need --epochs >= 2 (an epoch edge) and --rounds >= 3 (a median)")
    machine = print_machine()
    source = ib.open_source(args.store)
    manifest = bench_manifest(source, 1.0, 0)
    names = list(SETTINGS)
    run(source, manifest, True, argparse.Namespace(**{**vars(args), "epochs": 1}))  # warm-up
    secs: dict[str, list[float]] = {n: [] for n in names}
    firsts: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        for n in rotated(names, r):
            gc.collect()  # the last loader's windows are freed before this clock starts
            s, f = run(source, manifest, SETTINGS[n], args)
            secs[n].append(s)
            firsts[n] += f[1:]  # the epochs after the first: the edges
    ratio = np.asarray(secs["empty"]) / np.asarray(secs["ahead"])
    out = {"machine": machine, "store": args.store, "epochs": args.epochs,
           "rounds": args.rounds, "batch_size": args.batch_size,
           "block_chunks": args.block_chunks, "step_ms": args.step_ms,
           "median_run_s": {n: float(np.median(secs[n])) for n in names},
           "run_s": secs, "first_batch_s": firsts,
           "median_first_batch_s": {n: float(np.median(firsts[n])) for n in names},
           "empty_over_ahead": {"median": float(np.median(ratio)),
                                "q1": float(np.percentile(ratio, 25)),
                                "q3": float(np.percentile(ratio, 75))}}
    print(f"{args.store}: {args.epochs} epochs, step {args.step_ms} ms, {args.rounds} rounds")
    for n in names:
        print(f"  {n:<6} (prefetch_next_epoch={SETTINGS[n]!s:<5}) run {out['median_run_s'][n]:.3f}"
              f" s, first batch of epochs 2..{args.epochs}: "
              f"{out['median_first_batch_s'][n] * 1e3:.1f} ms (median)")
    e = out["empty_over_ahead"]
    print(f"  paired run time empty / ahead: {e['median']:.3f} (q1 {e['q1']:.3f}, "
          f"q3 {e['q3']:.3f})")
    if args.json is not None:
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
