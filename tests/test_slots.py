"""``memory/slots``: a split slot writes every part of a decoded sample where its placements
say, whether its parts are joined into one gather (adjacent channels, same dtype) or not;
the slot filler the decode threads and workers share decodes a stripe straight into the one
slot it fills whole, else into scratch, and copies every slot's row out."""

from __future__ import annotations

import numpy as np
import pytest

from insitubatch_nodes.memory.layout import Placement, row_view
from insitubatch_nodes.memory.slots import (
    SlotTable,
    SplitSlot,
    fill_slots,
    stripe_target,
    write_slot,
)

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


class Scratch:
    """A scratch provider that records what it handed out."""

    def __init__(self) -> None:
        self.given: list[np.ndarray] = []

    def __call__(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        self.given.append(np.full(shape, -1, dtype))
        return self.given[-1]


def test_a_one_sample_stripe_decodes_straight_into_the_slot_it_fills_whole():
    """One sample a stripe, a plain slot first: decoded into it (no scratch), copied into
    the other slots it feeds (a neighbour's history), the first left as decoded."""
    batch = np.zeros((3, 2, 4), "f4")
    dsts = [batch[1:2], batch[2:3]]
    scratch = Scratch()
    buf = stripe_target(dsts, (1, 2, 4), np.dtype("f4"), scratch)
    assert buf is dsts[0] and not scratch.given
    buf[...] = np.arange(8, dtype="f4").reshape(1, 2, 4)  # the decode
    fill_slots(buf, [0, 0], dsts)
    np.testing.assert_array_equal(batch[1], batch[2])
    np.testing.assert_array_equal(batch[2], np.arange(8).reshape(2, 4))
    assert not batch[0].any()


def test_several_samples_or_a_split_slot_decode_into_scratch_and_each_row_is_copied():
    rng = np.random.default_rng(2)
    # several samples a stripe: rows 3, 0 and 3 again into three plain slots
    batch = np.zeros((4, 5), "f4")
    dsts = [batch[0:1], batch[2:3], batch[3:4]]
    scratch = Scratch()
    buf = stripe_target(dsts, (4, 5), np.dtype("f4"), scratch)
    assert buf is scratch.given[0] and buf.shape == (4, 5)
    buf[...] = rng.standard_normal((4, 5))
    fill_slots(buf, [3, 0, 3], dsts)
    np.testing.assert_array_equal(batch, np.stack([buf[3], np.zeros(5), buf[0], buf[3]]))
    # one sample, but its slot takes levels 30, 2 and 17 of 37, in that order
    arrays = {"x": np.zeros((2, 3, 2), "f4")}
    where = parts_of([30]) + parts_of([2], start=1) + parts_of([17], start=2)
    slot = SlotTable([[where]]).slot(arrays, 0, 0, 1)
    assert isinstance(slot, SplitSlot)
    buf = stripe_target([slot], (1, 37, 2), np.dtype("f4"), scratch)
    assert buf is scratch.given[1]
    buf[...] = rng.standard_normal((1, 37, 2))
    fill_slots(buf, [0], [slot])
    np.testing.assert_array_equal(arrays["x"][1], buf[0, [30, 2, 17]])
    assert not arrays["x"][0].any()
