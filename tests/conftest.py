"""Shared fixtures: real zarr stores on disk, filled with data we can check rows against."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from stores import BLOSC, Var, write_store, write_weather

import insitubatch_nodes as ib


@pytest.fixture(autouse=True, scope="session")
def _threads_unless_asked():
    """``workers="auto"`` starts a process per core from 4 cores: on a big test machine every
    loader the suite builds would start a dozen. Tests ask for workers where they test
    them (``workers=N``), so the suite runs alike on 2 cores and on a GPU node. With
    ``INSITUBATCH_CORES`` set (``scripts/test``'s second leg), "auto" is left as users on
    that many cores get it."""
    import os

    from insitubatch_nodes import defaults

    if os.environ.get(defaults.CORES_ENV):
        yield
        return
    saved, defaults.WORKERS_FROM_CORES = defaults.WORKERS_FROM_CORES, 10**6
    yield
    defaults.WORKERS_FROM_CORES = saved


@pytest.fixture
def store_factory(tmp_path: Path):
    counter = iter(range(10**6))

    def make(variables: list[Var], seed: int = 0) -> tuple[Path, dict[str, np.ndarray]]:
        path = tmp_path / f"store{next(counter)}.zarr"
        return path, write_store(path, variables, seed)

    return make



@pytest.fixture
def corrupt(tmp_path: Path):
    """A store whose chunk 5 of ``x`` is not blosc at all, and its whole-store split."""
    path = tmp_path / "bad.zarr"
    write_store(path, [Var("x", (64, 4), (8, 4), compressors=BLOSC)])
    (path / "x" / "c" / "5" / "0").write_bytes(b"garbage, not blosc")
    src = ib.open_source(path)
    return src, ib.split_by_chunk(src, (1.0,))


@pytest.fixture(scope="module", params=[1, 4], ids=["1-step", "4-steps"])
def weather(tmp_path_factory, request):
    """A small ERA5-like store (``stores.write_weather``), one time step per chunk or four,
    and a manifest of one split. Modules with a ``weather`` of their own use theirs."""
    path = write_weather(tmp_path_factory.mktemp("wx") / "w.zarr", request.param)
    src = ib.open_source(path, variables=["t2m", "z"])
    return src, ib.split_by_chunk(src, (1.0,))
