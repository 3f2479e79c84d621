"""An asyncio event loop on a daemon thread, with the decode pool beside it.

The fetch node and ``SampleDataset`` both need one: coroutines for remote latency hiding,
pool threads for decoding (the decoders release the GIL). It belongs to the process that made
it; a forked child makes its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import threading
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
_thread_ids = itertools.count()


class LoopThread:
    """The event loop, its thread (``insitubatch-<loop_name>-N``) and the decode pool
    (``insitubatch-<pool_name>-N``), plus a one-thread device pool if asked; stopped by
    ``stop`` or, without joining, by ``stop_soon`` (what a GC finalizer may call)."""

    def __init__(self, threads: int, loop_name: str, pool_name: str,
                 device_thread: bool = False) -> None:
        n = next(_thread_ids)
        self.pid = os.getpid()
        self.loop = asyncio.new_event_loop()
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix=f"insitubatch-{pool_name}-{n}")
        # One thread issues all device work, so one stream and one staging buffer suffice.
        self.device_pool = (ThreadPoolExecutor(1, thread_name_prefix=f"insitubatch-device-{n}")
                            if device_thread else None)
        self.thread = threading.Thread(target=self._run, name=f"insitubatch-{loop_name}-{n}",
                                       daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            pending = asyncio.all_tasks(self.loop)
            for t in pending:
                t.cancel()
            if pending:
                self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self.loop.close()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and wait for its result (from another thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def stop(self, wait: bool = True) -> None:
        """Stop the loop and the pools; ``wait`` joins their threads. A GC finalizer must
        pass ``wait=False`` (``stop_soon``): GC can run it on any thread at any allocation,
        even inside ``threading``'s own bookkeeping while it holds a lock that joining a
        thread needs (seen: a pool thread starting up deadlocked joining another loader's
        pool), so there it only tells the threads to end, which they then do on their own."""
        if os.getpid() != self.pid:
            return  # a forked child: the thread and pool exist only in the parent
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            if wait and threading.current_thread() is not self.thread:
                self.thread.join(timeout=30)
        self.pool.shutdown(wait=wait, cancel_futures=True)
        if self.device_pool is not None:
            self.device_pool.shutdown(wait=wait, cancel_futures=True)

    @staticmethod
    def stop_soon(lt: LoopThread) -> None:
        """The finalizer: asks the loop thread to shut its pools down and stop, taking no
        lock itself. GC runs it on whatever thread allocates, even inside a pool's
        ``submit`` holding that pool's lock and the executors' global one (seen: a loop
        thread collected its own node while submitting to its own pool, and
        ``pool.shutdown`` waited for the lock it held: the whole process hung). The loop
        thread shuts the pools down between its callbacks instead; a loop already ended
        leaves its idle pools to be collected with it."""
        if os.getpid() != lt.pid or not lt.thread.is_alive():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            lt.loop.call_soon_threadsafe(lt._stop_from_loop)

    def _stop_from_loop(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        if self.device_pool is not None:
            self.device_pool.shutdown(wait=False, cancel_futures=True)
        self.loop.stop()
