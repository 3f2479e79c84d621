"""Batch memory that the training process and its decode workers map at once.

Anonymous segments (``memfd_create`` on Linux, an unlinked temporary file elsewhere): no
name in ``/dev/shm`` exists at any moment, so a crash, a kill or Ctrl-C can leave nothing
behind - the kernel frees a segment when its last mapping and descriptor go. A worker gets
each segment's descriptor once (``SCM_RIGHTS``, ``engine``) and maps it once; batches are
blocks of segments, recycled by ``memory.BufferPool`` (its ``allocate`` hook is
``SharedMemoryArena.allocate``), so no segment is made per batch.
"""

from __future__ import annotations

import bisect
import contextlib
import mmap
import os
import tempfile
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..errors import InsitubatchError, LoaderUsageError


class NotInArena(InsitubatchError, ValueError):
    """An array asked about is not a contiguous block of this arena (a bug if reached)."""


# Where an array lives: (segment, byte offset, shape, dtype string); what a job names.
Place = tuple[int, int, tuple[int, ...], str]


@dataclass(frozen=True, eq=False)
class Segment:
    """One mapped segment: its index (what jobs name), descriptor and size."""

    index: int
    fd: int
    nbytes: int
    address: int
    whole: np.ndarray  # the segment as bytes (its base the mapping), every block a slice


def _anonymous_fd(nbytes: int) -> int:
    """A descriptor of ``nbytes`` of fresh shared memory with no name anywhere."""
    if hasattr(os, "memfd_create"):  # Linux (CPython >= 3.8)
        fd = os.memfd_create("insitubatch-batches", os.MFD_CLOEXEC)
    else:  # macOS and others: a temporary file unlinked at once
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
        with tempfile.TemporaryFile(dir=folder) as f:
            fd = os.dup(f.fileno())
    os.ftruncate(fd, nbytes)
    return fd


def map_segment(index: int, fd: int, nbytes: int) -> Segment:
    """Map segment ``fd`` (``nbytes``) read-write: in the training process when it is made,
    in a worker when its descriptor arrives."""
    memory = mmap.mmap(fd, nbytes)
    whole = np.frombuffer(memory, dtype=np.uint8)
    return Segment(index, fd, nbytes, int(whole.ctypes.data), whole)


def array_at(segments: dict[int, Segment] | list[Segment], place: Place) -> np.ndarray:
    """The array a job names by ``place`` (a worker's view of the training process's)."""
    seg, offset, shape, dtype = place
    dt = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    return segments[seg].whole[offset:offset + n].view(dt).reshape(shape)


