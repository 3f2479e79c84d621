"""Decoding straight into batch rows (one sample per chunk; several, scattered from a decode
thread's scratch stripe) gives bit for bit the batches of the window-and-gather path, over
every store kind, with exactly-once and exact resume."""


import numpy as np
import pytest
import torch
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from numcodecs import Blosc
from stores import BLOSC, Var, assert_rows_stored, state_after, write_store

import insitubatch_nodes as ib
from insitubatch_nodes.memory.arena import BatchArena

KINDS = {
    "v3-blosc": [Var("x", (97, 6, 5), (1, 6, 5), compressors=BLOSC),
                 Var("y", (97, 4), (1, 4), dtype="int16")],
    "v2-blosc-lz4": [Var("x", (97, 6, 5), (1, 6, 5), zarr_format=2,
                         compressors=Blosc("lz4", 5, Blosc.SHUFFLE)),
                     Var("y", (97, 3, 6, 5), (1, 3, 6, 5), zarr_format=2)],
    "inner-and-edge-chunks": [Var("x", (97, 7, 5), (1, 3, 2), compressors=BLOSC)],
    "sharded": [Var("x", (96, 6, 5), (1, 6, 5), shards=(8, 6, 5))],
    "uint16-uncompressed": [Var("x", (97, 6), (1, 6), dtype="uint16", compressors=None)],
    # several samples per chunk: each chunk decoded once and scattered into its batches
    "many-v3-blosc": [Var("x", (97, 6, 5), (8, 6, 5), compressors=BLOSC),
                      Var("y", (97, 4), (8, 4), dtype="int16")],
    "many-v2-mixed-chunks": [Var("x", (97, 6, 5), (8, 6, 5), zarr_format=2,
                                 compressors=Blosc("lz4", 5, Blosc.SHUFFLE)),
                             Var("y", (97, 3, 6, 5), (4, 3, 6, 5), zarr_format=2)],
    "many-inner-and-edge-chunks": [Var("x", (97, 7, 5), (6, 3, 2), compressors=BLOSC)],
    "many-sharded": [Var("x", (96, 6, 5), (4, 6, 5), shards=(16, 6, 5))],
}
# read by zarr on the event loop (shards): several samples per chunk stay gathered unless
# in_place=True
GATHERED_BY_DEFAULT = {"many-sharded"}


