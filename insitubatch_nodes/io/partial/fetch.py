"""Fetching part of a blosc chunk from an object store: header and offsets, then the blocks.

One ranged GET of the header and block offsets (16 + 4 x blocks bytes; the first chunk of an
array guesses ``head_guess`` and fetches the rest if short, later ones ask exactly), then the
needed blocks' byte ranges in a few more GETs at once (obstore's ``get_ranges``, not
coalesced by obstore: it would fill gaps of up to 1 MiB). A chunk whose frame cannot be read
in part is completed with one more GET of the rest. Whether the second round trip pays is
decided per array and selection (``PartialRule``) and counted in ``PartialStats``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from ...metrics.counters import PartialStats
from .. import blosc2_lib
from .blocks import (
    MAX_BLOCK_FRACTION,
    BlockPlan,
    FrameHeader,
    Whole,
    coalesce,
    parse_header,
    plan_frame,
    stored_size,
)
from .ranges import Ranges
from .sparse import SparseFrame

Data = bytes | memoryview


@dataclass(frozen=True)
class PartialRule:
    """When an object-store chunk is fetched in part rather than whole, per array and
    selection:

    - never when the selection touches more than ``max_block_fraction`` of the blocks;
    - the needed blocks come in at most ``max_requests`` ranged GETs (the smallest gaps
      between them filled): obstore runs 10 at once and starts the rest as those end, so
      they overlap; at 8, GraphCast's 13 ARCO-ERA5 levels (12 runs of blocks) filled four
      one-level gaps and fetched 0.50 of the frame's bytes instead of 0.40
      (``benchmarks.bench_levels --grid 0.25 --s3``);
    - the extra round trip must pay: the bytes saved per chunk must be at least
      ``min_saved_bytes``, or where that is ``None``, what the link moves in one round
      trip, measured on the array's first ``trials`` partial fetches (the header GET's
      time, all latency, times the blocks' bytes per second once that latency is taken
      off). Bandwidth-bound (many reads in flight) any saved byte is a gain; latency-bound
      a chunk in part costs a round trip more and gains the saved bytes' transfer time:
      the rule takes the stricter case. A selection found not to pay is fetched whole
      from then on (one GET, decoded in part still).
    """

    max_block_fraction: float = MAX_BLOCK_FRACTION
    max_requests: int = 16
    min_saved_bytes: int | None = None
    trials: int = 4
    head_guess: int = 8192


class RangeGets(Protocol):
    """What a store offers partial fetches (``async_gets.ObjectStoreGets``)."""

    async def get(self, key: str) -> Data | None: ...

    async def get_range(self, key: str, start: int, end: int) -> Data | None: ...

    async def get_ranges(self, key: str, ranges: Ranges) -> list[Data]: ...


@dataclass
class _Trials:
    """One selection's first partial fetches, timed (``PartialRule``'s measured rule)."""

    n: int = 0
    head_s: float = 0.0
    runs_s: float = 0.0
    run_bytes: int = 0
    saved: int = 0
    unreadable: int = 0  # frames that could not be read in part (their header)

    def verdict(self) -> bool:
        """The saved bytes per chunk are at least one round trip's worth on this link."""
        latency = self.head_s / self.n
        moving = max(self.runs_s - self.head_s, 1e-6)  # the blocks' time less its latency
        return self.saved / self.n >= latency * self.run_bytes / moving


