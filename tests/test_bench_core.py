"""insitubatch_nodes.bench.core: what the benchmark times is what it says it times."""

from __future__ import annotations

from stores import BLOSC, Var, write_store

import insitubatch_nodes as ib
from insitubatch_nodes.bench.common import bench_manifest, one_epoch_at_a_time
from insitubatch_nodes.bench.core import CoreConfig, LoaderEpochs, time_first_batch


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


def test_epochs_timed_in_turn_with_other_paths_start_empty(tmp_path):
    """A benchmark's loader does not fetch its next epoch while the paths beside it are
    timed (that work would count in their time, not its own); an older version without the
    option gets no keyword."""
    import types

    write_store(tmp_path / "s.zarr", [Var("x", (40, 3), (4, 3), compressors=BLOSC)])
    cfg = CoreConfig(url=str(tmp_path / "s.zarr"), batch_size=8)
    src = ib.open_source(cfg.url)
    runs = LoaderEpochs(src, bench_manifest(src, 1.0, cfg.seed), cfg)
    try:
        assert runs.loader.node(ib.AsyncFetchNode).prefetch_next_epoch is False
    finally:
        runs.loader.close()
    assert one_epoch_at_a_time() == {"prefetch_next_epoch": False}
    assert one_epoch_at_a_time(types.SimpleNamespace()) == {}
