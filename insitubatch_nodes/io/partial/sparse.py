"""The parts of a blosc frame a partial fetch received, and their form in the chunk cache.

A partial fetch gets the header and block offsets, then the needed blocks' byte ranges. They
are kept as (offset, bytes) pieces of the frame, and each needed block is copied out of them
where it is decoded (on a pool thread, ``decode``). The chunk cache keeps one such entry per
chunk, widened when a later read needs more blocks: a read is served from it only if it
holds every block the read needs (``covers``), never a hole.
"""

from __future__ import annotations

import bisect
import struct
from dataclasses import dataclass
from functools import cached_property

from ...errors import ConfigError
from .ranges import Ranges, merge

Piece = tuple[int, bytes | memoryview]  # (offset in the frame, its bytes)
_MAGIC = b"IBSF"
_HEAD = struct.Struct("<4sIQ")  # magic, pieces, frame size
_PIECE = struct.Struct("<QQ")  # offset, length


@dataclass(frozen=True)
class SparseFrame:
    """Pieces of a frame of ``cbytes`` bytes, sorted by offset and disjoint (``with_pieces``
    keeps them so), the first its header."""

    cbytes: int
    pieces: tuple[Piece, ...]

    def __post_init__(self) -> None:
        pieces = tuple(sorted(self.pieces, key=lambda p: p[0]))
        ends = [off + memoryview(b).nbytes for off, b in pieces]
        if any(nxt < end for (nxt, _), end in zip(pieces[1:], ends, strict=False)):
            raise ConfigError("the pieces of a sparse blosc frame overlap")
        object.__setattr__(self, "pieces", pieces)

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
        """These pieces and the parts of ``more`` (a later fetch of further blocks) they
        lack: pieces never overlap, so ``copy_into`` finds a range's pieces by bisection."""
        pieces = list(self.pieces)
        for off, data in more:
            view = memoryview(data).cast("B")
            pieces += [(lo, view[lo - off:hi - off])
                       for lo, hi in self.missing(((off, off + view.nbytes),))]
        return SparseFrame(self.cbytes, tuple(pieces))

    @cached_property
    def _offsets(self) -> list[int]:
        return [off for off, _ in self.pieces]

    def copy_into(self, buf: memoryview, at: int, start: int, stop: int) -> None:
        """Bytes ``[start, stop)`` of the frame into ``buf`` from ``at`` (from the pieces
        holding some of them: ``missing`` says whether they hold all)."""
        i = max(0, bisect.bisect_right(self._offsets, start) - 1)
        for off, data in self.pieces[i:]:
            if off >= stop:
                break
            view = memoryview(data).cast("B")
            lo, hi = max(start, off), min(stop, off + view.nbytes)
            if lo < hi:
                buf[at + lo - start:at + hi - start] = view[lo - off:hi - off]

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


@dataclass(frozen=True)
class LaidOutFrame(SparseFrame):
    """A frame read in part into one buffer laid out as the whole frame (``frame``,
    ``cbytes`` long): every piece is a view of it at its own offset, the rest of it holds
    whatever was there before. A local file is read so (``local_files``): its needed
    blocks are decoded where they lie, bounded each by its own end, with no copy."""

    frame: memoryview
