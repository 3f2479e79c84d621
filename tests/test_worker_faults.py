"""Decode workers that misbehave cannot block or hang training (issue 41): a worker frozen
(SIGSTOP) before it is ready or mid-epoch with job frames bigger than its socket's buffer
is killed and replaced, and the epoch ends with every sample once; ``close()`` and a reset
with a frozen worker return within the timeout and a few seconds; a slow worker that makes
progress is never killed; a death blames only the job the worker was running; a worker
that cannot start is tried again, then the windows fail naming both deaths, and a later
window starts it afresh. Timeouts are 1-2 s: every test runs in seconds."""

import logging
import os
import re
import signal
import sys
import threading
import time

import pytest
from stores import Var, write_store, write_x_y
from test_worker_recovery import assert_batches_equal, engine_of, rows, wait_ready

import insitubatch_nodes as ib
from insitubatch_nodes.workers import deadlines, wire
from insitubatch_nodes.workers.engine import WorkerError
from insitubatch_nodes.workers.procs import frozen

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="workers need Unix sockets")

KW = dict(batch_size=4, block_chunks=16, seed=7, prefetch_windows=4)
SLACK_S = 8.0  # "a few seconds" on a shared 2-core machine: starts, imports, a reset


def samples(batches) -> list[int]:
    return sorted(int(i) for b in batches for i in b["sample_index"])


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


class Thaw:
    """Processes a test froze: let go (SIGKILL: a stopped one dies too) at its end, so a
    failed check never leaves one behind."""

    def __init__(self):
        self.popens = []

    def freeze(self, proc):
        self.popens.append(proc.popen)
        os.kill(proc.pid, signal.SIGSTOP)

    def kill_all(self):
        for p in self.popens:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture
def thaw():
    t = Thaw()
    yield t
    t.kill_all()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """160 samples of one sample per chunk: x (float32) and y (int16)."""
    path = tmp_path_factory.mktemp("faults") / "s.zarr"
    write_x_y(path)
    src = ib.open_source(path)
    return src, ib.split_by_chunk(src, (1.0,))


@pytest.fixture(scope="module")
def reference(store):
    src, m = store
    with ib.build_loader(src, m, "train", workers=0, **KW) as ref:
        return [rows(b) for b in ref]


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """Jobs whose frames are bigger than a socket's buffer: 16 variables, 128 samples per
    chunk, batches of 1024 (a job's slots: up to 16384, 48 bytes each)."""
    path = tmp_path_factory.mktemp("wide") / "w.zarr"
    write_store(path, [Var(f"v{i}", (16384, 2), (128, 2)) for i in range(16)])
    src = ib.open_source(path)
    kw = dict(batch_size=1024, block_chunks=16, seed=1, prefetch_windows=2)
    return src, ib.split_by_chunk(src, (1.0,)), kw


# -- frozen workers ---------------------------------------------------------------------
@pytest.mark.serial
def test_a_worker_frozen_before_it_is_ready_is_killed_and_replaced(
        store, reference, tmp_path, monkeypatch, caplog):
    """The only worker stops itself (SIGSTOP) right before it says ready, at its first start
    only: it is killed at the start deadline and its replacement serves the epoch."""
    src, m = store
    monkeypatch.setattr(deadlines, "START_TIMEOUT_S", 2.0)  # a start gets max(1 s, this)
    monkeypatch.setenv("INSITUBATCH_TEST_STOP_BEFORE_READY", "1")
    monkeypatch.setenv("INSITUBATCH_TEST_ONCE", str(tmp_path / "once"))
    caplog.set_level(logging.WARNING, logger="insitubatch_nodes")
    t0 = time.monotonic()
    with ib.build_loader(src, m, "train", workers=1, worker_timeout_s=1, **KW) as ld:
        first = engine_of(ld).procs[0]
        try:
            got = [rows(b) for b in ld]
            took = time.monotonic() - t0
            assert first.popen.poll() is not None  # killed, reaped
            assert ld.stats().worker_restarts >= 1
        finally:
            if first.popen.poll() is None:
                first.popen.kill()
    assert_batches_equal(got, reference)  # every sample once, as an uninterrupted run
    assert took < 2.0 + SLACK_S, took
    said = " ".join(warnings_of(caplog))
    assert f"pid {first.pid}) was not ready" in said and "started it again" in said, said


