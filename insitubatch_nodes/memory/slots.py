"""One variable's part of a batch slot, and the one function that writes a decoded sample
into it: the decode threads (``fetch.jobs``) and the decode workers (``workers.child``)
execute the same (selection in the decoded chunk -> selection in the batch) pairs.

A variable that fills its whole slot in the batch's dtype is decoded straight into it (the
slot is a plain array); one split across channels (some levels of an ARCO-ERA5 variable,
an anemoi variable subset) or converted to the stacked key's dtype is decoded once into
scratch and each of its parts copied out (``SplitSlot``).
"""

from __future__ import annotations

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
    """A slot fed from part of a decoded sample: per placement, the batch view it fills and
    the levels (or anemoi variables) of the sample it takes; written with a dtype cast
    where the stacked key is wider than the variable (float32 into float64 channels)."""

    views: tuple[np.ndarray, ...]
    levels: tuple[slice | None, ...]

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in self.views)

    def fill(self, sample: np.ndarray) -> None:
        """Write ``sample`` (one decoded sample, leading axis of 1) into every view."""
        for dst, lv in zip(self.views, self.levels, strict=True):
            np.copyto(dst, sample if lv is None else sample[:, lv], casting="unsafe")


Slot = np.ndarray | SplitSlot


def slot_of(arrays: dict[str, np.ndarray], where: SlotWhere, row: int) -> Slot:
    """Where one variable's step of batch row ``row`` goes: the array itself when it is
    decoded straight into the batch, else a ``SplitSlot`` of its parts."""
    if is_direct(where):
        return part_view(arrays, where[0], row)
    return SplitSlot(tuple(part_view(arrays, p, row) for p in where),
                     tuple(p[2].levels for p in where))


def write_slot(dst: Slot, sample: np.ndarray) -> None:
    """Copy one decoded sample (leading axis of 1) into its slot."""
    if isinstance(dst, SplitSlot):
        dst.fill(sample)
    else:
        np.copyto(dst, sample)

