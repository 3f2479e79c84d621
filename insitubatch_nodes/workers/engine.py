"""The training process's side of the decode workers: start them, hand out jobs, count
what lands, and turn a worker's failure into an error a training loop can act on.

One thread (``insitubatch-workers``) does all of it: it waits on the workers' sockets
and a wake-up pipe (one epoll set), gives each worker up to ``CREDIT`` jobs at a time (its
next job is in its socket when it finishes one), takes a batch's memory from the arena
only when the first job writing it goes out (so batch buffers come back warm from the
pool, as on the thread path), and tells the arena each job's row writes when it is done.
The training thread only queues a prepared window (``submit``): a few microseconds per
window. What crosses a socket per job is integers (``wire``): no pickle, one read for
every answer a worker's socket holds, one write per job.

Nothing stale, ever: a job counts as out (``WindowRun.out``, what ``settle`` waits for)
under the lock ``cancel`` takes, before its batches are allocated, and is checked again
(cancelled, generation) right before it is sent; so once ``settle`` returns no worker
writes into that window's memory, and the arena may clear and reuse it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import select
import threading
import time
from collections import deque
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler, send_handle
from typing import Any

from ..errors import ConfigError, InternalError
from ..memory.arena import BatchArena, StaleBatch
from ..metrics.counters import FetchStats
from . import wire
from .child import WorkerSetup
from .jobs import ReadJob, WorkerWindow
from .procs import WorkerProc, ended, start_worker, stop_all
from .runs import Task, WindowRun, WorkerError, died_twice, few
from .shared_memory import SharedMemoryArena

log = logging.getLogger("insitubatch_nodes")

CREDIT = wire.CREDIT  # jobs given to one worker at a time (answered in pairs: ``wire``)
JOB_TIMEOUT_S = 300.0  # fetch.worker_timeout_s's default: a job unanswered this long is hung
READ_BYTES = 1 << 16  # a worker's socket is read this much at a time (every answer it holds)
_FRAME, _DONE = wire.FRAME, wire.DONE

# Tests only: called on the engine thread as ``BEFORE_SEND(run, job)`` between a job's
# batches being allocated and the job being sent, where a cancel must not let it through.
BEFORE_SEND: Callable[[WindowRun, ReadJob], None] | None = None


class WorkerEngine:
    """``workers`` decode processes writing into ``shared`` for ``arena``'s batches.

    Built by the fetch node when its loop starts, stopped with it (``stop``); the processes
    live across epochs and restores. A job error fails the batches of its window
    (``BatchArena.fail``: the shuffle buffer raises it, the loader resets to the last
    batch delivered and the next ``next()`` reads the window again). A worker that dies
    (or holds a job ``job_timeout_s`` without answering, and is killed) is started again
    and its jobs run again on the live workers, into the same batch slots; a job whose
    second worker dies too fails its window with a ``WorkerError`` naming both.
    """

    def __init__(self, workers: int, setup: WorkerSetup, arena: BatchArena,
                 shared: SharedMemoryArena, stats: FetchStats, name: str = "insitubatch-workers",
                 job_timeout_s: float = JOB_TIMEOUT_S) -> None:
        if workers < 1:
            raise ConfigError(f"workers must be >= 1 for a WorkerEngine, got {workers}")
        if not job_timeout_s > 0:
            raise ConfigError(f"job_timeout_s must be > 0 seconds, got {job_timeout_s!r}")
        self.arena, self.shared, self.stats = arena, shared, stats
        self.job_timeout_s = float(job_timeout_s)
        # how often held jobs are checked for the timeout (a hung worker is killed within
        # job_timeout_s + this); an idle engine wakes no more often
        self._tick_s = min(1.0, self.job_timeout_s / 4)
        # pickled once, sent to every worker (and to one started again)
        self._setup = ForkingPickler.dumps(setup)
        self._lock = threading.Lock()
        self._queue: deque[Task] = deque()
        # batch -> its place: (batch, rows, key table, segment, offset, ...) (``wire``)
        self._places: dict[int, tuple[int, ...]] = {}
        self._places_generation = -1
        self._tables: dict[wire.Table, int] = {}  # key tables, numbered as workers get them
        self._table_of: dict[tuple[str, ...], int] = {}  # a batch's keys -> its table's number
        self._next_id = 0
        self.stopped = False
        self.reaped = False  # every process is gone: nothing writes for any window now
        self.broken: str | None = None  # a worker could not start: why
        self._wake_r, self._wake_w = os.pipe()
        # one epoll set for the thread's life (multiprocessing's wait() builds one per call)
        self._epoll = select.epoll()
        self._epoll.register(self._wake_r, select.EPOLLIN)
        self._by_fd: dict[int, WorkerProc[Task]] = {}
        self.procs = [self._start(i) for i in range(workers)]
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _start(self, number: int) -> WorkerProc[Task]:
        proc: WorkerProc[Task] = start_worker(number, self._setup)
        self._by_fd[proc.fd] = proc
        self._epoll.register(proc.fd, select.EPOLLIN)
        return proc

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    # -- the training thread's side ---------------------------------------------------
    def submit(self, window: WorkerWindow) -> WindowRun:
        if self.stopped:
            raise InternalError("these decode workers were stopped (the fetch node was closed): "
                               "a bug if reached, the node starts new ones")
        run = WindowRun(window, self, len(window.jobs), threading.Condition(self._lock))
        if self.broken is not None:
            run.failed = WorkerError(self.broken)
            self.arena.fail(window.batches, run.failed, window.generation)
            return run
        if run.left == 0:
            return run
        with self._lock:
            idle = not self._queue  # else the engine dispatches at its next answer anyway
            self._queue.extend([Task(run, job) for job in window.jobs])
        if idle:
            os.write(self._wake_w, b"x")
        return run

    def cancel(self, run: WindowRun) -> None:
        with self._lock:
            run.cancelled = True
            if any(t.run is run for t in self._queue):
                self._queue = deque(t for t in self._queue if t.run is not run)

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
        poll, by_fd, wake, tick = self._epoll.poll, self._by_fd, self._wake_r, self._tick_s
        try:
            check = time.monotonic() + tick
            while not self.stopped:
                if self._queue:
                    self._dispatch()
                for fd, _ in poll(tick):
                    proc = by_fd.get(fd)
                    if proc is not None:
                        self._readable(proc)
                    elif fd == wake:
                        os.read(wake, 4096)
                now = time.monotonic()
                if now >= check:
                    self._kill_hung(now)
                    check = now + tick
        except BaseException as e:  # a bug here must not hang the training loop
            log.exception("insitubatch: the decode workers' thread failed")
            self.broken = f"the decode workers' thread failed: {e!r}"
            self._fail_all()
        finally:
            self._shut()

    def _readable(self, proc: WorkerProc[Task]) -> None:
        """Every answer ``proc``'s socket holds (one read), then its end if it closed. The
        answers' counts are folded: one lock and one counter update per read, not per job
        (each costs the engine thread microseconds on a machine whose cores are busy)."""
        if proc.fd not in self._by_fd:  # died earlier in this round
            return
        try:
            data = os.read(proc.fd, READ_BYTES)
        except OSError:
            data = b""
        if not data:
            self._died(proc)
            return
        proc.since = time.monotonic()  # it answers: not hung
        if proc.inbox:  # the rest of a frame read before
            proc.inbox += data
            data, proc.inbox = bytes(proc.inbox), bytearray()
        at, n = 0, len(data)
        done: list[Task] = []
        while n - at >= 4:
            size = _FRAME.unpack_from(data, at)[0]
            if n - at - 4 < size:
                break
            if data[at + 4] == wire.PICKLE:
                if done:  # in order: a pickled answer may fail the window of those done
                    self._count_done(done)
                    done = []
                self._answer(proc, pickle.loads(data[at + 4:at + 4 + size]))
            else:  # a job done, as integers: the usual
                task = proc.jobs.pop(_DONE.unpack_from(data, at + 4)[1], None)
                if task is not None:  # else not held any more: dropped, never counted twice
                    done.append(task)
            at += 4 + size
        if done:
            self._count_done(done)
        if at < n:
            proc.inbox += data[at:]

    def _dispatch(self) -> None:
        """Give every worker with credit left the next jobs of the queue. A job counts as
        out under the lock ``cancel`` takes: a cancel either drops it here or is settled
        only once it was answered (or dropped before it was sent, ``_send_round``)."""
        procs, live = self.procs, self._by_fd
        try:
            while self._send_round(self._pick(procs, live), live):
                pass
        finally:
            for proc in procs:
                if proc.outbox and live.get(proc.fd) is proc:
                    data, proc.outbox = b"".join(proc.outbox), []
                    try:
                        _write(proc, data)
                    except OSError:
                        self._died(proc)

    def _pick(self, procs: list[WorkerProc[Task]], live: dict[int, WorkerProc[Task]],
              ) -> list[tuple[WorkerProc[Task], int, Task]]:
        """Under one lock, every job the workers' credit takes, each counted out and given
        to the live worker holding the fewest."""
        picked = []
        with self._lock:
            queue = self._queue
            while queue:
                proc, least = None, CREDIT
                for p in procs:
                    if len(p.jobs) < least and p.fd in live:
                        proc, least = p, len(p.jobs)
                if proc is None:
                    break
                task = queue.popleft()
                run = task.run
                if run.cancelled or run.failed is not None:
                    continue
                ident = self._next_id
                self._next_id += 1
                if not proc.jobs:
                    proc.since = time.monotonic()
                proc.jobs[ident] = task
                run.out += 1
                picked.append((proc, ident, task))
        return picked

    def _send_round(self, picked: list[tuple[WorkerProc[Task], int, Task]],
                    live: dict[int, WorkerProc[Task]]) -> bool:
        """Allocate the picked jobs' batches and send them, but those whose window was
        cancelled, failed or belongs to a cleared arena meanwhile (checked under the lock,
        after the allocation): those are dropped, never sent. True if any was dropped (its
        credit is free again)."""
        places: list[list[tuple[int, ...]] | None] = []
        for _, _, task in picked:
            try:
                got: list[tuple[int, ...]] | None = self._places_of(task.run, task.job)
            except StaleBatch:  # the arena was cleared since: a read of the old epoch
                got = None
            if got is not None and BEFORE_SEND is not None:
                BEFORE_SEND(task.run, task.job)
            places.append(got)
        with self._lock:
            gen = self.arena.generation
            alive = [p is not None and not t.run.cancelled and t.run.failed is None
                     and t.run.window.generation == gen
                     for p, (_, _, t) in zip(places, picked, strict=True)]
        dropped = False
        for ok, where, (proc, ident, task) in zip(alive, places, picked, strict=True):
            if not ok or live.get(proc.fd) is not proc:  # (a dead worker's jobs run again)
                if proc.jobs.pop(ident, None) is not None:
                    self._answered([task.run], finished=False)
                dropped = True
                continue
            assert where is not None
            try:
                self._send_setup(proc, where)
            except OSError:
                self._died(proc)
                continue
            job = task.job
            proc.outbox.append(wire.encode_job(ident, where, job.targets, job.urgent))
        return dropped

    def _places_of(self, run: WindowRun, job: ReadJob) -> list[tuple[int, ...]]:
        """Where the arrays of the batches ``job`` writes live, allocating each batch at
        the first job that writes it."""
        gen = run.window.generation
        if gen != self._places_generation:
            self._places, self._places_generation = {}, gen
        places = self._places
        out = []
        for b in job.writes:
            got = places.get(b)
            if got is None:
                got = places[b] = self._place(b, self.arena.arrays_of(b, gen))
            out.append(got)
        return out

    def _place(self, b: int, arrays: dict[str, Any]) -> tuple[int, ...]:
        """Batch ``b``'s place: (b, rows, key table, then segment and offset per key). A
        batch's shapes past the rows and its dtypes follow from its keys (the arena's
        layout): the table is made once per set of keys, then looked up."""
        names = tuple(arrays)
        number = self._table_of.get(names)
        if number is None:
            table = tuple((k, tuple(a.shape[1:]), a.dtype.str) for k, a in arrays.items())
            number = self._table_of[names] = self._tables.setdefault(table, len(self._tables))
        rows = next(iter(arrays.values())).shape[0] if arrays else 0
        where = self.shared.where
        return (b, rows, number, *[x for a in arrays.values() for x in where(a)])

    def _send_setup(self, proc: WorkerProc[Task], places: list[tuple[int, ...]]) -> None:
        """What ``proc`` needs before a job on ``places``: the segments' descriptors and the
        key tables it was not sent yet (written now: the jobs in its outbox come after)."""
        segments = self.shared.segments
        while proc.segments < len(segments):
            seg = segments[proc.segments]
            proc.conn.send(("segment", seg.index, seg.nbytes))
            send_handle(proc.conn, seg.fd, proc.pid)
            proc.segments += 1
        if len(proc.tables) < len(self._tables):
            for table, number in self._tables.items():
                if number not in proc.tables:
                    proc.conn.send(("table", number, table))
                    proc.tables.add(number)

    def _done(self, proc: WorkerProc[Task], ident: int, times: Any) -> None:
        """Job ``ident`` of ``proc`` is done, with read counters (a pickled answer)."""
        if times is not None:
            self.stats.read.merge(times)
        task = proc.jobs.pop(ident, None)
        if task is not None:  # else not held any more: dropped, never counted twice
            self._count_done([task])

    def _count_done(self, tasks: list[Task]) -> None:
        """``tasks`` are done: their row writes counted in the arena, their stripes in the
        fetch's counters, their windows told (one lock for all)."""
        stripes = nbytes = 0
        arena = self.arena
        for run, job, _ in tasks:
            gen = run.window.generation
            if gen == arena.generation and not run.cancelled:
                arena.done_many(job.writes, gen)
                for n, size in job.reads:
                    stripes += n
                    nbytes += n * size
        if stripes:
            self.stats.stripes_done(stripes, nbytes)
        self._answered([t.run for t in tasks], finished=True)

    def _answer(self, proc: WorkerProc[Task], msg: tuple) -> None:
        """A pickled answer: ready, fatal, a job done with read counters, a job's error."""
        kind = msg[0]
        if kind == "done":
            self._done(proc, msg[1], msg[2])
            return
        if kind == "ready":
            proc.ready = True
            return
        if kind == "fatal":
            self.broken = (f"decode worker {proc.number} (pid {proc.pid}) could not "
                           f"start: {msg[1].strip().splitlines()[-1]}")
            log.error("insitubatch: %s\n%s", self.broken, msg[1])
            self._fail_all()
            return
        task = proc.jobs.pop(msg[1], None)
        if task is None:  # not held any more: dropped
            return
        err = msg[2]
        err.add_note(f"insitubatch: in decode worker {proc.number} (pid {proc.pid})")
        self._fail(task.run, err)
        self._answered([task.run], finished=False)

    def _answered(self, runs: list[WindowRun], finished: bool) -> None:
        """A job of each of ``runs`` is no longer out (``finished``: done), under one lock."""
        with self._lock:
            for run in runs:
                run.out -= 1
                if finished:
                    run.left -= 1
                    if run.left == 0 and run.failed is None and not run.cancelled:
                        self.stats.window_fetched(len(run.window.plan.chunk_ids))
                if run.waiting:
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
        window's note). Jobs a live worker holds stay out until it answers or is reaped:
        it may still be writing."""
        assert self.broken is not None
        for proc in self.procs:
            for task in list(proc.jobs.values()):
                self._fail(task.run, WorkerError(self.broken))
        with self._lock:
            queued, self._queue = self._queue, deque()
        for task in queued:
            self._fail(task.run, WorkerError(self.broken))

    # -- a worker's death ---------------------------------------------------------------
    def _died(self, proc: WorkerProc[Task]) -> None:
        """``proc`` closed its socket: it died (a kill, an out-of-memory kill, a crash in a
        codec, or killed here for not answering). It is started again and its jobs run
        again on the live workers; one that dies before it said it was ready (an import or
        setup that fails every time) is not started again: every later window fails."""
        if self._by_fd.get(proc.fd) is not proc:  # seen dead already
            return
        how = ended(proc)
        held = list(proc.jobs.values())
        proc.jobs.clear()
        proc.outbox.clear()  # never written: its descriptor's number may be reused
        self._epoll.unregister(proc.fd)
        del self._by_fd[proc.fd]
        proc.conn.close()
        if not proc.ready:
            self._dead_at_start(proc, how, held)
            return
        rerun = [t for t in held if not (t.run.cancelled or t.run.failed is not None)]
        first = f"decode worker {proc.number} (pid {proc.pid}) {how}"
        again = [Task(t.run, t.job, first) for t in rerun if t.died is None]
        new = self._replace(proc)  # first: whoever sees the failures below sees it counted
        with self._lock:
            self._queue.extendleft(reversed(again))
        for task in rerun:
            if task.died is not None:
                self._fail(task.run, died_twice(task, first))
        for task in held:
            self._answered([task.run], finished=False)
        if new is not None:
            stripes = sorted({vs for t in again for vs in t.job.stripes()})
            log.warning("insitubatch: %s holding %d jobs; started it again (pid %d); %d jobs "
                        "run again on the live workers: stripes %s (variable, sample-axis "
                        "chunk)", first, len(held), new.pid, len(again), few(stripes))

    def _replace(self, proc: WorkerProc[Task]) -> WorkerProc[Task] | None:
        """A new worker in dead ``proc``'s place, counted (none while stopping or broken)."""
        if self.stopped or self.broken is not None:
            return None
        self.procs[self.procs.index(proc)] = new = self._start(proc.number)
        self.stats.worker_restarted()
        return new

    def _dead_at_start(self, proc: WorkerProc[Task], how: str, held: list[Task]) -> None:
        """A worker died before it was ready: the engine is broken, every window fails."""
        if self.broken is None:
            self.broken = (f"decode worker {proc.number} (pid {proc.pid}) {how} before "
                           "it started (its error is printed above, on stderr); use workers=0")
            self._fail_all()
        for task in held:
            self._fail(task.run, WorkerError(self.broken))
            self._answered([task.run], finished=False)

    def _kill_hung(self, now: float) -> None:
        for proc in self.procs:
            if proc.overdue(now, self.job_timeout_s):
                proc.kill_hung(now)  # its socket's end comes next round: ``_died``

    def _shut(self) -> None:
        """The thread's end: stop every worker (one deadline for all), release whoever
        waits in ``settle``."""
        stop_all(self.procs)
        self.reaped = True
        for proc in self.procs:
            for task in proc.jobs.values():
                with task.run.settled:
                    task.run.settled.notify_all()
        self._epoll.close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)


def _write(proc: WorkerProc[Task], data: bytes) -> None:
    """All of ``data`` into ``proc``'s socket (a blocking one: one write, but for a signal)."""
    sent = os.write(proc.fd, data)
    if sent < len(data):
        view = memoryview(data)[sent:]
        while view:
            view = view[os.write(proc.fd, view):]
