"""The training process's side of the decode workers: start them, hand out jobs, count
what lands, and turn a worker's failure into an error a training loop can act on.

One thread (``insitubatch-workers``) does all of it: it waits on the workers' sockets
and a wake-up pipe, gives each worker up to ``CREDIT`` jobs at a time (its next job is in
its socket when it finishes one), takes a batch's memory from the arena only when the
first job writing it goes out (so batch buffers come back warm from the pool, as on the
thread path), and tells the arena each job's row writes when it is done. The training
thread only queues a prepared window (``submit``): a few microseconds per window.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler, send_handle
from pathlib import Path

from ..errors import ConfigError, InsitubatchError
from ..memory.arena import BatchArena, StaleBatch
from ..metrics.counters import FetchStats
from .child import WorkerSetup
from .jobs import ReadJob, WorkerWindow
from .shared_memory import Place, SharedMemoryArena

log = logging.getLogger("insitubatch_nodes")

CREDIT = 2  # jobs given to one worker at a time


class WorkerError(InsitubatchError, RuntimeError):
    """A decode worker process died, or could not start: the message names it (number,
    pid, exit status) and the window and batches it was writing."""


@dataclass(eq=False)
class WindowRun:
    """A window on the workers: the future-like object the fetch node keeps (``cancel``,
    ``settle``, ``done``), as ``fetch.jobs.DirectWindow`` is for the decode threads."""

    window: WorkerWindow
    engine: WorkerEngine
    left: int  # jobs not yet done
    out: int = 0  # jobs given to a worker and not yet answered
    cancelled: bool = False
    failed: BaseException | None = None
    settled: threading.Condition = field(default_factory=threading.Condition)

    def cancel(self) -> bool:
        """Drop the jobs not yet given to a worker; ``settle`` waits for the others."""
        self.engine.cancel(self)
        return True

    def settle(self) -> None:
        """After ``cancel``: wait until no worker writes for this window any more, so its
        batches' memory can be given to the window that replaces it."""
        with self.settled:
            self.settled.wait_for(lambda: self.out == 0 or self.engine.stopped)

    def done(self) -> bool:
        return self.left == 0 or ((self.cancelled or self.failed is not None) and self.out == 0)


@dataclass(eq=False)
class _Proc:
    """One worker process as the engine sees it."""

    number: int
    popen: subprocess.Popen
    conn: Connection
    segments: int = 0  # segments whose descriptors it was sent
    jobs: dict[int, tuple[WindowRun, ReadJob]] = field(default_factory=dict)
    ready: bool = False


