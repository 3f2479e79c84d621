"""benchmarks/bench_workers: workers against threads, the training process's CPU per sample."""

from __future__ import annotations

import json

from benchmarks.bench_workers import main


def test_every_variant_reports_its_rate_cpu_and_paired_ratio(tmp_path, capsys):
    assert main(["--small", "--out", str(tmp_path), "--workers", "0,2"]) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    rows = {str(r["workers"]): r for r in result["rows"]}
    assert set(rows) == {"0", "2"}
    assert rows["0"]["resolved"] == 0 and rows["2"]["resolved"] == 2
    for r in rows.values():
        assert r["samples_per_s"] > 0 and r["main_cpu_us_per_sample"] > 0
        assert r["first_batch_s"] > 0
    assert rows["0"]["epoch_ratio_vs_0"] == 1.0
    assert "main CPU us/sample" in capsys.readouterr().out
