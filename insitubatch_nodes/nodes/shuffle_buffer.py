"""ShuffleBufferNode: cuts the windows' draw orders into batches of draws (decoded in
place, the plans cut them already: it passes the fetch's batches on)."""

from __future__ import annotations

import time
from collections import ChainMap, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torchdata.nodes import BaseNode

from ..errors import ConfigError, LoaderUsageError, StateError
from ..metrics.counters import ShuffleStats
from ..sampling.geometry import VariableGeometry
from ..sampling.items import BatchDraw, DecodedBatch, DecodedWindow, GatherPart
from .state import copy_state, require, require_count, shutdown_source


def _runs(samples: np.ndarray, steps: np.ndarray, sample_chunk: int,
          ) -> list[tuple[int, int, np.ndarray, int, int]]:
    """(step, stripe, offsets in the stripe, start, stop) for every run of batch rows that
    one stripe serves; ``samples`` is sorted, so each stripe's rows are one contiguous run.
    Runs are found in a Python loop over the batch's few rows: cheaper than the half dozen
    numpy calls (diff, flatnonzero, concatenate) a vectorised cut costs per batch."""
    out = []
    n = int(samples.size)
    for step, off in enumerate(steps.tolist()):
        rows = samples + off if off else samples
        stripe = rows // sample_chunk
        offsets = rows - stripe * sample_chunk
        ids = stripe.tolist()
        a, prev = 0, ids[0]
        for b in range(1, n):
            if ids[b] != prev:
                out.append((step, prev, offsets, a, b))
                a, prev = b, ids[b]
        out.append((step, prev, offsets, a, n))
    return out


_MIXED = ("ShuffleBufferNode's upstream yielded both batches (DecodedBatch) and windows "
          "(DecodedWindow) in one epoch: a fetch yields one or the other")


@dataclass
class _Resident:
    """A window being drawn from. ``evict[v]`` lists (last use, stripe) of variable ``v``'s
    stripes by last use; ``next_evict[v]`` is the first of them still held."""

    window: DecodedWindow
    snapshot: dict  # upstream state before this window was pulled
    offset: int = 0
    evict: tuple[list[tuple[int, int]], ...] = ()
    next_evict: list[int] = field(default_factory=list)

    def let_go(self) -> None:
        """Drop every stripe whose last draw has been taken (``offset`` is past it)."""
        for v, order in enumerate(self.evict):
            k, arrays = self.next_evict[v], self.window.arrays[v]
            while k < len(order) and order[k][0] < self.offset:
                del arrays[order[k][1]]
                k += 1
            self.next_evict[v] = k


