"""Benchmarks shipped with the package (``insitubatch bench``): the loader against a naive
per-sample ``DataLoader`` and the read floor, and sweeps over the knobs that matter.

Needs the ``bench`` extra (``pip install 'insitubatch-nodes[bench]'``: psutil, matplotlib).
"""

from __future__ import annotations

MISSING_HINT = ("insitubatch bench needs the 'bench' extra: pip install "
                "'insitubatch-nodes[bench]' (psutil, and matplotlib for plots; --no-plots "
                "skips matplotlib)")


def missing_bench_deps(plots: bool = True) -> list[str]:
    """Names of the bench extra's packages that are not importable."""
    import importlib.util

    names = ["psutil"] + (["matplotlib"] if plots else [])
    return [n for n in names if importlib.util.find_spec(n) is None]
