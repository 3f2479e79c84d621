"""The work items of a fetch: a window submitted straight to the decode pool, a window
prepared for in-place decoding, and how a window's local reads are cut into pool tasks.

Plain data and pool-thread functions, kept apart from ``AsyncFetchNode`` (which owns the
event loop, the pool and the order windows go out in) so each file has one job.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Executor, Future, wait
from dataclasses import dataclass

import numpy as np

from ..arena import BatchArena
from ..io.pool_task import OneShot
from ..io.reader import StripeReader
from ..items import DecodedWindow
from ..layout import row_view
from ..plan import ReadPlan


class DirectWindow:
    """A window whose stripe groups run as pool tasks submitted by the consumer thread:
    ``result()`` waits for them (the first failure raised, the rest cancelled) and makes the
    ``DecodedWindow``; ``cancel``/``done`` as the event-loop window futures have. Submits
    its ``tasks`` to ``pool`` itself, so each future's task is at hand to drop on cancel."""

    def __init__(self, plan: ReadPlan, jobs: list[tuple[int, list[int]]],
                 bufs: list[list[np.ndarray]], pool: Executor, tasks: Sequence[OneShot],
                 refetch: Callable[[list[tuple[int, int, np.ndarray]]], None] | None = None,
                 ) -> None:
        self.plan, self.jobs = plan, jobs
        self._tasks = tuple(tasks)
        self.futures: list[Future] = [pool.submit(t) for t in self._tasks]
        self._bufs: list[list[np.ndarray]] | None = bufs
        # cached windows: the tasks return the stripes not found after all, for this
        self._refetch = refetch

    def cancel(self) -> bool:
        for f, task in zip(self.futures, self._tasks, strict=True):
            if f.cancel():
                task.drop()  # never runs: its buffers go now, not when dequeued
        self._bufs = None
        return True

    def settle(self) -> None:
        """After ``cancel``: wait for the tasks it could not stop (already running, a few ms
        of decoding) to end, so their buffers are freed before a restart allocates new ones
        and the memory bound holds across a restore (their errors are not this window's
        any more: dropped)."""
        wait([f for f in self.futures if not f.cancelled()])

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


Item = tuple[int, int, int, np.ndarray]  # (variable, stripe, batch, out): one in-place read


