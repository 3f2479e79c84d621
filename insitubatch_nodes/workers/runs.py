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
    """A decode worker process could not start, or died twice running the same job: the
    message names them (number, pid, exit status) and the window and batches affected."""


@dataclass(eq=False)
class WindowRun:
    """A window on the workers: the future-like object the fetch node keeps (``cancel``,
    ``settle``, ``done``), as ``fetch.jobs.DirectWindow`` is for the decode threads.
    ``settled`` is a condition on the engine's lock: every count below changes under it."""

    window: WorkerWindow
    engine: Engine
    left: int  # jobs not yet done
    settled: threading.Condition
    out: int = 0  # jobs held by a worker (or being sent to one) and not yet answered
    cancelled: bool = False
    failed: BaseException | None = None
    waiting: int = 0  # threads in ``settle``: only then is an answer notified

    def cancel(self) -> bool:
        """Drop the jobs not yet given to a worker; ``settle`` waits for the others."""
        self.engine.cancel(self)
        return True

    def settle(self) -> None:
        """After ``cancel``: wait until no worker writes for this window any more, so its
        batches' memory can be given to the window that replaces it."""
        with self.settled:
            self.waiting += 1
            try:
                self.settled.wait_for(lambda: self.out == 0 or self.engine.reaped)
            finally:
                self.waiting -= 1

    def done(self) -> bool:
        return self.left == 0 or ((self.cancelled or self.failed is not None) and self.out == 0)


def few(items: list) -> str:
    return str(items[:16]) + (f" and {len(items) - 16} more" if len(items) > 16 else "")


def died_twice(task: Task, second: str) -> WorkerError:
    """The error of a job whose worker died, and whose second worker died too."""
    w = task.run.window
    stripes = task.job.stripes()
    return WorkerError(
        f"insitubatch: two decode workers died running the same job: {task.died}, then "
        f"{second}, both while reading stripes {few(stripes)} (variable, sample-axis "
        f"chunk) of the window of chunks {list(w.plan.chunk_ids)[:8]} into batches "
        f"{sorted(task.job.writes)[:8]}; it is not run a third time (a chunk that kills its "
        "decoder? workers=0 reads it in this process and shows its error)")
