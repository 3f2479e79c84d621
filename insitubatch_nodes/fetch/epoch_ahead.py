"""The next epoch, started early (``AsyncFetchNode(prefetch_next_epoch=True)``).

Once an epoch's plans are all submitted, the upstream is reset for the next epoch and that
epoch's first windows fill the free prefetch slots, so the next ``iter()`` starts on
fetched windows instead of an empty pipeline (an epoch's first batch waited for a whole
window). They are handed over only by the ``reset(None)`` that starts that epoch.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

from .windows import Entry, cancel_windows, drain

log = logging.getLogger("insitubatch_nodes")


class EpochAhead:
    """The next epoch's windows (``queue``), the upstream state at its start (``start``,
    set once the upstream was reset for it), whether its plans ran out (``exhausted``), and
    whether its windows were dropped (``failed``: then the reset that starts it puts the
    upstream back at ``start``)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.queue: deque[Entry] = deque()
        self.start: dict | None = None
        self.exhausted = False
        self.failed = False
        # the upstream is being (or was) reset for the next epoch (set before ``start``)
        self.going = False

    @property
    def epochs_ahead(self) -> int:
        """1 when the upstream was already reset for the next epoch, else 0."""
        return 1 if self.going else 0

    def top_up(self, room: int, restart: Callable[[], dict],
               pull: Callable[[deque[Entry]], bool]) -> None:
        """Keep ``room`` of the next epoch's windows submitted: ``restart()`` resets the
        upstream for it once (returning its state then), ``pull(queue)`` submits one more
        window onto ``queue`` (``False`` once the plans ran out). A failure here is not
        this epoch's: the windows are dropped and the epoch starts as it would have."""
        if self.failed:
            return
        try:
            if self.start is None:
                self.going = True
                self.start = restart()
            while not self.exhausted and len(self.queue) < room:
                if not pull(self.queue):
                    self.exhausted = True
        except Exception as e:
            log.debug("insitubatch: fetching the next epoch early failed (%r); it starts "
                      "when asked", e)
            self.drop()
            self.failed = True

    def drop(self) -> None:
        """Cancel the next epoch's windows; ``start`` stays, so the reset that starts that
        epoch puts the upstream back at its start instead of a second ``reset(None)``
        (which would skip an epoch)."""
        cancel_windows(drain(self.queue))
        if self.start is not None:
            self.failed = True

    def take(self) -> tuple[deque[Entry], bool]:
        """The windows fetched ahead and whether their plans ran out, handed over to the
        epoch they belong to (the queue replaced first: ``windows_pending`` reads both)."""
        queue = self.queue
        self.queue = deque()
        return queue, self.exhausted

    def clear(self) -> None:
        """Nothing is ahead any more: the upstream is at the epoch being started."""
        self.start = None
        self.going = False
        self.exhausted = self.failed = False
