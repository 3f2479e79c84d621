"""Batches are a function of the plan, never of the executor: the same seed gives the same
batches whoever decodes them (decode threads, 1-3 worker processes, ``workers="auto"`` on 2,
4 or 16 cores), and a state saved under any executor resumes under any other exactly.

The stores hold more one-step chunks than a default window (640 > 512), so a default that
depended on the executor (it did: 256 chunks on threads, 512 with workers) shows here as
other batches."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from stores import BLOSC, Var, write_store

import insitubatch_nodes as ib
from insitubatch_nodes import defaults
from insitubatch_nodes.config import LoaderConfig
from insitubatch_nodes.graph import resolve
from insitubatch_nodes.synthetic import write_anemoi_store

N = 640  # samples: more one-step chunks than a default window holds
LEVELS = [50, 100, 150, 200, 250, 300, 400, 500, 600, 700, 850, 925, 1000]

# (name, build_loader keywords, cores for "auto"): every way a loader can decode
EXECUTORS = [
    ("threads-1", dict(workers=0, decode_threads=1), None),
    ("threads-4", dict(workers=0, decode_threads=4), None),
    ("workers-1", dict(workers=1), None),
    ("workers-2", dict(workers=2), None),
    ("workers-3", dict(workers=3), None),
    ("auto-4-cores", dict(workers="auto"), 4),
]


def _levels_store(path):
    """WeatherBench2-like: t (N, 13 levels, 2, 3) one step a chunk with its level
    coordinate, and a surface field; a loader takes some levels in a given order."""
    dims = ("time", "lat", "lon")
    data = write_store(path, [
        Var("t", (N, len(LEVELS), 2, 3), (1, len(LEVELS), 2, 3), compressors=BLOSC,
            extra=dict(dimension_names=("time", "level", "lat", "lon"))),
        Var("t2m", (N, 2, 3), (1, 2, 3), compressors=BLOSC, extra=dict(dimension_names=dims))])
    import zarr

    g = zarr.open_group(path)
    g.create_array("level", shape=(len(LEVELS),), dtype="int64",
                   dimension_names=("level",))[:] = LEVELS
    return data


def _layout(name, root):
    """(source, manifest, build_loader keywords) of one layout people train on."""
    if name == "one-sample-per-chunk":
        write_store(root / "one.zarr", [
            Var("a", (N, 3, 4), (1, 3, 4), compressors=BLOSC),
            Var("b", (N, 4), (1, 4), compressors=BLOSC, dtype="float64")])
        src = ib.open_source(root / "one.zarr")
        return src, ib.split_by_chunk(src, (0.9, 0.1)), {}
    if name == "several-per-chunk":
        write_store(root / "several.zarr", [Var("a", (N, 3, 4), (8, 3, 4), compressors=BLOSC)])
        src = ib.open_source(root / "several.zarr")
        return src, ib.split_by_chunk(src, (0.9, 0.1)), {}
    if name == "level-subset":
        _levels_store(root / "levels.zarr")
        src = ib.open_source(root / "levels.zarr", variables=["t", "t2m"])
        return (src, ib.split_by_chunk(src, (1.0,)),
                dict(channels=[("t", 850), ("t", 50), ("t", 500), "t2m"]))
    if name == "anemoi-subset":
        write_anemoi_store(root / "anemoi.zarr", n_dates=N, n_cells=6)
        sub = ib.open_source(root / "anemoi.zarr", variables=["z_850", "2t", "t_500", "10u"])
        return sub, ib.split_by_chunk(sub, (1.0,)), {}
    assert name == "time-steps"
    write_store(root / "steps.zarr", [Var("a", (N, 3, 4), (1, 3, 4), compressors=BLOSC)])
    src = ib.open_source(root / "steps.zarr")
    return src, ib.split_by_chunk(src, (1.0,)), dict(steps=ib.SampleWindow(2, (1,)))


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """name -> (source, manifest, build_loader keywords), each store written when first
    asked for (a test process runs only some of them)."""
    class Layouts(dict):
        def __missing__(self, name):
            self[name] = got = _layout(name, tmp_path_factory.mktemp(name))
            return got

        def all(self):
            return {n: self[n] for n in LAYOUTS}

    return Layouts()


LAYOUTS = ["one-sample-per-chunk", "several-per-chunk", "level-subset", "anemoi-subset",
           "time-steps"]


def _epochs(loader, n=2):
    return [[{k: v.clone() for k, v in b.items()} for b in loader] for _ in range(n)]


def _same(got, want, what):
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.keys() == w.keys(), (what, i)
        for k in w:
            assert np.array_equal(g[k].numpy(), w[k].numpy(), equal_nan=True), (what, i, k)


def _loader(layout, kw, cores, monkeypatch):
    src, m, extra = layout
    if cores is not None:
        monkeypatch.setattr(defaults, "WORKERS_FROM_CORES", 4)  # conftest turns "auto" off
        monkeypatch.setenv(defaults.CORES_ENV, str(cores))
    else:
        monkeypatch.delenv(defaults.CORES_ENV, raising=False)
    return ib.build_loader(src, m, "train", batch_size=10, seed=3, **extra, **kw)


@pytest.mark.parametrize("name", LAYOUTS)
def test_the_seed_decides_the_batches_and_states_move_between_executors(layouts, name,
                                                                        monkeypatch):
    """Two epochs equal under every executor; a state saved under each, mid-epoch (a
    different batch for each), resumes under every other (on the other layouts: under the
    next) to the same batches as the uninterrupted run, this epoch and the next."""
    layout = layouts[name]
    loaders = {}
    try:
        for ex, kw, cores in EXECUTORS:
            loaders[ex] = _loader(layout, kw, cores, monkeypatch)
        assert loaders["auto-4-cores"].workers == 3
        with _loader(layout, {}, None, monkeypatch) as reference:
            want = _epochs(reference, 4)
        n = len(want[0])
        assert n >= 50
        for ex, ld in loaders.items():
            got = _epochs(ld)
            for e in range(2):
                _same(got[e], want[e], (name, ex, "epoch", e))
        states = {}
        for i, (saver, ld) in enumerate(loaders.items()):
            k = 3 + 7 * i  # batches of epoch 2 before the state: a point per executor
            it = iter(ld)
            for _ in range(k):
                next(it)
            states[saver] = k, json.loads(json.dumps(ld.state_dict()))
        names = list(loaders)
        for i, (saver, (k, state)) in enumerate(states.items()):
            # every pair on the layout whose default window the executor used to change;
            # elsewhere each executor resumes the one before it (each saves and resumes)
            others = ([n for n in names if n != saver] if name == "one-sample-per-chunk"
                      else [names[(i + 1) % len(names)]])
            for other in others:
                resumer = loaders[other]
                resumer.load_state_dict(state)
                _same(_epochs(resumer, 1)[0], want[2][k:], (name, saver, "->", other))
                it = iter(resumer)  # the next epoch's start (a later one resets it)
                _same([{k: v.clone() for k, v in next(it).items()} for _ in range(4)],
                      want[3][:4], (name, saver, "->", other, "next epoch"))
    finally:
        for ld in loaders.values():
            ld.shutdown()


def test_auto_plans_the_same_window_on_any_core_count(layouts, monkeypatch):
    """``workers="auto"`` on 2, 4 and 16 cores (threads, 3 and 15 processes) resolves the
    same plan as the threads: window, runs and chunks left out (the executor only decides
    who decodes and how far ahead)."""
    monkeypatch.setattr(defaults, "WORKERS_FROM_CORES", 4)
    for name, (src, m, extra) in layouts.all().items():
        monkeypatch.delenv(defaults.CORES_ENV, raising=False)
        base = resolve(src, m, "train", LoaderConfig.of(batch_size=10, workers=0, **extra))
        for cores in (2, 4, 16):
            monkeypatch.setenv(defaults.CORES_ENV, str(cores))
            auto = resolve(src, m, "train", LoaderConfig.of(batch_size=10, workers="auto",
                                                            **extra))
            assert auto.workers == (0 if cores < 4 else cores - 1)
            assert (auto.block_chunks, auto.run_chunks, auto.excluded) == \
                (base.block_chunks, base.run_chunks, base.excluded), (name, cores)


def test_fifteen_workers_serve_the_threads_batches(layouts, monkeypatch):
    """What "auto" starts on a 16-core node (15 processes) serves the threads' batches."""
    layout = layouts["one-sample-per-chunk"]
    with _loader(layout, dict(workers=0), None, monkeypatch) as threads:
        want = _epochs(threads, 1)
    with _loader(layout, dict(workers="auto"), 16, monkeypatch) as auto:
        assert auto.workers == 15
        _same(_epochs(auto, 1)[0], want[0], "auto on 16 cores")


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    path = tmp_path_factory.mktemp("small") / "s.zarr"
    data = write_store(path, [Var("a", (120, 2, 3), (1, 2, 3), compressors=BLOSC),
                              Var("c", (120, 5), (4, 5), compressors=BLOSC)])
    src = ib.open_source(path)
    return src, ib.split_by_chunk(src, (0.75, 0.25)), data


