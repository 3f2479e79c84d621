"""benchmarks/bench_threads: the loader's CPU and context switches, thread by thread."""

from __future__ import annotations

import json
import sys

import pytest
from stores import BLOSC, Var, write_store

from benchmarks.bench_threads import main
from insitubatch_nodes.io.decode import ChunkDecoder
from insitubatch_nodes.io.read_paths import LocalFiles

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="per-thread figures come from /proc/self/task")


@pytest.mark.parametrize("no_io", [False, True])
def test_every_thread_that_worked_is_reported_and_stubs_are_undone(tmp_path, capsys,
                                                                    monkeypatch, no_io):
    write_store(tmp_path / "s.zarr", [Var("x", (64, 8, 8), (1, 8, 8), compressors=BLOSC)])
    out = tmp_path / "t.json"
    reads = [0]
    real_read = LocalFiles.get_scratch

    def counted(self, key):
        reads[0] += 1
        return real_read(self, key)

    monkeypatch.setattr(LocalFiles, "get_scratch", counted)
    decode = ChunkDecoder.decode_into
    assert main(["--store", str(tmp_path / "s.zarr"), "--seconds", "0.3", "--json", str(out),
                 *(["--no-io"] if no_io else [])]) == 0
    # the file reads were stubbed out for the run (and only for it) with --no-io
    assert (reads[0] == 0) is no_io
    assert (LocalFiles.get_scratch, ChunkDecoder.decode_into) == (counted, decode)
    got = json.loads(out.read_text())
    assert got["no_io"] is no_io and got["samples_per_s"] > 0
    assert got["training_thread_cpu_us_per_sample"] > 0
    assert "training thread" in [t["thread"] for t in got["threads"]]
    assert got["cores"] == pytest.approx(sum(t["cores"] for t in got["threads"]))
    assert "us CPU per sample" in capsys.readouterr().out


def test_a_bad_duration_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--store", str(tmp_path / "none.zarr"), "--seconds", "0"])
    assert "--seconds 0.0" in capsys.readouterr().err
