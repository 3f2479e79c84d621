"""What a reader made of other readers (a composed variable's members, a cut's stored
array) answers by asking them: counters, cache, read path, partial-read rule."""

from __future__ import annotations

from typing import Any

from ...metrics.counters import ReadTimes
from ..chunk_cache import ChunkCache
from ..partial.fetch import PartialRule


class WrappedReader:
    """The readers in ``inner`` do the reads; this one answers for them all."""

    def __init__(self, inner: list[Any]) -> None:
        self.inner = inner
        self.times = ReadTimes()

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
