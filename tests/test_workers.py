"""Decode worker processes (``workers=N``): bit for bit the batches of the decode threads over
the store kinds, exactly once and exact resume with any number of workers, errors and dead
workers that lose nothing (tests/test_worker_recovery.py), and no process or shared-memory
segment left behind."""

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from stores import (
    BLOSC,
    Var,
    assert_rows_stored,
    state_after,
    stores_on_s3,
    write_store,
)
from test_in_place import (
    GATHERED_BY_DEFAULT,
    KINDS,
    assert_same,
    epochs,
    float_epochs,
    sample_kwargs,
)
from test_jobs import FakeArena, check_window

import insitubatch_nodes as ib
from insitubatch_nodes.sampling.plan import BatchSlots, ReadPlan
from insitubatch_nodes.workers import jobs as J
from insitubatch_nodes.workers.engine import CREDIT, WorkerError
from insitubatch_nodes.workers.shared_memory import SharedMemoryArena, array_at, map_segment

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="workers need Unix sockets")


def engine_of(loader):
    return loader.node(ib.AsyncFetchNode).engine


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by a parent that is gone) counts as gone
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # it exited while being read
        return False


def wait_gone(pids, timeout=10.0) -> list[int]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


# -- the memory --------------------------------------------------------------------------
def test_shared_memory_is_seen_by_a_second_mapping_and_blocks_are_reused():
    arena = SharedMemoryArena(segment_bytes=1 << 16)
    a = arena.allocate((4, 5), np.float32)
    b = arena.allocate((3, 1000), np.int16)
    c = arena.allocate((20000,), np.float64)  # bigger than a segment: its own
    assert len(arena.segments) == 2
    other = {s.index: map_segment(s.index, os.dup(s.fd), s.nbytes) for s in arena.segments}
    for arr, fill in ((a, 1.5), (b, 7), (c, -2.0)):
        place = arena.place(arr)
        view = array_at(other, place)
        assert view.shape == arr.shape and view.dtype == arr.dtype
        view[...] = fill  # written through the other mapping ...
        assert (arr == fill).all()  # ... read here
    first = arena.place(a)
    del a
    gc.collect()
    again = arena.allocate((4, 5), np.float32)  # the freed block, not a new one
    assert arena.place(again)[:2] == first[:2]
    with pytest.raises(ValueError, match="not a contiguous block"):
        arena.place(np.zeros(3))
    arena.close()
    with pytest.raises(RuntimeError, match="closed"):
        arena.allocate((1,), np.float32)


def test_a_block_is_found_by_its_buffer_and_freed_once_its_last_view_is_gone():
    """``where`` finds a whole block by its buffer (a pooled batch is a view of it) and
    reads the address of anything else; a view outliving the array it was made from keeps
    the block from being handed out again."""
    arena = SharedMemoryArena(segment_bytes=1 << 16)
    a = arena.allocate((4, 5), np.float32)
    seg, offset = arena.place(a)[:2]
    assert arena.where(a) == arena.where(a.view()) == (seg, offset)
    assert arena.where(a[1:]) == (seg, offset + 20)  # contiguous, not the whole block
    with pytest.raises(ValueError, match="not a contiguous block"):
        arena.where(a[:, :2])
    view = a.view()
    del a
    gc.collect()
    b = arena.allocate((4, 5), np.float32)
    assert arena.place(b)[:2] != (seg, offset)  # still in use, through ``view``
    del view
    gc.collect()
    c = arena.allocate((4, 5), np.float32)
    assert arena.place(c)[:2] == (seg, offset)  # free once its last view went
    assert arena.where(c.view()) == (seg, offset)
    arena.close()


