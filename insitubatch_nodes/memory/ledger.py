"""Accounting of decoded window memory, so the bound is checked rather than assumed."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

import numpy as np


class MemoryLedger:
    """Counts the bytes of live decode buffers (freed when the buffer is garbage).

    A ``BufferPool`` counts each buffer it hands out (``add``) and uncounts it from the
    weakref callback that runs when the buffer's last reference goes (``release``), so the
    count is what is really resident, wherever that happens.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.resident = 0
        self.peak = 0

    def add(self, n: int) -> None:
        """Count ``n`` more resident bytes; the caller calls ``release(n)`` when they go."""
        with self._lock:
            self.resident += n
            if self.resident > self.peak:
                self.peak = self.resident

    def release(self, n: int) -> None:
        with self._lock:
            self.resident -= n

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.resident


class BufferPool:
    """Recycles decode and batch buffers once nothing references them any more.

    Fresh memory costs page faults on first touch (measured here: they halve decode
    throughput). ``take`` hands out a *view* of a pooled base array; a weakref callback on
    the view returns the base when the last user (a window, a batch tensor a user kept)
    lets go, so memory is never reused while it can still be read. The pool never holds more
    buffers than were live at once.

    One plain ``weakref.ref`` per view does the give-back and the ledger's count together:
    a ``weakref.finalize`` (and a second one for the ledger) cost the consumer thread
    several microseconds per stripe and per batch.

    ``allocate(shape, dtype)`` makes a new base array (default ``np.empty``); the CUDA graph
    passes one that returns pinned host memory, so batches decoded in place are copied to
    the GPU straight from where they were decoded.
    """

    def __init__(self, ledger: MemoryLedger | None = None,
                 allocate: Callable[[tuple[int, ...], np.dtype], np.ndarray] | None = None,
                 ) -> None:
        self.ledger = ledger
        self._new = allocate if allocate is not None else np.empty
        # Reentrant: a give-back runs wherever a view dies, which can be a garbage
        # collection started by an allocation on a thread that holds the lock.
        self._lock = threading.RLock()
        self._free: dict[tuple, list[np.ndarray]] = {}
        # id(view) -> (its weak reference, pool key, base, ledger bytes): the give-back to
        # run (the reference, which carries that id, lives as long as the entry)
        self._owned: dict[int, tuple[_Ref, tuple, np.ndarray, int]] = {}

    def take(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """One buffer (a batch's array: the engine thread takes one per key and batch, so
        this path makes no lists and takes the pool's lock twice)."""
        key = (tuple(shape), np.dtype(dtype).str)
        with self._lock:
            free = self._free.get(key)
            base = free.pop() if free else None
        if base is None:
            base = self._new(shape, dtype)
        nbytes = base.nbytes if self.ledger is not None else 0
        view = self._own(base, key, nbytes)
        if nbytes:
            assert self.ledger is not None
            self.ledger.add(nbytes)
        return view

    def _own(self, base: np.ndarray, key: tuple, nbytes: int) -> np.ndarray:
        """A view of ``base`` handed out, given back (``nbytes`` leaving the ledger's
        count, which the caller adds) when it dies."""
        view = base.view()
        ident = id(view)
        ref = _Ref(view, self._give_back)
        ref.ident = ident
        with self._lock:
            self._owned[ident] = (ref, key, base, nbytes)
        return view

    def take_many(self, shape: tuple[int, ...], dtype: np.dtype, n: int) -> list[np.ndarray]:
        """``n`` buffers of one shape and dtype (a window's stripes)."""
        key = (tuple(shape), np.dtype(dtype).str)
        with self._lock:
            free = self._free.get(key)
            bases = [free.pop() for _ in range(min(n, len(free)))] if free else []
        bases += [self._new(shape, dtype) for _ in range(n - len(bases))]
        nbytes = bases[0].nbytes if self.ledger is not None and bases else 0
        views = [self._own(base, key, nbytes) for base in bases]
        if nbytes:
            assert self.ledger is not None
            self.ledger.add(nbytes * len(views))  # one lock for the window's stripes
        return views

    def _give_back(self, ref: _Ref) -> None:
        ident = ref.ident
        with self._lock:
            entry = self._owned.pop(ident, None)
            if entry is None:  # disowned
                return
            _, key, base, nbytes = entry
            self._free.setdefault(key, []).append(base)
        if nbytes:
            assert self.ledger is not None
            self.ledger.release(nbytes)

    def disown(self, view: np.ndarray) -> None:
        """Never recycle ``view``'s memory: work that cannot be stopped (a decode already
        running on a pool thread) may still write into slices of it, and slices keep only
        the base array alive, not the view. The memory is freed by GC instead (and leaves
        the ledger's count then)."""
        with self._lock:
            entry = self._owned.pop(id(view), None)
        if entry is not None and entry[3]:
            assert self.ledger is not None
            weakref.finalize(entry[2], self.ledger.release, entry[3])


class _Ref(weakref.ref):
    """A weak reference to a pooled view that knows the view's id (the pool's key): the
    give-back needs no closure per buffer."""

    __slots__ = ("ident",)
    ident: int
