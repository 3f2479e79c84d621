"""loader.stats(): the per-stage counters add up (bytes, stripes, chunks, times, starvation)."""

from __future__ import annotations

import dataclasses
import logging
import time

import pytest
from stores import BLOSC, Var

import insitubatch_nodes as ib
from insitubatch_nodes.metrics.loader_stats import LoaderStats
from insitubatch_nodes.nodes import ChunkPermuteNode, ReadPlanNode, SplitNode

# Two variables chunked differently along the sample axis (grid chunk = lcm(6, 4) = 12) and
# one chunked inside a sample, so stripes, chunks and inner chunks all differ.
VARS = [
    Var("a", (150, 6, 5), (6, 6, 5), compressors=BLOSC),
    Var("b", (150, 8), (4, 3)),
]


@pytest.fixture
def source(store_factory):
    path, _ = store_factory(VARS)
    return ib.open_source(path)


def _planned(source, manifest, split, **kw):
    """The read plans the standard graph makes for one epoch."""
    from insitubatch_nodes.graph import build_graph, resolve

    cfg = ib.LoaderConfig.of(seed=kw.get("seed", 0), rank=0, world_size=1,
                             block_chunks=kw["block_chunks"])
    node = build_graph(source, manifest, split, resolve(source, manifest, split, cfg),
                       upto="plan").root
    node.reset()
    return list(node)


def _var_bytes(batch) -> int:
    return sum(t.nbytes for k, t in batch.items() if k != "sample_index")


@pytest.mark.parametrize("batch_size,block_chunks", [(7, 3), (32, 2), (5, 20)])
def test_bytes_stripes_chunks_add_up(source, batch_size, block_chunks):
    manifest = ib.split_by_chunk(source, fractions=(0.7, 0.3), seed=1)
    plans = _planned(source, manifest, "train", block_chunks=block_chunks)
    # (one epoch's reads: the next epoch's first windows are not fetched as it ends)
    with ib.build_loader(source, manifest, "train", batch_size=batch_size,
                         block_chunks=block_chunks, max_inflight=3,
                         prefetch_next_epoch=False) as loader:
        delivered, samples, batches = 0, 0, 0
        for b in loader:
            delivered += _var_bytes(b)
            samples += len(b["sample_index"])
            batches += 1
        s = loader.stats()
    assert isinstance(s, LoaderStats)
    assert s.bytes_delivered == delivered
    assert s.bytes_fetched == sum(p.nbytes for p in plans)
    assert s.stripes_fetched == sum(p.n_reads for p in plans)
    assert s.chunks_fetched == len(manifest.chunk_ids("train"))
    assert s.windows_fetched == len(plans)
    assert (s.batches, s.samples) == (batches, samples) == (s.epoch_batches, s.epoch_samples)
    assert samples == manifest.n_samples_in("train")
    # Every stripe is read once and fully used: only the short last stripes differ.
    assert 1.0 <= s.amplification < 1.25
    assert 1 <= s.peak_stripes_in_flight <= 3
    # grouped by concern, every counter also by its flat name, as_dict flat
    flat = s.as_dict()
    assert flat["bytes_fetched"] == s.fetched.bytes_fetched == s.bytes_fetched
    assert s.progress.epoch_batches == s.epoch_batches and s.consumer.gather_s == s.gather_s
    assert LoaderStats.of(**flat) == s and set(flat) <= set(dir(s))
    with pytest.raises(AttributeError, match="no counter 'bytes'.*bytes_delivered"):
        _ = s.bytes
    with pytest.raises(TypeError, match=r"unknown counters \['nope'\]"):
        LoaderStats.of(**flat, nope=1)
    assert (s.stripes_in_flight, s.windows_in_flight, s.resident_windows) == (0, 0, 0)
    assert s.retries == 0