@pytest.fixture(scope="module", params=sorted(KINDS))
def kind(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("inplace") / f"{request.param}.zarr"
    data = write_store(path, KINDS[request.param])
    src = ib.open_source(path)
    return request.param, src, ib.split_by_chunk(src, (0.8, 0.2)), data


def epochs(loader, n=2):
    return [[{k: v.numpy().copy() for k, v in b.items()} for b in loader] for _ in range(n)]


def assert_same(got, want):
    assert len(got) == len(want)
    for eg, ew in zip(got, want, strict=True):
        assert len(eg) == len(ew) > 0
        for g, w in zip(eg, ew, strict=True):
            assert g.keys() == w.keys()
            for k in g:
                assert g[k].dtype == w[k].dtype, k
                np.testing.assert_array_equal(g[k], w[k], err_msg=k)


def is_in_place(loader) -> bool:
    return loader.node(ib.AsyncFetchNode).arena is not None


@settings(max_examples=4, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.integers(1, 40), block=st.integers(2, 20), seed=st.integers(0, 99),
       drop_last=st.booleans())
def test_equal_to_the_gather_path_over_store_kinds(kind, batch, block, seed, drop_last):
    name, src, m, data = kind
    kw = dict(batch_size=batch, block_chunks=block, seed=seed, drop_last=drop_last)
    # (keep_decoded=0: a split that fits in one window is gathered from kept stripes)
    forced = {"in_place": True} if name in GATHERED_BY_DEFAULT else {"keep_decoded": 0}
    if name in GATHERED_BY_DEFAULT:
        with ib.build_loader(src, m, "train", **kw) as default:
            assert not is_in_place(default)
    with ib.build_loader(src, m, "train", **forced, **kw) as new, \
            ib.build_loader(src, m, "train", in_place=False, **{**kw, "workers": 0}) as old:
        assert is_in_place(new) and not is_in_place(old)
        got, want = epochs(new), epochs(old)
    assert_same(got, want)
    assert_rows_stored(got[0], data)  # and the rows are the stored samples


def test_fill_values_of_missing_chunks(tmp_path):
    g = zarr.open_group(tmp_path / "f.zarr", mode="w")
    a = g.create_array("x", shape=(40, 3), chunks=(1, 3), dtype="float32", fill_value=-7.5)
    a[::3] = np.arange(14 * 3, dtype="float32").reshape(14, 3)  # two of three never written
    src = ib.open_source(tmp_path / "f.zarr")
    m = ib.split_by_chunk(src, (1.0,))
    with ib.build_loader(src, m, "train", batch_size=6, block_chunks=5) as new, \
            ib.build_loader(src, m, "train", batch_size=6, block_chunks=5, in_place=False) as old:
        got, want = epochs(new, 1), epochs(old, 1)
    assert_same(got, want)
    assert any((b["x"] == -7.5).any() for b in got[0])


def sample_kwargs(src, m, options):
    """``build_loader`` keywords for the ``weather`` store with ``options``, ``"stats"``
    and ``"static"`` standing for the split's statistics and a land-sea mask."""
    kw = dict(batch_size=7, block_chunks=5, seed=1, **options)
    if kw.get("stats") == "stats":
        kw["stats"] = ib.compute_stats(src, m, "train")
    if kw.get("static") == "static":
        kw["static"] = {"lsm": np.ones((6, 8), np.float32)}
    return kw


def float_epochs(loader, n=2):
    """``epochs``, every tensor as float32 (bfloat16 has no numpy type)."""
    return [[{k: v.float().numpy() for k, v in b.items()} for b in loader] for _ in range(n)]


@pytest.mark.parametrize("options", [
    dict(channels=["z", "t2m"]),
    dict(channels=["t2m", "z"], stats="stats"),
    dict(channels=["z", "t2m"], stats="stats", dtype=torch.bfloat16),
    dict(patch_size=(3, 4)),
    dict(static="static"),
    dict(rank=1, world_size=3, uneven="pad"),
    dict(rank=2, world_size=3, uneven="drop"),
    dict(steps=ib.SampleWindow(2, (1,))),
    dict(steps=ib.SampleWindow(3, (1, 2), stride=2), channels=["z", "t2m"], stats="stats"),
    dict(steps=ib.SampleWindow(1, (2,)), rank=0, world_size=2, drop_last=True),
    # levels split across channels: decoded into scratch, each part copied to its slot
    dict(channels=[("z", 850), "t2m"]),
    dict(channels=[("z", 1000), "t2m", ("z", 500)], stats="stats", dtype=torch.bfloat16),
    dict(channels=[("z", 850), ("z", 500), "t2m"], steps=ib.SampleWindow(2, (1,))),
    dict(channels=[("z", 850), "t2m"], workers=2),
    dict(channels=[("z", 1000), "t2m"], steps=ib.SampleWindow(2, (1, 2)), workers=2),
])
def test_equal_with_sample_options(weather, options):
    src, m = weather
    kw = sample_kwargs(src, m, options)
    with ib.build_loader(src, m, "train", **kw) as new, \
            ib.build_loader(src, m, "train", in_place=False, **{**kw, "workers": 0}) as old:
        assert is_in_place(new)
        got, want = float_epochs(new), float_epochs(old)
    assert_same(got, want)


@pytest.mark.parametrize(("cores", "threads"), [(1, 1), (2, 2), (3, 3), (16, 4), (None, 1)])
def test_default_decode_threads_in_place_are_the_cores(weather, monkeypatch, cores, threads):
    """In place one sample per chunk, no copy runs at all: as many decode threads as cores
    (at most 4), not the one more the gather path takes (tests/test_loader.py); chunks of
    several samples keep it (their row copies on the decode threads)."""
    src, m = weather
    monkeypatch.setattr("os.cpu_count", lambda: cores)
    if src.grid.chunk_size > 1:
        threads = min(4, (cores or 1) + 1)
    with ib.build_loader(src, m, "train", batch_size=8) as ld:
        assert is_in_place(ld) and ld.node(ib.AsyncFetchNode).decode_threads == threads
        assert sorted(i for b in ld for i in b["sample_index"].tolist()) == list(range(80))
    with ib.build_loader(src, m, "train", batch_size=8, in_place=False) as ld:
        assert ld.node(ib.AsyncFetchNode).decode_threads == min(4, (cores or 1) + 1)


def test_channels_that_split_a_chunk_are_in_place(weather):
    """Some levels of a variable (a chunk split across channels) decode in place by default,
    and ``in_place=True`` is accepted for them (it was refused)."""
    src, m = weather
    for in_place in (None, True):
        with ib.build_loader(src, m, "train", channels=[("z", 850), "t2m"],
                             in_place=in_place) as ld:
            assert is_in_place(ld)


def test_several_samples_per_chunk_in_place_on_local_files_only_by_default(tmp_path):
    """Chunks of several samples are scattered into batches on the decode threads of a
    local store; a remote store's reads await on the event loop, so by default its windows
    are gathered, and ``in_place=True`` (a scratch stripe per read) serves the same."""
    from stores import stores_on_s3

    variables = [Var("x", (40, 3, 4), (4, 3, 4), compressors=BLOSC),
                 Var("y", (40, 2), (8, 2), dtype="int16")]
    write_store(tmp_path / "local.zarr", variables)
    local = ib.open_source(tmp_path / "local.zarr")
    kw = dict(batch_size=6, block_chunks=3, seed=3)
    with ib.build_loader(local, ib.split_by_chunk(local, (1.0,)), "train", **kw) as ld:
        assert is_in_place(ld)
        assert ld.node(ib.ChunkPermuteNode).block_chunks == 3
    with ib.build_loader(local, ib.split_by_chunk(local, (1.0,)), "train",
                         batch_size=6) as ld:  # window size is mixing: the gather default
        assert ld.node(ib.ChunkPermuteNode).block_chunks == 16
    with stores_on_s3(tmp_path / "s3", {"s.zarr": variables}) as (server, stored):
        src = ib.open_source("s3://data/s.zarr", storage_options=server.options())
        m = ib.split_by_chunk(src, (1.0,))
        with ib.build_loader(src, m, "train", **kw) as gathered, \
                ib.build_loader(src, m, "train", in_place=True, **kw) as placed:
            assert not is_in_place(gathered) and is_in_place(placed)
            want, got = epochs(gathered), epochs(placed)
    assert_same(got, want)
    assert_rows_stored(got[0], stored["s.zarr"])


@settings(max_examples=5, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.integers(2, 17), block=st.integers(1, 9), stop=st.floats(0, 0.999),
       epoch=st.integers(0, 1))
def test_exact_resume_and_exactly_once(weather, batch, block, stop, epoch):
    src, m = weather
    kw = dict(batch_size=batch, block_chunks=block, seed=4, channels=["z", "t2m"])
    with ib.build_loader(src, m, "train", **kw) as ref:
        full = [[b["sample_index"].tolist() for b in ref] for _ in range(epoch + 2)]
    seen = sorted(i for b in full[epoch] for i in b)
    assert seen == list(range(80))  # exactly once (the split is the whole store)
    k = int(stop * len(full[epoch]))
    with ib.build_loader(src, m, "train", **kw) as a:
        state = state_after(a, k, epochs=epoch)
    with ib.build_loader(src, m, "train", **kw) as b:
        b.load_state_dict(state)
        rest = [x["sample_index"].tolist() for x in b]
        after = [x["sample_index"].tolist() for x in b]
    assert rest == full[epoch][k:]
    assert after == full[epoch + 1]


def test_elastic_resume_in_place(weather):
    src, m = weather
    kw = dict(batch_size=4, block_chunks=3, seed=2, uneven="none")  # exactly once
    states, seen = [], []
    for r in range(2):
        with ib.build_loader(src, m, "train", rank=r, world_size=2, **kw) as ld:
            it = iter(ld)
            for _ in range(3):
                seen += next(it)["sample_index"].tolist()
            states.append(ld.state_dict())
    merged = ib.merge_rank_states(states)
    for r in range(3):
        with ib.build_loader(src, m, "train", rank=r, world_size=3, **kw) as ld:
            assert is_in_place(ld)
            ld.load_state_dict(merged)
            seen += [i for b in ld for i in b["sample_index"].tolist()]
    assert sorted(seen) == list(range(80))


def test_memory_stays_within_the_bound_and_no_batch_lingers(weather):
    src, m = weather
    with ib.build_loader(src, m, "train", batch_size=5, block_chunks=3, seed=0) as ld:
        arena = ld.node(ib.AsyncFetchNode).arena
        assert isinstance(arena, BatchArena)
        for _ in range(2):
            for _ in ld:
                assert ld.ledger.resident <= ld.resident_bound
                assert len(arena) <= 8
        assert 0 < ld.ledger.peak <= ld.resident_bound
        it = iter(ld)
        next(it)
        ld.load_state_dict(ld.state_dict())  # a restore clears what was being filled
        next(iter(ld))
        assert len(arena) <= 8


def test_the_bound_counts_the_stripes_held_for_a_first_batch(tmp_path, monkeypatch):
    """Scattering in place, a start's head window holds its stripes for the copies after
    its first batch while the windows ahead already have their batches: with chunks of 5
    and 12 samples, batches of one and slow reads the ledger went past a bound that did
    not count those stripes (3 of 3 runs; a reviewer's repro)."""
    import time

    from insitubatch_nodes.io.read_paths import LocalFiles

    write_store(tmp_path / "m.zarr", [Var("a", (240, 4, 8), (5, 4, 8), compressors=BLOSC),
                                      Var("b", (240, 4, 8), (12, 4, 8), compressors=BLOSC)])
    slow = LocalFiles.get_scratch

    def get_scratch(self, key):
        time.sleep(0.003)
        return slow(self, key)

    monkeypatch.setattr(LocalFiles, "get_scratch", get_scratch)
    src = ib.open_source(tmp_path / "m.zarr")
    with ib.build_loader(src, ib.split_by_chunk(src, (1.0,)), "train", batch_size=1,
                         block_chunks=2, seed=0) as ld:
        assert is_in_place(ld)
        assert sum(1 for _ in ld) == 240
        it = iter(ld)
        next(it)
        ld.load_state_dict(ld.state_dict())  # a restore's head window holds its stripes too
        assert sum(1 for _ in ld) == 239
        assert 0 < ld.ledger.peak <= ld.resident_bound


def test_time_steps_in_place_resume_exactly_and_cover_every_anchor_once(weather):
    src, m = weather
    win = ib.SampleWindow(2, (1, 3))
    kw = dict(batch_size=6, block_chunks=4, seed=9, steps=win, channels=["z", "t2m"])
    with ib.build_loader(src, m, "train", **kw) as ref:
        assert is_in_place(ref)
        full = [[b["sample_index"].tolist() for b in ref] for _ in range(2)]
    anchors = sorted(i for b in full[0] for i in b)
    assert anchors == list(range(1, 80 - 3))  # every anchor whose steps fit, once
    k = len(full[0]) // 2
    with ib.build_loader(src, m, "train", **kw) as a:
        state = state_after(a, k)
    with ib.build_loader(src, m, "train", **kw) as b:
        b.load_state_dict(state)
        assert [x["sample_index"].tolist() for x in b] == full[0][k:]
        assert [x["sample_index"].tolist() for x in b] == full[1]


@pytest.mark.parametrize("per_chunk", [1, 4])
def test_a_corrupt_chunk_fails_its_batch_by_name_and_again(tmp_path, per_chunk):
    path = tmp_path / "bad.zarr"
    write_store(path, [Var("x", (60, 4), (per_chunk, 4), compressors=BLOSC)])
    bad = 17 // per_chunk  # the chunk holding sample 17
    (path / "x" / "c" / str(bad) / "0").write_bytes(b"garbage, not blosc")
    src = ib.open_source(path)
    with ib.build_loader(src, ib.split_by_chunk(src, (1.0,)), "train", batch_size=4,
                         retry=ib.RetryPolicy(attempts=2, base_delay=0), keep_decoded=0) as ld:
        assert is_in_place(ld)
        it = iter(ld)
        served: list[int] = []
        with pytest.raises(Exception) as info:  # noqa: B017 - the codec's own error type
            for _ in range(100):
                served += next(it)["sample_index"].tolist()
        err = info.value
        assert not isinstance(err, StopIteration)
        notes = "\n".join(getattr(err, "__notes__", []))
        assert f"x/c/{bad}/0" in notes and "into batches" in notes, notes
        # Asking again never moves quietly past the damaged chunk: the batches before its
        # own may come (its window failed them all; they are whole when read again), each
        # once, and then the same error.
        with pytest.raises(type(err)):
            for _ in range(100):
                served += next(it)["sample_index"].tolist()
        lost = set(range(bad * per_chunk, (bad + 1) * per_chunk))
        assert not lost & set(served) and len(served) == len(set(served))
        # a new epoch starts clean and fails again on the same chunk
        with pytest.raises(type(err)):
            for _ in ld:
                pass


def test_batches_go_out_before_their_whole_window_is_decoded(weather, monkeypatch):
    """A batch is handed out once its own rows are in (BatchArena.take): with every chunk
    read slowly, the first batch of one large window arrives while the window is still
    being read."""
    import time

    from insitubatch_nodes.io.read_paths import LocalFiles

    src, m = weather
    slow = LocalFiles.get_scratch

    def get_scratch(self, key):
        time.sleep(0.004)
        return slow(self, key)

    monkeypatch.setattr(LocalFiles, "get_scratch", get_scratch)
    with ib.build_loader(src, m, "train", batch_size=2, block_chunks=80,
                         prefetch_windows=0, keep_decoded=0) as ld:
        fetch = ld.node(ib.AsyncFetchNode)
        first = next(iter(ld))
        pending, finished = fetch.windows_pending()
        assert first["t2m"].shape[0] == 2
        assert pending == 1 and finished == 0  # the window is still being read


@pytest.mark.parametrize(("batch", "at_first", "at_second"), [
    (4, 1, 3),  # the first window alone until its first batch went out; then two ahead
    (12, 3, 4),  # 12 of the first window's 20 draws: two ahead at once; the second batch
                 # runs into the next window, and one more goes ahead
])
def test_windows_ahead_are_planned_once_the_first_batch_went_out(weather, monkeypatch, batch,
                                                                  at_first, at_second):
    """In place the first window goes out undecoded: the windows ahead are planned (a few ms
    on the training thread) once its first batch went out, when the next one is asked for,
    not before it; then ``prefetch_windows`` ahead, as always. Unless the first window holds
    less than a batch more than the first batch (12 of 20 draws): then at once, to keep the
    decode threads busy meanwhile. Chunks of several samples: one window fewer ahead while
    the head window, which holds its stripes for the copies after its first batch, is
    drawn (its stripes take that window's memory)."""
    src, m = weather
    if src.grid.chunk_size > 1:  # (4: one ahead once the first batch went out; 12: one
        at_first, at_second = {4: (1, 2), 12: (2, 4)}[batch]  # at once, then as before)
    plans = []
    real = ib.ReadPlanNode.next

    def counting(self):
        plan = real(self)
        plans.append(plan.window)
        return plan

    monkeypatch.setattr(ib.ReadPlanNode, "next", counting)
    # 20 draws a window (20 chunks of one step, 5 of four)
    with ib.build_loader(src, m, "train", batch_size=batch,
                         block_chunks=20 // src.grid.chunk_size, seed=4,
                         prefetch_windows=2) as ld:
        assert is_in_place(ld)
        for epoch in range(2):
            plans.clear()
            it = iter(ld)
            first = next(it)
            assert len(plans) == at_first, epoch
            second = next(it)
            assert len(plans) == at_second, epoch
            rest = [i for b in it for i in b["sample_index"].tolist()]
            got = first["sample_index"].tolist() + second["sample_index"].tolist() + rest
            assert sorted(got) == list(range(80)), epoch


def test_batches_take_their_memory_as_their_first_row_is_written(weather, monkeypatch):
    """One sample per chunk, each in one slot: a window's batches are expected when it is
    prepared and allocated by their first write, so the memory resident follows the decode
    threads, not the windows prepared ahead. The decode thread is held after the first
    three batches' chunks: with one window for the whole epoch, the ledger then holds those
    batches and the one its next task began, not the epoch's 20 (eager allocation did)."""
    import threading

    from insitubatch_nodes.io.read_paths import LocalFiles

    src, m = weather
    if src.variables[0].sample_chunk != 1:
        pytest.skip("several samples per chunk allocate their window's batches at once")
    read = LocalFiles.get_scratch
    allowed = threading.Semaphore(3 * 4 * 2)  # three batches of 4 samples, 2 variables
    gate = threading.Event()

    def held(self, key):
        if not allowed.acquire(blocking=False):
            gate.wait(30)
        return read(self, key)

    monkeypatch.setattr(LocalFiles, "get_scratch", held)
    with ib.build_loader(src, m, "train", batch_size=4, block_chunks=80, seed=0,
                         decode_threads=1, prefetch_windows=0) as ld:
        batch_bytes = 4 * sum(v.sample_nbytes for v in src.variables)
        it = iter(ld)
        try:
            got = [next(it) for _ in range(3)]
            held_now = ld.ledger.resident
        finally:
            gate.set()  # on a failure too: the held thread must not wait out its timeout
        assert held_now <= 4 * batch_bytes, held_now / batch_bytes
        rest = list(it)
        assert len(got) + len(rest) == 20
        seen = torch.cat([b["sample_index"] for b in got + rest]).sort().values
        assert torch.equal(seen, torch.arange(80))


def test_a_read_of_an_earlier_generation_cannot_take_a_new_batch(weather):
    """After a new epoch or a restore (``clear``), a read prepared before asks for its
    batch's memory and is stopped (``StaleBatch``) instead of writing into the new batch of
    that number; the new generation's reads allocate and fill it."""
    from insitubatch_nodes.memory.arena import StaleBatch
    from insitubatch_nodes.memory.layout import build_layout
    from insitubatch_nodes.memory.ledger import BufferPool, MemoryLedger

    src, _ = weather
    ledger = MemoryLedger()
    arena = BatchArena(build_layout(src.variables), BufferPool(ledger))
    arena.expect(0, 2)
    assert ledger.resident == 0  # expected, not allocated
    old = arena.generation
    first = arena.arrays_of(0, old)
    assert arena.arrays_of(0, old) is first and ledger.resident > 0  # allocated once
    arena.clear()
    arena.expect(0, 2)
    with pytest.raises(StaleBatch, match="batch 0 of generation"):
        arena.arrays_of(0, old)
    new = arena.arrays_of(0, arena.generation)
    assert new is not first
    arena.landed(0, 2 * arena.writes_per_row, arena.generation)
    assert arena.take(0) is new
