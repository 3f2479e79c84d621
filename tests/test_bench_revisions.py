"""benchmarks/bench_revisions: the loader at two git revisions, paired in one process."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from stores import BLOSC, Var, write_store

from benchmarks.bench_revisions import main

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not (REPO / ".git").exists(), reason="needs the git history")


def test_epochs_and_first_batches_of_both_versions(tmp_path, capsys, monkeypatch):
    import benchmarks.bench_revisions as br

    timed_with: list[str] = []  # the package each first batch was built by
    real = br.time_first_batch

    def recording(*args, build, **kw):
        timed_with.append(build.__module__.split(".")[0])
        return real(*args, build=build, **kw)

    monkeypatch.setattr(br, "time_first_batch", recording)
    write_store(tmp_path / "s.zarr", [Var("x", (96, 8, 8), (8, 8, 8), compressors=BLOSC)])
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                          text=True, check=True).stdout.strip()
    out = tmp_path / "r.json"
    assert main(["--store", str(tmp_path / "s.zarr"), "--baseline-rev", head, "--rounds", "3",
                 "--first-batch", "2", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["baseline_rev"] == head and got["current_rev"] is None
    (res,) = got["results"]
    # each side ran its own copy of the package, not the working tree's
    assert res["loader_modules"]["baseline"].startswith("ib_baseline.")
    assert res["loader_modules"]["current"].startswith("ib_current.")
    assert sorted(timed_with) == ["ib_baseline", "ib_baseline", "ib_current", "ib_current"]
    assert res["baseline_over_current"]["median"] > 0
    assert min(res["epoch_s"].values()) > 0
    for version in ("baseline", "current"):
        assert min(res["first_batch_s"][version].values()) > 0
    assert "paired baseline / current" in capsys.readouterr().out


def test_an_unknown_revision_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--store", str(tmp_path / "s.zarr"), "--baseline-rev", "no-such-rev-xyz"])
    assert "'no-such-rev-xyz' is not a commit" in capsys.readouterr().err


def test_block_chunks_auto_gives_both_loaders_the_loaders_pick(tmp_path):
    write_store(tmp_path / "s.zarr", [Var("x", (96, 8, 8), (1, 8, 8), compressors=BLOSC)])
    out = tmp_path / "r.json"
    assert main(["--store", str(tmp_path / "s.zarr"), "--baseline-rev", "HEAD", "--rounds",
                 "3", "--block-chunks", "auto", "--json", str(out)]) == 0
    (res,) = json.loads(out.read_text())["results"]
    assert res["block_chunks"] > 16  # one sample per chunk: in place, larger windows


def test_a_bad_block_chunks_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--store", str(tmp_path / "s.zarr"), "--baseline-rev", "HEAD",
              "--block-chunks", "many"])
    assert "--block-chunks 'many'" in capsys.readouterr().err