class ShuffleBufferNode(BaseNode[BatchDraw]):
    """Hands out each window's samples in its (pre-computed, seeded) draw order.

    Batches run on across window edges, so only the epoch's last batch is short. A stripe is
    dropped as soon as its last sample is drawn. State: upstream state before the head
    window, and how many of its samples were drawn.

    Decoded in place, the fetch yields batches (``DecodedBatch``) already cut and mixed by
    the plans (``schedule.batch_slots`` draws them exactly as this node would): each is
    passed on as a ``BatchDraw`` whose rows are ready (``ready``), and the fetch keeps the
    draws delivered into its head window in its own state.
    """

    SOURCE_KEY = "source"  # upstream state before the head window was pulled
    OFFSET_KEY = "offset"  # draws already taken from the head window

    def __init__(self, source: BaseNode[DecodedWindow | DecodedBatch],
                 variables: Sequence[VariableGeometry], batch_size: int,
                 drop_last: bool = False) -> None:
        super().__init__()
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        self.source = source
        self.variables = tuple(variables)
        self.batch_size = int(batch_size)
        self.drop_last = bool(drop_last)
        self._resident: deque[_Resident] = deque()
        self._skip = 0
        self._exhausted = False
        self._passing = False  # the upstream yields batches (in place): passed on
        self.stats = ShuffleStats()

    def resident_counts(self) -> tuple[int, int]:
        """(windows being drawn from, stripes they still hold), for ``LoaderStats``."""
        try:
            res = list(self._resident)
        except RuntimeError:  # mutated while copied from another thread
            return 0, 0
        return len(res), sum(len(a) for r in res for a in r.window.arrays)

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._resident.clear()
        self._exhausted = False
        self._passing = False
        self._skip = (0 if initial_state is None
                      else require_count(initial_state, self.OFFSET_KEY, self))
        self.source.reset(None if initial_state is None
                          else require(initial_state, self.SOURCE_KEY, self))

    def _pull(self, batch_ok: bool = False) -> _Resident | DecodedBatch | None:
        """The next window as a resident one (``None``: the epoch has no more); with
        ``batch_ok``, a batch the fetch cut already (decoded in place) as it is."""
        # (passing batches on, nothing is resident: no snapshot of the upstream's state)
        snap = None if self._passing else copy_state(self.source.state_dict())
        t0 = time.perf_counter()
        try:
            win = next(self.source)
        except StopIteration:
            self._exhausted = True
            if self._skip:
                raise StateError(f"ShuffleBufferNode state field {self.OFFSET_KEY!r} is "
                                 f"{self._skip}, but the restored epoch has no window left "
                                 "to skip draws of: the state was edited") from None
            return None
        finally:
            self.stats.upstream_s += time.perf_counter() - t0
        if isinstance(win, DecodedBatch):
            if self._skip:
                raise StateError(
                    f"ShuffleBufferNode state field {self.OFFSET_KEY!r} is {self._skip}, but "
                    "its upstream yields batches cut already (decoded in place), whose draws "
                    "into a window the fetch counts: the state was saved by a loader built "
                    "differently")
            if not batch_ok:
                raise LoaderUsageError(_MIXED)
            self._passing = True
            return win
        if snap is None:
            raise LoaderUsageError(_MIXED)
        self.stats.windows += 1
        if self._skip > win.plan.n_samples:
            raise StateError(f"ShuffleBufferNode state field {self.OFFSET_KEY!r} is "
                             f"{self._skip}, past the {win.plan.n_samples} draws of the "
                             "restored window: the state was edited or saved by a loader "
                             "built differently")
        plan = win.plan
        evict = tuple(sorted(zip(last, reads, strict=True))
                      for reads, last in zip(plan.reads, plan.last_use, strict=True))
        res = _Resident(win, snap, evict=evict, next_evict=[0] * len(evict))
        if self._skip:
            self._draw(res, self._skip)  # restoring mid-window: evict what was already drawn
            res.let_go()
            self._skip = 0
        return res

    def _draw(self, res: _Resident, n: int) -> np.ndarray:
        """Take the next ``n`` draws of ``res`` (its stripes are let go by the caller, once
        the batch's gather parts hold what they need)."""
        taken = res.window.plan.draw_order[res.offset : res.offset + n]
        res.offset += taken.size
        return taken

    def next(self) -> BatchDraw:
        t0 = time.perf_counter()
        if self._passing and not self._exhausted:
            return self._pass_on(t0)
        try:
            return self._next()
        finally:
            self.stats.next_s += time.perf_counter() - t0

    def _pass_on(self, t0: float) -> BatchDraw:
        """The next batch the fetch cut (decoded in place), as it is: nothing is resident
        and nothing drawn here, so this is the whole of ``_next`` and ``_pull`` then (a
        few calls a batch on the training thread)."""
        stats = self.stats
        try:
            item = next(self.source)
        except StopIteration:
            self._exhausted = True
            raise
        finally:
            dt = time.perf_counter() - t0
            stats.upstream_s += dt
            stats.next_s += dt
        if not isinstance(item, DecodedBatch):
            raise LoaderUsageError(_MIXED)
        return BatchDraw(item.sample_index, (), ready=item.arrays)

    def _next(self) -> BatchDraw:
        if not self._resident and not self._exhausted:
            first = self._pull(batch_ok=True)
            if isinstance(first, DecodedBatch):  # cut and mixed by the plans: passed on
                return BatchDraw(first.sample_index, (), ready=first.arrays)
            if first is not None:
                self._resident.append(first)
        pieces: list[np.ndarray] = []
        drawn: list[_Resident] = []  # windows this batch drew from, in order
        need = self.batch_size
        starts: list[int] = []  # each drawn window's offset before this batch
        try:
            while need:
                if not self._resident:
                    if self._exhausted:
                        break
                    res = self._pull()
                    if res is None:
                        break
                    assert isinstance(res, _Resident)
                    self._resident.append(res)
                head = self._resident[0]
                starts.append(head.offset)
                taken = self._draw(head, need)
                pieces.append(taken)
                drawn.append(head)
                need -= taken.size
                if head.offset >= head.window.plan.n_samples:
                    self._resident.popleft()
        except BaseException:
            # Pulling the next window failed (upstream raised, an interrupt) after draws of
            # this batch were taken: put them back, so asking again serves them, once.
            for res, start in zip(reversed(drawn), reversed(starts), strict=True):
                if res.offset >= res.window.plan.n_samples:
                    self._resident.appendleft(res)
                res.offset = start
            raise
        if need == self.batch_size or (need and self.drop_last):
            self._resident.clear()
            raise StopIteration
        draw = self._make_draw(pieces, drawn)
        for res in drawn:  # the parts hold their stripes now: the window need not
            res.let_go()
        return draw

    def _make_draw(self, pieces: list[np.ndarray], drawn: list[_Resident]) -> BatchDraw:
        samples = np.sort(np.concatenate(pieces) if len(pieces) > 1 else pieces[0])
        steps = drawn[0].window.plan.offsets  # the same for every window of a loader
        runs: dict[int, list] = {}  # per sample chunking: the runs, shared by its variables
        parts = []
        for v, var in enumerate(self.variables):
            lookup: Mapping[int, np.ndarray | torch.Tensor]
            if len(drawn) == 1:
                lookup = drawn[0].window.arrays[v]
            else:  # a batch across a window edge: stripe indices are global, so chain
                lookup = ChainMap(*(res.window.arrays[v] for res in drawn))
            var_runs = runs.get(var.sample_chunk)
            if var_runs is None:
                var_runs = runs[var.sample_chunk] = _runs(samples, steps, var.sample_chunk)
            parts.append(tuple([GatherPart(lookup[i], offsets[a:b], a, b, step)
                                for step, i, offsets, a, b in var_runs]))
        return BatchDraw(samples, tuple(parts))

    def get_state(self) -> dict[str, Any]:
        if self._resident:
            head = self._resident[0]
            return {self.SOURCE_KEY: copy_state(head.snapshot), self.OFFSET_KEY: head.offset}
        # (the upstream's state as it makes it: a new dict, or a snapshot nobody changes)
        return {self.SOURCE_KEY: self.source.state_dict(), self.OFFSET_KEY: self._skip}

    def start_state(self, upstream: dict[str, Any]) -> dict[str, Any]:
        """The state of this node before its first draw, over ``upstream``'s state."""
        return {self.SOURCE_KEY: upstream, self.OFFSET_KEY: 0}

    def shutdown(self) -> None:
        """Nothing of its own to stop: pass it upstream (torchdata's protocol)."""
        shutdown_source(self.source)