@pytest.mark.serial
def test_a_worker_frozen_with_frames_bigger_than_its_socket_is_killed_and_replaced(
        wide, monkeypatch, thaw):
    """Frozen after the first batch, a worker stops reading its socket while jobs of
    over 256 KB are queued for it (its socket holds ~208 KB): the engine never blocks on it,
    kills it at the timeout and runs its jobs on the others."""
    src, m, kw = wide
    with ib.build_loader(src, m, "train", workers=0, **kw) as ref:
        want = [rows(b) for b in ref]
    biggest = [0]
    real = wire.encode_job

    def spy(*args, **kwargs):
        frame = real(*args, **kwargs)
        biggest[0] = max(biggest[0], len(frame))
        return frame

    monkeypatch.setattr(wire, "encode_job", spy)
    with ib.build_loader(src, m, "train", workers=2, worker_timeout_s=1, **kw) as ld:
        it = iter(ld)
        got = [rows(next(it))]
        engine = engine_of(ld)
        wait_ready(engine)
        victim = engine.procs[0]
        thaw.freeze(victim)
        t0 = time.monotonic()
        consumer = threading.Thread(target=lambda: got.extend(rows(b) for b in it),
                                    daemon=True)
        consumer.start()
        full = False  # the engine held bytes the frozen worker's socket would not take
        while not (full or victim.gone):
            full = victim.writing
            time.sleep(0.001)
        consumer.join(timeout=60)
        took = time.monotonic() - t0
        assert not consumer.is_alive(), "the epoch did not finish"
        assert full, "the frozen worker's socket never filled: nothing tested"
        assert victim.popen.poll() is not None and victim.pid not in engine.pids
        assert ld.stats().worker_restarts >= 1
    assert biggest[0] > 256 << 10, biggest  # bigger than the socket's buffer: it blocked
    assert_batches_equal(got, want)
    assert took < 1.0 + SLACK_S, took


@pytest.mark.serial
def test_a_reset_and_close_with_a_frozen_worker_return_within_the_timeout(store, thaw):
    src, m = store
    with ib.build_loader(src, m, "train", workers=2, worker_timeout_s=1, **KW) as ld:
        it = iter(ld)
        next(it)
        engine = engine_of(ld)
        wait_ready(engine)
        thaw.freeze(engine.procs[0])
        next(it)  # (it is given jobs)
        t0 = time.monotonic()
        again = [rows(b) for b in ld]  # a new iter(): the old epoch's windows settle
        reset_s = time.monotonic() - t0
        assert samples(again) == list(range(160))  # the next epoch, every sample once
        wait_ready(engine)
        it = iter(ld)
        next(it)
        thaw.freeze(engine.procs[1])
        t0 = time.monotonic()
        ld.close()
        close_s = time.monotonic() - t0
        assert all(p.popen.poll() is not None for p in engine.procs)
    assert reset_s < 1.0 + SLACK_S, reset_s
    assert close_s < 1.0 + 4.0, close_s


@pytest.mark.serial
def test_close_with_every_worker_frozen_before_it_is_ready_returns_at_once(store, monkeypatch):
    src, m = store
    monkeypatch.setenv("INSITUBATCH_TEST_STOP_BEFORE_READY", "1")
    ld = ib.build_loader(src, m, "train", workers=2, worker_timeout_s=1, **KW)
    engine = engine_of(ld)
    try:
        deadline = time.monotonic() + 60
        while not all(frozen(p.pid) for p in engine.procs):
            assert time.monotonic() < deadline, "the workers did not stop themselves"
            time.sleep(0.02)
        t0 = time.monotonic()
        ld.close()
        took = time.monotonic() - t0
    finally:
        for p in engine.procs:
            if p.popen.poll() is None:
                p.popen.kill()
        ld.shutdown()
    assert all(p.popen.poll() is not None for p in engine.procs)
    assert took < 4.0, took


# -- slow is not hung -------------------------------------------------------------------
@pytest.mark.serial
def test_a_slow_worker_that_makes_progress_is_never_killed(tmp_path, monkeypatch):
    """Every job takes 0.6x the timeout: with answers in groups of 4 the worker is silent
    for 2.4x the timeout, but each job is on time, and it is never killed."""
    path = tmp_path / "slow.zarr"
    write_store(path, [Var("x", (28, 3), (1, 3))])
    src = ib.open_source(path)
    m = ib.split_by_chunk(src, (1.0,))
    monkeypatch.setenv("INSITUBATCH_TEST_JOB_SLEEP_S", "0.9")
    with ib.build_loader(src, m, "train", workers=1, worker_timeout_s=1.5, batch_size=4,
                         block_chunks=32, seed=0) as ld:
        got = [rows(b) for b in ld]
        assert ld.stats().worker_restarts == 0
    assert samples(got) == list(range(28))  # 7 jobs, 6.3 s on one worker


# -- blame ------------------------------------------------------------------------------
def batch_of(reference, sample) -> set[int]:
    return next({int(i) for i in b["sample_index"]} for b in reference
                if sample in b["sample_index"])


def stripes_named(text, after) -> list[tuple[int, int]]:
    listed = re.search(re.escape(after) + r" (\[[^\]]*\])", text)
    assert listed, text
    return [tuple(map(int, p)) for p in re.findall(r"\((\d+), (\d+)\)", listed.group(1))]


