"""The work items of a fetch: a window submitted straight to the decode pool, a window
prepared for in-place decoding, and how a window's local reads are cut into pool tasks.

Plain data and pool-thread functions, kept apart from ``AsyncFetchNode`` (which owns the
event loop, the pool and the order windows go out in) so each file has one job.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Executor, Future, wait
from dataclasses import dataclass
from itertools import pairwise
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ..io.partial.ranges import PartSpec
from ..io.pool_task import OneShot
from ..memory.arena import BatchArena
from ..memory.kept_stripes import KeptStripe
from ..memory.slots import Slot, SlotTable, SlotWhere, is_direct, part_view, write_slot
from ..sampling.cuts import THREAD_LIMITS, cut_jobs
from ..sampling.items import DecodedWindow
from ..sampling.plan import ReadPlan, kept_slots
from .scatter import Scatter

if TYPE_CHECKING:
    import torch


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
        arrays: tuple[dict[int, np.ndarray | torch.Tensor], ...] = tuple(
            {} for _ in self.plan.reads)
        for (v, idxs), bufs in zip(self.jobs, self._bufs, strict=True):
            arrays[v].update(zip(idxs, bufs, strict=True))
        self._bufs = None  # the window holds them now: dropped stripes can go back
        return DecodedWindow(self.plan, arrays)


@dataclass(frozen=True, eq=False)
class InPlaceJob:
    """A window prepared for in-place decoding: its read jobs ``(variable, stripe, batch,
    out)``, the copies for slots fed by a chunk decoded elsewhere ``(dst, src, dst batch,
    src batch)``, and the batches it feeds."""

    plan: ReadPlan
    jobs: list[list[Item]]
    copies: list[tuple[Slot, np.ndarray, int, int]]  # dst, src, their batches
    batches: list[int]
    generation: int  # the arena's, when prepared
    lazy: LazyRows | None = None  # where ``(row, step)`` outs of the jobs go

    def resolve(self, items: list[Item]) -> list[Ready]:
        """``items`` with each ``(row, step)`` out made the batch row it stands for (its
        batch allocated if this is its first write): called as a task starts."""
        if self.lazy is None:
            # only ``prepare_in_place`` makes ``(row, step)`` outs, and then it makes ``lazy``
            return cast(list[Ready], items)
        return self.lazy.resolve(items)

    def copy_rows(self, arena: BatchArena) -> None:
        """Once every read has landed: fill the slots fed by a chunk decoded elsewhere, and
        tell the arena (a row written in the destination, a read done in the source; a
        source batch -1 is a held stripe of a first window, ``prepare_scattered``). A run
        of copies into one batch is counted as it ends, so batches in order go out as
        their rows land; the sources are let go of before the last run is counted."""
        held: dict[int, int] = {}
        run_b, run_n = -1, 0
        dst = src = None
        for dst, src, b, src_b in self.copies:
            write_slot(dst, src)
            if b != run_b:
                if run_n:
                    arena.landed(run_b, run_n, self.generation)
                run_b, run_n = b, 0
            run_n += 1
            if src_b >= 0:
                held[src_b] = held.get(src_b, 0) + 1
        # The held stripes go back to the pool (BufferPool: no view left) before the last
        # batch is counted: once it is, the window ahead may take their memory.
        del dst, src
        self.copies.clear()
        for group in self.jobs:
            for item in group:
                if isinstance(item[3], Scatter):
                    item[3].keep = None
        if run_n:
            arena.landed(run_b, run_n, self.generation)
        for b, n in held.items():
            arena.landed(b, n, self.generation)

    def fail(self, arena: BatchArena, e: BaseException, note: bool = True) -> None:
        """The window failed with ``e``: every batch it feeds fails with it (named in a note
        on ``e``, unless ``note`` is off, as for a cancellation)."""
        if note:
            e.add_note(f"insitubatch: reading the window of chunks "
                       f"{list(self.plan.chunk_ids)[:8]} into batches {self.batches[:8]}")
        arena.fail(self.batches, e, self.generation)


@dataclass(frozen=True, eq=False)
class LazyRows:
    """The batch rows of a window decoded one sample per chunk, each sample in one slot,
    named by ``(row, step)`` when the window is prepared and made views of their batch's
    arrays when their task starts (``BatchArena.arrays_of``): a batch's memory is taken as
    the decode threads reach it, not a few windows ahead, and the consumer thread no
    longer makes a view per sample."""

    arena: BatchArena
    where: Sequence[tuple[SlotWhere, ...]]  # per variable and step: each ``is_direct``
    generation: int

    def resolve(self, items: list[Item]) -> list[Ready]:
        arrays: dict[int, dict[str, np.ndarray]] = {}
        where = self.where
        out: list[Ready] = []
        for v, i, b, slot in items:
            got = arrays.get(b)
            if got is None:
                got = arrays[b] = self.arena.arrays_of(b, self.generation)
            assert isinstance(slot, tuple)  # every out of a lazy job is a (row, step)
            r, k = slot
            # the slot is the array itself (``slot_of`` of a direct ``where``)
            out.append((v, i, b, part_view(got, where[v][k][0], r)))
        return out


# (variable, stripe, batch, out): one in-place read, decoded into ``out`` (one sample per
# chunk), scattered (``Scatter``; ``batch`` is then the first batch it feeds), or, before
# ``InPlaceJob.resolve``, the ``(row, step)`` of its slot in ``batch`` (``LazyRows``)
Item = tuple[int, int, int, "np.ndarray | Scatter | tuple[int, int]"]
# an ``Item`` resolved (``InPlaceJob.resolve``): decoded into ``out``, or scattered
Ready = tuple[int, int, int, "np.ndarray | Scatter"]
# the stripe of (variable, index) kept across epochs, if it is (``FetchContext.kept_stripe``)
KeptOf = Callable[[int, int], KeptStripe | None]

def batch_writes(items: Sequence[Item]) -> dict[int, int]:
    """Row writes per batch that ``items`` make once read."""
    per_batch: dict[int, int] = {}
    for _, _, b, out in items:
        if isinstance(out, Scatter):
            for sb in out.batches:
                per_batch[sb] = per_batch.get(sb, 0) + 1
        else:
            per_batch[b] = per_batch.get(b, 0) + 1
    return per_batch


@dataclass(frozen=True)
class _Slots:
    """Every slot a window's kept draws fill, in draw order (steps inner): its sample,
    batch, row and step, and the batch arrays they are in."""

    sample: np.ndarray
    batch: np.ndarray
    row: np.ndarray
    step: np.ndarray
    n_steps: int
    arrays: dict[int, dict[str, np.ndarray]]
    table: SlotTable  # per variable and step: where it goes
    unique: bool  # each sample in one slot: the batches are expected, not allocated

    @property
    def where(self) -> tuple[tuple[SlotWhere, ...], ...]:
        return self.table.where

    def views(self, v: int, bs: list[int], rs: list[int], ks: list[int]) -> list[Slot]:
        """Variable ``v``'s part of each slot (batch, row, step)."""
        arrays = self.arrays
        w = self.where[v][0]
        if self.n_steps == 1 and len(w) == 1 and w[0][2].whole and w[0][1] is None \
                and w[0][2].channel is None:
            key = w[0][0]
            return [arrays[b][key][r : r + 1] for b, r in zip(bs, rs, strict=True)]
        slot = self.table.slot
        return [slot(arrays[b], v, k, r) for b, r, k in zip(bs, rs, ks, strict=True)]

    def direct_views(self, v: int, bs: list[int], rs: list[int], ks: list[int],
                     ) -> list[np.ndarray]:
        """``views`` of a variable decoded straight into its slots (``layout.all_direct``):
        each the array itself."""
        assert all(is_direct(w) for w in self.where[v])
        arrays, w = self.arrays, self.where[v][0]
        if self.n_steps == 1 and w[0][1] is None and w[0][2].channel is None:
            key = w[0][0]
            return [arrays[b][key][r : r + 1] for b, r in zip(bs, rs, strict=True)]
        where = self.where[v]
        return [part_view(arrays[b], where[k][0], r) for b, r, k in zip(bs, rs, ks, strict=True)]


