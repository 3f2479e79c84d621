"""Local stores read as plain files on a pool thread: fetch and decode in one hand-off.

The fastest path, and the only one that groups several small stripes in one pool task
(the hand-off costs about as much as reading a small chunk).
"""

from __future__ import annotations

import mmap
import os
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np

from . import blosc2_lib
from .partial.blocks import Whole, parse_header, plan_frame, select_blocks
from .partial.decode import DECODE_MAX_FRACTION
from .partial.ranges import PartSpec, Ranges, merge
from .partial.sparse import LaidOutFrame, SparseFrame
from .pool_task import OneShot
from .read_path_base import FrameCheck, Frames, Loop, ReadPath, Stripes, check_frame
from .thread_buffer import ThreadBuffer


class PageBuffer(ThreadBuffer):
    """``ThreadBuffer``, starting half a page past a page boundary (``_ALIGN_AT``): what
    file reads land in.

    The kernel copies a file's page-cache pages into the buffer with ``rep movsb``, which
    runs 3-4x slower when the buffer's address is a few bytes (under 64) past the file
    offset's, modulo the page: a store after each load to an address that aliases it (4K
    aliasing). A ``bytearray`` starts wherever malloc puts it, 16 bytes into a page when
    freshly mapped: a file read from offset 0 into that took 410 us against 120 us for a
    0.9 MB ARCO-ERA5 frame at 2.5 degrees (2-vCPU Xeon VM), and a frame read in part at
    its own offsets (``LaidOutFrame``) was always the slow case. Reads at offset ``k`` go
    to byte ``k`` of this buffer, half a page from the file page's offset: the fast case.
    """

    def raw(self, n: int, keep: int = 0) -> memoryview:
        buf: memoryview | None = getattr(self._local, "buf", None)
        if buf is None or len(buf) < n:
            size = max(n, _MIN_BYTES)
            block = np.empty(size + mmap.PAGESIZE, np.uint8)
            skip = (_ALIGN_AT - block.ctypes.data) % mmap.PAGESIZE
            grown = block[skip:skip + size].data  # a memoryview, format "B"
            if buf is not None and keep:
                grown[:keep] = buf[:keep]
            buf = self._local.buf = grown
        return buf


_MIN_BYTES = 1 << 16  # a thread's first buffer: small chunks never grow it
# Where in a page the buffer starts: half a page in. Page-aligned, a whole chunk's frame sat
# at the same page offset as the batch row or scratch it decodes into (both page-aligned
# too), and c-blosc2's decode then hit the same 4K aliasing: 2 workers on t2m one step a
# chunk fell from 10.4-10.9k to 8.4-8.7k samples/s (2-vCPU AMD VM, docs/benchmarks.md). Half
# a page in, neither a file's page-cache copy nor the decode aliases.
_ALIGN_AT = 2048
_READ = PageBuffer()  # ``LocalFiles.get_scratch``: one chunk file's bytes per thread
HEAD_GUESS = 4096  # bytes read first for a partial read: header and ~1000 block offsets


