"""Decoded in place, the fetch yields batches: each window handed on is cut into the batches
its plan already made (``plan.BatchSlots``), and a batch goes out once every window that
feeds it is submitted, with the fetch's position after it.

The cut is the plan's: draws are numbered through the epoch and batch ``b`` holds draws
``[b * batch_size, (b + 1) * batch_size)``, so a batch is one run of a window's slots, or
the tail of one window and the head of the next. Nothing is cut twice and nothing waits
here: the batch's arrays are a future (``BatchArena.future``) the gather waits on.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

import numpy as np

from ..errors import InternalError, StateError
from ..memory.arena import BatchArena
from ..sampling.items import DecodedBatch
from ..sampling.plan import ReadPlan, kept_end


class CutBatch(NamedTuple):
    """A batch ready to go out, and the fetch's position once it has: the upstream state
    before the window holding the next draw, and the draws of that window delivered."""

    batch: DecodedBatch
    state: dict
    offset: int


class BatchCut:
    """The batches of the windows handed on, in plan order (``out``), the one still waiting
    for its next window's draws (``_pieces`` of batch ``_batch``), the draws of the head
    window a restore skips (``skip``), the batches taken since the reset (``served``) and
    the fetch's position after the last one (``at``: upstream state, offset).

    The restore's skip is kept here alone, as part of the fetch's position: the head
    window (the first window submitted since the reset, and the first cut) neither reads
    nor cuts its first ``skip`` draws. ``submit_skip`` hands it to the window being
    submitted, ``take_skip`` to the window being cut; each once."""

    def __init__(self) -> None:
        self.out: deque[CutBatch] = deque()
        self._batch = -1
        # the draws and slot rows of batch ``_batch`` in the windows cut so far
        self._pieces: list[tuple[np.ndarray, np.ndarray]] = []
        self._have = 0
        self.skip = 0
        self._submitted = True  # the head window was submitted (its skip handed over)
        self._head = False  # the next window cut is the head window of a reset
        self.served = 0
        self.at: tuple[dict | None, int] = (None, 0)

    def reset(self, start: dict | None, skip: int) -> None:
        """Forget everything cut (the batches were cleared from the arena); the epoch (or
        restore) starts at upstream state ``start``, ``skip`` draws into its first window."""
        self.out.clear()
        self._batch, self._pieces, self._have = -1, [], 0
        self.skip, self.served, self.at = skip, 0, (start, skip)
        self._submitted, self._head = False, True

    def take(self) -> DecodedBatch:
        """The next batch cut (``out`` is not empty); the position moves past it."""
        item = self.out.popleft()
        self.at = (item.state, item.offset)
        self.served += 1
        return item.batch

    def submit_skip(self) -> int:
        """The draws of the window being submitted not to read: the restore's skip for the
        first window submitted since the reset (its head window), then 0."""
        if self._submitted:
            return 0
        self._submitted = True
        return self.skip

    def take_skip(self) -> int:
        """The restore's skip, for the window being cut now (then 0)."""
        skip, self.skip = self.skip, 0
        return skip

    def check_head(self, plan: ReadPlan, owner: str) -> None:
        """The window about to be cut, if it is a reset's head window: the restore's
        ``skip`` draws lie within it and end at an edge of the batches planned from the
        epoch's start (at its first draw too: a state saved on the gather path after its
        batch size changed mid-epoch resumes between batches of this plan)."""
        if not self._head:
            return
        skip = self.skip
        if skip > plan.n_samples:
            raise StateError(f"{owner} state field 'offset' is {skip}, past the "
                             f"{plan.n_samples} draws of the restored window: the state was "
                             "edited or saved by a loader built differently")
        slots = plan.slots
        if slots is not None and not slots.starts_batch(skip):
            raise StateError(
                f"{owner} state field 'offset' is {skip}, inside batch "
                f"{int(slots.batch[skip])} of this loader's plans (draw {slots.first + skip} "
                f"of the epoch, batches of {slots.batch_size}): batches decoded in place are "
                "cut from the epoch's start, and this state was saved between them (by a "
                "loader gathering batches of another size: resume it with in_place=False "
                "and the saved block_chunks)")

    def add(self, plan: ReadPlan, before: dict, after: dict, skip: int,
            arena: BatchArena) -> None:
        """Cut ``plan``'s window (handed on; the upstream's state was ``before`` its plan
        and ``after`` it) from draw ``skip`` on: every batch it completes goes to ``out``.

        Kept draws (``[skip, kept_end)``) fill consecutive batches, one run each, and a
        draw's slot row is its rank by sample in its batch: one scatter sorts every batch
        of the window (a batch's rows are a view of it), not a sort per batch."""
        slots = plan.slots
        assert slots is not None, "a window decoded in place has batch slots"
        self._head = False
        batch = slots.batch
        n, end = int(batch.size), kept_end(batch)
        if skip >= end:
            return  # nothing left, or only a short last batch that drop_last drops
        edges = (np.flatnonzero(batch[skip + 1:end] != batch[skip:end - 1]) + skip + 1).tolist()
        b0 = int(batch[skip])
        rows = self._sorted(plan, skip, end, b0, b0 + len(edges))
        size, total, put = slots.batch_size, slots.total, self.out.append
        for i, (a, e) in enumerate(zip([skip, *edges], [*edges, end], strict=True)):
            b = b0 + i
            if self._pieces and b != self._batch:
                raise InternalError(
                    f"batch {self._batch} got {self._have} of its "
                    f"{slots.rows_in(self._batch)} rows before window {plan.window} "
                    f"started batch {b}: the plans cut the epoch's batches inconsistently "
                    "(a bug)")
            self._have += e - a
            n_rows = min(size, total - b * size)  # slots.rows_in(b), inlined: a call a batch
            if self._have < n_rows:  # the rest of it is in the next window(s)
                self._batch = b
                self._pieces.append((plan.draw_order[a:e], slots.row[a:e]))
                continue
            self._pieces, self._have = [], 0
            at = (after, 0) if e == n else (before, e)
            put(CutBatch(DecodedBatch(rows[i * size:i * size + n_rows], arena.future(b)), *at))

    def _sorted(self, plan: ReadPlan, skip: int, end: int, first: int, last: int,
                ) -> np.ndarray:
        """Batches ``first .. last``'s samples, each at its rows in a ``batch_size`` run:
        draws ``[skip, end)`` of ``plan`` and the earlier windows' ones of ``first`` still
        waiting (``_pieces``), each put at its slot row (``schedule.batch_slots``: its rank
        by sample, ties in draw order: what a stable sort of the batch would give)."""
        slots = plan.slots
        assert slots is not None
        size = slots.batch_size
        out = np.empty((last - first + 1) * size, dtype=plan.draw_order.dtype)
        if self._pieces and self._batch == first:
            for draws, rows in self._pieces:
                out[rows] = draws
        out[(slots.batch[skip:end] - first) * size + slots.row[skip:end]] = \
            plan.draw_order[skip:end]
        return out

    def end(self, state: dict | None) -> None:
        """The epoch's windows are all cut (the upstream at ``state``): no batch may be
        left waiting for rows."""
        self.at = (state, 0)
        if self._pieces:
            raise InternalError(f"the epoch ended with batch {self._batch} holding {self._have} "
                               "rows, fewer than the plans gave it (a bug)")