# -- bit for bit -------------------------------------------------------------------------
@pytest.fixture(scope="module", params=sorted(KINDS))
def kind(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("workers") / f"{request.param}.zarr"
    data = write_store(path, KINDS[request.param])
    src = ib.open_source(path)
    return request.param, src, ib.split_by_chunk(src, (0.8, 0.2)), data


@settings(max_examples=1, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.integers(2, 40), block=st.integers(2, 20), seed=st.integers(0, 99),
       drop_last=st.booleans(), workers=st.integers(1, 3))
@example(batch=7, block=5, seed=3, drop_last=True, workers=3)
def test_equal_to_the_decode_threads_over_store_kinds(kind, batch, block, seed, drop_last,
                                                       workers):
    """Two examples a store kind (one of them three workers), batches of several rows: each
    starts its worker processes (~0.6 s of CPU each), over ten kinds."""
    name, src, m, data = kind
    kw = dict(batch_size=batch, block_chunks=block, seed=seed, drop_last=drop_last)
    forced = {"in_place": True} if name in GATHERED_BY_DEFAULT else {}
    with ib.build_loader(src, m, "train", workers=workers, **kw) as new, \
            ib.build_loader(src, m, "train", workers=0, **forced, **kw) as old:
        assert new.workers == workers and old.workers == 0
        got, want = epochs(new), epochs(old)
        assert len(engine_of(new).pids) == workers
    assert_same(got, want)
    assert_rows_stored(got[0], data)  # and the rows are the stored samples


@pytest.mark.parametrize("options", [
    dict(channels=["z", "t2m"], stats="stats", dtype=torch.bfloat16),
    dict(static="static", patch_size=(3, 4)),
    dict(rank=1, world_size=3, uneven="pad"),
    dict(window=ib.SampleWindow(2, (1,))),
    dict(window=ib.SampleWindow(3, (1, 2), stride=2), channels=["z", "t2m"]),
    dict(window=ib.SampleWindow(1, (2,)), rank=0, world_size=2, drop_last=True),
])
def test_equal_with_sample_options(weather, options):
    src, m = weather
    kw = sample_kwargs(src, m, options)
    with ib.build_loader(src, m, "train", workers=2, **kw) as new, \
            ib.build_loader(src, m, "train", workers=0, **kw) as old:
        got, want = float_epochs(new), float_epochs(old)
    assert_same(got, want)


def test_several_samples_per_chunk_on_s3(tmp_path):
    """Object stores: each worker reads with its own obstore client and event loop."""
    pytest.importorskip("moto", reason="the S3 tests serve the store with moto")
    stores = {"s": [Var("x", (45, 4, 5), (1, 4, 5), compressors=BLOSC),
                    Var("y", (45, 3), (5, 3), dtype="int16")]}
    with stores_on_s3(tmp_path, stores) as (server, data):
        src = ib.open_source("s3://data/s", storage_options=server.options())
        m = ib.split_by_chunk(src, (1.0,))
        kw = dict(batch_size=6, block_chunks=4, seed=5)
        with ib.build_loader(src, m, "train", workers=2, **kw) as new, \
                ib.build_loader(src, m, "train", workers=0, in_place=True, **kw) as old:
            got, want = epochs(new, 1), epochs(old, 1)
    assert_same(got, want)
    assert_rows_stored(got[0], data["s"])


# -- exactly once, exact resume ----------------------------------------------------------
@settings(max_examples=4, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.integers(2, 17), block=st.integers(1, 9), stop=st.floats(0, 0.999),
       epoch=st.integers(0, 1), before=st.integers(0, 3), after=st.integers(0, 3))
def test_exact_resume_and_exactly_once_with_any_workers(weather, batch, block, stop, epoch,
                                                         before, after):
    """A state taken with ``before`` workers resumes with ``after`` (0: threads)."""
    src, m = weather
    kw = dict(batch_size=batch, block_chunks=block, seed=4, channels=["z", "t2m"])
    with ib.build_loader(src, m, "train", workers=0, **kw) as ref:
        full = [[b["sample_index"].tolist() for b in ref] for _ in range(epoch + 2)]
    assert sorted(i for b in full[epoch] for i in b) == list(range(80))
    k = int(stop * len(full[epoch]))
    with ib.build_loader(src, m, "train", workers=before, **kw) as a:
        for _ in range(epoch):
            assert [b["sample_index"].tolist() for b in a] == full[0]
        state = state_after(a, k)
    with ib.build_loader(src, m, "train", workers=after, **kw) as b:
        b.load_state_dict(state)
        rest = [x["sample_index"].tolist() for x in b]
        nxt = [x["sample_index"].tolist() for x in b]
    assert rest == full[epoch][k:]
    assert nxt == full[epoch + 1]


def test_memory_stays_within_the_bound(weather):
    src, m = weather
    with ib.build_loader(src, m, "train", batch_size=5, block_chunks=3, seed=0,
                         workers=2) as ld:
        for _ in range(2):
            for _ in ld:
                assert ld.ledger.resident <= ld.resident_bound
        assert 0 < ld.ledger.peak <= ld.resident_bound
        # shared memory is only taken for the pool's buffers: never more than were live at
        # once (batches recycled, no block per batch)
        shared = ld.node(ib.AsyncFetchNode).shared
        assert 0 < shared.allocated <= ld.ledger.peak


# -- faults ------------------------------------------------------------------------------
@pytest.mark.parametrize("per_chunk", [1, 4])
def test_a_corrupt_chunk_in_a_worker_fails_its_batch_by_name(tmp_path, per_chunk):
    path = tmp_path / "bad.zarr"
    write_store(path, [Var("x", (60, 4), (per_chunk, 4), compressors=BLOSC)])
    bad = 17 // per_chunk
    (path / "x" / "c" / str(bad) / "0").write_bytes(b"garbage, not blosc")
    src = ib.open_source(path)
    with ib.build_loader(src, ib.split_by_chunk(src, (1.0,)), "train", batch_size=4,
                         workers=2, retry=ib.RetryPolicy(attempts=2, base_delay=0)) as ld:
        it = iter(ld)
        served: list[int] = []
        with pytest.raises(ib.CorruptChunkError) as info:
            for _ in range(100):
                served += next(it)["sample_index"].tolist()
        err = info.value
        assert f"x/c/{bad}/0" in str(err) and err.variable == "x" and err.attempts == 2
        notes = "\n".join(err.__notes__)
        assert "decode worker" in notes and "into batches" in notes, notes
        with pytest.raises(ib.CorruptChunkError):  # asking again: the same error
            for _ in range(100):
                served += next(it)["sample_index"].tolist()
        lost = set(range(bad * per_chunk, (bad + 1) * per_chunk))
        assert not lost & set(served) and len(served) == len(set(served))


# -- nothing left behind -----------------------------------------------------------------
def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def test_close_shutdown_and_gc_leave_no_process(weather):
    src, m = weather
    shm = _shm()
    ld = ib.build_loader(src, m, "train", batch_size=5, workers=2)
    next(iter(ld))
    pids = engine_of(ld).pids
    assert all(alive(p) for p in pids)
    ld.close()  # restartable: the workers stop, and start again with the next epoch
    assert wait_gone(pids) == []
    next(iter(ld))
    pids = engine_of(ld).pids
    ld.shutdown()
    assert wait_gone(pids) == []
    ld = ib.build_loader(src, m, "train", batch_size=5, workers=2)
    next(iter(ld))
    pids = engine_of(ld).pids
    del ld
    gc.collect()
    assert wait_gone(pids) == []
    assert _shm() <= shm  # no named segment, ever


SCRIPT = textwrap.dedent("""
    import os, signal, sys
    import insitubatch_nodes as ib
    src = ib.open_source(sys.argv[1])
    ld = ib.build_loader(src, ib.split_by_chunk(src, (1.0,)), "train", batch_size=5, workers=2)
    it = iter(ld)
    next(it)
    print(" ".join(map(str, ld.node(ib.AsyncFetchNode).engine.pids)), flush=True)
    if sys.argv[2] == "crash":
        os.kill(os.getpid(), signal.SIGKILL)
    for _ in range(10**6):  # until interrupted
        for b in ld:
            pass
""")


@pytest.mark.parametrize("how", ["crash", "ctrl-c"])
def test_a_crash_or_ctrl_c_of_the_training_process_leaves_no_worker(weather, tmp_path, how):
    src, _ = weather
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    shm = _shm()
    proc = subprocess.Popen([sys.executable, str(script), src.url.removeprefix("file://"),
                             how], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=Path(__file__).parents[1], preexec_fn=_as_from_a_terminal)
    try:
        _stop_training(proc, how, shm)
    finally:
        if proc.poll() is None:  # a failed test must not leave it running
            proc.kill()
            proc.wait()


def _as_from_a_terminal() -> None:
    """The trainer starts with Ctrl-C as a shell gives it (default, unblocked): an ignored or
    blocked SIGINT is inherited through exec, and in full-suite runs the test process had
    one by this test (the trainer never saw the interrupts; never when run alone)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])


def _stop_training(proc, how, shm):
    pids = [int(p) for p in proc.stdout.readline().split()]
    # stderr drained as it comes: a full pipe would block the process we wait for
    chunks: list[str] = []
    drain = threading.Thread(target=lambda: chunks.extend(iter(proc.stderr.readline, "")),
                             daemon=True)
    drain.start()
    if len(pids) != 2:
        drain.join(timeout=60)
        raise AssertionError("".join(chunks))
    if how == "ctrl-c":
        time.sleep(0.3)
        # again until it stops, as a user would: an interrupt that lands in a weakref
        # callback (a batch buffer given back) is printed and dropped by Python itself
        for _ in range(20):
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=3)
                break
            except subprocess.TimeoutExpired:
                pass
    code = proc.wait(timeout=60)
    drain.join(timeout=30)
    err = "".join(chunks)
    assert code != 0
    if how == "ctrl-c":
        assert "KeyboardInterrupt" in err
        assert "workers/child.py" not in err, err  # the workers print nothing
    assert wait_gone(pids) == [], f"workers {pids} outlived the training process"
    assert _shm() <= shm


# -- configuration -----------------------------------------------------------------------
def test_workers_are_checked(weather):
    src, m = weather
    for bad in (-1, "many", 1.5, True):
        with pytest.raises(ValueError, match="fetch.workers must be 'auto' or an integer"):
            ib.build_loader(src, m, "train", workers=bad)
    with pytest.raises(ValueError, match="in_place=False"):
        ib.build_loader(src, m, "train", workers=2, in_place=False)
    with ib.build_loader(src, m, "train", workers=0) as ld:
        assert ld.workers == 0 and engine_of(ld) is None


@pytest.mark.parametrize(("cores", "in_place", "want"), [
    (2, True, 0), (3, True, 0), (4, True, 3), (16, True, 15), (128, True, 32), (16, False, 0),
])
def test_auto_starts_processes_from_four_cores(cores, in_place, want, monkeypatch):
    from insitubatch_nodes import defaults

    monkeypatch.setattr(defaults, "WORKERS_FROM_CORES", 4)  # conftest raises it for the suite
    assert defaults.default_workers(in_place, cores) == want


def test_auto_shares_the_cores_between_the_ranks_of_a_node(monkeypatch):
    from insitubatch_nodes.defaults import cores_per_rank

    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(64)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert cores_per_rank() == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "not a number")
    assert cores_per_rank() == 64


def test_enough_windows_ahead_to_keep_every_worker_busy(weather):
    """Each worker holds up to CREDIT jobs of about a batch: with many workers, more windows
    go ahead (and the resident bound counts them); a given prefetch_windows is kept."""
    from insitubatch_nodes.graph import resolve

    src, m = weather
    few = resolve(src, m, "train", ib.LoaderConfig.of(batch_size=8, block_chunks=4, workers=1))
    many = resolve(src, m, "train", ib.LoaderConfig.of(batch_size=8, block_chunks=4, workers=6))
    window = 4 * src.grid.chunk_size  # samples per window
    for r, workers in ((few, 1), (many, 6)):
        assert r.prefetch_windows == max(2, -(-CREDIT * workers * 8 // window))
    assert many.prefetch_windows > few.prefetch_windows
    assert many.resident_bound > few.resident_bound
    given_ = resolve(src, m, "train", ib.LoaderConfig.of(batch_size=8, block_chunks=4,
                                                         workers=6, prefetch_windows=1))
    assert given_.prefetch_windows == 1


def test_a_store_that_cannot_reach_a_worker_is_named(weather, monkeypatch):
    """Workers open their readers from the pickled arrays: a store that does not pickle is
    an error naming it with workers=N, and the decode threads with "auto"."""
    import insitubatch_nodes.defaults as defaults
    import insitubatch_nodes.graph as graph

    src, m = weather

    class Unpicklable:
        """The last array, as a store holding a live connection would pickle."""

        def __getattr__(self, name):
            return getattr(src.arrays[-1], name)

        def __reduce__(self):
            raise TypeError("this store holds a live connection")

    monkeypatch.setattr(defaults, "default_workers", lambda in_place: 2)
    fake = type(src)(**{**src.__dict__, "arrays": (*src.arrays[:-1], Unpicklable())})
    with pytest.raises(ValueError, match="cannot be sent to a worker process.*live connection"):
        graph.resolve(fake, m, "train", ib.LoaderConfig.of(workers=2))
    assert graph.resolve(fake, m, "train", ib.LoaderConfig.of(workers="auto")).workers == 0
    assert graph.resolve(src, m, "train", ib.LoaderConfig.of(workers="auto")).workers == 2


def test_a_worker_that_cannot_start_fails_the_batches_with_why(weather, monkeypatch):
    """A worker that dies before it is ready (here: Python cannot even find the module) is
    not started again and again: the batches fail with a WorkerError saying so."""
    src, m = weather
    monkeypatch.setattr(sys, "executable", "/bin/false")
    with ib.build_loader(src, m, "train", batch_size=5, workers=1) as ld:
        with pytest.raises(WorkerError, match="before it started"):
            next(iter(ld))
        engine = engine_of(ld)
        assert engine.broken and len(engine.pids) == 1


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 70), st.integers(1, 9), st.integers(1, 3), st.integers(1, 4),
       st.integers(0, 2**31), st.sampled_from([4, 1 << 20, 24 << 20]))
def test_one_slot_a_stripe_is_cut_as_defined_on_its_fast_path(n, batch_size, n_vars, workers,
                                                               seed, most):
    """The common case's fast path (one sample per chunk, no time steps, distinct samples,
    cut by ``sampling.cuts`` on (sample, variable) rows) makes the jobs the definition says
    (``test_jobs.check_window``), and the same jobs as the general path: windows starting
    inside a batch, rows shuffled within their batch, variables of other sizes, rows up to
    72 MB a sample (a batch then needs several jobs)."""
    rng = np.random.default_rng(seed)
    first = int(rng.integers(0, batch_size))  # the window starts inside a batch
    draws = np.arange(first, first + n)
    batch, row = draws // batch_size, draws % batch_size
    for b in np.unique(batch):  # rows within a batch in sample order, draws shuffled
        at = batch == b
        row[at] = rng.permutation(row[at])
    samples = rng.choice(10 * n, n, replace=False)
    plan = ReadPlan(0, 0, (), samples, (tuple(sorted(samples.tolist())),) * n_vars, 0,
                    slots=BatchSlots(batch, row, batch_size, first + n + batch_size))
    row_bytes = [int(x) for x in rng.integers(most // 2, most + 1, n_vars)]
    sizes = [int(x) for x in rng.choice([1000, 2000], n_vars)]
    args = (workers, [1] * n_vars, row_bytes, sizes)
    arena = FakeArena()
    fast = J.prepare_window(plan, arena, *args)
    check_window(fast, plan, 0, [1] * n_vars, row_bytes, sizes, workers, arena.expected)
    with pytest.MonkeyPatch.context() as mp:  # the general path, for the same window
        mp.setattr(J, "_distinct", lambda plan, kept: False)
        slow = J.prepare_window(plan, FakeArena(), *args)
    assert len(fast.jobs) == len(slow.jobs)
    for a, b in zip(fast.jobs, slow.jobs, strict=True):
        np.testing.assert_array_equal(a.targets, b.targets)
        assert (a.writes, a.reads, a.urgent) == (b.writes, b.reads, b.urgent)
