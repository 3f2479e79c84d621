"""A worker's death as the engine judges it: which of its jobs is to blame, what runs
again, when a slot stops being started again, and the words a training loop sees.

**Blame.** A worker runs its jobs in the order they were sent, one at a time, and its
status page (``deadlines``) says which one it was running when it died. Only that job is
blamed (``Task.died``): the jobs after it were never started (still in its socket or the
engine's outbox) and go back to the queue's head as they were; the jobs before it were
done but not yet reported (answers go in groups, ``wire.GROUP``) and run again too, also
without blame (a job's writes are idempotent: the same bytes into the same slots, counted
once, when a worker reports it). A worker that died between jobs blames none. A job
blamed twice (its second worker died running it too: a chunk that kills its decoder)
fails its window with a ``WorkerError`` naming both deaths and that job's stripes only.

**Start-up.** A worker that dies before it said "ready" (or is killed for not getting
ready in time) holds no job (only ready workers get jobs) and is started again, up to
``START_TRIES`` in a row for its slot; then every window in flight fails with a
``WorkerError`` naming each death, and the slot stays down until a later window is
submitted (``WorkerEngine.submit``), which starts it afresh: an error, not a dead engine.

``Deaths`` is the engine's side of it (mixed into ``engine.WorkerEngine``, on its thread):
the deadlines checked at its ticks, a death's jobs sorted, the slot started again.
"""

from __future__ import annotations

import logging
import select
import threading
from collections import deque
from typing import TYPE_CHECKING, Any

from ..metrics.counters import FetchStats
from . import deadlines
from .procs import WorkerProc, reap
from .runs import Task, WindowRun, WorkerError, few

log = logging.getLogger("insitubatch_nodes")

START_TRIES = 2  # starts in a row of one worker slot that may die before "ready"


def who(proc: WorkerProc[Any]) -> str:
    return f"decode worker {proc.number} (pid {proc.pid})"


def blame(held: list[Task], idents: list[int], running: int) -> tuple[Task | None, list[Task]]:
    """Of the jobs a dead worker held (``idents``, in the order sent), the one it was
    running (``running``, from its status page) and the others, in order."""
    blamed = None
    others = []
    for ident, task in zip(idents, held, strict=True):
        if ident == running:
            blamed = task
        else:
            others.append(task)
    return blamed, others


def death_warning(what: str, blamed: Task | None, others: int, new_pid: int | None) -> str:
    """The WARNING of a worker's death mid-run: the job it ran (its stripes), the others."""
    ran = ("between jobs" if blamed is None else
           f"running stripes {few(blamed.job.stripes())} (variable, sample-axis chunk)")
    again = "not started again (stopping)" if new_pid is None else \
        f"started it again (pid {new_pid})"
    held = f"the {others} jobs it held" if blamed is None else f"the {others} other jobs it held"
    return (f"insitubatch: {what}, {ran}; {again}; {held} (not started, or done and not "
            "yet reported) run again on the live workers")


def start_error(deaths: tuple[str, ...]) -> str:
    """Why a slot's workers could not start, each death said."""
    return (f"{', then '.join(deaths)}: {len(deaths)} starts in a row of this decode "
            "worker failed (its error, if any, is printed above on stderr); the windows in "
            "flight fail, and the next window starts it again (workers=0 reads in this "
            "process)")


def died_twice(task: Task, second: str) -> WorkerError:
    """The error of a job whose worker died running it, and whose second worker died
    running it too."""
    w = task.run.window
    stripes = task.job.stripes()
    return WorkerError(
        f"insitubatch: two decode workers died running the same job: {task.died}, then "
        f"{second}, both while reading stripes {few(stripes)} (variable, sample-axis "
        f"chunk) of the window of chunks {list(w.plan.chunk_ids)[:8]} into batches "
        f"{sorted(task.job.writes)[:8]}; it is not run a third time (a chunk that kills its "
        "decoder? workers=0 reads it in this process and shows its error)")


