"""What options left to the loader become (defaults.py): the cores it sizes itself for."""

import pytest

from insitubatch_nodes import defaults
from insitubatch_nodes.errors import ConfigError


def test_cores_from_the_environment(monkeypatch):
    monkeypatch.setattr(defaults, "WORKERS_FROM_CORES", 4)  # conftest turns "auto" off
    monkeypatch.setenv(defaults.CORES_ENV, "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert defaults.cores_per_rank() == 8
    assert defaults.default_workers(True) == 7
    assert defaults.default_workers(False) == 0  # decode="gpu" / in_place=False: threads


@pytest.mark.parametrize("bad", ["0", "-2", "four"])
def test_a_bad_core_count_names_the_variable(monkeypatch, bad):
    monkeypatch.setenv(defaults.CORES_ENV, bad)
    with pytest.raises(ConfigError, match=rf"INSITUBATCH_CORES={bad!r}.*whole number"):
        defaults.cores_per_rank()


def test_in_place_windows_of_one_step_chunks_are_bigger_with_workers(tmp_path):
    """One sample per chunk in place, window size does not change the shuffle: ~64 MB (at
    most 256 chunks) on the decode threads, ~128 MB (at most 512) with decode workers, where
    planning a window is most of what the training thread does; an explicit size is kept."""
    import insitubatch_nodes as ib
    from insitubatch_nodes.synthetic import DemoSpec, write_store

    write_store(tmp_path / "s.zarr", DemoSpec(n_times=600, n_lat=8, n_lon=8, time_chunk=1,
                                              seed=0, variables=("t2m",)), zarr_format=2)
    src = ib.open_source(str(tmp_path / "s.zarr"))
    m = ib.split_by_chunk(src, fractions=(1.0, 0.0, 0.0))
    sizes = {}
    for workers in (0, 1):
        with ib.build_loader(src, m, "train", workers=workers, batch_size=8) as ld:
            sizes[workers] = ld.node(ib.ChunkPermuteNode).block_chunks
            assert len({int(i) for b in ld for i in b["sample_index"]}) == 600
    assert sizes == {0: defaults.WINDOW_CHUNKS, 1: defaults.WORKERS_WINDOW_CHUNKS}
    with ib.build_loader(src, m, "train", workers=1, batch_size=8, block_chunks=64) as ld:
        assert ld.node(ib.ChunkPermuteNode).block_chunks == 64


def test_a_budget_that_holds_the_threads_window_keeps_it_with_workers(tmp_path):
    """The workers' bigger default window never turns a ``memory_budget`` that the threads'
    default fits into an error: under such a budget the loader takes the threads' window."""
    import insitubatch_nodes as ib
    from insitubatch_nodes.synthetic import DemoSpec, write_store

    write_store(tmp_path / "s.zarr", DemoSpec(n_times=600, n_lat=8, n_lon=8, time_chunk=1,
                                              seed=0, variables=("t2m",)), zarr_format=2)
    src = ib.open_source(str(tmp_path / "s.zarr"))
    m = ib.split_by_chunk(src, fractions=(1.0, 0.0, 0.0))
    with ib.build_loader(src, m, "train", workers=0, batch_size=8) as ld:
        fits = ld.resident_bound  # the threads' default window, as the budget
    with ib.build_loader(src, m, "train", workers=1, batch_size=8) as ld:
        assert ld.resident_bound > fits  # the workers' window would not fit it
    with ib.build_loader(src, m, "train", workers=1, batch_size=8, memory_budget=fits) as ld:
        assert ld.node(ib.ChunkPermuteNode).block_chunks == defaults.WINDOW_CHUNKS
        assert ld.resident_bound <= fits
        assert len({int(i) for b in ld for i in b["sample_index"]}) == 600
    with pytest.raises(ConfigError, match="memory_budget"):  # below even that: named
        ib.build_loader(src, m, "train", workers=1, batch_size=8, memory_budget=fits // 4)