@pytest.mark.parametrize("in_place", [False, None], ids=["gathered", "scattered"])
def test_starvation_and_stage_times(source, in_place):
    manifest = ib.split_by_chunk(source, fractions=(1.0,), seed=0)
    with ib.build_loader(source, manifest, "train", batch_size=10, block_chunks=4,
                         in_place=in_place) as loader:
        before = loader.stats()
        assert before.epoch_batches == 0 and before.starvation == 0.0
        it = iter(loader)
        next(it)
        mid = loader.stats()
        assert mid.epoch_batches == 1 and mid.starvation > 0.0  # it waited for window 1
        assert mid.resident_bound_bytes == loader.resident_bound
        if in_place is False:
            assert mid.resident_windows == 1 and mid.resident_stripes > 0
            assert 0 < mid.window_occupancy <= 1.0
        else:  # decoded into batches: the shuffle buffer holds no stripes
            assert (loader.node(ib.AsyncFetchNode).arena is not None
                    and mid.resident_stripes == 0 and mid.resident_bytes > 0)
        for _ in it:
            time.sleep(0.01)  # a slow training step: the loader keeps ahead
        s = loader.stats()
    assert s.epoch_wait_s <= s.epoch_wall_s
    assert s.starvation < 0.5  # ~150 ms of sleep against a few ms of waiting
    # The stages are measured, not just a remainder: on CPU the device stage is a
    # pass-through, so what is left after the measured stages is small.
    assert s.gather_s > 0 and s.shuffle_s > 0 and s.schedule_s > 0
    assert s.deliver_s < 0.2 * s.epoch_wait_s + 2e-3
    assert s.store_s > 0 and s.decode_s > 0
    # The epoch ended: its wall clock is frozen.
    time.sleep(0.02)
    assert loader.stats().epoch_wall_s == s.epoch_wall_s


def test_fast_consumer_starves_more_than_slow(source):
    manifest = ib.split_by_chunk(source, fractions=(1.0,), seed=0)
    with ib.build_loader(source, manifest, "train", batch_size=10, block_chunks=2) as loader:
        list(loader)
        fast = loader.stats()
        for _ in loader:
            time.sleep(0.005)
        slow = loader.stats()
    assert slow.epoch == fast.epoch + 1
    assert slow.starvation < fast.starvation
    assert slow.batches == 2 * fast.epoch_batches  # lifetime vs per-epoch counters


def test_stats_after_resume_count_only_this_run(source):
    manifest = ib.split_by_chunk(source, fractions=(1.0,), seed=0)
    kw = dict(batch_size=8, block_chunks=3, seed=4, prefetch_next_epoch=False)  # one epoch
    with ib.build_loader(source, manifest, "train", **kw) as loader:
        it = iter(loader)
        for _ in range(5):
            next(it)
        state = loader.state_dict()
        total = sum(1 for _ in it) + 5
    with ib.build_loader(source, manifest, "train", **kw) as resumed:
        resumed.load_state_dict(state)
        n = sum(1 for _ in resumed)
        s = resumed.stats()
    assert n == total - 5
    assert s.epoch_batches == s.batches == n
    # Resume refetches the head window only: fewer stripes than a whole epoch.
    plans = _planned(source, manifest, "train", **kw)
    assert s.stripes_fetched < sum(p.n_reads for p in plans)


def test_periodic_logging(source, caplog):
    manifest = ib.split_by_chunk(source, fractions=(1.0,), seed=0)
    with caplog.at_level(logging.INFO, logger="insitubatch_nodes"), \
            ib.build_loader(source, manifest, "train", batch_size=4, block_chunks=2,
                            log_every_s=1e-6) as loader:
        for _ in loader:
            time.sleep(0.001)
    lines = [r.getMessage() for r in caplog.records if r.name == "insitubatch_nodes"]
    # the build's one line on the decode threads, then the periodic summaries
    assert lines[0].startswith("insitubatch: decode threads, not worker processes")
    assert len(lines) > 1 and all("starvation" in line for line in lines[1:])
    loader.log_stats_every(None)
    with pytest.raises(ValueError, match="seconds > 0"):
        loader.log_stats_every(0)