class Deaths:
    """The engine's handling of its workers' deadlines and ends (``engine.WorkerEngine``
    mixes it in; everything here runs on the engine thread)."""

    if TYPE_CHECKING:  # the engine's, used here
        procs: list[WorkerProc[Task]]
        stats: FetchStats
        stopped: bool
        broken: str | None
        job_timeout_s: float
        start_timeout_s: float
        _lock: threading.Lock
        _queue: deque[Task]
        _epoll: select.epoll
        _by_fd: dict[int, WorkerProc[Task]]
        _takers: list[WorkerProc[Task]]
        _for_good: bool
        _down: int
        _revive: bool

        def _start(self, number: int, start_deaths: tuple[str, ...] = ()
                   ) -> WorkerProc[Task]: ...
        def _fail(self, run: WindowRun, err: BaseException) -> None: ...
        def _fail_all(self) -> None: ...
        def _answered(self, runs: list[WindowRun], finished: bool) -> None: ...

    def _check_deadlines(self, now: float) -> None:
        """Kill the workers past a deadline (``deadlines.overdue``); their sockets' ends
        come next (``_died``), or, should a process it started hold its socket open,
        their exits are seen here at the next tick."""
        for proc in list(self.procs):
            if proc.gone:
                continue
            if proc.killed is not None:
                if proc.popen.poll() is not None:
                    self._died(proc)
                continue
            why = deadlines.overdue(proc, now, self.job_timeout_s, self.start_timeout_s)
            if why is not None:
                proc.kill(why)
                self._no_jobs(proc)

    def _no_jobs(self, proc: WorkerProc[Task]) -> None:
        """``proc`` is given no more jobs (killed, or dead)."""
        if proc in self._takers:
            self._takers.remove(proc)

    def _died(self, proc: WorkerProc[Task]) -> None:
        """``proc``'s socket ended: it died (a kill, an out-of-memory kill, a crash in a
        codec, a deadline) or could not start. It is started again; only the job it was
        running is blamed, its other jobs run again as they were (``deaths``)."""
        if proc.gone:
            return
        proc.gone = True
        self._no_jobs(proc)
        what = f"{who(proc)} {reap(proc)}"
        running = proc.status.read()[0] if proc.ready else deadlines.IDLE
        idents, held = list(proc.jobs), list(proc.jobs.values())
        proc.jobs.clear()
        proc.outbox.clear()  # never written: its descriptor's number may be reused
        proc.fds_out = 0
        self._epoll.unregister(proc.fd)
        del self._by_fd[proc.fd]
        proc.sock.close()
        proc.status.close()
        if not proc.ready:  # it held nothing: only ready workers get jobs
            self._dead_at_start(proc, what)
            return
        blamed, others = blame(held, idents, running)
        new = self._replace(proc)  # first: whoever sees the failures below sees it counted
        again = []
        for task in held:
            if task.run.cancelled or task.run.failed is not None:
                continue
            if task is not blamed:
                again.append(task)  # never started, or done and not reported: no blame
            elif task.died is None:
                again.append(Task(task.run, task.job, what))
            else:
                self._fail(task.run, died_twice(task, what))
        with self._lock:
            self._queue.extendleft(reversed(again))
        if held:
            self._answered([t.run for t in held], finished=False)
        if new is not None:
            log.warning(death_warning(what, blamed, len(others), new.pid))

    def _replace(self, proc: WorkerProc[Task], start_deaths: tuple[str, ...] = (),
                 ) -> WorkerProc[Task] | None:
        """A new worker in dead ``proc``'s place, counted (none while stopping or broken
        for good)."""
        if self.stopped or self._for_good:
            return None
        self.procs[self.procs.index(proc)] = new = self._start(proc.number, start_deaths)
        self.stats.worker_restarted()
        return new

    def _dead_at_start(self, proc: WorkerProc[Task], what: str) -> None:
        """A worker died before it was ready: started again, up to ``START_TRIES`` in a
        row for its slot; then the windows in flight fail and the slot stays down until
        the next window is submitted (``submit``)."""
        deaths = (*proc.start_deaths, f"{what} before it started")
        if len(deaths) < START_TRIES:
            new = self._replace(proc, deaths)
            if new is not None:
                log.warning("insitubatch: %s; started it again (pid %d)", deaths[-1], new.pid)
            return
        self._down += 1
        self.broken = start_error(deaths)
        log.error("insitubatch: %s", self.broken)
        self._fail_all()

    def _start_down(self) -> None:
        """Start the slots left down again, afresh (a window came after their failure)."""
        self._revive = False
        for proc in list(self.procs):
            if proc.gone and not proc.ready and not self.stopped:
                self._replace(proc)
        self._down = 0
