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


class BufferPool:
    """Recycles decode and batch buffers once nothing references them any more.

    Fresh memory costs page faults on first touch (measured here: they halve decode
    throughput). ``take`` hands out a *view* of a pooled base array; a weakref finalizer on
    the view returns the base when the last user (a window, a batch tensor a user kept)
    lets go, so memory is never reused while it can still be read. The pool never holds more
    buffers than were live at once.
    """

    def __init__(self, ledger: MemoryLedger | None = None) -> None:
        self.ledger = ledger
        self._lock = threading.Lock()
        self._free: dict[tuple, list[np.ndarray]] = {}
        self._owned: dict[int, weakref.finalize] = {}  # id(view) -> its give-back

    def take(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        key = (tuple(shape), np.dtype(dtype).str)
        with self._lock:
            free = self._free.get(key)
            base = free.pop() if free else None
        if base is None:
            base = np.empty(shape, dtype=dtype)
        view = base.view()
        fin = weakref.finalize(view, self._give_back, key, base, id(view))
        with self._lock:
            self._owned[id(view)] = fin
        if self.ledger is not None:
            self.ledger.track(view)
        return view

    def _give_back(self, key: tuple, base: np.ndarray, ident: int) -> None:
        with self._lock:
            self._owned.pop(ident, None)
            self._free.setdefault(key, []).append(base)

    def disown(self, view: np.ndarray) -> None:
        """Never recycle ``view``'s memory: work that cannot be stopped (a decode already
        running on a pool thread) may still write into slices of it, and slices keep only
        the base array alive, not the view. The memory is freed by GC instead."""
        with self._lock:
            fin = self._owned.pop(id(view), None)
        if fin is not None:
            fin.detach()
