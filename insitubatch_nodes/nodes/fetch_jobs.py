"""The work items of a fetch: a window submitted straight to the decode pool, a window
prepared for in-place decoding, and how a window's local reads are cut into pool tasks.

Plain data and pool-thread functions, kept apart from ``AsyncFetchNode`` (which owns the
event loop, the pool and the order windows go out in) so each file has one job.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from dataclasses import dataclass

import numpy as np

from ..arena import BatchArena
from ..io.reader import StripeReader
from ..items import DecodedWindow
from ..plan import ReadPlan


class DirectWindow:
    """A window whose stripe groups run as pool tasks submitted by the consumer thread:
    ``result()`` waits for them (the first failure raised, the rest cancelled) and makes the
    ``DecodedWindow``; ``cancel``/``done`` as the event-loop window futures have."""

    def __init__(self, plan: ReadPlan, jobs: list[tuple[int, list[int]]],
                 bufs: list[list[np.ndarray]], futures: list[Future],
                 refetch: Callable[[list[tuple[int, int, np.ndarray]]], None] | None = None,
                 ) -> None:
        self.plan, self.jobs, self.futures = plan, jobs, futures
        self._bufs: list[list[np.ndarray]] | None = bufs
        # cached windows: the tasks return the stripes not found after all, for this
        self._refetch = refetch

    def cancel(self) -> bool:
        for f in self.futures:
            f.cancel()
        self._bufs = None
        return True

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def result(self) -> DecodedWindow:
        try:
            # One wake-up for the window, not one per task: each wake-up of the consumer
            # takes the GIL back from the decode threads (``wait`` returns at the first
            # failure too, which ``result()`` below raises in task order).
            wait(self.futures, return_when=FIRST_EXCEPTION)
            results = [f.result() for f in self.futures]
            if self._refetch is not None:
                assert self._bufs is not None
                misses = [(v, i, out) for (v, idxs), outs, missed
                          in zip(self.jobs, self._bufs, results, strict=True)
                          for i, out in zip(idxs, outs, strict=True) if i in missed]
                if misses:
                    self._refetch(misses)
        except BaseException:
            self.cancel()
            raise
        assert self._bufs is not None
        arrays: tuple[dict[int, np.ndarray], ...] = tuple({} for _ in self.plan.reads)
        for (v, idxs), bufs in zip(self.jobs, self._bufs, strict=True):
            arrays[v].update(zip(idxs, bufs, strict=True))
        self._bufs = None  # the window holds them now: dropped stripes can go back
        return DecodedWindow(self.plan, arrays)


def read_local_items(items: list[tuple[StripeReader, int, np.ndarray]],
                      submitted: float) -> None:
    """Read and decode each ``(reader, stripe, out)`` on this pool thread, in order."""
    for reader, index, out in items:
        reader.read_local(index, out, submitted)
        submitted = None  # only the first stripe waited in the queue


@dataclass(frozen=True, eq=False)
class InPlaceJob:
    """A window prepared for in-place decoding: its read jobs ``(variable, stripe, batch,
    out)``, the copies for slots fed by a chunk decoded elsewhere ``(dst, src, dst batch,
    src batch)``, and the batches it feeds."""

    plan: ReadPlan
    jobs: list[list[tuple[int, int, int, np.ndarray]]]
    copies: list[tuple[np.ndarray, np.ndarray, int, int]]  # dst, src, their batches
    batches: list[int]
    generation: int  # the arena's, when prepared

    def copy_rows(self, arena: BatchArena) -> None:
        """Once every read has landed: fill the slots fed by a chunk decoded elsewhere, and
        tell the arena (a row written in the destination, a read done in the source)."""
        counted: dict[int, int] = {}
        for dst, src, b, src_b in self.copies:
            np.copyto(dst, src)
            counted[b] = counted.get(b, 0) + 1
            counted[src_b] = counted.get(src_b, 0) + 1
        for b, n in counted.items():
            arena.done(b, n, self.generation)

    def fail(self, arena: BatchArena, e: BaseException, note: bool = True) -> None:
        """The window failed with ``e``: every batch it feeds fails with it (named in a note
        on ``e``, unless ``note`` is off, as for a cancellation)."""
        if note:
            e.add_note(f"insitubatch: reading the window of chunks "
                       f"{list(self.plan.chunk_ids)[:8]} into batches {self.batches[:8]}")
        arena.fail(self.batches, e, self.generation)


def batch_jobs(items: list[tuple[int, int, int, np.ndarray]], threads: int,
                ) -> list[list[tuple[int, int, int, np.ndarray]]]:
    """Pool tasks for a window's local reads: every variable of a few samples per task, so
    a window costs a few hand-offs whatever the number of variables; cut at batch edges
    (``items`` come in batch order) and each batch split across the threads, so each
    batch is complete as early as it can be."""
    jobs: list[list[tuple[int, int, int, np.ndarray]]] = []
    start = 0
    while start < len(items):
        b = items[start][2]
        stop = start
        while stop < len(items) and items[stop][2] == b:
            stop += 1
        nbytes = sum(it[3].nbytes for it in items[start:stop])
        # every thread on each batch (in turn), a task at most ~16 MB or 64 chunks
        parts = min(stop - start, max(threads, -(-nbytes // (16 << 20)), -(-(stop - start) // 64)))
        size = -(-(stop - start) // parts)
        jobs += [items[k : min(k + size, stop)] for k in range(start, stop, size)]
        start = stop
    return jobs
