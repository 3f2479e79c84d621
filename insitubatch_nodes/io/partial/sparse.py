"""The parts of a blosc frame a partial fetch received, and their form in the chunk cache.

A partial fetch gets the header and block offsets, then the needed blocks' byte ranges. They
are kept as (offset, bytes) pieces of the frame and laid out at their offsets in a buffer of
the frame's size only where they are decoded (on a pool thread), so c-blosc2 reads each
block where the frame has it. The chunk cache keeps one such entry per chunk, widened when a
later read needs more blocks: a read is served from it only if it holds every block the
read needs (``covers``), never a hole.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from .ranges import Ranges, merge

Piece = tuple[int, bytes | memoryview]  # (offset in the frame, its bytes)
_MAGIC = b"IBSF"
_HEAD = struct.Struct("<4sIQ")  # magic, pieces, frame size
_PIECE = struct.Struct("<QQ")  # offset, length


@dataclass(frozen=True)
class SparseFrame:
    """Pieces of a frame of ``cbytes`` bytes, sorted by offset, the first its header."""

    cbytes: int
    pieces: tuple[Piece, ...]

    @property
    def held(self) -> Ranges:
        """The frame's byte ranges these pieces hold."""
        return merge((off, off + len(b)) for off, b in self.pieces)

    @property
    def nbytes(self) -> int:
        """Bytes held (overlaps counted once)."""
        return sum(e - s for s, e in self.held)

    def head(self) -> bytes | memoryview:
        """The first piece: the header and block offsets."""
        return self.pieces[0][1]

    def missing(self, ranges: Ranges) -> Ranges:
        """The parts of ``ranges`` no piece holds."""
        out: list[tuple[int, int]] = []
        held = self.held
        for lo, hi in ranges:
            at = lo
            for s, e in held:
                if e <= at or s >= hi:
                    continue
                if s > at:
                    out.append((at, s))
                at = max(at, e)
            if at < hi:
                out.append((at, hi))
        return merge(out)

    def covers(self, ranges: Ranges) -> bool:
        return not self.missing(ranges)

    def with_pieces(self, more: list[Piece]) -> SparseFrame:
        """These pieces and ``more`` (a later fetch of further blocks)."""
        return SparseFrame(self.cbytes, tuple(sorted((*self.pieces, *more),
                                                     key=lambda p: p[0])))

    def assemble(self, buf: memoryview) -> memoryview:
        """The pieces laid out at their offsets in the first ``cbytes`` of ``buf`` (bytes
        no piece holds keep whatever ``buf`` held: never read for the needed blocks)."""
        out = buf[:self.cbytes]
        for off, data in self.pieces:
            view = memoryview(data).cast("B")
            out[off:off + view.nbytes] = view
        return out

    def to_bytes(self) -> bytes:
        """The chunk cache's payload for this frame."""
        parts = [_HEAD.pack(_MAGIC, len(self.pieces), self.cbytes)]
        parts += [_PIECE.pack(off, len(memoryview(b).cast("B"))) for off, b in self.pieces]
        parts += [bytes(b) for _, b in self.pieces]
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, raw: bytes | memoryview) -> SparseFrame | None:
        """The frame a cache payload holds, or ``None`` if it is not one (a foreign or
        damaged entry: the cache checks its crc, this only its layout)."""
        view = memoryview(raw).cast("B")
        if view.nbytes < _HEAD.size:
            return None
        magic, n, cbytes = _HEAD.unpack_from(view, 0)
        at = _HEAD.size + n * _PIECE.size
        if magic != _MAGIC or n == 0 or view.nbytes < at:
            return None
        pieces = []
        for i in range(n):
            off, size = _PIECE.unpack_from(view, _HEAD.size + i * _PIECE.size)
            if off + size > cbytes or at + size > view.nbytes:
                return None
            pieces.append((off, bytes(view[at:at + size])))
            at += size
        return cls(cbytes, tuple(pieces)) if at == view.nbytes else None
