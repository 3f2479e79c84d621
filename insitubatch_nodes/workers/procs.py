"""The decode worker processes as the engine holds them: start one, say how one ended, and
stop them all under one deadline.

Kept apart from the engine's dispatch so that the protocol there (what is out, what is
stale, what is run again) reads without the process plumbing around it.
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
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Generic, TypeVar

# A worker closing its socket exits at once, or after the read it is in; then it is killed.
STOP_WAIT_S = 5.0

T = TypeVar("T")  # what the engine holds per job (``engine.Task``)


@dataclass(eq=False)
class WorkerProc(Generic[T]):
    """One worker process as the engine sees it: its socket, the segments and key tables
    it was sent, the jobs it holds (by id), and when it last showed progress (``since``: ready, an
    answer, a job given while it held none), which the job timeout counts from."""

    number: int
    popen: subprocess.Popen
    conn: Connection
    segments: int = 0  # segments whose descriptors it was sent
    tables: set[int] = field(default_factory=set)  # key tables it was sent (``wire``)
    inbox: bytearray = field(default_factory=bytearray)  # answers read, not yet whole
    outbox: list[bytes] = field(default_factory=list)  # jobs to write at the round's end
    fd: int = -1  # its socket's descriptor (``conn.fileno()`` costs a call)
    jobs: dict[int, T] = field(default_factory=dict)
    ready: bool = False
    since: float = field(default_factory=time.monotonic)
    hung_s: float | None = None  # killed after holding a job this long without answering

    def __post_init__(self) -> None:
        self.fd = self.conn.fileno()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def overdue(self, now: float, timeout_s: float) -> bool:
        """Ready, holding jobs, and silent for longer than ``timeout_s``."""
        return (self.ready and bool(self.jobs) and self.hung_s is None
                and now - self.since > timeout_s)

    def kill_hung(self, now: float) -> None:
        """End a worker that stopped answering; its socket's end then reaches the engine
        as any death does (``ended`` says why)."""
        self.hung_s = now - self.since
        with contextlib.suppress(OSError):
            self.popen.kill()


def start_worker(number: int, setup: bytes | memoryview) -> WorkerProc[T]:
    """``python -m insitubatch_nodes.workers.child FD`` on a socket pair, sent ``setup``.
    A worker that dies at once (its Python or import failed) shows as its socket's end
    on the engine thread, which then says why."""
    parent, child = socket.socketpair()
    env = dict(os.environ)
    # the package as this process imports it, first (a checkout that is not installed);
    # -P: not the working directory before it (``-m`` would put it first, and a checkout
    # there of another revision would answer the jobs with other code)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    try:
        popen = subprocess.Popen(
            [sys.executable, "-P", "-m", "insitubatch_nodes.workers.child",
             str(child.fileno())],
            pass_fds=[child.fileno()], stdin=subprocess.DEVNULL, env=env)
    finally:
        child.close()
    conn = Connection(os.dup(parent.fileno()))
    parent.close()
    with contextlib.suppress(OSError):
        conn.send_bytes(setup)
    return WorkerProc(number, popen, conn)


def ended(proc: WorkerProc[T], timeout_s: float = STOP_WAIT_S) -> str:
    """How ``proc``, whose socket ended, ended ("was killed by signal SIGKILL"), reaped;
    one that closed its socket but lives on is killed after ``timeout_s``."""
    try:
        code = proc.popen.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.popen.kill()
        code = proc.popen.wait()
    if proc.hung_s is not None:
        return (f"held a job {proc.hung_s:.0f} s without answering (fetch.worker_timeout_s) "
                "and was killed")
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def stop_all(procs: list[WorkerProc[T]], timeout_s: float = STOP_WAIT_S) -> None:
    """Close every socket (a worker exits when its socket closes), then wait for all of
    them under one deadline, killing those still running at it. One not yet ready (still
    importing: seconds on a busy machine) holds nothing worth finishing: killed at once."""
    for proc in procs:
        with contextlib.suppress(OSError):
            proc.conn.close()
        if not proc.ready:
            with contextlib.suppress(OSError):
                proc.popen.kill()
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:  # stuck in a read: it would exit after it
            proc.popen.kill()
            proc.popen.wait()
