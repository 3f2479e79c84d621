"""The windows of an epoch in flight, in plan order, as the fetch node queues them.

Each queued window carries the upstream's state after its plan, so the node's state is
the upstream's as of the last window delivered and in-flight work is refetched on resume.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from typing import NamedTuple

from ..sampling.items import DecodedWindow
from ..sampling.plan import ReadPlan
from .submit import Window


class Entry(NamedTuple):
    """A queued window: the window being fetched, the upstream state after its plan, and
    its plan when decoded in place (delivered at once, undecoded)."""

    window: Window
    state: dict
    plan: ReadPlan | None


def made(win: DecodedWindow) -> Future:
    """A window already made, as a done future in the queue's place of the one that made it."""
    done: Future = Future()
    done.set_result(win)
    return done


def drain(queue: deque[Entry]) -> list[Window]:
    """The windows of a queue of entries, the queue emptied."""
    windows = [fut for fut, _, _ in queue]
    queue.clear()
    return windows


def cancel_windows(windows: list[Window]) -> None:
    """Cancel ``windows``, then wait for the pool tasks of local ones already running
    (``DirectWindow.settle``) and the jobs a worker process is running
    (``WindowRun.settle``); windows on the event loop end their reads as the loop
    cancels them."""
    for fut in windows:
        fut.cancel()
    for fut in windows:
        if not isinstance(fut, Future):
            fut.settle()


class EpochWindows:
    """This epoch's windows: those queued (``queue``), in-place ones handed on and still
    decoding (``running``), whether the upstream ran out (``exhausted``), the error that
    ended the epoch, and whether it began with ``reset(None)`` and was asked for since."""

    def __init__(self) -> None:
        self.queue: deque[Entry] = deque()
        self.running: list[Window] = []  # in-place windows, still decoding
        self.exhausted = False
        self.error: BaseException | None = None
        # This epoch began with reset(None), and whether next() was called since: a second
        # reset(None) before it was starts the same epoch again (``AsyncFetchNode.reset``).
        self.began_fresh = False
        self.asked = False

    def cancel(self) -> None:
        """Cancel the queued windows and the in-place ones still decoding, and wait for
        their pool tasks already running (``DirectWindow.settle``): the windows that
        replace them count within the same memory bound."""
        running, self.running = self.running, []
        cancel_windows([*drain(self.queue), *running])

    def handed_on(self, window: Window) -> None:
        """An in-place window went out undecoded: keep it while it decodes."""
        self.running = [f for f in self.running if not f.done()] + [window]

    def in_flight(self) -> list[Window]:
        """The windows queued or still decoding (read from other threads: may raise
        ``RuntimeError`` if the queue changes while copied)."""
        return ([f for f, _, _ in list(self.queue)]
                + [f for f in list(self.running) if not f.done()])
