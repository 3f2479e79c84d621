"""How one in-place item is read on a pool thread: a stripe decoded straight into its slot,
or into scratch (or its kept buffer) and its samples copied out (``Scatter``).

Pool-thread functions and the one mutable item type, apart from the window preparation in
``jobs`` that makes them, so each file has one job.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..io.partial.ranges import PartSpec
from ..io.retry import RetryPolicy
from ..io.served import Reader
from ..io.thread_buffer import ThreadBuffer
from ..memory.kept_stripes import KeptStripe
from ..memory.slots import Slot, fill_slots, stripe_target


@dataclass(eq=False, slots=True)
class Scatter:
    """Where the samples of a stripe holding several (or of a split slot) go: decoded once
    into this thread's scratch buffer (hot in cache), then sample ``rows[k]`` of it copied
    into slot ``dsts[k]`` of batch ``batches[k]`` (``memory.slots``, the slot filler the
    workers run too): the one copy a many-samples chunk needs, made on the decode thread,
    not a window buffer gathered on the training thread. ``keep``: decode into this buffer
    instead, held for the copies made after the first batch (``prepare_scattered``).
    ``kept``: the stripe kept across epochs (``memory.kept_stripes``): decoded into it
    once, copied from it after; ``decoded`` says whether this read decoded it."""

    rows: list[int]
    dsts: list[Slot]
    batches: list[int]
    keep: np.ndarray | None = None
    part: PartSpec | None = None  # the levels the slots take: only their blocks decoded
    kept: KeptStripe | None = None
    decoded: bool = True

    def target(self, reader: Reader, scratch: bool = True) -> np.ndarray:
        """The buffer to decode the stripe into: the held one, else the slot filler's
        (``memory.slots.stripe_target``: its one slot, or this thread's scratch;
        ``scratch=False``: a fresh one, for reads that await on the event loop)."""
        if self.keep is not None:
            return self.keep
        return stripe_target(self.dsts, reader.geom.stripe_shape, reader.geom.dtype,
                             _SCRATCH.array if scratch else np.empty)

    def fill_from(self, stripe: np.ndarray) -> None:
        fill_slots(stripe, self.rows, self.dsts)


_SCRATCH = ThreadBuffer()  # a decode thread's stripe of a many-samples chunk


def read_item(reader: Reader, index: int, out: np.ndarray | Scatter,
              submitted: float | None = None, retry: RetryPolicy | None = None) -> None:
    """Read and decode one in-place item on this pool thread; with ``retry``, with its
    tries and error notes (an item alone in its task, or each of a failed group's). A
    stripe kept across epochs is decoded into its kept buffer by the first task to reach
    it (a failure leaves it to the next) and copied from there."""
    if not isinstance(out, Scatter):
        _read(reader, index, out, None, submitted, retry)
        return
    kept = out.kept
    if kept is None:
        stripe = out.target(reader)
        _read(reader, index, stripe, out.part, submitted, retry)
    else:
        stripe = kept.array
        out.decoded = kept.decode_once(
            lambda buf: _read(reader, index, buf, out.part, submitted, retry))
    out.fill_from(stripe)


def _read(reader: Reader, index: int, stripe: np.ndarray, part: PartSpec | None,
          submitted: float | None, retry: RetryPolicy | None) -> None:
    """One stripe into ``stripe``: once, or with ``retry``'s tries and notes."""
    if retry is None:
        reader.read_local(index, stripe, submitted, part=part)
    else:
        reader.read_local_retrying([index], [stripe], retry, submitted, part=part)


def read_local_items(items: list[tuple[Reader, int, np.ndarray | Scatter]],
                      submitted: float | None) -> None:
    """Read and decode each ``(reader, stripe, out)`` on this pool thread, in order."""
    for reader, index, out in items:
        read_item(reader, index, out, submitted)
        submitted = None  # only the first stripe waited in the queue
