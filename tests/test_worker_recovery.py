"""Decode workers under stress: a reset (a new ``iter()``, ``load_state_dict``, an error's
rewind) while a job is between its allocation and its send never lets a stale job write
into reused memory; a worker killed or hung is replaced and its jobs run again, so the
training loop sees every sample once and no error; a job that kills two workers fails by
name; and no worker prints anything when the training process lets it go."""

import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from stores import BLOSC, Var, write_store, write_x_y

import insitubatch_nodes as ib
from insitubatch_nodes.workers import engine as engine_module
from insitubatch_nodes.workers import wire
from insitubatch_nodes.workers.engine import WorkerError

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="workers need Unix sockets")

KW = dict(batch_size=4, block_chunks=16, seed=7, prefetch_windows=4)


def engine_of(loader):
    return loader.node(ib.AsyncFetchNode).engine


def wait_ready(engine, timeout_s=60):
    """Until every worker of ``engine`` said it is ready."""
    deadline = time.monotonic() + timeout_s
    while not all(p.ready for p in engine.procs):
        assert time.monotonic() < deadline, "the workers did not get ready"
        time.sleep(0.01)


def rows(batch) -> dict:
    return {k: v.numpy().copy() for k, v in batch.items()}


def assert_batches_equal(got, want):
    """Every batch, every row: sample_index and values."""
    assert len(got) == len(want) > 0
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys()
        for k in g:
            np.testing.assert_array_equal(g[k], w[k], err_msg=k)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """160 samples of one sample per chunk: x (float32) and y (int16)."""
    path = tmp_path_factory.mktemp("recovery") / "s.zarr"
    write_x_y(path)
    src = ib.open_source(path)
    return path, src, ib.split_by_chunk(src, (1.0,))


# -- nothing stale, ever -----------------------------------------------------------------
class Hold:
    """The engine's ``BEFORE_SEND`` seam. Until the hold, jobs of batches from
    ``slow_from`` on pause there (the consumer needs none of them first, and the engine
    keeps work queued however slow the machine); once ``when(run, job)`` holds, that one
    job is held between its batches' allocation and its send until its window is
    cancelled: the reset of the training thread lands right there. ``sent_stale`` collects
    the held jobs that were sent after all."""

    def __init__(self, monkeypatch, slow_from=2, pause=0.2):
        self.slow_from, self.pause = slow_from, pause
        self.when = None
        self.holding = threading.Event()
        self.held: list = []  # jobs whose window was cancelled while they were held
        self.runs: list = []  # every window seen, in the order of its first job
        self.sent_stale: list = []
        monkeypatch.setattr(engine_module, "BEFORE_SEND", self)
        # the least credit (jobs of 16 MB or more): this store's small jobs get 9 a worker,
        # which would take every window's jobs in the first round and leave none queued
        monkeypatch.setattr(wire, "credit", lambda job_nbytes: wire.CREDIT)
        real = wire.encode_job

        def spy(ident, places, targets, *rest):
            if any(targets is job.targets for job in self.held):
                self.sent_stale.append(ident)
            return real(ident, places, targets, *rest)

        monkeypatch.setattr(wire, "encode_job", spy)

    def __call__(self, run, job):
        if not any(r is run for r in self.runs):
            self.runs.append(run)
        if self.holding.is_set():
            return
        if min(job.writes) >= self.slow_from:
            time.sleep(self.pause)
        when = self.when
        if when is None or not when(run, job):
            return
        self.when = None  # once
        self.holding.set()
        deadline = time.monotonic() + 30
        while not run.cancelled and time.monotonic() < deadline:
            time.sleep(0.005)
        if run.cancelled:
            self.held.append(job)

    def arm(self, when=lambda run, job: True):
        self.when = when
        assert self.holding.wait(30), "no job went out after the hold was armed"

    def check(self):
        assert self.held, "no job was held while its window was cancelled: nothing tested"
        assert not self.sent_stale, f"jobs {self.sent_stale} were sent after their cancel"


def reference(src, m, **kw):
    with ib.build_loader(src, m, "train", workers=0, **KW, **kw) as ref:
        return [rows(b) for b in ref], [rows(b) for b in ref]


def test_a_break_and_a_new_iter_with_a_job_in_flight_serve_a_fresh_epoch(store, monkeypatch):
    _, src, m = store
    with ib.build_loader(src, m, "train", workers=0, **KW) as ref:
        it = iter(ref)
        head = [rows(next(it)) for _ in range(2)]
        want = [rows(b) for b in ref]  # a new iter() after the break
    hold = Hold(monkeypatch)
    with ib.build_loader(src, m, "train", workers=2, **KW) as ld:
        it = iter(ld)
        got = [rows(next(it)) for _ in range(2)]
        hold.arm()
        again = [rows(b) for b in ld]
    assert_batches_equal(got, head)
    assert_batches_equal(again, want)
    hold.check()


