"""Peers in ``insitubatch bench``: rows that say why when a peer cannot run, ratios paired per
epoch, and (where installed) zarr-beluga and tensorstore reading the same samples we do.
Nothing here is timed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import insitubatch_nodes as ib
from insitubatch_nodes import cli
from insitubatch_nodes.bench import BELUGA_MODES, PEER_NAMES, PEERS_HINT, peers
from insitubatch_nodes.synthetic import (
    WB2_LEVEL_VARIABLES,
    WB2_SURFACE_VARIABLES,
    WB2_VARIABLES,
    DemoSpec,
    WB2Spec,
    write_store,
    write_wb2_store,
)


@pytest.fixture(scope="module")
def wb2(tmp_path_factory) -> Path:
    return write_wb2_store(tmp_path_factory.mktemp("peers") / "wb2.zarr",
                           WB2Spec.small(n_times=12), progress=False)


@pytest.fixture(scope="module")
def demo_v3(tmp_path_factory) -> Path:
    spec = DemoSpec(n_times=24, n_lat=6, n_lon=8, time_chunk=8)
    return write_store(tmp_path_factory.mktemp("peers") / "demo.zarr", spec, progress=False)


class FakePass:
    """A peer pass with scripted epoch times (``None``: fail that epoch)."""

    peer = "zarr-beluga"

    def __init__(self, name: str, seconds: list[float | None], mode: str = "m") -> None:
        self.name, self.mode, self._seconds = name, mode, list(seconds)
        self.orders: list[np.ndarray] = []
        self.closed = False

    def tensors(self, order):  # pragma: no cover - not used
        return iter(())

    def run_pass(self, order: np.ndarray) -> float:
        self.orders.append(order)
        s = self._seconds.pop(0)
        if s is None:
            raise OSError("disk on fire")
        return s

    def close(self) -> None:
        self.closed = True


def test_the_peers_extra_is_declared():
    import tomllib

    meta = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    extra = " ".join(meta["project"]["optional-dependencies"]["peers"])
    assert "zarr-beluga" in extra and "tensorstore" in extra and "[peers]" in PEERS_HINT


def test_paired_ratios_use_warm_epochs_only():
    assert peers.warm_epochs(5) == [2, 3, 4, 5] and peers.warm_epochs(1) == [1]
    ours = {1: 9.0, 2: 1.0, 3: 2.0, 4: 1.0}
    theirs = {1: 1.0, 2: 2.0, 3: 2.0, 4: 3.0}
    assert peers.paired_ratio(ours, theirs, [2, 3, 4]) == 2.0  # median of 2, 1, 3
    assert peers.paired_ratio(ours, {}, [2]) is None


def test_peers_not_installed_or_remote_are_rows_that_say_so(monkeypatch, demo_v3):
    src = ib.open_source(demo_v3)
    monkeypatch.setattr(peers.importlib.util, "find_spec", lambda name: None)
    passes, missing = peers.open_peers(demo_v3, src, PEER_NAMES, BELUGA_MODES, 4)
    assert passes == [] and [m.peer for m in missing] == list(PEER_NAMES)
    assert all(m.reason == f"not installed ({PEERS_HINT})" for m in missing)
    monkeypatch.undo()
    _, missing = peers.open_peers(None, src, PEER_NAMES, BELUGA_MODES, 4)
    assert {m.reason for m in missing} <= {"local stores only", f"not installed ({PEERS_HINT})"}
    with pytest.raises(ValueError, match="unknown peer 'dali'"):
        peers.open_peers(demo_v3, src, ["dali"], BELUGA_MODES, 4)


def test_peer_epochs_share_one_order_and_report_best_mode_and_failures():
    slow = FakePass("beluga (slow)", [9.0, 4.0, 4.0, 4.0], "per_variable")
    fast = FakePass("beluga (fast)", [9.0, 2.0, 2.0, 2.0], "concurrent")
    flaky = FakePass("flaky", [1.0, None])
    flaky.peer = "tensorstore"
    runs = peers.PeerEpochs([slow, fast, flaky], np.arange(10), seed=0)
    for epoch in range(1, 5):
        runs.run_epoch(epoch)
    assert np.array_equal(np.sort(slow.orders[0]), np.arange(10))
    assert np.array_equal(slow.orders[1], fast.orders[1])  # same order for every peer
    assert not np.array_equal(slow.orders[0], slow.orders[1])  # a new one each epoch
    assert flaky.closed and len(flaky.orders) == 2
    ours = {"per_variable": {e: 1.0 for e in range(1, 5)}}
    rows = peers.peer_results(runs, [peers.Unavailable("tensorstore", "not installed")], 10,
                              100, ours)
    by_name = {r["name"]: r for r in rows}
    assert by_name["beluga (fast)"]["best"] and not by_name["beluga (slow)"]["best"]
    assert by_name["beluga (fast)"]["seconds"] == 2.0  # median of epochs 2-4
    assert by_name["beluga (slow)"]["ratios"]["per_variable"] == 4.0  # ours 4x faster
    assert by_name["flaky"]["status"].startswith("failed: OSError: disk on fire")
    text = peers.format_peers(rows, 4)
    assert "* beluga (fast)" in text and "not installed" in text and "4.00" in text
    md = peers.format_peers_markdown(rows)
    assert "**beluga (fast)** (best)" in md and "| tensorstore | not installed |" in md


def _expected_sample(g, i: int) -> np.ndarray:
    return np.concatenate([g[v][i] for v in WB2_LEVEL_VARIABLES]
                          + [g[v][i][None] for v in WB2_SURFACE_VARIABLES])


@pytest.mark.parametrize("mode", BELUGA_MODES)
def test_beluga_reads_our_wb2_store_in_our_order(wb2, mode):
    pytest.importorskip("beluga")
    import zarr

    p = peers.BelugaPass(wb2, WB2_VARIABLES, mode)
    order = np.array([7, 2, 11, 0])
    got = [x.numpy().copy() for x in p.tensors(order)]
    g = zarr.open_group(wb2, mode="r")
    assert [x.shape for x in got] == [(1, 83, 24, 12)] * 4
    for x, i in zip(got, order, strict=True):
        assert np.array_equal(x[0], _expected_sample(g, int(i)))
    assert p.run_pass(order) > 0
    p.close()


def test_tensorstore_reads_sorted_batches_of_each_variable(wb2, demo_v3):
    pytest.importorskip("tensorstore")
    import zarr

    order = np.array([5, 1, 9, 3, 8])
    for root, names, fmt in ((wb2, ["temperature", "2m_temperature"], 2),
                             (demo_v3, ["t2m", "msl"], 3)):
        p = peers.TensorstorePass(root, names, [fmt] * len(names), batch_size=2)
        got = [x.numpy() for x in p.tensors(order)]
        g = zarr.open_group(root, mode="r")
        want = [g[v][np.sort(order[b:b + 2])] for b in range(0, 5, 2) for v in names]
        assert len(got) == len(want) == 6
        for x, w in zip(got, want, strict=True):
            assert np.array_equal(x, w)
        assert p.run_pass(order) > 0


def test_bench_runs_peers_and_stacked_channels_in_one_run(wb2, tmp_path, monkeypatch, capsys):
    """One bench run: the loader per variable and stacking all 83 channels, zarr-beluga where
    installed, tensorstore reported as not installed (faked): no failure either way."""
    real = peers.importlib.util.find_spec
    monkeypatch.setattr(peers.importlib.util, "find_spec",
                        lambda name: None if name == "tensorstore" else real(name))
    out = tmp_path / "out"
    assert cli.main(["bench", str(wb2), "--out", str(out), "--epochs", "2", "--channels", "all",
                     "--naive-workers", "0", "--naive-samples", "4", "--batch-size", "4",
                     "--block-chunks", "auto", "--resume-after", "1", "--no-plots",
                     "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "channels stacked (11 variables into one 4x83x24x12 tensor)" in text
    res = json.loads((out / "core.json").read_text())
    assert res["channels"]["batch_shape"] == [4, 83, 24, 12]
    assert res["channels"]["ratio_channels_over_per_variable"] > 0
    assert sorted(res["split"]["variables"]) == sorted(WB2_VARIABLES)  # not land_sea_mask
    rows = {r["name"]: r for r in res["peers"]}
    assert rows["tensorstore"]["status"].startswith("not installed")
    ran = [r for r in res["peers"] if r["status"] == "ok"]
    try:
        import beluga  # noqa: F401
    except ImportError:
        assert rows["zarr-beluga"]["status"].startswith("not installed")
    else:
        assert len(ran) == 2 and sum(r["best"] for r in ran) == 1
        for r in ran:
            assert r["samples"] == 12 and r["ratios"]["per_variable"] > 0
            assert r["ratios"]["channels"] > 0
    md = (out / "core.md").read_text()
    assert "| peer |" in md and "not installed" in md


def test_bench_peer_options_are_checked(capsys):
    for argv, words in ((["--peers", "dali"], ["--peers", "zarr-beluga, tensorstore", "'dali'"]),
                        (["--beluga-modes", "fast"], ["--beluga-modes", "per_variable"]),
                        (["--block-chunks", "lots"], ["--block-chunks", "'lots'"])):
        with pytest.raises(SystemExit) as e:
            cli.main(["bench", "x", *argv])
        assert e.value.code == 2
        err = capsys.readouterr().err
        for w in words:
            assert w in err, (w, err)
