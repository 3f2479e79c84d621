"""Decoded stripes kept across epochs: a split read again every epoch is decoded once.

When a split's stripes hold several samples each and all fit in memory the loader may
use (one in-place window's, or ``keep_decoded`` bytes), each stripe is decoded into a
buffer kept here the first time a window reads it; later windows (the next epochs) copy
their samples out of it instead of reading and decoding the chunk again. Which samples go
where is still the plan's: keeping changes the work, never the batches.

A stripe is decoded by the first task to reach it (``claim``); a task reaching it while
another decodes waits for that decode (it runs on another pool thread and never waits on
anything itself), or, on the event loop, which must not block, reads it the usual way.
A decode that fails leaves the stripe to the next task that claims it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable

import numpy as np

from .ledger import MemoryLedger

_EMPTY, _DECODING, _READY = 0, 1, 2


class KeptStripe:
    """One stripe's kept buffer and whether it holds the decoded stripe yet."""

    __slots__ = ("array", "_cond", "_state")

    def __init__(self, array: np.ndarray, cond: threading.Condition) -> None:
        self.array = array
        self._cond = cond  # the keeper's: few stripes, rare waits
        self._state = _EMPTY

    def claim(self, wait: bool = True) -> bool | None:
        """True: the caller decodes into ``array`` and then calls ``done(ok)``; False: the
        stripe is decoded, read ``array``; None (``wait=False`` while another task
        decodes it): read the stripe the usual way, not into ``array``."""
        with self._cond:
            while self._state == _DECODING:
                if not wait:
                    return None
                self._cond.wait()
            if self._state == _READY:
                return False
            self._state = _DECODING
            return True

    def decode_once(self, decode: Callable[[np.ndarray], object]) -> bool:
        """``decode(array)`` if no task has decoded this stripe yet (waiting for one that
        is decoding it); whether it ran. A failure leaves the stripe to the next claim."""
        if not self.claim():
            return False
        ok = False
        try:
            decode(self.array)
            ok = True
        finally:
            self.done(ok)
        return True

    def done(self, ok: bool) -> None:
        """The claimed decode ended: the stripe is kept (``ok``), or left to be claimed
        again (a failed read: the buffer may hold part of it)."""
        with self._cond:
            self._state = _READY if ok else _EMPTY
            self._cond.notify_all()


class KeptStripes:
    """Decoded stripes by key, up to ``capacity`` bytes, counted by ``ledger``. A stripe
    not kept when the capacity is reached is read every time (nothing is evicted: which
    stripes are kept would otherwise depend on the order tasks finish)."""

    def __init__(self, capacity: int, ledger: MemoryLedger | None = None) -> None:
        self.capacity = int(capacity)
        self.ledger = ledger
        self.nbytes = 0
        self._lock = threading.Lock()
        self._cond = threading.Condition()
        self._stripes: dict[Hashable, KeptStripe] = {}

    def get(self, key: Hashable, shape: tuple[int, ...], dtype: np.dtype,
            ) -> KeptStripe | None:
        """The kept stripe of ``key`` (a new, empty one if it fits), else None. Called on
        the consumer thread as a window is prepared."""
        with self._lock:
            got = self._stripes.get(key)
            if got is not None:
                return got
            nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
            if self.nbytes + nbytes > self.capacity:
                return None
            got = self._stripes[key] = KeptStripe(np.empty(shape, dtype), self._cond)
            self.nbytes += nbytes
        if self.ledger is not None:
            self.ledger.add(nbytes)
        return got

    def find(self, key: Hashable) -> KeptStripe | None:
        """The kept stripe of ``key`` if it is kept (none is made: pool threads look up
        what the consumer thread admitted when it submitted the window)."""
        return self._stripes.get(key)

    def __len__(self) -> int:
        return len(self._stripes)

    def clear(self) -> None:
        """Let go of every kept stripe (the fetch shut down)."""
        with self._lock:
            self._stripes.clear()
            n, self.nbytes = self.nbytes, 0
        if self.ledger is not None and n:
            self.ledger.release(n)
