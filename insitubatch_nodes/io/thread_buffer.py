"""A grow-only buffer per thread, for the bytes of one chunk at a time.

A fresh buffer per chunk above glibc's 128 kB ``mmap`` threshold is a fresh mapping, page-
faulted in on every chunk: profiles of 140 kB blosc chunks showed it halving decode
throughput. The file read, the inflate under HDF5's shuffle and the decode of a chunk that
only partly covers its stripe each keep one of these.
"""

from __future__ import annotations

import threading
from math import prod

import numpy as np

_MIN_BYTES = 1 << 16  # the first buffer of a thread: small chunks never grow it


class ThreadBuffer:
    """One buffer per thread, grown to the largest request and never shrunk. What it
    returns is valid until the same thread's next request of the same ``ThreadBuffer``."""

    def __init__(self) -> None:
        self._local = threading.local()

    def raw(self, n: int, keep: int = 0) -> memoryview:
        """At least ``n`` bytes (this thread's whole buffer); a grown buffer starts with
        the old one's first ``keep`` bytes."""
        buf: memoryview | None = getattr(self._local, "buf", None)
        if buf is None or len(buf) < n:
            grown = memoryview(bytearray(max(n, _MIN_BYTES)))
            if buf is not None and keep:
                grown[:keep] = buf[:keep]
            buf = self._local.buf = grown
        return buf

    def array(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """The buffer's first bytes as a writable C-ordered array of ``shape`` and ``dtype``
        (its values are whatever this thread's last use left)."""
        dtype = np.dtype(dtype)
        nbytes = prod(shape) * dtype.itemsize
        flat = np.frombuffer(self.raw(nbytes), dtype=np.uint8, count=nbytes)
        return flat.view(dtype).reshape(shape)