def test_a_death_blames_only_the_job_the_worker_was_running(
        store, reference, tmp_path, monkeypatch, caplog):
    """A worker kills itself (once) on stripe 37 with other jobs queued in its socket: the
    WARNING names only the job it ran, which runs again, as do the others, unblamed."""
    src, m = store
    monkeypatch.setenv("INSITUBATCH_TEST_KILL_STRIPE", "0:37")
    monkeypatch.setenv("INSITUBATCH_TEST_ONCE", str(tmp_path / "once"))
    caplog.set_level(logging.WARNING, logger="insitubatch_nodes")
    with ib.build_loader(src, m, "train", workers=2, **KW) as ld:
        got = [rows(b) for b in ld]
        assert ld.stats().worker_restarts == 1
    assert_batches_equal(got, reference)
    said = [w for w in warnings_of(caplog) if "SIGKILL" in w]
    assert len(said) == 1, said
    named = stripes_named(said[0], "running stripes")
    assert (0, 37) in named and {s for _, s in named} <= batch_of(reference, 37), said
    others = re.search(r"the (\d+) other jobs it held", said[0])
    assert others and int(others.group(1)) >= 1, said  # other jobs held: run again, unblamed


def test_a_job_that_kills_two_workers_names_only_its_own_stripes(store, reference, monkeypatch):
    src, m = store
    monkeypatch.setenv("INSITUBATCH_TEST_KILL_STRIPE", "0:37")
    with (ib.build_loader(src, m, "train", workers=2, **KW) as ld,
          pytest.raises(WorkerError) as info):
        for _ in ld:
            pass
    text = str(info.value)
    assert len(set(re.findall(r"pid (\d+)\) was killed by signal SIGKILL", text))) == 2, text
    named = stripes_named(text, "both while reading stripes")
    assert (0, 37) in named and {s for _, s in named} <= batch_of(reference, 37), text


# -- a start that fails -----------------------------------------------------------------
def test_a_replacement_that_cannot_start_is_tried_again_then_fails_naming_both(
        store, tmp_path, monkeypatch):
    """The worker is killed mid-epoch; its replacement exits before it is ready, and so does
    the next try: the windows fail with a WorkerError naming both; once starts work again,
    the next epoch starts a new worker and runs whole."""
    src, m = store
    broken = tmp_path / "no-start"
    monkeypatch.setenv("INSITUBATCH_TEST_EXIT_BEFORE_READY", str(broken))
    with ib.build_loader(src, m, "train", workers=1, worker_timeout_s=2, **KW) as ld:
        it = iter(ld)
        next(it)
        engine = engine_of(ld)
        wait_ready(engine)
        broken.touch()
        os.kill(engine.pids[0], signal.SIGKILL)
        with pytest.raises(WorkerError) as info:
            for _ in it:
                pass
        text = str(info.value)
        died = re.findall(r"pid (\d+)\) exited with status 3 before it started", text)
        assert len(set(died)) == 2 and "2 starts in a row" in text, text
        broken.unlink()
        got = [rows(b) for b in ld]  # not broken for good: a new worker starts
        assert ld.stats().worker_restarts >= 3
    assert samples(got) == list(range(160))


# -- the send side ----------------------------------------------------------------------
def test_a_descriptor_queued_behind_a_full_socket_lands_at_its_place():
    """The outbox writes what the socket takes and asks for EPOLLOUT for the rest; a
    descriptor queued behind 1 MB goes on its own byte only once the bytes before it are
    in the socket, so the reader finds it right after the message naming it."""
    import pickle
    import select
    import socket
    from multiprocessing.connection import Connection

    from insitubatch_nodes.workers.deadlines import StatusPage
    from insitubatch_nodes.workers.outbox import Sender, queue_fd, queue_pickle
    from insitubatch_nodes.workers.procs import WorkerProc

    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    page, page_fd = StatusPage.create()
    os.close(page_fd)
    proc = WorkerProc(0, None, ours, page)
    epoll = select.epoll()
    epoll.register(ours.fileno(), select.EPOLLIN)
    sender = Sender(epoll)
    big = os.urandom(1 << 20)
    r, w = os.pipe()
    os.write(w, b"marker")
    proc.outbox.append(wire.framed(big))
    queue_pickle(proc, pickle.dumps(("segment", 0, 6)))
    queue_fd(proc, r)
    proc.outbox.append(wire.framed(b"after"))
    sender.flush(proc)
    assert proc.writing and proc.outbox, "1 MB went into the socket at once: nothing tested"
    conn = Connection(os.dup(theirs.fileno()))
    got: list = []

    def read():
        got.append(conn.recv_bytes())
        got.append(pickle.loads(conn.recv_bytes()))
        got.append(wire.recv_fd(theirs))
        got.append(conn.recv_bytes())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + 10
    while proc.outbox and time.monotonic() < deadline:
        if epoll.poll(1):
            sender.flush(proc)
    reader.join(10)
    try:
        assert len(got) == 4 and got[0] == big and got[1] == ("segment", 0, 6), got[1:2]
        assert got[3] == b"after"
        assert os.read(got[2], 6) == b"marker"  # the pipe's read end, passed
        assert not proc.writing and not proc.outbox and proc.fds_out == 0
    finally:
        for fd in (r, w, *got[2:3]):
            os.close(fd)
        conn.close()
        theirs.close()
        ours.close()
        epoll.close()
        page.close()
