"""The batches being decoded into: buffers keyed by batch number, filled row by row.

With one sample per chunk the fetch decodes every chunk straight into its final batch row
(``plan.BatchSlots`` says which); a batch is complete once every window that feeds it has
been fetched, and the shuffle buffer then takes it whole. Shared by the fetch (which
allocates on the loop thread) and the shuffle buffer (which takes on the consumer thread).
"""

from __future__ import annotations

import threading

import numpy as np

from .layout import BatchLayout
from .memory import BufferPool
from .windows import SampleWindow


class BatchArena:
    """Batch buffers by batch number: ``rows(b, n)`` allocates batch ``b`` (``n`` rows, every
    key of the layout) on first use; ``take(b)`` hands it over and forgets every earlier
    batch (skipped on resume: complete, so their memory may be recycled)."""

    def __init__(self, layout: BatchLayout, pool: BufferPool,
                 steps: SampleWindow | None = None) -> None:
        self.layout = layout
        self.pool = pool
        # With time steps a key holds (rows, history, ...) inputs and "target/key"
        # (rows, n_leads, ...) targets, as GatherNode makes them.
        self.steps = steps
        self._lock = threading.Lock()
        self._batches: dict[int, dict[str, np.ndarray]] = {}

    def slot(self, key: str, step: int) -> tuple[str, int | None]:
        """Batch key and column for step ``step`` of a sample (``None``: no step axis)."""
        if self.steps is None:
            return key, None
        h = self.steps.history
        return (key, step) if step < h else (f"target/{key}", step - h)

    def _allocate(self, n: int) -> dict[str, np.ndarray]:
        out = {}
        for k in self.layout.keys:
            if self.steps is None:
                out[k.name] = self.pool.take((n, *k.row_shape), k.dtype)
                continue
            out[k.name] = self.pool.take((n, self.steps.history, *k.row_shape), k.dtype)
            if self.steps.lead:
                out[f"target/{k.name}"] = self.pool.take(
                    (n, len(self.steps.lead), *k.row_shape), k.dtype)
        return out

    def rows(self, b: int, n: int) -> dict[str, np.ndarray]:
        with self._lock:
            got = self._batches.get(b)
            if got is None:
                got = self._batches[b] = self._allocate(n)
            return got

    def take(self, b: int) -> dict[str, np.ndarray]:
        with self._lock:
            got = self._batches.pop(b, None)
            for old in [k for k in self._batches if k < b]:
                del self._batches[old]
        if got is None:
            raise RuntimeError(f"batch {b} was never decoded into: the plans and the shuffle "
                               "buffer disagree on where batches start (a bug)")
        return got

    def clear(self) -> None:
        """Forget every batch (new epoch, restore, error). Reads still running on pool
        threads may write into them, so their memory is never recycled, only freed."""
        with self._lock:
            stale, self._batches = self._batches, {}
        for arrays in stale.values():
            for a in arrays.values():
                self.pool.disown(a)

    def __len__(self) -> int:
        return len(self._batches)
