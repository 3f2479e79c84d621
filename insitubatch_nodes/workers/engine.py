"""The training process's side of the decode workers: start them, hand out jobs, count
what lands, and turn a worker's failure into an error a training loop can act on.

One thread (``insitubatch-workers``) does all of it: it waits on the workers' sockets
and a wake-up pipe (one epoll set), gives each ready worker its credit of jobs at a time
(``wire.credit``: 5, up to 9 for small jobs; its next job is in its socket when it
finishes one), takes a batch's memory from the arena only when the first job writing it
goes out (so batch buffers come back warm from the pool, as on the thread path), and tells
the arena the row writes of the jobs answered once the round's refill went out. The
training thread only queues a prepared window (``submit``): a few microseconds per window.
What crosses a socket per job is integers (``wire``): no pickle, one read for every answer
a worker's socket holds, one write per round of jobs.

The thread never blocks on a worker: sends go through non-blocking outboxes (``outbox``),
a worker's progress is read from its status page at the thread's ticks (``deadlines``:
a job's time counts from when the worker took it; a worker frozen, stuck or never ready is
killed), and a death blames only the job the worker was running (``deaths``). So
``settle``, ``stop`` and every reset end within ``job_timeout_s`` and a few seconds,
whatever the workers do. ``procs`` starts and stops the processes, ``places`` says where
the batches live.

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
from multiprocessing.reduction import ForkingPickler
from typing import Any

from ..errors import ConfigError, InternalError
from ..memory.arena import BatchArena, StaleBatch
from ..metrics.counters import FetchStats
from . import deadlines, wire
from .child import WorkerSetup
from .deaths import Deaths, who
from .jobs import ReadJob, WorkerWindow
from .outbox import Sender
from .places import Places
from .procs import STOP_WAIT_S, WorkerProc, start_worker, stop_all
from .runs import Task, WindowRun, WorkerError
from .shared_memory import SharedMemoryArena

log = logging.getLogger("insitubatch_nodes")

CREDIT = wire.CREDIT  # jobs given to one worker at a time, at least (``wire.credit``)
JOB_TIMEOUT_S = 300.0  # fetch.worker_timeout_s's default (``deadlines``)
READ_BYTES = 1 << 16  # a worker's socket is read this much at a time (every answer it holds)
_FRAME, _DONE = wire.FRAME, wire.DONE
_IN, _OUT = select.EPOLLIN, select.EPOLLOUT

# Tests only: called on the engine thread as ``BEFORE_SEND(run, job)`` between a job's
# batches being allocated and the job being sent, where a cancel must not let it through.
BEFORE_SEND: Callable[[WindowRun, ReadJob], None] | None = None


class WorkerEngine(Deaths):
    """``workers`` decode processes writing into ``shared`` for ``arena``'s batches.

    Built by the fetch node when its loop starts, stopped with it (``stop``); the processes
    live across epochs and restores. A job error fails the batches of its window
    (``BatchArena.fail``: ``GatherNode``, waiting on the batch's future, raises it; the
    loader resets to the last batch delivered and the next ``next()`` reads the window
    again). A worker that dies, or is killed by a deadline (``deadlines``), is started
    again and its jobs run again on the live workers, into the same batch slots; only the
    job it was running is blamed, and a job blamed twice fails its window with a
    ``WorkerError`` naming both deaths (``deaths``). A worker slot that cannot start
    ``deaths.START_TRIES`` times in a row fails the windows in flight; the next window
    submitted starts it again.
    """

    def __init__(self, workers: int, setup: WorkerSetup, arena: BatchArena,
                 shared: SharedMemoryArena, stats: FetchStats, name: str = "insitubatch-workers",
                 job_timeout_s: float = JOB_TIMEOUT_S) -> None:
        if workers < 1:
            raise ConfigError(f"workers must be >= 1 for a WorkerEngine, got {workers}")
        if not job_timeout_s > 0:
            raise ConfigError(f"job_timeout_s must be > 0 seconds, got {job_timeout_s!r}")
        self.arena, self.stats = arena, stats
        self.job_timeout_s = float(job_timeout_s)
        self.start_timeout_s = max(self.job_timeout_s, deadlines.START_TIMEOUT_S)
        # how often the deadlines are checked (a worker is killed within its deadline +
        # this); an idle engine wakes no more often
        self._tick_s = min(1.0, self.job_timeout_s / 4)
        # pickled and framed once, sent to every worker (and to one started again)
        self._setup = wire.framed(ForkingPickler.dumps(setup))
        self._lock = threading.Lock()
        self._queue: deque[Task] = deque()
        self._places = Places(arena, shared)
        self._next_id = 0
        self._done: list[Task] = []  # jobs answered, counted after the round (``_readable``)
        self.stopped = False
        self.reaped = False  # every process is gone: nothing writes for any window now
        # why the windows in flight failed for want of workers: a slot's workers could not
        # start (``deaths``; None again once a worker is ready), or this thread failed
        self.broken: str | None = None
        self._for_good = False  # this thread failed: nothing is started again
        self._down = 0  # worker slots left down after failing to start: the next submit
        self._revive = False  # ... asks for them to be started again
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        # one epoll set for the thread's life (multiprocessing's wait() builds one per call)
        self._epoll = select.epoll()
        self._epoll.register(self._wake_r, _IN)
        self._sender = Sender(self._epoll)
        self._by_fd: dict[int, WorkerProc[Task]] = {}
        self._takers: list[WorkerProc[Task]] = []  # ready, not killed nor dead: given jobs
        self.procs = [self._start(i) for i in range(workers)]
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _start(self, number: int, start_deaths: tuple[str, ...] = ()) -> WorkerProc[Task]:
        """A new worker process in slot ``number``; its setup is written as its socket
        takes it (EPOLLOUT: the thread's next round, never a blocking write)."""
        proc: WorkerProc[Task] = start_worker(number, self._setup, start_deaths)
        self._by_fd[proc.fd] = proc
        self._epoll.register(proc.fd, _IN | _OUT)
        proc.writing = True
        return proc

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    @property
    def usable(self) -> bool:
        """Whether windows submitted now can run: False once stopped, or once the engine
        thread failed (a bug: the fetch node may start a new engine)."""
        return not (self.stopped or self._for_good)

    # -- the training thread's side ---------------------------------------------------
    def submit(self, window: WorkerWindow) -> WindowRun:
        if self.stopped:
            raise InternalError("these decode workers were stopped (the fetch node was closed): "
                               "a bug if reached, the node starts new ones")
        run = WindowRun(window, self, len(window.jobs), threading.Condition(self._lock),
                        credit=wire.credit(window.job_nbytes))
        if self._for_good:
            assert self.broken is not None
            run.failed = WorkerError(self.broken)
            self.arena.fail(window.batches, run.failed, window.generation)
            return run
        if run.left == 0:
            return run
        with self._lock:
            self._queue.extend([Task(run, job) for job in window.jobs])
            # else every ready worker is full: the engine dispatches at its next answer
            # anyway (it looks at the queue after taking answers, this looked after adding
            # to it), and a wake-up costs both threads a GIL hand-over
            wake = any(len(p.jobs) < run.credit for p in self._takers) or not self._takers
            if self._down:  # slots that could not start: try them again for this window
                self._revive = wake = True
        if wake:
            self._wake()
        return run

    def cancel(self, run: WindowRun) -> None:
        with self._lock:
            run.cancelled = True
            if any(t.run is run for t in self._queue):
                self._queue = deque(t for t in self._queue if t.run is not run)

    def stop(self, wait: bool = True) -> None:
        """Stop the workers (their sockets closed: they exit) and the thread. ``wait``:
        join the thread, which reaps the processes within ``STOP_WAIT_S`` (or the job
        timeout, if shorter), killing those that would not exit (GC does not wait: see
        ``LoopThread.stop_soon``)."""
        with self._lock:
            if self.stopped:
                return
            self.stopped = True
            self._queue.clear()
        self._wake()
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full (wake-ups pending anyway) or closed
            os.write(self._wake_w, b"x")

    # -- the engine thread ------------------------------------------------------------
    def _serve(self) -> None:
        poll, by_fd, wake, tick = self._epoll.poll, self._by_fd, self._wake_r, self._tick_s
        try:
            check = time.monotonic() + tick
            while not self.stopped:
                if self._revive:
                    self._start_down()
                if self._queue:
                    self._dispatch()
                if self._done:  # after the refill: the consumer wakes as this thread sleeps
                    self._count_done(self._take_done())
                for fd, events in poll(tick):
                    proc = by_fd.get(fd)
                    if proc is not None:
                        if events & _OUT:
                            self._flush(proc)
                        if events != _OUT:
                            self._readable(proc)
                    elif fd == wake:
                        os.read(wake, 4096)
                now = time.monotonic()
                if now >= check:
                    self._check_deadlines(now)
                    check = now + tick
        except BaseException as e:  # a bug here must not hang the training loop
            log.exception("insitubatch: the decode workers' thread failed")
            self.broken = f"the decode workers' thread failed: {e!r}"
            self._for_good = True
            self._fail_all()
        finally:
            if self._done and not self._for_good:
                self._count_done(self._take_done())
            self._shut()

    def _take_done(self) -> list[Task]:
        done, self._done = self._done, []
        return done

    def _readable(self, proc: WorkerProc[Task]) -> None:
        """Every answer ``proc``'s socket holds (one read), then its end if it closed. Jobs
        done wait in ``_done`` until the round's refill went out: then one count for all
        (``_count_done``: a lock and a counter update per round, not per job, each costing
        microseconds on busy cores), and the consumer it wakes finds this thread asleep
        rather than holding the GIL."""
        if proc.gone:  # died earlier in this round
            return
        try:
            data = os.read(proc.fd, READ_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._died(proc)
            return
        if proc.inbox:  # the rest of a frame read before
            proc.inbox += data
            data, proc.inbox = bytes(proc.inbox), bytearray()
        at, n = 0, len(data)
        jobs, done = proc.jobs, self._done
        while n - at >= 4:
            size = _FRAME.unpack_from(data, at)[0]
            if n - at - 4 < size:
                break
            if data[at + 4] == wire.PICKLE:
                self._answer(proc, pickle.loads(data[at + 4:at + 4 + size]))
                done = self._done
            else:  # a job done, as integers: the usual
                task = jobs.pop(_DONE.unpack_from(data, at + 4)[1], None)
                if task is not None:  # else not held any more: dropped, never counted twice
                    done.append(task)
            at += 4 + size
        if at < n:
            proc.inbox += data[at:]

    def _flush(self, proc: WorkerProc[Task]) -> None:
        """What ``proc``'s socket takes of its outbox, now (``outbox``)."""
        try:
            self._sender.flush(proc)
        except OSError:
            self._died(proc)

    def _dispatch(self) -> None:
        """Give every ready worker with credit left the next jobs of the queue. A job counts
        as out under the lock ``cancel`` takes: a cancel either drops it here or is settled
        only once it was answered (or dropped before it was sent, ``_send_round``)."""
        try:
            while self._send_round(self._pick()):
                pass
        finally:
            for proc in self.procs:  # (one a death here replaced has its setup to write)
                if proc.outbox and not proc.writing and not proc.gone:
                    self._flush(proc)

    def _pick(self) -> list[tuple[WorkerProc[Task], int, Task]]:
        """Under one lock, every job the ready workers' credit takes (a window's credit:
        ``wire.credit``), each counted out and given to the ready worker holding the
        fewest."""
        picked: list[tuple[WorkerProc[Task], int, Task]] = []
        takers = self._takers
        if not takers:
            return picked
        now = time.monotonic()
        with self._lock:
            queue = self._queue
            while queue:
                task = queue[0]
                run = task.run
                if run.cancelled or run.failed is not None:
                    queue.popleft()
                    continue
                proc, least = None, run.credit
                for p in takers:
                    if len(p.jobs) < least:
                        proc, least = p, len(p.jobs)
                if proc is None:
                    break
                queue.popleft()
                ident = self._next_id
                self._next_id += 1
                proc.jobs[ident] = task
                proc.sent_at = now
                run.out += 1
                picked.append((proc, ident, task))
        return picked

    def _send_round(self, picked: list[tuple[WorkerProc[Task], int, Task]]) -> bool:
        """Allocate the picked jobs' batches and queue them to their workers, but those
        whose window was cancelled, failed or belongs to a cleared arena meanwhile (checked
        under the lock, after the allocation): those are dropped, never sent. True if any
        was dropped (its credit is free again)."""
        places: list[list[tuple[int, ...]] | None] = []
        for _, _, task in picked:
            try:
                got: list[tuple[int, ...]] | None = self._places.of(
                    task.job, task.run.window.generation)
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
            if not ok or proc.gone:  # (a dead worker's jobs run again)
                if proc.jobs.pop(ident, None) is not None:
                    self._answered([task.run], finished=False)
                dropped = True
                continue
            assert where is not None
            self._places.send_setup(proc)
            job = task.job
            proc.outbox.append(wire.encode_job(ident, where, job.targets, job.urgent))
        return dropped

    def _job_finished(self, proc: WorkerProc[Task], ident: int, times: Any) -> None:
        """Job ``ident`` of ``proc`` is done, with read counters (a pickled answer)."""
        if times is not None:
            self.stats.read.merge(times)
        task = proc.jobs.pop(ident, None)
        if task is not None:  # else not held any more: dropped, never counted twice
            self._done.append(task)

    def _count_done(self, tasks: list[Task]) -> None:
        """``tasks`` are done: their row writes counted in the arena (one call for all),
        their stripes in the fetch's counters, their windows told (one lock for all)."""
        stripes = nbytes = 0
        arena = self.arena
        gen = arena.generation
        writes: dict[int, int] = {}
        for run, job, _ in tasks:
            if run.window.generation == gen and not run.cancelled:
                for b, n in job.writes.items():
                    writes[b] = writes.get(b, 0) + n
                for n, size in job.reads:
                    stripes += n
                    nbytes += n * size
        if writes:  # (not counted if the arena was cleared since ``gen`` was read)
            arena.landed_many(writes, gen)
        if stripes:
            self.stats.stripes_done(stripes, nbytes)
        self._answered([t.run for t in tasks], finished=True)

    def _answer(self, proc: WorkerProc[Task], msg: tuple) -> None:
        """A pickled answer: ready, fatal, a job done with read counters, a job's error."""
        kind = msg[0]
        if kind == "done":
            self._job_finished(proc, msg[1], msg[2])
            return
        if self._done:  # in order: this answer may fail the window of jobs done before it
            self._count_done(self._take_done())
        if kind == "ready":
            proc.ready = True
            proc.start_deaths = ()
            if proc.killed is None:
                self._takers.append(proc)
            if not self._for_good:
                self.broken = None
            return
        if kind == "fatal":  # its end follows: a death before it started (``_died``)
            proc.fatal = msg[1].strip().splitlines()[-1]
            log.error("insitubatch: %s could not start:\n%s", who(proc), msg[1])
            return
        task = proc.jobs.pop(msg[1], None)
        if task is None:  # not held any more: dropped
            return
        err = msg[2]
        err.add_note(f"insitubatch: in {who(proc)}")
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
        """Every window given to the engine fails (``broken`` says why), each with a
        ``WorkerError`` of its own (one error object would collect every window's note).
        Jobs a live worker holds stay out until it answers or is reaped: it may still be
        writing."""
        assert self.broken is not None
        for proc in self.procs:
            for task in list(proc.jobs.values()):
                self._fail(task.run, WorkerError(self.broken))
        with self._lock:
            queued, self._queue = self._queue, deque()
        for task in queued:
            self._fail(task.run, WorkerError(self.broken))

    def _shut(self) -> None:
        """The thread's end: stop every worker (one deadline for all), release whoever
        waits in ``settle``."""
        stop_all([p for p in self.procs if not p.gone], min(STOP_WAIT_S, self.job_timeout_s))
        self.reaped = True
        for proc in self.procs:
            for task in proc.jobs.values():
                with task.run.settled:
                    task.run.settled.notify_all()
        self._epoll.close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