def prepare_in_place(plan: ReadPlan, arena: BatchArena, threads: int,
                     grouped: bool) -> InPlaceJob:
    """Where every chunk of a one-sample-per-chunk window goes: each (sample, step) a draw
    reads lands in (batch, row, step); a chunk feeding several slots (a neighbour's history,
    padding for equal steps) is decoded once, into its first slot, and copied into the
    others. Allocates the window's batches and holds the ones copies read from.

    In place, every variable holds one sample per chunk (``graph._not_in_place``), so every
    variable reads every slot's sample. This runs on the consumer thread, holding the GIL
    the decode threads need between chunks: index math in a few numpy calls, and the reads
    built by comprehensions over plain lists (a per-slot loop of dicts and calls cost ~2.5 us
    per sample there)."""
    slots = plan.slots
    assert slots is not None
    keep = slots.batch >= 0  # -1: a short last batch that drop_last drops
    keep[: arena.take_skip()] = False  # restored mid-window: delivered before
    steps = np.asarray(plan.offsets, dtype=np.int64)
    n_steps = int(steps.size)
    draws = np.asarray(plan.draw_order, dtype=np.int64)[keep]
    # every slot a draw fills, in draw order (steps inner)
    sample = (draws[:, None] + steps[None, :]).ravel()
    batch = np.repeat(slots.batch[keep], n_steps)
    row = np.repeat(slots.row[keep], n_steps)
    step = np.tile(np.arange(n_steps, dtype=np.int64), draws.size)
    samples_all = sample.tolist()
    if len(set(samples_all)) == len(samples_all):  # each sample in one slot: no copies
        first = np.arange(sample.size)
        dup = first[:0]
    else:  # decoded into its first slot (in draw order), copied into the others
        first = np.unique(sample, return_index=True)[1]
        other = np.ones(sample.size, dtype=bool)
        other[first] = False
        dup = np.flatnonzero(other)
    # read in (batch, row, step) order of the slot decoded into: the window's first
    # batches are complete first
    src = first[np.argsort((batch[first] * slots.batch_size + row[first]) * n_steps
                           + step[first])]
    arrays = {b: arena.rows(b, slots.rows_in(b)) for b in sorted(set(batch.tolist()))}
    n_vars = len(plan.reads)
    # per variable and step: (batch key, step column, placement) of its slot
    where = []
    for v in range(n_vars):
        pl = arena.layout.direct(v)
        assert pl is not None, f"variable {v} is not decoded whole into the batch"
        where.append([(*arena.slot(pl.key, k), pl) for k in range(n_steps)])

    def views(v: int, bs: list[int], rs: list[int], ks: list[int]) -> list[np.ndarray]:
        """Variable ``v``'s part of each slot (batch, row, step)."""
        if n_steps == 1 and where[v][0][1] is None and where[v][0][2].channel is None:
            key = where[v][0][0]
            return [arrays[b][key][r : r + 1] for b, r in zip(bs, rs, strict=True)]
        out = []
        for b, r, k in zip(bs, rs, ks, strict=True):
            key, col, pl = where[v][k]
            rows = arrays[b][key][r : r + 1]
            out.append(row_view(rows if col is None else rows[:, col], pl))
        return out

    bl, rl, kl = batch[src].tolist(), row[src].tolist(), step[src].tolist()
    sl = sample[src].tolist()
    per_var = [list(zip([v] * len(sl), sl, bl, views(v, bl, rl, kl), strict=True))
               for v in range(n_vars)]
    # every variable of a sample together (one task reads them all)
    items = per_var[0] if n_vars == 1 else [it for its in zip(*per_var, strict=True) for it in its]

    copies: list[tuple[np.ndarray, np.ndarray, int, int]] = []
    held: dict[int, int] = {}
    if dup.size:
        from_ = first[np.searchsorted(sample[first], sample[dup])]
        for v in range(n_vars):
            copies += zip(views(v, batch[dup].tolist(), row[dup].tolist(), step[dup].tolist()),
                          views(v, batch[from_].tolist(), row[from_].tolist(),
                                step[from_].tolist()),
                          batch[dup].tolist(), batch[from_].tolist(), strict=True)
        for sb in batch[from_].tolist():
            held[sb] = held.get(sb, 0) + n_vars
    for b, n in held.items():
        arena.hold(b, n)
    jobs = batch_jobs(items, threads) if grouped else [[it] for it in items]
    return InPlaceJob(plan, jobs, copies, list(arrays), arena.generation)


def batch_jobs(items: list[Item], threads: int) -> list[list[Item]]:
    """Pool tasks for a window's local reads: every variable of a few samples per task, so
    a window costs a few hand-offs whatever the number of variables; cut at batch edges
    (``items`` come in batch order), at most ~16 MB or 64 chunks a task.

    The window's first batch is split across the threads, so it is complete as early as it
    can be (the one a training loop waits for at an epoch's start or after a restore); the
    others are one task each, every thread on its own batch: a task per thread per batch
    cost ~3-5 % of one-step epochs in hand-offs (paired, 2-vCPU VM)."""
    if not items:
        return []
    jobs: list[list[Item]] = []
    batches = [it[2] for it in items]
    sizes = [it[3].nbytes for it in items]
    bounds = [0] + [k for k in range(1, len(items)) if batches[k] != batches[k - 1]]
    for n, (start, stop) in enumerate(zip(bounds, bounds[1:] + [len(items)], strict=True)):
        nbytes = sum(sizes[start:stop])
        parts = max(threads if n == 0 else 1, -(-nbytes // (16 << 20)),
                    -(-(stop - start) // 64))
        size = -(-(stop - start) // min(stop - start, parts))
        jobs += [items[k : min(k + size, stop)] for k in range(start, stop, size)]
    return jobs
