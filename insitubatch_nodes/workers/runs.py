"""A window on the decode workers as the fetch node and the engine hold it: its jobs
(``Task``), the future-like ``WindowRun`` the node keeps, and the errors a lost worker
raises (kept apart from ``engine``'s dispatch so that each module reads on its own).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from ..errors import InsitubatchError
from .jobs import ReadJob, WorkerWindow


class Engine(Protocol):
    """What a ``WindowRun`` asks of its engine (``engine.WorkerEngine``)."""

    reaped: bool

    def cancel(self, run: WindowRun) -> None: ...


class Task(NamedTuple):
    """A job of a window as the engine queues and hands it out; ``died`` says how the
    worker that ran it first died (a job is run again once, never a third time)."""

    run: WindowRun
    job: ReadJob
    died: str | None = None


class WorkerError(InsitubatchError, RuntimeError):
    """A decode worker process could not start (twice in a row), or two died running the
    same job: the message names each death (number, pid, how it ended) and, for a job, its
    stripes and the window and batches affected."""


@dataclass(eq=False)
class WindowRun:
    """A window on the workers: the future-like object the fetch node keeps (``cancel``,
    ``settle``, ``finished``, also named ``done``), as ``fetch.jobs.DirectWindow`` is for
    the decode threads. ``settled`` is a condition on the engine's lock: every count below
    changes under it."""

    window: WorkerWindow
    engine: Engine
    left: int  # jobs not yet done
    settled: threading.Condition
    out: int = 0  # jobs held by a worker (or being sent to one) and not yet answered
    cancelled: bool = False
    failed: BaseException | None = None
    waiting: int = 0  # threads in ``settle``: only then is an answer notified
    credit: int = 5  # jobs a worker may hold while it is given this window's (``wire.credit``)

    def cancel(self) -> bool:
        """Drop the jobs not yet given to a worker; ``settle`` waits for the others."""
        self.engine.cancel(self)
        return True

    def settle(self) -> None:
        """After ``cancel``: wait until no worker writes for this window any more, so its
        batches' memory can be given to the window that replaces it. Bounded whatever the
        workers do: a worker that holds a job past ``fetch.worker_timeout_s`` (frozen,
        stuck) is killed and its jobs released (``deadlines``)."""
        with self.settled:
            self.waiting += 1
            try:
                self.settled.wait_for(lambda: self.out == 0 or self.engine.reaped)
            finally:
                self.waiting -= 1

    def done(self) -> bool:
        """No worker will write for this window any more: every job done, or it was
        cancelled or failed and nothing of it is out (``Future.done``, as the fetch's other
        windows)."""
        return self.left == 0 or ((self.cancelled or self.failed is not None) and self.out == 0)


def few(items: list) -> str:
    return str(items[:16]) + (f" and {len(items) - 16} more" if len(items) > 16 else "")
