"""Decoding only the blosc blocks that hold the wanted bytes, with c-blosc2's getitem.

``blosc2_getitem_ctx`` decodes the blocks under an item range and nothing else; called once
per needed block (from its first to its last wanted byte) on the decode thread's own context
(``blosc2_lib``). A whole frame in hand falls back to the whole-frame decode wherever a
partial one is impossible or not worth it (``blocks.Whole``) or fails, so a damaged block
raises the error it always did. A sparse frame (only some blocks fetched) has nothing to
fall back to: a failure there raises ``ValueError`` at once (a ``ChunkDecodeError`` once
``ChunkDecoder`` wraps it, retried like a truncated transfer).
"""

from __future__ import annotations

import numpy as np

from .. import blosc2_lib
from ..blosc_frame import check_header
from ..thread_buffer import ThreadBuffer
from .blocks import BlockPlan, Whole, plan_frame
from .ranges import Ranges
from .sparse import SparseFrame

# A frame in hand decodes block by block up to this share of its blocks. The time tracks the
# share: on a (1, 37, 721, 1440) float32 chunk (numcodecs lz4, shuffle, 294 blocks of 512 kB),
# 0.40 of the whole decode's time for GraphCast's 13 levels (114 blocks), 0.84 at 0.81 of
# the blocks, 0.99 from 0.95 (medians of 15 interleaved rounds, one thread, 2-vCPU VM).
DECODE_MAX_FRACTION = 0.9
_SPARSE = ThreadBuffer()  # per decode thread: a sparse frame laid out at its offsets


def decode_blocks(frame: bytes | memoryview | SparseFrame, out: np.ndarray,
                  wanted: Ranges) -> bool:
    """Decode the decoded-byte ranges ``wanted`` of the blosc frame ``frame`` into the same
    bytes of ``out``: True when done block by block, False when the caller must decode the
    whole frame itself (not c-blosc 1's header, stored uncompressed, nearly every block
    wanted, no c-blosc2, or a block that did not decode). Bytes of ``out`` between wanted
    ones in a decoded block get their stored values; others are left as they are. A
    ``SparseFrame`` that does not decode raises ``ValueError``."""
    if isinstance(frame, SparseFrame):
        view = check_header(frame.assemble(_SPARSE.raw(frame.cbytes)), out.nbytes)
        plan = plan_frame(frame.head(), out.nbytes, wanted, 1.0)
        missing = [] if isinstance(plan, Whole) else frame.missing(plan.spans)
        if isinstance(plan, Whole) or missing:
            why = plan.reason if isinstance(plan, Whole) else f"blocks at {missing} missing"
            raise ValueError(f"part of a blosc frame cannot be decoded: {why}")
        if not _decode(view, out, plan):
            raise ValueError(f"blosc blocks {_named(plan.blocks)} did not decode")
        return True
    view = check_header(frame, out.nbytes)
    plan = plan_frame(view, out.nbytes, wanted, DECODE_MAX_FRACTION)
    return not isinstance(plan, Whole) and _decode(view, out, plan)


def _decode(view: memoryview, out: np.ndarray, plan: BlockPlan) -> bool:
    lib = blosc2_lib.load()
    if lib is None:
        return False
    return lib.decode_ranges(view, out, plan.decode, plan.header.typesize)


def _named(blocks: tuple[int, ...]) -> str:
    text = ", ".join(map(str, blocks[:8]))
    return text + (f" ... ({len(blocks)} in all)" if len(blocks) > 8 else "")
