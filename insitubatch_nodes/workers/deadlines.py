"""Deadlines that follow the work: which job a worker runs, since when, read by the
engine without a message or a wake-up of either side.

**The status page.** Each worker gets a page of shared memory of its own (an anonymous
``memfd`` the engine makes and the worker inherits at its start, ``procs.start_worker``):
two float64 cells, the id of the job it runs (``IDLE``, -1, between jobs) and
``time.monotonic()`` when it took that job or went idle. The worker writes them at each
job's start and end with no system call (a store into its mapping; the clock is read through
the vDSO); ``CLOCK_MONOTONIC`` is the same clock in every process of a Linux machine. The
engine reads them only at its ticks (``WorkerEngine``, every ``min(1 s, job_timeout_s /
4)``) and when a worker died (``deaths``: the job it was running is the only one to blame).
So the healthy path pays nothing per job on the training process: no answer per job, no
timer, no wake-up.

**The deadlines** (``overdue``), each ``fetch.worker_timeout_s`` (``job_timeout_s``):

- a worker running one job longer than it is killed (a job's time counts from when the
  worker *took* it, not from when it was sent: a worker with jobs queued in its socket is
  not late for them, and one answering in groups of ``wire.GROUP`` is not silent too long);
- a worker idle while it holds jobs (sent, not taken: it stopped reading, say frozen by
  SIGSTOP) longer than it, counted from the later of going idle and its last job sent;
- a worker not ready ``max(job_timeout_s, START_TIMEOUT_S)`` after it was started: a start
  imports numpy, zarr and the codecs, seconds on a busy machine or a network file system,
  and a short job timeout must not kill healthy starts (twice in a row fails the windows:
  ``deaths``); tests lower the floor.

Written stamp first, id second; read id and stamp twice until both reads agree, so a pair
torn by a concurrent write is read again rather than taken for a stale job.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
import time
from typing import Protocol

IDLE = -1
START_TIMEOUT_S = 30.0  # a worker's start gets at least this long (see above)


class StatusPage:
    """A worker's status page, mapped from ``fd`` (in the engine and in the worker)."""

    def __init__(self, fd: int) -> None:
        self._map = mmap.mmap(fd, mmap.PAGESIZE)
        self.cells = memoryview(self._map).cast("d")

    @classmethod
    def create(cls) -> tuple[StatusPage, int]:
        """A new page, idle since 0, and its descriptor (to pass to the worker, then close)."""
        fd = _page_fd()
        page = cls(fd)
        page.cells[0] = IDLE
        return page, fd

    def took(self, ident: int) -> None:
        """The worker took job ``ident`` now."""
        cells = self.cells
        cells[1] = time.monotonic()
        cells[0] = ident

    def idle(self) -> None:
        """The worker is between jobs from now."""
        cells = self.cells
        cells[1] = time.monotonic()
        cells[0] = IDLE

    def read(self) -> tuple[int, float]:
        """(the job running or ``IDLE``, since when)."""
        cells = self.cells
        got = (cells[0], cells[1])
        for _ in range(8):
            again = (cells[0], cells[1])
            if again == got:
                break
            got = again
        return int(got[0]), got[1]

    def close(self) -> None:
        self.cells.release()
        with contextlib.suppress(BufferError, ValueError):
            self._map.close()


def _page_fd() -> int:
    """An anonymous file of one page: a memfd, or an unlinked temporary file elsewhere."""
    try:
        fd = os.memfd_create("insitubatch-status", os.MFD_CLOEXEC)
    except (AttributeError, OSError):
        with tempfile.TemporaryFile() as f:
            fd = os.dup(f.fileno())
    os.ftruncate(fd, mmap.PAGESIZE)
    return fd


class Watched(Protocol):
    """What the deadlines read of a worker (``procs.WorkerProc``)."""

    ready: bool
    started: float  # when its process was started
    sent_at: float  # when the engine last gave it a job
    status: StatusPage

    @property
    def jobs(self) -> dict: ...


def overdue(proc: Watched, now: float, job_timeout_s: float,
            start_timeout_s: float) -> str | None:
    """Why ``proc`` is to be killed now (the words go after "decode worker N (pid P)"),
    or ``None``; the engine asks only of workers not killed yet."""
    if not proc.ready:
        waited = now - proc.started
        if waited > start_timeout_s:
            return (f"was not ready {waited:.0f} s after it was started (a start gets "
                    f"{start_timeout_s:.0f} s) and was killed")
        return None
    ident, since = proc.status.read()
    if ident != IDLE:
        if now - since > job_timeout_s:
            return (f"ran one job {now - since:.0f} s (fetch.worker_timeout_s: "
                    f"{job_timeout_s:g}) and was killed")
        return None
    jobs = proc.jobs
    if jobs and now - max(since, proc.sent_at) > job_timeout_s:
        return (f"held {len(jobs)} jobs {now - max(since, proc.sent_at):.0f} s without taking "
                f"one (fetch.worker_timeout_s: {job_timeout_s:g}) and was killed")
    return None
