"""The fetch's event loop thread and decode pool, owned for the node's lifetime.

Started at the first window (or ``start()``), stopped by ``close()``, restarted by the next
epoch, never after ``shutdown()``; a forked child must not wait on a thread it does not
have (DESIGN.md "Threading model": ``DataLoader(num_workers>0)`` wrappers).
"""

from __future__ import annotations

import os
import weakref

from ..errors import LoaderUsageError
from ..io.loop_thread import LoopThread


class FetchLoop:
    """The ``LoopThread`` of one fetch node, the pid that started it and its GC finalizer."""

    def __init__(self, decode_threads: int, device_thread: bool) -> None:
        self.decode_threads = decode_threads
        self.device_thread = device_thread
        self.lt: LoopThread | None = None
        self.pid: int | None = None
        self.finalizer: weakref.finalize | None = None
        self.shut_down = False

    def check_process(self) -> None:
        if self.pid is not None and os.getpid() != self.pid:
            raise LoaderUsageError(
                "this insitubatch loader was started in another process and then forked (e.g. "
                "wrapped in a DataLoader with num_workers > 0). It does its own parallel IO on "
                "a background thread, which does not survive fork (and obstore clients hang "
                "after fork): iterate the loader directly in the training process, without "
                "DataLoader workers."
            )

    def ensure(self, owner: object) -> LoopThread:
        """The running loop thread, started if need be; stopped when ``owner`` is collected
        (a no-op in a forked child: ``LoopThread.stop_soon``)."""
        self.check_process()
        if self.shut_down:
            raise LoaderUsageError("this AsyncFetchNode was shut down (loader.shutdown() "
                                   "is final): build a new loader (close() and the end "
                                   "of a with block stop it until the next iteration)")
        if self.lt is None:
            self.pid = os.getpid()
            self.lt = LoopThread(self.decode_threads, "fetch", "decode",
                                 device_thread=self.device_thread)
            self.finalizer = weakref.finalize(owner, LoopThread.stop_soon, self.lt)
        return self.lt

    def stop(self) -> None:
        """Stop the loop thread and decode pool now; ``ensure`` starts them again."""
        if self.finalizer is not None and self.finalizer.detach() is not None:
            assert self.lt is not None
            self.lt.stop(wait=True)  # here, unlike in GC, joining is safe
        self.lt = None
        self.finalizer = None