def _window_slots(plan: ReadPlan, arena: BatchArena, skip: int, lazy: bool = False,
                  ) -> _Slots:
    """The slots of ``plan``'s draws not dropped (``drop_last``) nor delivered before a
    restore (its first ``skip``), with their batches allocated; with ``lazy`` and each
    sample in one slot (``unique``), only expected, allocated by their first write
    (``arrays`` then maps each batch to ``None``)."""
    slots = plan.slots
    assert slots is not None
    kept = kept_slots(plan, skip)
    sample, batch, n_steps = kept.sample, kept.batch, kept.n_steps
    unique = lazy and len(set(sample.tolist())) == sample.size
    arrays: dict[int, Any] = {}
    for b in sorted(set(batch.tolist())):
        if unique:
            arena.expect(b, slots.rows_in(b))
            arrays[b] = None
        else:
            arrays[b] = arena.rows(b, slots.rows_in(b))
    table = arena.slot_table(len(plan.reads), n_steps)
    return _Slots(sample=sample, batch=batch, row=kept.row, step=kept.step,
                  n_steps=n_steps, arrays=arrays, table=table, unique=unique)


def slot_parts(arena: BatchArena, sample_shapes: Sequence[tuple[int, ...]],
               ) -> tuple[PartSpec | None, ...]:
    """Per variable, the levels (or anemoi variables) of a sample its slots take where that
    is not all of them: a read decodes (and on object stores fetches) only their blocks."""
    where = arena.where(len(sample_shapes), 1)
    return tuple(PartSpec.for_slot(w[0], shape)
                 for w, shape in zip(where, sample_shapes, strict=True))


