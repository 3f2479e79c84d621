"""The interface every read path offers its reader: ``ReadPath``, and ``Stripes``, what a
path needs of the reader.

Split from the paths themselves so each kind of store (``local_files``, ``async_gets``,
``cached_gets``, ``zarr_getitem``) lives in a module of its own; ``read_paths`` picks one.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import ClassVar, Protocol

import numpy as np

from ..errors import UsageTypeError
from ..metrics.counters import PartialStats, ReadTimes
from .partial.fetch import PartialFetch
from .partial.ranges import ChunkPart, PartSpec
from .partial.sparse import SparseFrame
from .retry import ChunkDecodeError

Frames = list[bytes | memoryview | None]  # one stripe's stored chunks, in inner-chunk order
# What a read decodes: stored chunks, or parts of them (a partial fetch), in inner order.
Datas = list[bytes | memoryview | SparseFrame | None]
# What ``place_all`` decodes: ``Frames`` or ``Datas`` (read only: either list)
Placeable = Sequence[bytes | memoryview | SparseFrame | None]
Parts = tuple[ChunkPart | None, ...]  # per inner chunk, what a partial read wants of it
FrameCheck = Callable[[bytes | memoryview], None]  # raises ValueError on a damaged frame
Loop = asyncio.AbstractEventLoop


class Stripes(Protocol):
    """What a read path needs of its reader. ``times`` is looked up at every read: the
    loader swaps in its own counters after the reader is built."""

    times: ReadTimes
    inner: list[tuple[int, ...]]
    whole_key: str | None  # a stripe stored as one chunk: its key is format(stripe)
    chunk_nbytes: int  # one stored chunk, decoded
    blocks_ok: bool  # chunks are lone blosc frames: they decode and fetch in part
    partial: PartialFetch
    partial_stats: PartialStats

    def chunk_parts(self, part: PartSpec | None) -> Parts | None: ...

    def chunk_key(self, coords: tuple[int, ...]) -> str: ...

    def keys(self, index: int) -> list[str]: ...

    def rows(self, index: int) -> slice: ...

    def place(self, data: bytes | memoryview | SparseFrame | None, inner: tuple[int, ...],
              out: np.ndarray, cp: ChunkPart | None = None) -> None: ...

    def place_all(self, datas: Placeable, out: np.ndarray, submitted: float | None = None,
                  parts: Parts | None = None) -> None: ...


class ReadPath(ABC):
    """How one stripe's stored chunks are fetched, once: the reader adds the retries and
    (but on the ``zarr`` path) the decoding. ``name`` is what ``StripeReader.mode`` shows."""

    name: ClassVar[str]
    groups_reads: ClassVar[bool] = False  # several stripes in one pool task (read_many)

    @abstractmethod
    async def read(self, stripes: Stripes, index: int, out: np.ndarray, loop: Loop,
                   pool: Executor, part: PartSpec | None = None) -> None:
        """Fill ``out`` with stripe ``index`` (``part`` of it: ``StripeReader``)."""

    @abstractmethod
    async def frames(self, stripes: Stripes, index: int, check: FrameCheck, loop: Loop,
                     pool: Executor) -> Frames:
        """Stripe ``index``'s stored chunks (``None``: never written), each ``check``-ed."""

    async def read_many(self, stripes: Stripes, indices: list[int], outs: list[np.ndarray],
                        loop: Loop, pool: Executor, part: PartSpec | None = None) -> None:
        """``read`` of several stripes in one pool task (only where ``groups_reads``)."""
        raise UsageTypeError(f"the {self.name!r} read path cannot group reads")

    async def frames_many(self, stripes: Stripes, indices: list[int], check: FrameCheck,
                          loop: Loop, pool: Executor) -> list[Frames]:
        """``frames`` of several stripes in one pool task (only where ``groups_reads``)."""
        raise UsageTypeError(f"the {self.name!r} read path cannot group reads")


def check_frames(check: FrameCheck, keys: list[str], datas: Frames) -> None:
    """``check`` every stored chunk of a stripe, as ``check_frame`` does (shared by the
    async paths, which check on the pool, not on the loop driving their gets)."""
    for key, data in zip(keys, datas, strict=True):
        check_frame(check, data, key)


def check_frame(check: FrameCheck, data: bytes | memoryview | None, key: str) -> None:
    """``check`` one stored chunk (``None``: never written, nothing to check); its
    ValueError becomes a ``ChunkDecodeError`` naming the key, so the reader retries it."""
    if data is None:
        return
    try:
        check(data)
    except ValueError as e:
        raise ChunkDecodeError(f"chunk {key!r}: {e}", key) from e

