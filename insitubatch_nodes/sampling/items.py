"""The items that flow between the stages of the graph, in one leaf module.

Each stage imports the type it consumes from here, never from the stage that produces it,
so any stage can be swapped for another that yields the same item.

    SplitNode -> int -> ChunkPermuteNode -> ScheduledWindow -> ReadPlanNode -> ReadPlan
    -> AsyncFetchNode -> DecodedWindow | DecodedBatch -> ShuffleBufferNode -> BatchDraw
    -> GatherNode -> dict[str, Tensor] -> PinOrCudaNode

A window's stripes (``DecodedWindow``) are cut into batches and mixed by the shuffle buffer;
decoded in place, the plan already cut them (``plan.BatchSlots``), so the fetch yields each
batch (``DecodedBatch``) in plan order and the shuffle buffer passes it on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from .plan import ReadPlan
from .schedule import RankSchedule, WindowSpec


@dataclass(frozen=True, eq=False)
class ScheduledWindow:
    """One window of this rank's epoch schedule: its position in the schedule (``index``,
    which seeds nothing but names the plan), its chunks and draws (``spec``), and the whole
    schedule (where its draws land in the epoch's batches depends on its neighbours)."""

    index: int
    spec: WindowSpec
    schedule: RankSchedule

    @property
    def epoch(self) -> int:
        return self.spec.epoch

    @property
    def chunk_ids(self) -> np.ndarray:
        return self.spec.chunk_ids


@dataclass(frozen=True, eq=False)
class DecodedWindow:
    """A window's plan and its decoded stripes: ``arrays[v][stripe index] -> buffer``, a
    numpy array (CPU decode) or a device tensor (``decode="gpu"``)."""

    plan: ReadPlan
    arrays: tuple[dict[int, np.ndarray | torch.Tensor], ...]


class ArraysFuture(Protocol):
    """A batch's arrays by batch key, being written by the decode threads or workers:
    ``result()`` waits until every row has landed (raising the read's error if one
    failed, again at every ask), as ``concurrent.futures.Future.result`` does, and hands
    the arrays over once (the fetch's is a ``memory/arena.BatchFuture``).

    The rules for a stage of one's own that holds these futures:

    - A future is valid until the fetch is reset: a new epoch (``iter()``), a restore
      (``load_state_dict``), the rewind after an error, ``close()``. Batch numbers restart
      at a reset, so it names its generation: ``result()`` on a stale one raises
      ``memory.arena.StaleFuture`` (a ``StaleBatch``, a ``RuntimeError``), naming the
      batch and both generations, and never returns another batch's rows. Resolve futures
      before the reset, or drop them.
    - Futures of one generation may be resolved in any order: taking one hands over that
      batch only. A future never resolved keeps its batch's memory until the next reset.
    - ``result()`` hands the batch over once; asking again raises ``StaleFuture``.
    """

    def result(self) -> dict[str, np.ndarray]: ...


@dataclass(frozen=True, eq=False)
class DecodedBatch:
    """One batch decoded in place, yielded by the fetch in plan order as soon as every
    chunk it needs is submitted: its rows' sample indices (ascending: rows are sorted) and
    its arrays, still being written (``arrays.result()`` waits for them, row ``k`` holding
    sample ``sample_index[k]``). ``arrays`` is valid until the fetch is reset and may be
    resolved in any order among the batches yielded since (``ArraysFuture``)."""

    sample_index: np.ndarray
    arrays: ArraysFuture


@dataclass(frozen=True, eq=False)
class GatherPart:
    """Rows ``[start, stop)`` of a batch come from ``array`` at ``offsets`` (sample axis);
    ``array`` is a numpy stripe, or a device tensor when the window was decoded there."""

    array: np.ndarray | torch.Tensor
    offsets: np.ndarray
    start: int
    stop: int
    step: int = 0  # which step of a time-window sample (0 without windows)


@dataclass(frozen=True, eq=False)
class BatchDraw:
    """Which resident stripe and offset every row of a batch comes from, per variable.

    Rows are in ascending sample order, so each stripe's rows are one contiguous run of the
    batch for every variable and a gather is one ``np.take`` per stripe per variable.
    """

    sample_index: np.ndarray
    parts: tuple[tuple[GatherPart, ...], ...]
    # A batch decoded in place (``DecodedBatch.arrays``): its arrays by batch key, rows in
    # ``sample_index`` order, once written; then there is nothing to gather.
    ready: ArraysFuture | None = None