def prepare_in_place(plan: ReadPlan, arena: BatchArena, threads: int, grouped: bool,
                     sample_chunks: Sequence[int] = (), first: bool = False,
                     parts: Sequence[PartSpec | None] = (), skip: int = 0,
                     kept: KeptOf | None = None) -> InPlaceJob:
    """Where every chunk of an in-place window goes: each (sample, step) a draw reads lands
    in (batch, row, step). With one sample per chunk (``sample_chunks`` all 1) the chunk is
    decoded straight into its slot; one feeding several slots (a neighbour's history,
    padding for equal steps) is decoded once, into its first slot, and copied into the
    others. With several samples per chunk, ``prepare_scattered`` (``first``: a start's
    head window). Allocates the window's batches (each sample in one slot: expects them,
    ``LazyRows``) and holds the ones copies read from. ``skip``: the draws of a restore's
    head window delivered before, not read.

    This runs on the consumer thread, holding the GIL the decode threads need between
    chunks: index math in a few numpy calls, and the reads built by comprehensions over
    plain lists (a per-slot loop of dicts and calls cost ~2.5 us per sample there)."""
    if any(n != 1 for n in sample_chunks) or not arena.layout.all_direct:
        # several samples per chunk, or a sample split across channels: decoded into
        # scratch once, each slot's part copied out (``Scatter``)
        return prepare_scattered(plan, arena, threads, sample_chunks, first,
                                 parts or (None,) * len(plan.reads), skip, kept)
    # each sample in one slot (no copies): batches taken as their first row is written
    s = _window_slots(plan, arena, skip, lazy=True)
    sample, batch, row, step, n_steps = s.sample, s.batch, s.row, s.step, s.n_steps
    slots = plan.slots
    assert slots is not None
    unique = s.unique
    if unique:
        lead = np.arange(sample.size)
        dup = lead[:0]
    else:  # decoded into its first slot (in draw order), copied into the others
        lead = np.unique(sample, return_index=True)[1]
        other = np.ones(sample.size, dtype=bool)
        other[lead] = False
        dup = np.flatnonzero(other)
    # read in (batch, row, step) order of the slot decoded into: the window's first
    # batches are complete first
    src = lead[np.argsort((batch[lead] * slots.batch_size + row[lead]) * n_steps
                          + step[lead])]
    n_vars = len(plan.reads)
    bl, rl, kl = batch[src].tolist(), row[src].tolist(), step[src].tolist()
    sl = sample[src].tolist()
    if unique:  # (row, step): resolved to a view when its task starts (LazyRows)
        outs: list[list[Any]] = [list(zip(rl, kl, strict=True))] * n_vars
    else:
        outs = [s.direct_views(v, bl, rl, kl) for v in range(n_vars)]
    per_var = [list(zip([v] * len(sl), sl, bl, outs[v], strict=True)) for v in range(n_vars)]
    # every variable of a sample together (one task reads them all)
    items = per_var[0] if n_vars == 1 else [it for its in zip(*per_var, strict=True) for it in its]

    copies: list[tuple[Slot, np.ndarray, int, int]] = []
    held: dict[int, int] = {}
    if dup.size:
        from_ = lead[np.searchsorted(sample[lead], sample[dup])]
        for v in range(n_vars):
            copies += zip(s.views(v, batch[dup].tolist(), row[dup].tolist(), step[dup].tolist()),
                          s.direct_views(v, batch[from_].tolist(), row[from_].tolist(),
                                         step[from_].tolist()),
                          batch[dup].tolist(), batch[from_].tolist(), strict=True)
        for sb in batch[from_].tolist():
            held[sb] = held.get(sb, 0) + n_vars
    for b, n in held.items():
        arena.hold(b, n)
    lazy = LazyRows(arena, s.where, arena.generation) if unique else None
    if grouped:  # every variable of a few samples a task (items: a sample's together)
        row_bytes = np.asarray([arena.layout.row_nbytes(v) for v in range(n_vars)])
        nbytes, runs = np.tile(row_bytes, src.size), np.repeat(batch[src], n_vars)
        cuts = cut_jobs(nbytes, threads, THREAD_LIMITS, runs)
        jobs = [items[a:z] for a, z in pairwise(cuts)]
    else:
        jobs = [[it] for it in items]
    return InPlaceJob(plan, jobs, copies, list(s.arrays), arena.generation, lazy)