@settings(max_examples=6, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch_size=st.integers(3, 13), block_chunks=st.integers(1, 12),
       seed=st.integers(0, 3), drop_last=st.booleans(), at=st.floats(0.0, 1.0),
       save_on_workers=st.booleans())
def test_a_state_moves_between_threads_and_workers_at_any_point(
        small, batch_size, block_chunks, seed, drop_last, at, save_on_workers):
    """Over batch sizes, windows, seeds, ``drop_last`` and the point saved at: a state
    saved on the threads resumes on a worker (and back) to the rows the stores hold, each
    sample of the split once, in the uninterrupted run's batches."""
    src, m, data = small
    kw = dict(batch_size=batch_size, block_chunks=block_chunks, seed=seed,
              drop_last=drop_last)
    with ib.build_loader(src, m, "train", workers=0, **kw) as reference:
        want = _epochs(reference, 1)[0]
    k = int(at * (len(want) - 1))
    executors = [dict(workers=0), dict(workers=1)]
    if save_on_workers:
        executors.reverse()
    with ib.build_loader(src, m, "train", **executors[0], **kw) as saver:
        it = iter(saver)
        for _ in range(k):
            next(it)
        state = json.loads(json.dumps(saver.state_dict()))
    with ib.build_loader(src, m, "train", **executors[1], **kw) as resumer:
        resumer.load_state_dict(state)
        rest = _epochs(resumer, 1)[0]
    _same(rest, want[k:], (kw, k))
    served = np.concatenate([b["sample_index"].numpy() for b in want])
    assert len(set(served.tolist())) == served.size
    for b in rest:
        idx = b["sample_index"].numpy()
        np.testing.assert_array_equal(b["a"].numpy(), data["a"][idx])
        np.testing.assert_array_equal(b["c"].numpy(), data["c"][idx])