@dataclass(frozen=True)
class LocalFiles(ReadPath):
    """Local stores: plain file reads on a pool thread, fetch and decode in one hand-off.
    Small stripes are grouped a few per pool task, since the hand-off (~0.1 ms) dominates."""

    root: Path
    # per decoded chunk size, the (blocksize, typesize) of the last blosc header read in
    # part: a selection they put over ``DECODE_MAX_FRACTION`` of the blocks reads whole
    # files from then on without reading the header first (``get_part``)
    shapes: dict[int, tuple[int, int]] = field(default_factory=dict, compare=False,
                                               repr=False)
    name: ClassVar[str] = "local"
    groups_reads: ClassVar[bool] = True

    def get(self, key: str) -> bytes | None:
        try:
            # a string join: pathlib's ``/`` costs several microseconds per chunk
            with open(f"{self.root}/{key}", "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def get_scratch(self, key: str) -> memoryview | None:
        """``get``, into this thread's reused buffer: valid until this thread's next call.

        A fresh ``bytes`` per chunk is a fresh ``mmap`` for anything over glibc's 128 kB
        threshold, so every read page-faulted its buffer in (seen in profiles of 140 kB blosc
        chunks). Only for bytes decoded at once.

        Three system calls (open, one read into the whole buffer, close): each releases and
        retakes the GIL, and with two decode threads every retake can wait out the other
        thread's Python. ``open()`` plus ``fstat`` cost five. The size is asked only when the
        read filled the buffer (a chunk larger than any before on this thread).
        """
        try:
            fd = os.open(f"{self.root}/{key}", os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            buf = _READ.raw(0)
            got = os.readv(fd, [buf])
            return _read_on(fd, got, got == len(buf))
        finally:
            os.close(fd)

    def get_part(self, key: str, nbytes: int, wanted: Ranges,
                 ) -> memoryview | SparseFrame | None:
        """The blocks of chunk ``key`` (``nbytes`` decoded) that hold the decoded byte ranges
        ``wanted``, read as an object store's are: the header and block offsets, then only
        those blocks. Copying a 0.25 degree ARCO-ERA5 frame out of the page cache took as
        long as decoding the 13 of 37 levels in it, so the bytes not decoded are not read
        either. The whole file where the frame cannot be read in part, straight away where
        the last header said the selection takes nearly every block (the decode still
        decides from the frame's own header). One open, and every read lands in this
        thread's buffer where it lies in the file (``LaidOutFrame``): the blocks are
        decoded there, never copied."""
        shape = self.shapes.get(nbytes)
        if shape is not None and _most_blocks(nbytes, *shape, wanted):
            return self.get_scratch(key)
        try:
            fd = os.open(f"{self.root}/{key}", os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            return _read_part(fd, nbytes, wanted, self.shapes)
        finally:
            os.close(fd)

    def read_blocking(self, stripes: Stripes, index: int, out: np.ndarray,
                      submitted: float | None = None, part: PartSpec | None = None) -> None:
        """Read and decode stripe ``index`` (``part`` of it) into ``out`` on this thread;
        ``submitted`` (a ``perf_counter`` time) is when it was handed to the pool, to count
        the queueing. A part reads the whole file of each chunk it needs (local reads are
        cheap) and decodes only the blocks it wants."""
        t0 = time.perf_counter()
        wait = t0 - submitted if submitted is not None else 0.0
        parts = stripes.chunk_parts(part)
        if stripes.whole_key is not None and parts is None:  # the per-sample hot path
            data = self.get_scratch(stripes.whole_key.format(index))
            t1 = time.perf_counter()
            stripes.place(data, stripes.inner[0], out)
            stripes.times.add(t1 - t0, time.perf_counter() - t1, wait)
            return
        store = 0.0
        for i, inner in enumerate(stripes.inner):
            cp = None if parts is None else parts[i]
            if parts is not None and cp is None:
                stripes.partial_stats.skipped(1)  # no wanted index in this chunk
                continue
            key = stripes.chunk_key((index, *inner))
            t1 = time.perf_counter()
            got = (self.get_part(key, stripes.chunk_nbytes, cp.byte_ranges)
                   if cp is not None and not cp.whole and stripes.blocks_ok
                   else self.get_scratch(key))
            store += time.perf_counter() - t1
            stripes.place(got, inner, out, cp)
        stripes.times.add(store, time.perf_counter() - t0 - store, wait)

    def read_many_blocking(self, stripes: Stripes, indices: list[int], outs: list[np.ndarray],
                           submitted: float | None = None,
                           part: PartSpec | None = None) -> None:
        for index, out in zip(indices, outs, strict=True):
            self.read_blocking(stripes, index, out, submitted, part)
            submitted = None  # only the first stripe waited in the queue

    def frames_blocking(self, stripes: Stripes, index: int, check: FrameCheck) -> Frames:
        t0 = time.perf_counter()
        out: Frames = []
        for inner in stripes.inner:
            key = stripes.chunk_key((index, *inner))
            data = self.get(key)
            check_frame(check, data, key)
            out.append(data)
        stripes.times.add(time.perf_counter() - t0, 0.0)
        return out

    def _frames_many_blocking(self, stripes: Stripes, indices: list[int],
                              check: FrameCheck) -> list[Frames]:
        return [self.frames_blocking(stripes, i, check) for i in indices]

    async def read(self, stripes: Stripes, index: int, out: np.ndarray, loop: Loop,
                   pool: Executor, part: PartSpec | None = None) -> None:
        await loop.run_in_executor(pool, OneShot(self.read_blocking, stripes, index, out,
                                                 time.perf_counter(), part))

    async def read_many(self, stripes: Stripes, indices: list[int], outs: list[np.ndarray],
                        loop: Loop, pool: Executor, part: PartSpec | None = None) -> None:
        await loop.run_in_executor(pool, OneShot(self.read_many_blocking, stripes, indices,
                                                 outs, time.perf_counter(), part))

    async def frames(self, stripes: Stripes, index: int, check: FrameCheck, loop: Loop,
                     pool: Executor) -> Frames:
        return await loop.run_in_executor(pool, self.frames_blocking, stripes, index, check)

    async def frames_many(self, stripes: Stripes, indices: list[int], check: FrameCheck,
                          loop: Loop, pool: Executor) -> list[Frames]:
        return await loop.run_in_executor(pool, self._frames_many_blocking, stripes, indices,
                                          check)


def _read_on(fd: int, got: int, full: bool) -> memoryview:
    """File ``fd`` whole in this thread's buffer, whose first ``got`` bytes it holds
    already; ``full``: the read that got them filled what it asked for (more may follow).
    A full buffer grows past the file's size (one byte more, so that a read reaching its
    end stops there), asking the size only then."""
    buf = _READ.raw(got, keep=got)
    while full:
        if got == len(buf):
            buf = _READ.raw(max(os.fstat(fd).st_size, got) + 1, keep=got)
        more = os.preadv(fd, [buf[got:]], got)
        full = 0 < more == len(buf) - got
        got += more
    return buf[:got]


def _most_blocks(nbytes: int, blocksize: int, typesize: int, wanted: Ranges) -> bool:
    """Whether ``wanted`` lies in more than ``DECODE_MAX_FRACTION`` of the blocks of a
    frame of these sizes: then it decodes whole, and is read whole."""
    chosen = select_blocks(nbytes, blocksize, typesize, wanted)
    return (not isinstance(chosen, Whole)
            and len(chosen[0]) > DECODE_MAX_FRACTION * -(-nbytes // blocksize))


def _read_part(fd: int, nbytes: int, wanted: Ranges,
               shapes: dict[int, tuple[int, int]] | None = None,
               ) -> memoryview | LaidOutFrame:
    """``LocalFiles.get_part`` of the open file ``fd``: its header and block offsets first,
    then, if the frame can be read in part (``plan_frame``), only the needed blocks'
    bytes, each at its own offset in this thread's buffer; else the rest of the file.
    The header's block and item sizes go into ``shapes``."""
    buf = _READ.raw(HEAD_GUESS)
    asked = HEAD_GUESS
    got = os.preadv(fd, [buf[:asked]], 0)
    header = parse_header(buf[:got], nbytes)
    if isinstance(header, Whole) or blosc2_lib.load() is None:
        return _read_on(fd, got, got == asked)
    if shapes is not None:
        shapes[nbytes] = (header.blocksize, header.typesize)
    head = header.head_bytes
    if got == asked < head:  # more block offsets than the first read held
        buf = _READ.raw(head, keep=got)
        asked = head
        got += os.preadv(fd, [buf[got:head]], got)
    # the whole frame in hand already, or a file ending in its offsets (damaged): whole
    plan = (plan_frame(buf[:got], nbytes, wanted, DECODE_MAX_FRACTION)
            if head <= got < header.cbytes else Whole("read whole"))
    if isinstance(plan, Whole):
        return _read_on(fd, got, got == asked)
    buf = _READ.raw(header.cbytes, keep=head)
    pieces: list[tuple[int, memoryview]] = [(0, buf[:head])]
    for s, e in merge(plan.spans):
        # a short read (a truncated file) leaves a hole: the decode names the blocks
        pieces.append((s, buf[s:s + os.preadv(fd, [buf[s:e]], s)]))
    return LaidOutFrame(header.cbytes, tuple(pieces), buf[:header.cbytes])
