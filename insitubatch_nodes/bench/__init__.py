"""Benchmarks shipped with the package (``insitubatch bench``): the loader against a naive
per-sample ``DataLoader``, the read floor and peer readers (zarr-beluga, tensorstore), and
sweeps over the knobs that matter.

Needs the ``bench`` extra (``pip install 'insitubatch-nodes[bench]'``: psutil, matplotlib).
"""

from __future__ import annotations

# Peers (``bench/peers.py``): other readers measured on the same store, optional.
PEER_NAMES = ("zarr-beluga", "tensorstore")
BELUGA_ZARR_READ = ("per_variable", "concurrent", "fetch_decode")  # zarr-beluga 0.3's modes
BELUGA_MODES = ("per_variable", "concurrent")  # run by default; the better is reported
PEERS_HINT = "pip install 'insitubatch-nodes[peers]'"

MISSING_HINT = ("insitubatch bench needs the 'bench' extra: pip install "
                "'insitubatch-nodes[bench]' (psutil, and matplotlib for plots; --no-plots "
                "skips matplotlib)")


def missing_bench_deps(plots: bool = True) -> list[str]:
    """Names of the bench extra's packages that are not importable."""
    import importlib.util

    names = ["psutil"] + (["matplotlib"] if plots else [])
    return [n for n in names if importlib.util.find_spec(n) is None]
