"""What a reader made of other readers (a composed variable's members, a cut's stored
array) answers by asking them: counters, cache, read path, partial-read rule; and the
calls every such reader makes of its own two reads (``read_local_retrying``, ``read``)."""

from __future__ import annotations

import abc
import asyncio
from concurrent.futures import Executor
from typing import Any

import numpy as np

from ...errors import UsageTypeError
from ...metrics.counters import ReadTimes
from ...sampling.geometry import VariableGeometry
from ..chunk_cache import ChunkCache
from ..partial.fetch import PartialRule
from ..partial.ranges import PartSpec
from ..read_paths import FrameCheck, Frames
from ..retry import NO_RETRY, RetryPolicy


class WrappedReader(abc.ABC):
    """The readers in ``inner`` do the reads; this one answers for them all. ``KIND``
    says what the variable is, for the GPU decoder's refusal."""

    KIND = ""

    def __init__(self, inner: list[Any], geom: VariableGeometry, source_url: str) -> None:
        self.inner = inner
        self.geom = geom
        self.source_url = source_url
        self.times = ReadTimes()

    @abc.abstractmethod
    def read_local_retrying(self, indices: list[int], outs: list[np.ndarray],
                            retry: RetryPolicy = NO_RETRY,
                            submitted: float | None = None, *,
                            part: PartSpec | None = None) -> int:
        """Stripes ``indices`` into ``outs`` on this (pool) thread; returns attempts."""

    @abc.abstractmethod
    async def read(self, index: int, out: np.ndarray, loop: asyncio.AbstractEventLoop,
                   pool: Executor, retry: RetryPolicy = NO_RETRY, *,
                   part: PartSpec | None = None) -> int:
        """Stripe ``index`` into ``out`` on the event loop; returns attempts."""

    def read_local(self, index: int, out: np.ndarray, submitted: float | None = None, *,
                   part: PartSpec | None = None) -> None:
        self.read_local_retrying([index], [out], NO_RETRY, submitted, part=part)

    def read_local_many(self, indices: list[int], outs: list[np.ndarray],
                        submitted: float | None = None, *,
                        part: PartSpec | None = None) -> None:
        self.read_local_retrying(indices, outs, NO_RETRY, submitted, part=part)

    async def read_group(self, indices: list[int], outs: list[np.ndarray],
                         loop: asyncio.AbstractEventLoop, pool: Executor,
                         retry: RetryPolicy = NO_RETRY, *,
                         part: PartSpec | None = None) -> int:
        attempts = 0
        for index, out in zip(indices, outs, strict=True):
            attempts += await self.read(index, out, loop, pool, retry, part=part)
        return attempts

    async def read_frames(self, indices: list[int], check: FrameCheck,
                          loop: asyncio.AbstractEventLoop, pool: Executor,
                          retry: RetryPolicy = NO_RETRY) -> tuple[list[Frames], int]:
        raise UsageTypeError(f"variable {self.geom.name!r} of {self.source_url} is "
                             f"{self.KIND}, which the GPU decoder does not read: build the "
                             "loader with decode='cpu'")

    def count_into(self, times: ReadTimes) -> None:
        self.times = times
        for r in self.inner:
            r.count_into(times)

    def use_cache(self, cache: ChunkCache, snapshot_id: str | None = None) -> None:
        for r in self.inner:
            r.use_cache(cache, snapshot_id)

    @property
    def partial_rule(self) -> PartialRule:
        rule: PartialRule = self.inner[0].partial_rule
        return rule

    @partial_rule.setter
    def partial_rule(self, rule: PartialRule) -> None:
        for r in self.inner:
            r.partial_rule = rule

    @property
    def mode(self) -> str:
        modes = sorted({str(r.mode) for r in self.inner})
        return modes[0] if len(modes) == 1 else "+".join(modes)

    @property
    def groups_reads(self) -> bool:
        return all(r.groups_reads for r in self.inner)

    @property
    def reads_cache(self) -> bool:
        return all(r.reads_cache for r in self.inner)

    @property
    def chunk_nbytes(self) -> int:
        return max(int(r.chunk_nbytes) for r in self.inner)