class SharedMemoryArena:
    """Hands out C-contiguous arrays in shared segments and says where each one lives.

    ``allocate`` is a ``BufferPool`` allocator: the pool recycles the arrays, so memory is
    only allocated when the pool grows; a block comes back to this arena (for any shape of
    its size) only when its array is garbage (``BufferPool.disown``: a batch abandoned at a
    restore). Blocks are page-aligned, so two batches never share a page; a batch split
    across workers (a window's first) has disjoint rows written by several, which may share
    a cache line only where one row ends and the next begins.
    ``on_segment(address, nbytes)`` runs for every new segment (CUDA page-locks it there).
    """

    SEGMENT_BYTES = 64 << 20
    ALIGN = 4096

    def __init__(self, segment_bytes: int = SEGMENT_BYTES,
                 on_segment: Callable[[int, int], None] | None = None) -> None:
        self.segment_bytes = int(segment_bytes)
        self.on_segment = on_segment
        self._lock = threading.Lock()
        self.segments: list[Segment] = []
        self._starts: list[int] = []  # segment addresses, ascending (bisect)
        self._by_start: list[int] = []  # segment index of each address in _starts
        self._used = 0  # bytes used of the last segment
        self._free: dict[int, list[tuple[int, int]]] = {}  # block size -> (segment, offset)
        # id of each live block's buffer array -> (segment, offset, bytes) (``where``)
        self._homes: dict[int, tuple[int, int, int]] = {}
        self.allocated = 0  # bytes asked for in fresh blocks (a reused block not again)
        self.closed = False
        self._fds: list[int] = []
        weakref.finalize(self, _close_all, self._fds)

    @property
    def nbytes(self) -> int:
        """Bytes of shared memory mapped (the segments' sizes)."""
        return sum(s.nbytes for s in self.segments)

    def allocate(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        dt = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        size = max(self.ALIGN, -(-n // self.ALIGN) * self.ALIGN)
        with self._lock:
            if self.closed:
                raise LoaderUsageError("this SharedMemoryArena was closed (loader.shutdown()): "
                                   "build a new loader")
            free = self._free.get(size)
            if free:
                seg, offset = free.pop()
            else:
                seg, offset = self._bump(size)
                self.allocated += n
            # its own buffer object (not a slice of the segment's array): every view of the
            # block has it as its ``base``, which ``where`` looks up instead of an address
            raw = np.frombuffer(self.segments[seg].whole.data[offset:offset + n],
                                dtype=dt)
            self._homes[id(raw)] = (seg, offset, n)
        # back to the free blocks once nothing over it is left (a view outliving the pool's
        # array included), and forgotten by ``where`` then
        weakref.finalize(raw, self._give_back, size, seg, offset, id(raw))
        return raw.reshape(shape)

    def _bump(self, size: int) -> tuple[int, int]:
        """A fresh block of ``size`` bytes at the end of the last segment, or of a new one
        (under ``_lock``)."""
        if not self.segments or self._used + size > self.segments[-1].nbytes:
            nbytes = max(self.segment_bytes, size)
            index = len(self.segments)
            fd = _anonymous_fd(nbytes)
            self._fds.append(fd)
            segment = map_segment(index, fd, nbytes)
            if self.on_segment is not None:
                self.on_segment(segment.address, nbytes)
            self.segments.append(segment)
            at = bisect.bisect(self._starts, segment.address)
            self._starts.insert(at, segment.address)
            self._by_start.insert(at, index)
            self._used = 0
        offset = self._used
        self._used += size
        return len(self.segments) - 1, offset

    def _give_back(self, size: int, seg: int, offset: int, ident: int) -> None:
        with self._lock:
            self._homes.pop(ident, None)
            self._free.setdefault(size, []).append((seg, offset))

    def place(self, arr: np.ndarray) -> Place:
        """Where ``arr`` (an array of this arena's, C-contiguous) lives, for a worker."""
        address = int(arr.ctypes.data)
        at = bisect.bisect(self._starts, address) - 1
        if at < 0 or not arr.flags.c_contiguous:
            raise NotInArena(f"array of shape {arr.shape} at {address:#x} is not a "
                             "contiguous block of this shared-memory arena")
        seg = self.segments[self._by_start[at]]
        offset = address - seg.address
        if offset + arr.nbytes > seg.nbytes:
            raise NotInArena(f"array of shape {arr.shape} at {address:#x} is not in a "
                             "segment of this shared-memory arena")
        return seg.index, offset, tuple(arr.shape), arr.dtype.str

    def where(self, arr: np.ndarray) -> tuple[int, int]:
        """(segment, byte offset) of ``arr`` (an array of this arena's, C-contiguous): what a
        job names per array, its shape and dtype being the batch's (``wire``). A whole
        block (a batch's array: contiguous, as many bytes as the block, over its buffer) is
        looked up by its base; the address is read only for anything else (microseconds)."""
        home = self._homes.get(id(arr.base))
        if home is not None and arr.nbytes == home[2] and arr.flags.c_contiguous:
            return home[0], home[1]
        address = arr.__array_interface__["data"][0]
        at = bisect.bisect(self._starts, address) - 1
        seg = self.segments[self._by_start[at]] if at >= 0 else None
        if (seg is None or not arr.flags.c_contiguous
                or address + arr.nbytes > seg.address + seg.nbytes):
            raise NotInArena(f"array of shape {arr.shape} at {address:#x} is not a "
                             "contiguous block of this shared-memory arena")
        return seg.index, address - seg.address

    def close(self) -> None:
        """Close the segments' descriptors (the mappings stay while arrays use them; the
        kernel frees the memory with the last one). Later ``allocate`` calls fail."""
        with self._lock:
            self.closed = True
            _close_all(self._fds)


def _close_all(fds: list[int]) -> None:
    """Close ``fds`` and empty the list (a second call closes nothing)."""
    while fds:
        with contextlib.suppress(OSError):
            os.close(fds.pop())