def test_stats_is_a_frozen_snapshot(source):
    manifest = ib.split_by_chunk(source, fractions=(1.0,), seed=0)
    with ib.build_loader(source, manifest, "train", batch_size=4) as loader:
        s = loader.stats()
        with pytest.raises(dataclasses.FrozenInstanceError):
            s.batches = 3  # type: ignore[misc]
        d = s.as_dict()
        assert d["batches"] == 0 and "starvation" in s.summary()


def test_hand_built_graph_has_stats(source):
    from insitubatch_nodes.nodes import (
        AsyncFetchNode,
        GatherNode,
        PinOrCudaNode,
        ShuffleBufferNode,
    )

    manifest = ib.split_by_chunk(source, fractions=(1.0,), seed=0)
    node = SplitNode(manifest, "train")
    node = ChunkPermuteNode(node, source.grid, seed=0, rank=0, world_size=1, block_chunks=4)
    node = ReadPlanNode(node, source.variables)
    node = AsyncFetchNode(node, source)
    node = ShuffleBufferNode(node, source.variables, batch_size=16)
    node = GatherNode(node, source.variables)
    node = PinOrCudaNode(node)
    with ib.InSituLoader(node) as loader:
        delivered = sum(_var_bytes(b) for b in loader)
        s = loader.stats()
    assert s.bytes_delivered == delivered
    assert s.resident_bound_bytes is None and s.window_occupancy is None


def test_fetch_counters_change_only_under_their_lock():
    """Local windows count from pool threads, the loop and the consumer at once. (CPython
    3.11 never switches threads inside a plain ``+=``, so lost counts cannot be provoked
    here; what is checked is that every update waits for the counters' lock.)"""
    import threading

    from insitubatch_nodes.metrics.counters import FetchStats

    stats = FetchStats()
    updates = [lambda: stats.slot_taken(0.5), stats.slot_released,
               lambda: stats.stripes_read(2, 8), lambda: stats.window_fetched(3)]
    for update in updates:
        with stats._lock:  # as if another thread were counting
            t = threading.Thread(target=update)
            t.start()
            t.join(0.2)
            assert t.is_alive(), f"{update} changed the counters without the lock"
        t.join()
    assert (stats.slot_wait_s, stats.in_flight, stats.peak_in_flight) == (0.5, 0, 1)
    assert (stats.stripes, stats.bytes_decoded, stats.windows, stats.chunks) == (2, 16, 1, 3)


@pytest.mark.parametrize("in_place", [False, True])
def test_the_fetch_writes_its_shared_counters_only_under_their_lock(store_factory, monkeypatch,
                                                                     in_place):
    """Every counter that pool threads and the consumer share is written with the lock held,
    on both local paths (a write from a caller that skips ``FetchStats``' methods fails the
    epoch: the assertion raises on the thread that wrote)."""
    from insitubatch_nodes.metrics.counters import FetchStats

    shared = {"windows", "chunks", "stripes", "bytes_decoded", "in_flight", "peak_in_flight",
              "slot_wait_s"}
    plain = FetchStats.__setattr__
    writes = []

    def guarded(self, name, value):
        if name in shared and "_lock" in self.__dict__:
            assert self._lock.locked(), f"FetchStats.{name} written without its lock"
            writes.append(name)
        plain(self, name, value)

    monkeypatch.setattr(FetchStats, "__setattr__", guarded)
    src = ib.open_source(store_factory([Var("x", (64, 6), (1, 6), compressors=BLOSC)])[0])
    m = ib.split_by_chunk(src, (1.0,))
    with ib.build_loader(src, m, "train", batch_size=8, in_place=in_place) as loader:
        assert sum(len(b["sample_index"]) for b in loader) == 64
    assert {"windows", "stripes", "in_flight"} <= set(writes)
