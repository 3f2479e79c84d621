"""benchmarks/bench_variants: loader variants side by side against the gather floor."""

from __future__ import annotations

import json

import pytest
from stores import BLOSC, Var, write_store

from benchmarks.bench_variants import main, parse_variant


def test_a_variant_is_integer_or_boolean_build_loader_keywords():
    assert parse_variant("prefetch_windows=2,max_inflight=64") == {"prefetch_windows": 2,
                                                                  "max_inflight": 64}
    assert parse_variant("in_place=false,decode_threads=3") == {"in_place": False,
                                                                "decode_threads": 3}
    assert parse_variant("in_place=True") == {"in_place": True}
    assert parse_variant("in_place=none") == {"in_place": None}
    with pytest.raises(SystemExit, match="'decode_threads' is not key=value"):
        parse_variant("decode_threads")
    with pytest.raises(SystemExit, match=r"prefetch_windows='two' is not an integer"):
        parse_variant("prefetch_windows=two")


def test_every_variant_gets_its_paired_ratio(tmp_path, capsys):
    write_store(tmp_path / "s.zarr", [Var("x", (96, 8, 8), (8, 8, 8), compressors=BLOSC)])
    out = tmp_path / "v.json"
    assert main(["--store", str(tmp_path / "s.zarr"), "--variant", "prefetch_windows=1",
                 "--variant", "prefetch_windows=2,decode_threads=3", "--rounds", "3",
                 "--floor-threads", "2,3", "--first-batch", "2", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert [v["variant"] for v in got["variants"]] == ["prefetch_windows=1",
                                                       "prefetch_windows=2,decode_threads=3"]
    assert len(got["floor_seconds"]) == 3 and got["other_cores"] >= 0
    assert len(got["floor_idle_core_s"]) == 3
    assert [f["threads"] for f in got["other_floors"]] == [3]
    assert got["other_floors"][0]["reference_over_this"] > 0
    for v in got["variants"]:
        assert v["median"] > 0 and v["idle_core_s"] == v["idle_core_s"]  # a number, not NaN
        assert min(v["first_batch_s"].values()) > 0
    assert "x floor+copy: median" in capsys.readouterr().out


@pytest.mark.parametrize(("threads", "says"), [("2,x", "give integers"),
                                               ("2,0", "every count must be >= 1")])
def test_floor_threads_must_be_counts(tmp_path, capsys, threads, says):
    with pytest.raises(SystemExit):
        main(["--store", str(tmp_path / "none.zarr"), "--variant", "prefetch_windows=1",
              "--floor-threads", threads])
    assert f"--floor-threads {threads!r}: {says}" in capsys.readouterr().err


def test_a_loader_keyword_that_does_not_exist_is_refused(tmp_path):
    write_store(tmp_path / "s.zarr", [Var("x", (32, 4), (8, 4))])
    with pytest.raises(TypeError, match="no_such_knob"):
        main(["--store", str(tmp_path / "s.zarr"), "--variant", "prefetch_windows=1",
              "--variant", "no_such_knob=1"])