def prepare_scattered(plan: ReadPlan, arena: BatchArena, threads: int,
                      sample_chunks: Sequence[int], first: bool = False,
                      parts: Sequence[PartSpec | None] = (), skip: int = 0,
                      kept: KeptOf | None = None) -> InPlaceJob:
    """``prepare_in_place`` where chunks hold several samples (variable ``v``: stripes of
    ``sample_chunks[v]``): every stripe the window's slots read is decoded once, on a decode
    thread, into that thread's scratch buffer and its samples copied into their slots
    (``Scatter``), so the gather copy runs beside the decoding with its source hot in
    cache. Stripes are cut into about two tasks per decode thread (``sampling.cuts``, the
    window one run), in the order of the first batch each feeds (a batch needs most of its
    window's stripes; no task is worth splitting at batch edges).

    ``first`` (the head window of an epoch's or a restore's start, whose first batch the
    training loop waits for): the stripes are decoded into buffers of their own and only
    that batch's rows copied at once; the rest are copied by the last task to finish,
    after it (at 24 samples per chunk, copying the whole window before the first batch
    made it ~12 % later than the gather path's). One window's stripes held so: the resident
    bound counts them (``budget.resident_bound``).

    ``kept`` (``FetchContext.kept_stripe``): a stripe kept across epochs is decoded into its
    kept buffer once and all its samples copied from there, by the task that reads it; no
    stripe is held for a first batch then (the kept ones take that memory)."""
    s = _window_slots(plan, arena, skip)
    if not s.sample.size:  # every draw dropped (drop_last) or delivered before a restore
        return InPlaceJob(plan, [], [], list(s.arrays), arena.generation)
    items: list[tuple[int, int, Item]] = []  # (first batch it feeds, bytes, item)
    rest: list[tuple[int, Slot, np.ndarray]] = []  # (batch, dst, src)
    b0 = int(s.batch.min()) if first else None
    for v, per in enumerate(sample_chunks):
        stripe = s.sample // per
        order = np.lexsort((s.row, s.batch, stripe))  # by stripe, then batch and row
        st = stripe[order]
        cuts = (np.flatnonzero(np.diff(st)) + 1).tolist()
        offs = (s.sample[order] - st * per).tolist()
        bs = s.batch[order].tolist()
        dsts = s.views(v, bs, s.row[order].tolist(), s.step[order].tolist())
        # a split variable's slots are parts of a sample: scattered from scratch as usual,
        # only the blocks of the levels they take decoded (``part``)
        # (not with kept stripes: their memory is what the held ones would take)
        head = (dsts[0] if b0 is not None and kept is None and isinstance(dsts[0], np.ndarray)
                else None)
        part = None if head is not None or not parts else parts[v]
        for a, z in zip([0, *cuts], [*cuts, len(bs)], strict=True):
            got = None if kept is None else kept(v, int(st[a]))
            if got is not None:
                out = Scatter(offs[a:z], dsts[a:z], bs[a:z], part=parts[v] if parts else None,
                              kept=got)
            elif head is None or b0 is None:
                out = Scatter(offs[a:z], dsts[a:z], bs[a:z], part=part)
            else:  # the first batch's rows now, the others once every stripe is in
                keep = arena.pool.take((per, *head.shape[1:]), head.dtype)
                now = [k for k in range(a, z) if bs[k] == b0]
                out = Scatter([offs[k] for k in now], [dsts[k] for k in now],
                              [b0] * len(now), keep)
                rest += [(bs[k], dsts[k], keep[offs[k] : offs[k] + 1])
                         for k in range(a, z) if bs[k] != b0]
            items.append((bs[a], sum(d.nbytes for d in dsts[a:z]),
                          (v, int(st[a]), bs[a], out)))
    items.sort(key=lambda t: t[0])  # stable: stripe order within a batch
    ordered = [it for _, _, it in items]
    # one run: a stripe feeds many batches, no task is worth splitting at batch edges
    cuts = cut_jobs(np.asarray([n for _, n, _ in items]), 2 * threads, THREAD_LIMITS)
    jobs = [ordered[a:z] for a, z in pairwise(cuts)]
    rest.sort(key=lambda t: t[0])  # in batch order (stable): the next batches go out first
    copies: list[tuple[Slot, np.ndarray, int, int]] = [
        (dst, src, b, -1) for b, dst, src in rest]
    return InPlaceJob(plan, jobs, copies, list(s.arrays), arena.generation)