@dataclass
class PartialFetch:
    """One array's partial fetches: per selection (the wanted byte ranges of a chunk)
    whether they pay, and the size of its frames' headers. Used on the event loop only."""

    rule: PartialRule = field(default_factory=PartialRule)
    stats: PartialStats = field(default_factory=PartialStats)
    _pays: dict[Ranges, bool] = field(default_factory=dict)
    _trials: dict[Ranges, _Trials] = field(default_factory=dict)
    _head: int = 0

    def pays(self, wanted: Ranges) -> bool | None:
        """Whether reading ``wanted`` in part was found to pay (``None``: not decided)."""
        return self._pays.get(wanted)

    async def fetch(self, gets: RangeGets, key: str, nbytes: int, wanted: Ranges,
                    known: SparseFrame | None = None) -> Data | SparseFrame | None:
        """Chunk ``key`` (``nbytes`` decoded): its whole frame, or the parts holding the
        decoded byte ranges ``wanted`` (with ``known``'s, parts from the chunk cache), or
        ``None`` if it was never written."""
        if blosc2_lib.load() is None or self._pays.get(wanted) is False:
            return await self._whole(gets, key)
        t0 = time.perf_counter()
        head: Data | None
        if known is not None:
            head = known.head()
        else:
            head = await gets.get_range(key, 0, self._head or self.rule.head_guess)
            if head is None:
                return None
        head, header = await self._complete_head(gets, key, head, nbytes)
        if isinstance(header, Whole):
            self._unreadable(wanted)
            return await self._rest(gets, key, head, stored_size(head, nbytes),
                                    known is not None)
        if len(head) >= header.cbytes:  # a small frame came whole with the guess
            self.stats.fetched(False, len(head), header.cbytes)
            return head
        plan = plan_frame(head, nbytes, wanted, self.rule.max_block_fraction)
        if isinstance(plan, Whole):
            self._pays[wanted] = False
            return await self._rest(gets, key, head, header.cbytes, known is not None)
        head_s = time.perf_counter() - t0
        return await self._blocks(gets, key, head, plan, wanted, known, head_s)

    async def _complete_head(self, gets: RangeGets, key: str, head: Data,
                             nbytes: int) -> tuple[Data, FrameHeader | Whole]:
        """The header and every block offset, fetching the rest of them if the guess was
        short; and the parsed header (or ``Whole``)."""
        header = parse_header(head, nbytes)
        if isinstance(header, Whole):
            return head, header
        self._head = header.head_bytes
        if len(head) < header.head_bytes:
            more = await gets.get_range(key, len(head), header.head_bytes)
            head = bytes(head) + bytes(more or b"")  # counted with the chunk's bytes
        return head, header

    async def _whole(self, gets: RangeGets, key: str) -> Data | None:
        data = await gets.get(key)
        if data is not None:
            self.stats.fetched(False, len(data), len(data))
        return data

    async def _rest(self, gets: RangeGets, key: str, head: Data, cbytes: int | None,
                    cached_head: bool) -> Data | None:
        """The whole frame, ``head`` being its start: the rest in one more GET (all of it
        again where the frame's size is not known for sure or the head came from the
        cache: a damaged header is found by the whole-frame decode as it always was)."""
        if cbytes is None or cached_head:
            return await self._whole(gets, key)
        rest = await gets.get_range(key, len(head), cbytes) if cbytes > len(head) else b""
        data = bytes(head) + bytes(rest or b"")
        self.stats.fetched(False, len(data), cbytes)
        return data

    async def _blocks(self, gets: RangeGets, key: str, head: Data, plan: BlockPlan,
                      wanted: Ranges, known: SparseFrame | None,
                      head_s: float) -> SparseFrame:
        """The needed blocks (those ``known`` lacks) as a sparse frame; times the first
        fetches of a selection for ``PartialRule``."""
        frame = known or SparseFrame(plan.header.cbytes, ((0, head),))
        want = frame.missing(plan.spans)
        runs = coalesce(want, self.rule.max_requests)
        t0 = time.perf_counter()
        datas = await gets.get_ranges(key, runs) if runs else []
        runs_s = time.perf_counter() - t0
        got = sum(len(d) for d in datas)
        fetched = got + (0 if known is not None else len(head))
        frame = frame.with_pieces([(s, d) for (s, _), d in zip(runs, datas, strict=True)])
        self.stats.fetched(True, fetched, plan.header.cbytes)
        if wanted not in self._pays and known is None:
            self._judge(wanted, plan, head_s, runs_s, got, fetched)
        return frame

    def _unreadable(self, wanted: Ranges) -> None:
        """A frame whose header forbids a partial read (damaged, stored uncompressed, not
        c-blosc 1's): one alone says nothing of the array, but ``trials`` of them before any
        frame could be read in part mean its frames are all so: whole from then on."""
        t = self._trials.setdefault(wanted, _Trials())
        t.unreadable += 1
        if t.unreadable >= self.rule.trials and t.n == 0 and wanted not in self._pays:
            self._pays[wanted] = False

    def _judge(self, wanted: Ranges, plan: BlockPlan, head_s: float, runs_s: float,
               run_bytes: int, fetched: int) -> None:
        saved = plan.header.cbytes - fetched
        if self.rule.min_saved_bytes is not None:
            self._pays[wanted] = saved >= self.rule.min_saved_bytes
            return
        t = self._trials.setdefault(wanted, _Trials())
        t.n += 1
        t.head_s += head_s
        t.runs_s += runs_s
        t.run_bytes += run_bytes
        t.saved += saved
        if t.n >= self.rule.trials:
            self._pays[wanted] = t.verdict()
            del self._trials[wanted]