def test_load_state_dict_on_a_live_loader_with_a_job_in_flight(store, monkeypatch):
    _, src, m = store
    full, _ = reference(src, m)
    # sends paced at 2 a second until the hold: under a loaded machine's slow start, jobs of
    # the windows ahead are still queued when the hold is armed after four batches
    hold = Hold(monkeypatch, pause=0.5)
    with ib.build_loader(src, m, "train", workers=2, **KW) as ld:
        it = iter(ld)
        for _ in range(3):
            next(it)
        state = ld.state_dict()
        next(it)
        hold.arm()
        ld.load_state_dict(state)
        rest = [rows(b) for b in ld]
    assert_batches_equal(rest, full[3:])
    hold.check()


def test_an_error_rewind_with_jobs_in_flight_serves_every_batch_once(store, monkeypatch):
    """A chunk of the second window is damaged once: its window fails while later windows'
    jobs are out, and one of them is held at its send as the loader rewinds; the chunk is
    mended, and the epoch goes on as an undamaged one."""
    path, src, m = store
    full, _ = reference(src, m, retry=ib.RetryPolicy(attempts=2, base_delay=0))
    bad = int(full[6]["sample_index"][0])  # batch 6: the second window (4 batches each)
    chunk = path / "x" / "c" / str(bad) / "0" / "0"
    good = chunk.read_bytes()
    hold = Hold(monkeypatch, slow_from=4)

    def after_the_failure(run, job):
        """A later window's job, once the damaged window failed (windows between may still
        have jobs out: workers answer in groups, so a window is done late)."""
        failed = [k for k, r in enumerate(hold.runs) if r.failed is not None]
        k = next(i for i, r in enumerate(hold.runs) if r is run)
        return bool(failed) and k > failed[0]

    chunk.write_bytes(b"garbage, not blosc")
    try:
        with ib.build_loader(src, m, "train", workers=2, retry=ib.RetryPolicy(
                attempts=2, base_delay=0), **KW) as ld:
            it = iter(ld)
            got = [rows(next(it)) for _ in range(4)]  # the first window
            hold.arm(after_the_failure)
            with pytest.raises(ib.CorruptChunkError):
                got.append(rows(next(it)))
            chunk.write_bytes(good)
            got += [rows(b) for b in it]
    finally:
        chunk.write_bytes(good)
    assert_batches_equal(got, full)
    hold.check()


# -- a lost worker is replaced -----------------------------------------------------------
def frozen_with_jobs(engine, consume):
    """Freeze every worker, let ``consume`` ask for batches on a thread until the engine
    handed jobs to the frozen workers; the worker holding most of them."""
    wait_ready(engine)
    for pid in engine.pids:
        os.kill(pid, signal.SIGSTOP)
    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    deadline = time.monotonic() + 30
    while not any(p.jobs for p in engine.procs) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # let the engine settle what it hands out to the frozen pair
    victim = max(engine.procs, key=lambda p: len(p.jobs))
    assert victim.jobs, "the frozen workers hold no job: the test proves nothing"
    return consumer, victim


def test_a_worker_killed_mid_epoch_is_replaced_and_nothing_is_lost(tmp_path, caplog):
    path = tmp_path / "k.zarr"
    write_store(path, [Var("x", (400, 8, 8), (1, 8, 8), compressors=BLOSC)])
    src = ib.open_source(path)
    m = ib.split_by_chunk(src, (1.0,))
    kw = dict(batch_size=8, block_chunks=16, seed=3)
    with ib.build_loader(src, m, "train", workers=0, **kw) as ref:
        want = [rows(b) for b in ref]
    caplog.set_level(logging.WARNING, logger="insitubatch_nodes")
    with ib.build_loader(src, m, "train", workers=2, **kw) as ld:
        it = iter(ld)
        got = [rows(next(it)) for _ in range(2)]
        errors: list[BaseException] = []

        def consume() -> None:
            try:
                got.extend(rows(b) for b in it)
            except BaseException as e:  # noqa: BLE001 - the test says which
                errors.append(e)

        engine = engine_of(ld)
        frozen = engine.pids
        try:
            consumer, victim = frozen_with_jobs(engine, consume)
            pid = victim.popen.pid
            running = victim.jobs.get(victim.status.read()[0])  # (frozen: it stays so)
            os.kill(pid, signal.SIGKILL)
        finally:  # the others go on (a failed check above must not leave them frozen)
            for other in frozen:
                os.kill(other, signal.SIGCONT)
        consumer.join(timeout=120)
        assert not consumer.is_alive(), "the epoch did not finish after the kill"
        assert errors == []
        assert_batches_equal(got, want)  # every sample once, as an uninterrupted run
        assert pid not in engine.pids and len(engine.pids) == 2  # started again
        assert ld.stats().worker_restarts == 1
        again = [b["x"].numpy().copy() for b in ld]  # the next epoch runs on the new worker
        assert sum(len(b) for b in again) == 400
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    # only the job it was running is named (blamed), if any: the others never ran, or ran
    # and were not reported yet
    said = ("between jobs" if running is None
            else f"running stripes {running.job.stripes()} ")
    assert any(f"pid {pid}" in w and "SIGKILL" in w and said in w for w in warned), warned


