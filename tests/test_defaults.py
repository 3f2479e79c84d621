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


def _t2m_store(tmp_path):
    import insitubatch_nodes as ib
    from insitubatch_nodes.synthetic import DemoSpec, write_store

    write_store(tmp_path / "s.zarr", DemoSpec(n_times=600, n_lat=8, n_lon=8, time_chunk=1,
                                              seed=0, variables=("t2m",)), zarr_format=2)
    src = ib.open_source(str(tmp_path / "s.zarr"))
    return src, ib.split_by_chunk(src, fractions=(1.0, 0.0, 0.0))


def test_the_default_window_is_the_same_for_every_executor(tmp_path, monkeypatch):
    """One sample per chunk in place, window size does not change the shuffle: ~128 MB (at
    most 512 chunks) whoever decodes (threads, workers, "auto" on any core count), since
    the window is part of the plan; an explicit size is kept."""
    import insitubatch_nodes as ib

    src, m = _t2m_store(tmp_path)
    monkeypatch.setattr(defaults, "WORKERS_FROM_CORES", 4)  # conftest turns "auto" off
    most = defaults.IN_PLACE_WINDOWS[0][1]
    for workers, cores in ((0, 2), (1, 2), ("auto", 2), ("auto", 4)):
        monkeypatch.setenv(defaults.CORES_ENV, str(cores))
        with ib.build_loader(src, m, "train", workers=workers, batch_size=8) as ld:
            assert ld.node(ib.ChunkPermuteNode).block_chunks == most, (workers, cores)
            assert len({int(i) for b in ld for i in b["sample_index"]}) == 600
    with ib.build_loader(src, m, "train", workers=1, batch_size=8, block_chunks=64) as ld:
        assert ld.node(ib.ChunkPermuteNode).block_chunks == 64


def test_a_budget_picks_the_window_without_the_executor(tmp_path):
    """Under a ``memory_budget`` that does not hold the default window the smaller default
    is taken, for threads and workers alike (the window is chosen at the default prefetch);
    workers then go only as deep as the budget holds; below even that, an error naming the
    budget."""
    import insitubatch_nodes as ib

    src, m = _t2m_store(tmp_path)
    with ib.build_loader(src, m, "train", workers=0, batch_size=8, block_chunks=256) as ld:
        fits = ld.resident_bound  # the smaller window at the default prefetch, as the budget
    for workers in (0, 1, 2):
        with ib.build_loader(src, m, "train", workers=workers, batch_size=8,
                             memory_budget=fits) as ld:
            assert ld.node(ib.ChunkPermuteNode).block_chunks == defaults.IN_PLACE_WINDOWS[1][1]
            assert ld.resident_bound <= fits
            assert len({int(i) for b in ld for i in b["sample_index"]}) == 600
    with pytest.raises(ConfigError, match="memory_budget"):  # below even that: named
        ib.build_loader(src, m, "train", workers=1, batch_size=8, memory_budget=fits // 4)


def _auto_lines(caplog, monkeypatch, src, cores, **fetch):
    """The INFO lines ``workers="auto"`` logs on ``cores`` cores per rank."""
    from insitubatch_nodes.config import FetchConfig

    monkeypatch.setenv(defaults.CORES_ENV, str(cores))
    caplog.clear()
    f = FetchConfig(workers="auto", **fetch)
    possible = defaults.in_place_possible(f, None)
    threads = defaults.decode_threads(f, src, possible)
    with caplog.at_level("INFO", logger="insitubatch_nodes"):
        workers = defaults.resolve_workers(src, f, possible, threads)
    return workers, [r.getMessage() for r in caplog.records if r.levelname == "INFO"]


def test_auto_says_what_it_chose(tmp_path, monkeypatch, caplog):
    """``workers="auto"`` logs one INFO line whichever way it goes: worker processes or
    decode threads, how many, and why (the cores per rank and the threshold; or why
    threads). An explicit count logs nothing."""
    from insitubatch_nodes.config import FetchConfig

    src, _ = _t2m_store(tmp_path)
    monkeypatch.setattr(defaults, "WORKERS_FROM_CORES", 4)  # conftest turns "auto" off
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    workers, lines = _auto_lines(caplog, monkeypatch, src, 4)
    assert workers == 3 and len(lines) == 1, lines
    assert lines[0].startswith("insitubatch: decode worker processes, workers='auto' chose 3:")
    assert "4 cores per rank (INSITUBATCH_CORES=4)" in lines[0]
    assert "the 4 from which worker processes start" in lines[0]
    workers, lines = _auto_lines(caplog, monkeypatch, src, 2)
    assert workers == 0 and len(lines) == 1, lines
    # the count said is the loader's own: its fetch runs that many decode threads
    import insitubatch_nodes as ib

    caplog.clear()
    with caplog.at_level("INFO", logger="insitubatch_nodes"), \
            ib.build_loader(src, ib.split_by_chunk(src, (1.0,)), "train") as ld:
        threads = ld.node(ib.AsyncFetchNode).decode_threads
    said = [r.getMessage() for r in caplog.records if "workers='auto' chose" in r.getMessage()]
    assert said == lines, (said, lines)
    assert lines[0].startswith("insitubatch: decode threads, not worker processes: "
                               f"workers='auto' chose {threads} decode threads")
    assert "2 cores per rank" in lines[0] and "start from 4" in lines[0]
    workers, lines = _auto_lines(caplog, monkeypatch, src, 8, in_place=False, decode_threads=3)
    assert workers == 0 and len(lines) == 1, lines
    assert "chose 3 decode threads" in lines[0] and "in_place=False" in lines[0]
    caplog.clear()
    with caplog.at_level("INFO", logger="insitubatch_nodes"):
        assert defaults.resolve_workers(src, FetchConfig(workers=2), True, 1) == 2
    assert not caplog.records


def test_in_place_errors_name_the_keywords(tmp_path):
    """The refusals speak build_loader's keywords (workers=, in_place=), the config field
    in parentheses."""
    import insitubatch_nodes as ib

    src, m = _t2m_store(tmp_path)
    with pytest.raises(ConfigError) as e:
        ib.build_loader(src, m, "train", workers=2, in_place=False)
    msg = str(e.value)
    assert msg.startswith("workers=2 (fetch.workers): ") and "in_place=False" in msg
    assert "fetch.in_place=False" not in msg
