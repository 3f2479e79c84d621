"""insitubatch_nodes.bench.core: what the benchmark times is what it says it times."""

from __future__ import annotations

from stores import BLOSC, Var, write_store

import insitubatch_nodes as ib
from insitubatch_nodes.bench.common import bench_manifest
from insitubatch_nodes.bench.core import CoreConfig, time_first_batch


def test_the_first_batch_after_a_resume_is_a_full_one(tmp_path):
    # 44 samples in batches of 8: resuming 10 batches in would leave the 4-sample remainder
    write_store(tmp_path / "s.zarr", [Var("x", (44, 4, 4), (1, 4, 4), compressors=BLOSC)])
    cfg = CoreConfig(url=str(tmp_path / "s.zarr"), batch_size=8, resume_after=10)
    src = ib.open_source(cfg.url)
    m = bench_manifest(src, 1.0, cfg.seed)
    got = time_first_batch(src, m, cfg, 1)
    k = got["resume_after_batches"]
    assert k >= 1 and (k + 1) * 8 <= 44  # the timed batch after the restore is full
    assert got["first_batch_after_resume_s"] > 0 and got["first_batch_s"] > 0
    # a long epoch keeps the configured point
    assert time_first_batch(src, m, CoreConfig(url=cfg.url, batch_size=2, resume_after=3),
                            1)["resume_after_batches"] == 3
