"""Which blocks of a blosc 1 frame hold the wanted bytes, and where they lie (pure).

A frame is a 16-byte header, one int32 offset per block (``bstarts``) and the blocks, each
compressed on its own. A block spans from its offset to the next larger offset (or the
frame's end): c-blosc 1 compressing on several threads appends blocks as they finish, so
offsets are not in block order (seen in numcodecs' frames). Returns ``Whole`` with a reason
wherever reading part of the frame is impossible or not worth it:

- a header c-blosc 1 would refuse, or offsets that do not tile the frame (damaged: the
  whole-frame decode then raises the error it always did);
- a frame stored uncompressed (flag 0x02: it has no offsets);
- a selection touching more than ``MAX_BLOCK_FRACTION`` of the blocks: decoding nearly
  every block block by block saves little, and on an object store the second round trip
  and the extra requests would cost more than the bytes saved.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import lru_cache

from .ranges import Ranges, merge

HEADER = 16
MAX_BLOCK_FRACTION = 0.8  # above: the whole frame
_MEMCPYED, _RESERVED, _SHUFFLES = 0x02, 0x08, 0x05


@dataclass(frozen=True)
class Whole:
    """The whole frame is read, and why (for logs and tests)."""

    reason: str


@dataclass(frozen=True)
class FrameHeader:
    """A blosc 1 frame's header, as c-blosc 1 checks it (``parse_header``)."""

    flags: int
    typesize: int
    nbytes: int  # decoded size
    blocksize: int
    cbytes: int  # the frame's size

    @property
    def nblocks(self) -> int:
        return -(-self.nbytes // self.blocksize)

    @property
    def head_bytes(self) -> int:
        """The header and the block offsets: what a partial fetch gets first."""
        return HEADER + 4 * self.nblocks


def parse_header(head: bytes | memoryview, nbytes: int) -> FrameHeader | Whole:
    """The header at the start of ``head`` (at least 16 bytes of a frame that decodes to
    ``nbytes``), if it is one c-blosc 1 writes (``blosc_frame.written_by_blosc1``'s header
    rules, the frame's size from its header) and has block offsets."""
    view = memoryview(head).cast("B")
    if view.nbytes < HEADER:
        return Whole(f"a blosc frame of {view.nbytes} bytes is shorter than its header")
    version, versionlz, flags, typesize = view[0], view[1], view[2], view[3]
    total, blocksize, cbytes = struct.unpack_from("<iii", view, 4)
    if version != 2 or versionlz != 1 or typesize == 0:
        return Whole(f"not a blosc 1 header (version {version}.{versionlz}, typesize "
                     f"{typesize})")
    if flags & _RESERVED or flags & _SHUFFLES == _SHUFFLES or flags >> 5 > 4:
        return Whole(f"blosc header flags {flags:#x} are not c-blosc 1's")
    if total != nbytes or not 0 < blocksize <= nbytes:
        return Whole(f"blosc header says {total} bytes in blocks of {blocksize}, the chunk "
                     f"has {nbytes}")
    if flags & _MEMCPYED:
        return Whole("the frame is stored uncompressed (memcpyed): it has no blocks")
    header = FrameHeader(flags, typesize, total, blocksize, cbytes)
    if cbytes <= header.head_bytes:
        return Whole(f"a blosc frame of {cbytes} bytes cannot hold {header.nblocks} blocks")
    return header


def stored_size(head: bytes | memoryview, nbytes: int) -> int | None:
    """The size of a frame stored uncompressed (flag 0x02) of a chunk of ``nbytes``, from
    its header at the start of ``head``; ``None`` for any other header."""
    view = memoryview(head).cast("B")
    if view.nbytes < HEADER or not view[2] & _MEMCPYED or view[0] != 2:
        return None
    total, _, cbytes = struct.unpack_from("<iii", view, 4)
    return cbytes if total == nbytes and cbytes == HEADER + nbytes else None


def block_spans(header: FrameHeader, bstarts: bytes | memoryview) -> tuple[int, ...] | Whole:
    """Each block's compressed end, given the offsets (``header.head_bytes - 16`` bytes
    after the header): the next larger offset, or the frame's end. ``Whole`` if the offsets
    do not tile the frame (the first block right after them, all distinct, inside it)."""
    n = header.nblocks
    starts = struct.unpack_from(f"<{n}i", memoryview(bstarts).cast("B"), 0)
    ordered = sorted(starts)
    first, last = ordered[0], ordered[-1]
    if first != header.head_bytes or last >= header.cbytes:
        return Whole(f"blosc block offsets run from {first} to {last}, the frame holds "
                     f"{header.head_bytes}..{header.cbytes}: damaged")
    if len(set(starts)) != n:
        a, b = _shared_offset(starts)
        return Whole(f"blosc blocks {a} and {b} share offset {starts[a]}: damaged")
    if ordered == list(starts):  # one compressing thread: in block order (C-speed checks)
        return (*starts[1:], header.cbytes)
    order = sorted(range(n), key=starts.__getitem__)
    ends = [0] * n
    for a, b in zip(order, order[1:], strict=False):
        ends[a] = starts[b]
    ends[order[-1]] = header.cbytes
    return tuple(ends)


def _shared_offset(starts: tuple[int, ...]) -> tuple[int, int]:
    """Two blocks with one offset (there are some), the lower index first, as the sorted
    walk over them meets them."""
    order = sorted(range(len(starts)), key=starts.__getitem__)
    return next((a, b) for a, b in zip(order, order[1:], strict=False)
                if starts[a] == starts[b])


@dataclass(frozen=True)
class BlockPlan:
    """The blocks a selection needs: ``blocks`` (sorted), each block's compressed range
    ``spans`` (same order), and the decoded byte ranges to decode, ``decode``: each needed
    block whole (c-blosc2 decodes a whole block straight into the output; a part of one it
    decodes into its own buffer and copies out)."""

    header: FrameHeader
    blocks: tuple[int, ...]
    spans: Ranges
    decode: Ranges

    @property
    def span_bytes(self) -> int:
        """Compressed bytes of the needed blocks."""
        return sum(e - s for s, e in self.spans)


def coalesce(ranges: Ranges, max_runs: int) -> Ranges:
    """``ranges`` (sorted, disjoint) as at most ``max_runs`` ranges, the smallest gaps
    between them filled first: few requests, few wasted bytes."""
    runs = [list(r) for r in ranges]
    while len(runs) > max(1, max_runs):
        i = min(range(len(runs) - 1), key=lambda k: runs[k + 1][0] - runs[k][1])
        runs[i][1] = runs.pop(i + 1)[1]
    return tuple((s, e) for s, e in runs)


def plan_blocks(header: FrameHeader, bstarts: bytes | memoryview, wanted: Ranges,
                max_fraction: float = MAX_BLOCK_FRACTION) -> BlockPlan | Whole:
    """The blocks of the frame ``header`` describes (offsets ``bstarts``) that hold the
    decoded byte ranges ``wanted``, or ``Whole`` and why. Wanted ranges are widened to
    whole items of the frame's typesize, as c-blosc2's getitem counts them."""
    chosen = select_blocks(header.nbytes, header.blocksize, header.typesize, wanted)
    if isinstance(chosen, Whole):
        return chosen
    blocks, decode = chosen
    if len(blocks) > max_fraction * header.nblocks:
        return Whole(f"the selection touches {len(blocks)} of {header.nblocks} blocks")
    ends = block_spans(header, bstarts)
    if isinstance(ends, Whole):
        return ends
    starts = struct.unpack_from(f"<{header.nblocks}i", memoryview(bstarts).cast("B"), 0)
    return BlockPlan(header, blocks, tuple((starts[j], ends[j]) for j in blocks), decode)


@lru_cache(maxsize=1024)
def select_blocks(nbytes: int, blocksize: int, typesize: int, wanted: Ranges,
                  ) -> tuple[tuple[int, ...], Ranges] | Whole:
    """The blocks (sorted) of a frame of ``nbytes`` in blocks of ``blocksize`` that hold
    the decoded byte ranges ``wanted``, and each one's decoded bytes: the whole block, so
    c-blosc2 decodes it straight into the output instead of copying it out of its own
    buffer. The header's sizes and the selection decide this, not the block offsets, so
    every chunk of an array shares one answer: cached (in Python it cost ~9% of a decode
    worker's time per sample)."""
    ts, bs = typesize, blocksize
    if nbytes % ts:
        return Whole(f"the chunk's {nbytes} bytes are no whole number of blosc items "
                     f"of {ts} bytes")
    items = merge((lo // ts * ts, -(-hi // ts) * ts) for lo, hi in wanted)
    if not items or items[-1][1] > nbytes:
        return Whole(f"wanted bytes {items!r} are not in a chunk of {nbytes}")
    blocks = sorted({j for lo, hi in items for j in range(lo // bs, (hi - 1) // bs + 1)})
    return tuple(blocks), tuple((j * bs, min((j + 1) * bs, nbytes)) for j in blocks)


def plan_frame(head: bytes | memoryview, nbytes: int, wanted: Ranges,
               max_fraction: float = MAX_BLOCK_FRACTION) -> BlockPlan | Whole:
    """``plan_blocks`` from the start of a frame (its header and offsets at least)."""
    header = parse_header(head, nbytes)
    if isinstance(header, Whole):
        return header
    view = memoryview(head).cast("B")
    if view.nbytes < header.head_bytes:
        return Whole(f"{view.nbytes} bytes hold no {header.nblocks} block offsets")
    return plan_blocks(header, view[HEADER:header.head_bytes], wanted, max_fraction)
