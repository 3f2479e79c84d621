"""Accounting of decoded window memory, so the bound is checked rather than assumed."""

from __future__ import annotations

import threading
import weakref

import numpy as np


class MemoryLedger:
    """Counts the bytes of live decode buffers (freed when the buffer is garbage).

    Buffers register through ``track``; a weakref finalizer subtracts them, so the count is
    what is really resident, wherever the last reference was dropped.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.resident = 0
        self.peak = 0

    def track(self, arr: np.ndarray) -> np.ndarray:
        n = int(arr.nbytes)
        with self._lock:
            self.resident += n
            self.peak = max(self.peak, self.resident)
        weakref.finalize(arr, self._free, n)
        return arr

    def _free(self, n: int) -> None:
        with self._lock:
            self.resident -= n

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.resident