def test_a_job_that_kills_two_workers_fails_naming_both(store, monkeypatch):
    """A chunk that kills its decoder (here: the test seam of child.py) is run again once,
    on another worker; when that one dies too the window fails with a WorkerError naming
    both deaths and the stripe."""
    _, src, m = store
    monkeypatch.setenv("INSITUBATCH_TEST_KILL_STRIPE", "0:37")
    with ib.build_loader(src, m, "train", workers=2, **KW) as ld:
        with pytest.raises(WorkerError) as info:
            for _ in ld:
                pass
        restarts = ld.stats().worker_restarts
    text = str(info.value)
    pids = re.findall(r"pid (\d+)\) was killed by signal SIGKILL", text)
    assert len(set(pids)) == 2, text
    assert "(0, 37)" in text and "not run a third time" in text, text
    assert restarts >= 2


def test_a_hung_worker_is_killed_after_the_timeout_and_replaced(store, caplog):
    _, src, m = store
    full, _ = reference(src, m)
    caplog.set_level(logging.WARNING, logger="insitubatch_nodes")
    with ib.build_loader(src, m, "train", workers=2, worker_timeout_s=3, **KW) as ld:
        it = iter(ld)
        got = [rows(next(it))]
        engine = engine_of(ld)
        wait_ready(engine)  # (only ready workers are given jobs)
        hung = engine.pids[0]
        os.kill(hung, signal.SIGSTOP)  # it is given jobs, and answers none
        try:
            got += [rows(b) for b in it]
        finally:
            if hung in engine.pids:  # never replaced (the test fails): let it go on
                os.kill(hung, signal.SIGCONT)
        assert hung not in engine.pids
        assert ld.stats().worker_restarts >= 1
    assert_batches_equal(got, full)
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert f"pid {hung}" in warned and "(fetch.worker_timeout_s: 3)" in warned, warned


def test_worker_timeout_is_checked(store):
    _, src, m = store
    for bad in (0, -1.0, "soon", True, float("inf")):
        with pytest.raises(ValueError, match="fetch.worker_timeout_s must be a number"):
            ib.build_loader(src, m, "train", workers=1, worker_timeout_s=bad)


# -- quiet ---------------------------------------------------------------------------------
QUIET = textwrap.dedent("""
    import gc, sys
    import insitubatch_nodes as ib
    src = ib.open_source(sys.argv[1])
    m = ib.split_by_chunk(src, (1.0,))
    kw = dict(batch_size=5, workers=2)
    ib.build_loader(src, m, "train", **kw).shutdown()  # right after build
    ld = ib.build_loader(src, m, "train", **kw)
    next(iter(ld))
    ld.shutdown()  # after one batch
    ld = ib.build_loader(src, m, "train", **kw)
    del ld  # collected right after build
    gc.collect()
    ld = ib.build_loader(src, m, "train", **kw)
    next(iter(ld))
    del ld  # collected after one batch
    gc.collect()
    with ib.build_loader(src, m, "train", **kw) as ld:
        next(iter(ld))
    # every configuration error comes before a worker starts (test_nodes); what can fail
    # once they run is a state: refused, then the loader dropped with its workers running
    ld = ib.build_loader(src, m, "train", **kw)
    try:
        ld.load_state_dict({"root": {}, "num_yielded": 0, "format": 4})
    except ValueError as e:
        assert "state" in str(e), e
    else:
        raise AssertionError("a state without its fields was not refused")
    del ld
    gc.collect()
    ld = ib.build_loader(src, m, "train", **kw)  # left to the interpreter's exit
    print("done", flush=True)
""")


def test_workers_let_go_by_the_training_process_print_nothing(store, tmp_path):
    path, _, _ = store
    script = tmp_path / "quiet.py"
    script.write_text(QUIET)
    root = str(Path(__file__).parents[1])  # this checkout's package, not an installed one
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    # communicate() waits for the workers too: they write to the same stderr
    done = subprocess.run([sys.executable, str(script), str(path)], capture_output=True,
                          text=True, timeout=300, cwd=root, env=env)
    assert done.returncode == 0 and done.stdout == "done\n", done.stderr
    assert done.stderr == "", done.stderr
