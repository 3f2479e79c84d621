"""One variable's part of a batch slot, and the one slot filler: where a stripe decodes
(``stripe_target``) and how each slot's row is copied out of it (``fill_slots``,
``write_slot``). The decode threads (``fetch.jobs``) and the decode workers
(``workers.child``) run the same functions, so they execute the same (selection in the
decoded chunk -> selection in the batch) pairs.

A variable that fills its whole slot in the batch's dtype is decoded straight into it (the
slot is a plain array); one split across channels (some levels of an ARCO-ERA5 variable,
an anemoi variable subset) or converted to the stacked key's dtype is decoded once into
scratch and each of its parts copied out (``SplitSlot``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from .layout import Placement, row_view

# (batch key, time-step column or None, placement): one part of a variable's slot
Part = tuple[str, "int | None", Placement]
# every part one variable's step fills in a batch row, in placement order
SlotWhere = tuple[Part, ...]


def is_direct(where: SlotWhere) -> bool:
    """The variable fills its slot whole and in its own dtype: decode straight into it."""
    return len(where) == 1 and where[0][2].whole


def part_view(arrays: dict[str, np.ndarray], part: Part, row: int) -> np.ndarray:
    """The view of batch row ``row`` (a leading axis of 1 kept) that ``part`` fills."""
    key, col, pl = part
    rows = arrays[key][row : row + 1]
    return row_view(rows if col is None else rows[:, col], pl)


@dataclass(frozen=True, eq=False, slots=True)
class SplitSlot:
    """A slot fed from part of a decoded sample: per placement (or run of placements into
    adjacent channels, ``joined``), the batch view it fills and the levels (or anemoi
    variables) of the sample it takes; written with a dtype cast where the stacked key is
    wider than the variable (float32 into float64 channels)."""

    views: tuple[np.ndarray, ...]
    levels: tuple[slice | np.ndarray | None, ...]

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in self.views)

    def fill(self, sample: np.ndarray) -> None:
        """Write ``sample`` (one decoded sample, leading axis of 1) into every view."""
        for dst, lv in zip(self.views, self.levels, strict=True):
            if isinstance(lv, np.ndarray):
                # one C call for the run; "clip" writes into ``out`` directly ("raise"
                # buffers it), and the indices are in range by construction
                np.take(sample, lv, axis=1, out=dst, mode="clip")
            else:
                np.copyto(dst, sample if lv is None else sample[:, lv], casting="unsafe")


Slot = np.ndarray | SplitSlot
# a split ``SlotWhere``'s parts, runs of them into adjacent channels joined (``joined``)
Runs = tuple[tuple[Part, "slice | np.ndarray | None"], ...]


def joined(where: SlotWhere) -> Runs:
    """``where``'s parts, each run of them that fills adjacent channels of one key in the
    variable's dtype joined into one part and the level indices it gathers. GraphCast's
    13 of ARCO-ERA5's 37 levels are 12 parts (two levels adjacent) into 13 adjacent
    channels: one copy call per sample instead of twelve."""
    runs: list[tuple[Part, slice | np.ndarray | None]] = []
    for part in where:
        pl = part[2]
        if runs and _joins(runs[-1], part):
            (key, col, prev), lv = runs[-1]
            assert isinstance(prev.channel, slice) and isinstance(pl.channel, slice)
            assert pl.levels is not None and lv is not None
            idx = np.concatenate([_indices(lv), _indices(pl.levels)])
            # the run's view: its channels (``levels`` unused: the indices say which)
            runs[-1] = ((key, col, Placement(key, slice(prev.channel.start, pl.channel.stop),
                                             None, False)), idx)
        else:
            runs.append((part, pl.levels))
    return tuple(runs)


def _joins(run: tuple[Part, slice | np.ndarray | None], part: Part) -> bool:
    """``part`` fills the channels right after ``run``'s, of the same key and time-step
    column, both from some levels, neither converting dtype: one gather fills both."""
    (key, col, a), lv = run
    b = part[2]
    return (part[0] == key and part[1] == col and not a.cast and not b.cast
            and lv is not None and (not isinstance(lv, slice) or lv.step in (None, 1))
            and isinstance(a.channel, slice) and isinstance(b.channel, slice)
            and a.channel.step in (None, 1) and b.channel.step in (None, 1)
            and a.channel.stop == b.channel.start and b.levels is not None
            and b.levels.step in (None, 1))


def _indices(levels: slice | np.ndarray | None) -> np.ndarray:
    """A run's level indices so far (a slice of step 1, or indices already)."""
    if isinstance(levels, np.ndarray):
        return levels
    assert levels is not None and levels.step in (None, 1)
    return np.arange(levels.start, levels.stop)


class SlotTable:
    """Per variable and time step, where a decoded sample goes (``where[v][k]``, a
    ``SlotWhere``), each split one's runs joined once when the table is made (a table per
    loader: the arena's, a worker's), not per slot written."""

    __slots__ = ("where", "_runs")

    def __init__(self, where: Sequence[Sequence[SlotWhere]]) -> None:
        self.where = tuple(tuple(per_step) for per_step in where)
        self._runs: tuple[tuple[Runs | None, ...], ...] = tuple(
            tuple(None if is_direct(w) else joined(w) for w in per_step)
            for per_step in self.where)

    def slot(self, arrays: dict[str, np.ndarray], v: int, k: int, row: int) -> Slot:
        """Where variable ``v``'s step ``k`` of batch row ``row`` goes: the array itself when
        it is decoded straight into the batch, else a ``SplitSlot`` of its joined parts."""
        runs = self._runs[v][k]
        if runs is None:
            return part_view(arrays, self.where[v][k][0], row)
        return SplitSlot(tuple(part_view(arrays, p, row) for p, _ in runs),
                         tuple(lv for _, lv in runs))


def write_slot(dst: Slot, sample: np.ndarray) -> None:
    """Copy one decoded sample (leading axis of 1) into its slot."""
    if isinstance(dst, SplitSlot):
        dst.fill(sample)
    else:
        np.copyto(dst, sample)


def stripe_target(dsts: Sequence[Slot], shape: tuple[int, ...], dtype: np.dtype,
                  scratch: Callable[[tuple[int, ...], np.dtype], np.ndarray]) -> np.ndarray:
    """Where a stripe of ``shape`` and ``dtype`` filling slots ``dsts`` decodes: straight
    into its first slot when the stripe is one sample and that slot a plain array (the
    variable fills it whole in its own dtype, ``is_direct``); else ``scratch(shape,
    dtype)`` (a thread's reused buffer, or a fresh one), each slot's row copied out of it
    afterwards (``fill_slots``)."""
    first = dsts[0]
    if shape[0] == 1 and isinstance(first, np.ndarray):
        return first
    return scratch(shape, dtype)


def fill_slots(stripe: np.ndarray, rows: Iterable[int], dsts: Sequence[Slot]) -> None:
    """Copy row ``rows[k]`` of the decoded ``stripe`` into slot ``dsts[k]``; the slot the
    stripe was decoded into (``stripe_target``) holds it already."""
    for r, dst in zip(rows, dsts, strict=True):
        if dst is not stripe:
            write_slot(dst, stripe[r : r + 1])
