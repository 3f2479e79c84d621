"""Shared fixtures: real zarr stores on disk, filled with data we can check rows against;
and how the suite runs on several processes (``scripts/test``: ``pytest -n``)."""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from stores import BLOSC, Var, write_store, write_weather

import insitubatch_nodes as ib

# -- running in parallel (pytest-xdist) ----------------------------------------------------
# Tests in files whose owners mark them themselves: here until they carry
# ``@pytest.mark.serial`` (module file name::test function, every parametrization). /dev/shm
# is the machine's: beside other tests it holds their entries too (a forkserver DataLoader's
# sem.mp-* for seconds, torch_* segments).
SERIAL = {
    "test_workers.py::test_close_shutdown_and_gc_leave_no_process": "compares /dev/shm",
    "test_workers.py::test_a_crash_or_ctrl_c_of_the_training_process_leaves_no_worker":
        "compares /dev/shm; Ctrl-C timing",
    "test_in_place.py::test_batches_go_out_before_their_whole_window_is_decoded":
        "a batch must beat a window of 4 ms reads (failed under -n 2)",
    "test_metrics.py::test_starvation_and_stage_times": "starvation and stage-time bounds",
    "test_metrics.py::test_fast_consumer_starves_more_than_slow": "compares starvation",
    "test_nodes.py::test_close_stops_threads": "a thread gone 50 ms after close",
    "test_structure.py::test_a_torchdata_prefetcher_over_the_graph_is_shut_down_through_it":
        "a thread gone 50 ms after shutdown",
    "test_structure.py::test_loader_shutdown_stops_the_fetch_thread_through_a_prefetcher":
        "a thread gone 50 ms after shutdown",
    "test_structure.py::"
    "test_close_stops_the_thread_and_a_later_epoch_restarts_it_but_shutdown_is_final":
        "a thread gone 50 ms after close",
}

# Modules whose tests start processes (recipes, torchrun, README blocks, decode workers): in
# a parallel run collected first, so that it starts its long tests early and ends on short
# ones, not with one process still running a long test while the others wait. Whole modules
# move, so module-scoped fixtures are still built once per process.
LONG_FIRST = ("test_distributed.py", "test_workers.py", "test_recipes.py", "test_readme.py",
              "test_in_place.py", "test_loader.py", "test_worker_recovery.py",
              "test_dataset.py", "test_cache.py", "test_cli.py", "test_split_layouts.py",
              "test_storage.py", "test_virtual.py")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Several test processes share the cores: one intra-op thread each (and in the
    # processes they start), or torch's OpenMP threads spin against each other (a recipe's
    # epoch went from 0.6 to 5.6 s on 2 cores). Hypothesis' 200 ms deadline would time the
    # neighbour's load, not the example.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    from hypothesis import settings

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    settings.register_profile("parallel", deadline=None)
    settings.load_profile("parallel")


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if f"{item.path.name}::{item.originalname}" in SERIAL:
            item.add_marker(pytest.mark.serial)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        rank = {name: k for k, name in enumerate(LONG_FIRST)}
        items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order


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


@pytest.fixture(scope="session")
def once(tmp_path_factory) -> Callable[[str, Callable[[Path], object]], Path]:
    """``once(name, make)``: a folder that ``make(folder)`` filled once in this whole run,
    whichever test process (``pytest -n``) asks first; the others wait for it under a lock
    and get the same folder. For what is expensive to make and only read afterwards (a
    torchrun job stopped mid-epoch, its store): a module-scoped fixture would make it again
    in every process that runs one of the module's tests."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # this run's, shared by its test processes

    def get(name: str, make: Callable[[Path], object]) -> Path:
        folder = base / f"once-{name}"
        with open(base / f"once-{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if not (folder / ".made").exists():
                shutil.rmtree(folder, ignore_errors=True)  # a failed attempt's
                folder.mkdir()
                make(folder)
                (folder / ".made").touch()
        return folder

    return get


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
