"""``memory/slots``: a split slot writes every part of a decoded sample where its placements
say, whether its parts are joined into one gather (adjacent channels, same dtype) or not."""

from __future__ import annotations

import numpy as np
import pytest

from insitubatch_nodes.memory.layout import Placement, row_view
from insitubatch_nodes.memory.slots import SlotTable, SplitSlot, write_slot

LEVELS = [8, 10, 12, 14, 16, 17, 19, 21, 23, 25, 30, 33, 36]  # GraphCast's in ARCO-ERA5's 37


def parts_of(levels: list[int], key: str = "x", col: int | None = None, start: int = 0,
             cast: bool = False) -> tuple:
    """One part per level, adjacent levels in adjacent channels joined as ``build_layout``
    joins them."""
    out: list = []
    for c, lv in enumerate(levels, start):
        prev = out[-1][2] if out else None
        if prev is not None and prev.levels.stop == lv and prev.channel.stop == c:
            out[-1] = (key, col, Placement(key, slice(prev.channel.start, c + 1),
                                           slice(prev.levels.start, lv + 1), cast))
        else:
            out.append((key, col, Placement(key, slice(c, c + 1), slice(lv, lv + 1), cast)))
    return tuple(out)


def expected(arrays: dict[str, np.ndarray], where: tuple, row: int,
             sample: np.ndarray) -> dict[str, np.ndarray]:
    """What writing ``sample`` part by part (no joining) gives."""
    want = {k: a.copy() for k, a in arrays.items()}
    for key, col, pl in where:
        rows = want[key][row:row + 1]
        np.copyto(row_view(rows if col is None else rows[:, col], pl), sample[:, pl.levels],
                  casting="unsafe")
    return want


@pytest.mark.parametrize("col", [None, 1])
def test_adjacent_channels_fill_in_one_gather_as_part_by_part(col):
    sample = np.random.default_rng(0).standard_normal((1, 37, 3, 4)).astype("f4")
    shape = (4, 13, 3, 4) if col is None else (4, 2, 13, 3, 4)
    arrays = {"x": np.zeros(shape, "f4")}
    where = parts_of(LEVELS, col=col)
    assert len(where) == 12  # 16 and 17 share a part
    want = expected(arrays, where, 2, sample)
    slot = SlotTable([[where]]).slot(arrays, 0, 0, 2)
    assert isinstance(slot, SplitSlot) and len(slot.views) == 1  # one run of 13 channels
    write_slot(slot, sample)
    np.testing.assert_array_equal(arrays["x"], want["x"])


@pytest.mark.parametrize(("dtype", "cast", "views"), [("f8", True, 4), ("f4", False, 2)])
def test_parts_that_cast_or_skip_channels_are_written_on_their_own(dtype, cast, views):
    """float32 levels into float64 channels convert part by part; a gap in the channels
    (4, 5 after 0, 1) starts a new run."""
    sample = np.random.default_rng(1).standard_normal((1, 37, 3, 4)).astype("f4")
    arrays = {"x": np.zeros((2, 20, 3, 4), dtype)}
    where = parts_of([3, 5], cast=cast) + parts_of([7, 9], start=4, cast=cast)
    want = expected(arrays, where, 1, sample)
    slot = SlotTable([[where]]).slot(arrays, 0, 0, 1)
    assert isinstance(slot, SplitSlot) and len(slot.views) == views
    write_slot(slot, sample)
    np.testing.assert_array_equal(arrays["x"], want["x"])


def test_a_run_stops_at_another_key_and_a_table_joins_its_runs_once():
    sample = np.arange(37 * 6, dtype="f4").reshape(1, 37, 2, 3)
    arrays = {"a": np.zeros((1, 2, 2, 3), "f4"), "b": np.zeros((1, 2, 2, 3), "f4")}
    where = parts_of([0, 5], key="a") + parts_of([9, 11], key="b")
    want = expected(arrays, where, 0, sample)
    table = SlotTable([[where]])
    first = table.slot(arrays, 0, 0, 0)
    assert isinstance(first, SplitSlot) and len(first.views) == 2
    again = table.slot(arrays, 0, 0, 0)
    assert all(x is y for x, y in zip(first.levels, again.levels, strict=True))  # joined once
    write_slot(again, sample)
    for k in arrays:
        np.testing.assert_array_equal(arrays[k], want[k])
