"""The first-batch hold: at an epoch's (or a restore's) start only the windows the first
batch draws from go in; the windows ahead follow once they are all out (in place: once
the first batch itself went out). DESIGN.md "Time to first batch" says why.

How far the first batch reaches is the fetch's to say: its batch size (``AsyncFetchNode(
batch_size=)``) and, decoding in place, the draws of the head window a restore skips.
"""

from __future__ import annotations

from collections.abc import Callable

from ..sampling.plan import ReadPlan
from .jobs import InPlaceJob, prepare_in_place
from .submit import FetchContext


class FirstBatchHold:
    """Where the fetch stands with its start's first batch: begun (``started``), the first
    batch's windows not all out yet (``holding``), the windows ahead waiting for the first
    batch to go out (``deferred``, in place), and the start's head window while it holds
    stripes for its copies (``head``)."""

    def __init__(self, in_place: bool) -> None:
        # The draws of the first windows the first batch reaches (set by the fetch at each
        # reset); 0: unknown, and the first window goes alone.
        self.draws = 0
        self.in_place = in_place
        self.started = False  # next() ran since the last reset (the first windows went in)
        self.holding = False  # the first batch's windows are not all out: none go ahead
        self.deferred = False  # in place: the windows ahead wait for the first batch
        self.start_draws = 0  # draws of the windows submitted at the start
        self.starting = False  # the next window prepared is a start's head window
        self.head: InPlaceJob | None = None  # that window, while it holds stripes

    def reset(self) -> None:
        """A new start: a cancelled head window's held stripes go with it."""
        self.head = None
        self.started = self.holding = self.deferred = False

    def begin(self, top_up: Callable[[int], int]) -> None:
        """Submit the first batch's windows alone (``top_up(draws)`` pulls windows until
        they hold ``draws`` and returns the draws pulled): windows ahead of them would
        share the cores with their last stripes and delay it."""
        self.starting = True  # the head window (in place: its first batch first)
        try:
            self.start_draws = top_up(max(1, self.draws))
        finally:
            self.starting = False
        self.holding = True
        self.started = True

    def let_go(self, queued: int) -> bool:
        """The head window of ``queued`` is about to go out: whether the windows ahead go
        in now. Not while windows the first batch needs are still to come after it; in
        place the window goes out undecoded and its first batch lands while the rest
        decodes, so they wait (``resume``) until that batch went out, when the start's
        windows hold a batch's worth more than it (else at once, to keep the pool busy)."""
        if self.holding and queued > 1:
            return False
        defer = (self.holding and self.in_place and self.draws > 0
                 and self.start_draws >= 2 * self.draws)
        self.holding = False
        self.deferred = defer
        return not defer

    def resume(self) -> bool:
        """The first batch went out (the fetch was asked for the next one): whether windows
        ahead were waiting for it (once)."""
        deferred, self.deferred = self.deferred, False
        return deferred

    def drawn(self, plan: ReadPlan) -> None:
        """``plan``'s window is being drawn: once past the head window its copies are done
        (but for a batch straddling its end, whose windows ahead the resident bound's held
        stripes cover)."""
        if self.head is not None and plan is not self.head.plan:
            self.head = None

    def head_holds(self) -> bool:
        """A start's head window holds stripes for its copies and is being drawn: one
        window fewer goes ahead meanwhile, so the held stripes take that window's memory
        instead of adding to it (at 24 samples per chunk the ledger peaked 100 MB higher).
        Until the next window is handed on, not until the copies end: a count of windows
        ahead that does not depend on the decode threads' timing."""
        return self.head is not None

    def take_starting(self) -> bool:
        """Whether the window being prepared is the head window of a start (an epoch's or a
        restore's), the only one whose stripes are held for its first batch: at most one
        window's stripes are, which the resident bound counts."""
        head, self.starting = self.starting, False
        return head

    def prepare(self, plan: ReadPlan, ctx: FetchContext, skip: int = 0) -> InPlaceJob:
        """Where every chunk of the window goes (``jobs.prepare_in_place``), on the
        consumer thread before submitting, so the batches exist before the shuffle buffer
        asks for them."""
        assert ctx.arena is not None
        first = self.take_starting()
        job = prepare_in_place(plan, ctx.arena, ctx.decode_threads, ctx.grouped,
                               ctx.sample_chunks, first=first, parts=ctx.parts, skip=skip,
                               kept=ctx.kept_stripe if ctx.kept is not None else None)
        if first and job.copies:
            self.head = job
        return job