class WorkerEngine:
    """``workers`` decode processes writing into ``shared`` for ``arena``'s batches.

    Built by the fetch node when its loop starts, stopped with it (``stop``); the processes
    live across epochs and restores. A job error fails the batches of its window
    (``BatchArena.fail``: the shuffle buffer raises it, the loader resets to the last
    batch delivered and the next ``next()`` reads the window again); a worker that dies
    fails the windows it held with a ``WorkerError`` naming it, and is started again.
    """

    def __init__(self, workers: int, setup: WorkerSetup, arena: BatchArena,
                 shared: SharedMemoryArena, stats: FetchStats, stripe_nbytes: list[int],
                 name: str = "insitubatch-workers") -> None:
        if workers < 1:
            raise ConfigError(f"workers must be >= 1 for a WorkerEngine, got {workers}")
        self.arena, self.shared, self.stats = arena, shared, stats
        # pickled once, sent to every worker (and to one started again)
        self._setup = ForkingPickler.dumps(setup)
        self.stripe_nbytes = stripe_nbytes
        self._lock = threading.Lock()
        self._queue: deque[tuple[WindowRun, ReadJob]] = deque()
        self._places: dict[int, dict[str, Place]] = {}  # batch -> where its arrays live
        self._places_generation = -1
        self._next_id = 0
        self.stopped = False
        self.broken: str | None = None  # a worker could not start: why
        self._wake_r, self._wake_w = os.pipe()
        # one epoll set for the thread's life (multiprocessing's wait() builds one per call)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self.procs = [self._start(i) for i in range(workers)]
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    # -- processes ------------------------------------------------------------------
    def _start(self, number: int) -> _Proc:
        parent, child = socket.socketpair()
        env = dict(os.environ)
        # the package as this process imports it, first (a checkout that is not installed)
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
        try:
            popen = subprocess.Popen(
                [sys.executable, "-m", "insitubatch_nodes.workers.child", str(child.fileno())],
                pass_fds=[child.fileno()], stdin=subprocess.DEVNULL, env=env)
        finally:
            child.close()
        conn = Connection(os.dup(parent.fileno()))
        parent.close()
        # a worker that died at once (its Python or import failed) shows as its socket's end
        # on the engine thread, which then says why (``_died``)
        with contextlib.suppress(OSError):
            conn.send_bytes(self._setup)
        proc = _Proc(number, popen, conn)
        self._selector.register(conn.fileno(), selectors.EVENT_READ, proc)
        return proc

    @property
    def pids(self) -> list[int]:
        return [p.popen.pid for p in self.procs]

    # -- the training thread's side ---------------------------------------------------
    def submit(self, window: WorkerWindow) -> WindowRun:
        if self.stopped:
            raise RuntimeError("these decode workers were stopped (the fetch node was closed): "
                               "a bug if reached, the node starts new ones")
        run = WindowRun(window, self, left=len(window.jobs))
        if self.broken is not None:
            run.failed = WorkerError(self.broken)
            self.arena.fail(window.batches, run.failed, window.generation)
            return run
        if run.left == 0:
            return run
        with self._lock:
            self._queue.extend((run, job) for job in window.jobs)
        os.write(self._wake_w, b"x")
        return run

    def cancel(self, run: WindowRun) -> None:
        with self._lock:
            run.cancelled = True
            if any(r is run for r, _ in self._queue):
                self._queue = deque(e for e in self._queue if e[0] is not run)

    def stop(self, wait: bool = True) -> None:
        """Stop the workers (their sockets closed: they exit) and the thread. ``wait``:
        join the thread, which reaps the processes (GC does not wait: see
        ``LoopThread.stop_soon``)."""
        with self._lock:
            if self.stopped:
                return
            self.stopped = True
            self._queue.clear()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()

    # -- the engine thread ------------------------------------------------------------
    def _serve(self) -> None:
        try:
            while not self.stopped:
                self._dispatch()
                for key, _ in self._selector.select():
                    proc = key.data
                    if proc is None:
                        os.read(self._wake_r, 4096)
                        continue
                    if proc.conn.closed:  # died earlier in this round
                        continue
                    try:
                        msg = proc.conn.recv()
                    except (EOFError, OSError):
                        self._died(proc)
                        continue
                    self._answer(proc, msg)
        except BaseException as e:  # a bug here must not hang the training loop
            log.exception("insitubatch: the decode workers' thread failed")
            self.broken = f"the decode workers' thread failed: {e!r}"
            self._fail_all()
        finally:
            self._shut()

    def _dispatch(self) -> None:
        """Give every worker with credit left the next jobs of the queue."""
        while True:
            with self._lock:
                if not self._queue:
                    return
                proc = min(self.procs, key=lambda p: len(p.jobs))
                if len(proc.jobs) >= CREDIT:
                    return
                run, job = self._queue.popleft()
            if run.cancelled or run.failed is not None:
                continue
            try:
                places = self._places_of(run, job)
            except StaleBatch:  # the arena was cleared since: a read of the old epoch
                continue
            self._send_segments(proc)
            ident = self._next_id
            self._next_id += 1
            with run.settled:
                run.out += 1
            proc.jobs[ident] = (run, job)
            try:
                proc.conn.send(("job", ident, job.reads, places))
            except OSError:
                self._died(proc)

    def _places_of(self, run: WindowRun, job: ReadJob) -> dict[int, dict[str, Place]]:
        """Where the arrays of the batches ``job`` writes live, allocating each batch at
        the first job that writes it."""
        gen = run.window.generation
        if gen != self._places_generation:
            self._places, self._places_generation = {}, gen
        out = {}
        for b in job.writes:
            got = self._places.get(b)
            if got is None:
                arrays = self.arena.arrays_of(b, gen)
                got = self._places[b] = {k: self.shared.place(a) for k, a in arrays.items()}
            out[b] = got
        return out

    def _send_segments(self, proc: _Proc) -> None:
        segments = self.shared.segments
        while proc.segments < len(segments):
            seg = segments[proc.segments]
            proc.conn.send(("segment", seg.index, seg.nbytes))
            send_handle(proc.conn, seg.fd, proc.popen.pid)
            proc.segments += 1

    def _answer(self, proc: _Proc, msg: tuple) -> None:
        kind = msg[0]
        if kind == "ready":
            proc.ready = True
            return
        if kind == "fatal":
            self.broken = (f"decode worker {proc.number} (pid {proc.popen.pid}) could not "
                           f"start: {msg[1].strip().splitlines()[-1]}")
            log.error("insitubatch: %s\n%s", self.broken, msg[1])
            self._fail_all()
            return
        run, job = proc.jobs.pop(msg[1])
        if kind == "done":
            if msg[2] is not None:
                self.stats.read.merge(msg[2])
            if run.window.generation == self.arena.generation and not run.cancelled:
                for b, n in job.writes.items():
                    self.arena.done(b, n, run.window.generation)
                for v, n in job.per_variable.items():
                    self.stats.stripes_read(n, self.stripe_nbytes[v])
            self._answered(run, finished=True)
        else:
            err = msg[2]
            err.add_note(f"insitubatch: in decode worker {proc.number} "
                         f"(pid {proc.popen.pid})")
            self._fail(run, err)
            self._answered(run, finished=False)

    def _answered(self, run: WindowRun, finished: bool) -> None:
        with run.settled:
            run.out -= 1
            if finished:
                run.left -= 1
                if run.left == 0 and run.failed is None and not run.cancelled:
                    self.stats.window_fetched(len(run.window.plan.chunk_ids))
            run.settled.notify_all()

    def _fail(self, run: WindowRun, err: BaseException) -> None:
        """``run`` failed with ``err``: every batch it feeds fails (named in a note)."""
        if run.failed is not None:
            return
        run.failed = err
        w = run.window
        err.add_note(f"insitubatch: reading the window of chunks {list(w.plan.chunk_ids)[:8]} "
                     f"into batches {w.batches[:8]}")
        self.arena.fail(w.batches, err, w.generation)
        self.cancel(run)

    def _fail_all(self) -> None:
        """The engine is ``broken``: every window given to it fails, each with a
        ``WorkerError`` of its own saying why (one error object would collect every
        window's note)."""
        assert self.broken is not None
        for proc in self.procs:
            for run, _ in list(proc.jobs.values()):
                self._fail(run, WorkerError(self.broken))
                self._answered(run, finished=False)
            proc.jobs.clear()
        with self._lock:
            queued, self._queue = self._queue, deque()
        for run, _ in queued:
            self._fail(run, WorkerError(self.broken))

    def _died(self, proc: _Proc) -> None:
        """``proc`` closed its socket: it died (a kill, an out-of-memory kill, a crash in a
        codec). Fail the windows it held, naming it, and start it again; one that dies
        before it said it was ready (an import or setup that fails every time) is not
        started again: every later window fails with why."""
        try:
            code = proc.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:  # closed its socket but lives on: end it
            proc.popen.kill()
            code = proc.popen.wait()
        how = (f"was killed by signal {signal.Signals(-code).name}" if code < 0
               else f"exited with status {code}")
        held = list(proc.jobs.values())
        proc.jobs.clear()
        self._selector.unregister(proc.conn.fileno())
        proc.conn.close()
        if not proc.ready and self.broken is None:
            self.broken = (f"decode worker {proc.number} (pid {proc.popen.pid}) {how} before "
                           "it started (its error is printed above, on stderr); use workers=0")
            self._fail_all()
        for run, job in held:
            chunks = sorted({(v, s) for v, s, _ in job.reads})[:8]
            err = WorkerError(
                f"insitubatch decode worker {proc.number} (pid {proc.popen.pid}) {how} while "
                f"reading stripes {chunks} (variable, sample-axis chunk) of the window of "
                f"chunks {list(run.window.plan.chunk_ids)[:8]} into batches "
                f"{sorted(job.writes)[:8]}; it is started again, and the next batch asked "
                "for reads the window again")
            self._fail(run, err)
            self._answered(run, finished=False)
        if not self.stopped and self.broken is None:
            self.procs[self.procs.index(proc)] = self._start(proc.number)

    def _shut(self) -> None:
        """The thread's end: close every socket (a worker exits when its socket closes),
        reap the processes, release whoever waits in ``settle``."""
        for proc in self.procs:
            with contextlib.suppress(OSError):
                proc.conn.close()
        for proc in self.procs:
            try:
                proc.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:  # stuck in a read: it would exit after it
                proc.popen.kill()
                proc.popen.wait()
        for proc in self.procs:
            for run, _ in proc.jobs.values():
                with run.settled:
                    run.settled.notify_all()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
