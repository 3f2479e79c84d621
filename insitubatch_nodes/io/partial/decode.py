"""Decoding only the blosc blocks that hold the wanted bytes, with c-blosc2's getitem.

``blosc2_getitem_ctx`` decodes the blocks under an item range and nothing else; called once
per needed block (from its first to its last wanted byte) on the decode thread's own context
(``blosc2_lib``). A whole frame in hand falls back to the whole-frame decode wherever a
partial one is impossible or not worth it (``blocks.Whole``) or fails, so a damaged block
raises the error it always did. A sparse frame (only some blocks fetched) decodes each
block as a frame of its own and has nothing to fall back to: a failure there raises
``ValueError`` at once (a ``ChunkDecodeError`` once ``ChunkDecoder`` wraps it, retried
like a truncated transfer). One read into a buffer laid out as the frame (a local file's
``LaidOutFrame``) decodes its blocks where they lie, each bounded by its own end, and fails
the same way.
"""

from __future__ import annotations

import struct

import numpy as np

from .. import blosc2_lib
from ..blosc_frame import check_header
from ..retry import ChunkDecodeError
from ..thread_buffer import ThreadBuffer
from .blocks import HEADER, BlockPlan, Whole, plan_frame
from .ranges import Ranges
from .sparse import LaidOutFrame, SparseFrame

# A frame in hand decodes block by block up to this share of its blocks. The time tracks the
# share: on a (1, 37, 721, 1440) float32 chunk (numcodecs lz4, shuffle, 294 blocks of 512 kB),
# 0.40 of the whole decode's time for GraphCast's 13 levels (114 blocks), 0.84 at 0.81 of
# the blocks, 0.99 from 0.95 (medians of 15 interleaved rounds, one thread, 2-vCPU VM).
DECODE_MAX_FRACTION = 0.9
_SPARSE = ThreadBuffer()  # per decode thread: one block of a sparse frame, as a frame


def decode_blocks(frame: bytes | memoryview | SparseFrame, out: np.ndarray,
                  wanted: Ranges) -> bool:
    """Decode the decoded-byte ranges ``wanted`` of the blosc frame ``frame`` into the same
    bytes of ``out``: True when done block by block, False when the caller must decode the
    whole frame itself (not c-blosc 1's header, stored uncompressed, nearly every block
    wanted, no c-blosc2, or a block that did not decode). Every byte of ``out`` in a
    decoded block gets its stored value; others are left as they are. A ``SparseFrame``
    that does not decode raises ``ValueError``."""
    if isinstance(frame, LaidOutFrame):
        _decode_laid_out(frame, out, wanted)
        return True
    if isinstance(frame, SparseFrame):
        _decode_sparse(frame, out, wanted)
        return True
    view = check_header(frame, out.nbytes)
    plan = plan_frame(view, out.nbytes, wanted, DECODE_MAX_FRACTION)
    return not isinstance(plan, Whole) and _decode(view, out, plan)


def _decode(view: memoryview, out: np.ndarray, plan: BlockPlan) -> bool:
    lib = blosc2_lib.load()
    if lib is None:
        return False
    return lib.decode_ranges(view, out, plan.decode, plan.header.typesize)


def _sparse_plan(frame: SparseFrame, head: bytes | memoryview, out: np.ndarray,
                 wanted: Ranges) -> BlockPlan:
    """The plan of a frame fetched in part (every needed block, whatever their share),
    once its header agrees with its size and it holds every needed block."""
    plan = plan_frame(head, out.nbytes, wanted, 1.0)
    if isinstance(plan, Whole) or plan.header.cbytes != frame.cbytes:
        why = plan.reason if isinstance(plan, Whole) else (
            f"its header says {plan.header.cbytes} bytes, it was {frame.cbytes}")
        raise ChunkDecodeError(f"part of a blosc frame cannot be decoded: {why}")
    missing = frame.missing(plan.spans)
    if missing:
        raise ChunkDecodeError(f"part of a blosc frame lacks the blocks at {missing}")
    return plan


def _decode_laid_out(frame: LaidOutFrame, out: np.ndarray, wanted: Ranges) -> None:
    """Decode a frame read in part into a buffer laid out as the frame: each needed block
    where it lies (no copy into a frame of its own, as ``_decode_sparse`` must), bounded
    by its own end so that a damaged block cannot read the stale bytes after it."""
    plan = _sparse_plan(frame, frame.head(), out, wanted)
    lib = blosc2_lib.load()
    failed = 0 if lib is None else lib.decode_bounded(
        frame.frame, out, plan.decode, tuple(e for _, e in plan.spans), plan.header.typesize)
    if failed is not None:
        s, e = plan.spans[failed]
        raise ChunkDecodeError(f"blosc block {plan.blocks[failed]} (bytes {s}..{e} of the "
                               f"frame) did not decode")


def _decode_sparse(frame: SparseFrame, out: np.ndarray, wanted: Ranges) -> None:
    """Decode a sparse frame's needed blocks one at a time, each as a frame of its own in
    this thread's buffer (the header, offsets all pointing past them, the block): a buffer
    of one block, not of the whole frame (~90 MB for a 0.25 degree ARCO chunk)."""
    plan = _sparse_plan(frame, frame.head(), out, wanted)
    lib = blosc2_lib.load()
    head, n = plan.header.head_bytes, plan.header.nblocks
    buf = _SPARSE.raw(head + max(e - s for s, e in plan.spans))
    frame.copy_into(buf, 0, 0, head)
    struct.pack_into(f"<{n}i", buf, HEADER, *([head] * n))
    for j, (s, e), decode in zip(plan.blocks, plan.spans, plan.decode, strict=True):
        size = head + e - s
        struct.pack_into("<i", buf, 12, size)  # the frame's compressed size
        frame.copy_into(buf, head, s, e)
        if lib is None or not lib.decode_ranges(buf[:size], out, (decode,),
                                                plan.header.typesize):
            raise ChunkDecodeError(f"blosc block {j} (bytes {s}..{e} of the frame) did not decode")
