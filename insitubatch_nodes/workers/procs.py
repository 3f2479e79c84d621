"""The decode worker processes as the engine holds them: start one, say how one ended, and
stop them all under one deadline.

Kept apart from the engine's dispatch so that the protocol there (what is out, what is
stale, what is run again) reads without the process plumbing around it. Nothing here
waits on a worker without a bound: a worker frozen (SIGSTOP), stuck in a job or still
starting is killed (SIGKILL ends a stopped process too) rather than waited for.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, TypeVar

from .deadlines import StatusPage

# A worker whose socket closed exits at once, or after the job it is in: it gets this long
# (or the job timeout, if shorter), then it is killed.
STOP_WAIT_S = 5.0
# A worker whose socket ended without a signal (it exited by itself): this long to be gone.
GONE_WAIT_S = 1.0

T = TypeVar("T")  # what the engine holds per job (``runs.Task``)


@dataclass(eq=False)
class WorkerProc(Generic[T]):
    """One worker process as the engine sees it: its socket (non-blocking), status page
    (``deadlines``), what it was sent (segments, key tables) and is still to be sent
    (``outbox``), the jobs it holds by id in the order they were sent (it runs them in
    that order), and what the deadlines count from."""

    number: int  # its slot: a replacement takes the same number
    popen: subprocess.Popen
    sock: socket.socket
    status: StatusPage
    # the deaths before "ready" of this slot's workers just before this one (``deaths``)
    start_deaths: tuple[str, ...] = ()
    segments: int = 0  # segments whose descriptors it was sent (or queued in ``outbox``)
    tables: set[int] = field(default_factory=set)  # key tables it was sent (``wire``)
    inbox: bytearray = field(default_factory=bytearray)  # answers read, not yet whole
    # bytes to write, in order, and descriptors (ints) to pass between them (``outbox``)
    outbox: list[bytes | int] = field(default_factory=list)
    fds_out: int = 0  # descriptors in ``outbox``
    writing: bool = False  # waiting for its socket to take more (EPOLLOUT registered)
    fd: int = -1  # its socket's descriptor (``sock.fileno()`` costs a call)
    jobs: dict[int, T] = field(default_factory=dict)
    ready: bool = False
    started: float = field(default_factory=time.monotonic)
    sent_at: float = 0.0  # when it was last given a job
    killed: str | None = None  # why the engine killed it (``deadlines.overdue``)
    fatal: str | None = None  # the last line of the error its setup raised
    gone: bool = False  # its end was handled: reaped, nothing held

    def __post_init__(self) -> None:
        self.fd = self.sock.fileno()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def kill(self, why: str) -> None:
        """End it (its socket's end then reaches the engine as any death does)."""
        self.killed = why
        with contextlib.suppress(OSError):
            self.popen.kill()


def start_worker(number: int, setup: bytes, start_deaths: tuple[str, ...] = ()
                 ) -> WorkerProc[T]:
    """``python -m insitubatch_nodes.workers.child FD STATUS_FD`` on a socket pair, with
    ``setup`` (a whole frame) first in its outbox: nothing is written here, so a worker
    that never reads cannot block the engine. A worker that dies at once (its Python or
    import failed) shows as its socket's end on the engine thread, which then says why."""
    parent, child = socket.socketpair()
    status, status_fd = StatusPage.create()
    env = dict(os.environ)
    # the package as this process imports it, first (a checkout that is not installed);
    # -P: not the working directory before it (``-m`` would put it first, and a checkout
    # there of another revision would answer the jobs with other code)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    try:
        popen = subprocess.Popen(
            [sys.executable, "-P", "-m", "insitubatch_nodes.workers.child",
             str(child.fileno()), str(status_fd)],
            pass_fds=[child.fileno(), status_fd], stdin=subprocess.DEVNULL, env=env)
    except BaseException:
        parent.close()
        status.close()
        raise
    finally:
        child.close()
        os.close(status_fd)  # the worker has its own; the page stays mapped here
    parent.setblocking(False)
    return WorkerProc(number, popen, parent, status, start_deaths, outbox=[setup])


def frozen(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP, a debugger): it would not exit."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:][:1] in (b"T", b"t")


def reap(proc: WorkerProc[T], grace_s: float = GONE_WAIT_S) -> str:
    """How ``proc``, whose socket ended, ended ("was killed by signal SIGKILL"), reaped;
    one that lives on is killed at once if frozen, else after ``grace_s``."""
    popen = proc.popen
    if popen.poll() is None:
        if frozen(popen.pid):
            popen.kill()
        try:
            popen.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            popen.kill()
    code = popen.wait()
    if proc.killed is not None:
        return proc.killed
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    if proc.fatal is not None:
        return f"exited with status {code} ({proc.fatal})"
    return f"exited with status {code}"


def stop_all(procs: list[WorkerProc[T]], timeout_s: float = STOP_WAIT_S) -> None:
    """Close every socket (a worker exits when its socket closes, or after the job it is
    in), then wait for all of them under one deadline, killing those still running at it.
    Those that would not exit are killed at once: one not yet ready (still importing:
    seconds on a busy machine, and nothing worth finishing), one frozen, one killed
    already (a SIGKILL is not lost: waiting for it is quick)."""
    for proc in procs:
        with contextlib.suppress(OSError):
            proc.sock.close()
        if proc.popen.poll() is None and (not proc.ready or proc.killed is not None
                                          or frozen(proc.pid)):
            with contextlib.suppress(OSError):
                proc.popen.kill()
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:  # stuck in a job: it would exit after it
            proc.popen.kill()
            proc.popen.wait()
        proc.status.close()
