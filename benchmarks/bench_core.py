"""Core benchmark: the insitubatch loader against a naive DataLoader and the read floor.

A thin wrapper kept so the original command still works; the benchmark itself lives in
``insitubatch_nodes.bench.core`` (``insitubatch bench URL`` runs it on any store). Run on
demand, never as a test, from the repository root::

    .venv/bin/python -m benchmarks.bench_core            # or: python benchmarks/bench_core.py

It writes its synthetic store (one variable, ``t2m``, (2000, 181, 360) float32, 8 steps per
chunk, blosc-zstd) to ``--path`` and then measures every path on it.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from insitubatch_nodes.bench.core import legacy_main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(legacy_main())
