"""A sample's time steps: an anchor step with history before it and leads after.

Pure index math. ``SampleWindow(history=2, lead=(1, 6), stride=1)`` makes the sample at
anchor ``t`` the inputs ``t-1, t`` and the targets ``t+1, t+6``; only anchors whose whole
window lies on the axis are samples, and exactly-once applies to anchors.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError
from .geometry import SampleGrid


@dataclass(frozen=True)
class SampleWindow:
    """Inputs at ``t - (history-1)*stride, ..., t`` and targets at ``t + l*stride``."""

    history: int = 1
    lead: tuple[int, ...] = ()
    stride: int = 1

    def __post_init__(self) -> None:
        def whole(x: object) -> bool:  # a step count: an int, not a float or a bool
            return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))

        for name in ("history", "stride"):
            value = getattr(self, name)
            if not whole(value) or value < 1:
                raise ConfigError(f"SampleWindow {name} must be an integer >= 1 (steps), got "
                                 f"{value!r}")
            object.__setattr__(self, name, int(value))
        given: object = self.lead  # as the caller wrote it: checked here
        if whole(given):
            given = (given,)
        if isinstance(given, (str, bytes)) or not isinstance(given, Sequence | np.ndarray):
            raise ConfigError(f"SampleWindow lead must be a step count or a sequence of them "
                             f"(e.g. (1, 6)), got {given!r}")
        lead = tuple(given)
        if (not all(whole(x) and x >= 1 for x in lead)) or len(set(lead)) != len(lead):
            raise ConfigError(f"SampleWindow leads must be distinct integers >= 1, got {lead!r}")
        object.__setattr__(self, "lead", tuple(int(x) for x in lead))

    @property
    def input_offsets(self) -> np.ndarray:
        return np.arange(-(self.history - 1), 1, dtype=np.int64) * self.stride

    @property
    def target_offsets(self) -> np.ndarray:
        return np.asarray(self.lead, dtype=np.int64) * self.stride

    @property
    def offsets(self) -> np.ndarray:
        """Every step a sample reads, relative to its anchor: inputs, then targets."""
        return np.concatenate([self.input_offsets, self.target_offsets])

    @property
    def before(self) -> int:
        return (self.history - 1) * self.stride

    @property
    def after(self) -> int:
        return max(self.lead, default=0) * self.stride

    @property
    def span(self) -> int:
        """Steps from the first input to the last target, inclusive."""
        return self.before + self.after + 1

    @property
    def is_single_step(self) -> bool:
        return self.history == 1 and not self.lead

    def grid(self, grid: SampleGrid) -> SampleGrid:
        """The same chunk grid, with only complete windows' anchors as samples."""
        return grid.with_valid(self.before, grid.n_samples - self.after)


def chunks_touching(missing: Sequence[int], grid: SampleGrid,
                    steps: SampleWindow | None = None) -> np.ndarray:
    """The chunk ids holding a sample (an anchor, with ``steps``) whose time steps (the ones
    it reads) include a ``missing`` one, ascending: leaving them out of a split keeps every
    served sample off the missing steps. Whole chunks go: a chunk is the unit of a split
    (anemoi stores hold one date each)."""
    if len(missing) == 0:
        return np.empty(0, dtype=np.int64)
    offsets = np.zeros(1, np.int64) if steps is None else steps.offsets
    m = np.asarray(missing, dtype=np.int64)
    # anchor a reads m when a + o == m for one of its offsets o (the steps it reads, not
    # every step of its span: with a stride or sparse leads most of the span is not read)
    anchors = (m[:, None] - offsets[None, :]).ravel()
    valid = grid if steps is None else steps.grid(grid)  # anchors whose window fits
    anchors = anchors[(anchors >= valid.first) & (anchors < valid.end)]
    return np.unique(anchors // grid.chunk_size)


def chunks_across_gaps(coord: np.ndarray | None, grid: SampleGrid,
                       steps: SampleWindow) -> np.ndarray:
    """The chunk ids holding an anchor whose time steps are not evenly spaced in the sample
    coordinate ``coord``, ascending: a step a store never wrote, or one an inner join left
    out because a member lacks it, would put other times into a window (a 12-hour gap read
    as 6 hours). The step is the smallest difference; a coordinate whose differences are
    not all whole multiples of it (calendar months) has no gaps to find. Whole chunks go,
    as for missing steps."""
    none = np.empty(0, dtype=np.int64)
    if coord is None or coord.size < 2 or steps.span == 1 or coord.dtype.kind not in "Mmfiu":
        return none
    diffs = np.diff(coord)
    zero = diffs.dtype.type(0)
    if (diffs < zero).all():  # a decreasing axis: its steps as well
        diffs = -diffs
    if unordered_at(coord) is not None:
        return none  # refused by the caller, naming where (``unordered_at``)
    ratio = (diffs / diffs.min()).astype(np.float64)
    k = np.round(ratio)
    if not np.allclose(ratio, k, rtol=0, atol=1e-6) or (k == 1).all():
        return none  # irregular by nature, or regular
    at = np.concatenate([[0], np.cumsum(k.astype(np.int64))])  # each sample, in steps
    valid = steps.grid(grid)
    anchors = np.arange(valid.first, valid.end, dtype=np.int64)
    bad = np.zeros(anchors.size, dtype=bool)
    for o in steps.offsets.tolist():
        bad |= at[anchors + o] - at[anchors] != o
    return np.unique(anchors[bad] // grid.chunk_size)


def unordered_at(coord: np.ndarray | None) -> int | None:
    """The first index ``i`` where a numeric or datetime sample coordinate stops moving one
    way (``coord[i + 1]`` equal to ``coord[i]``, or turning back), or ``None``: a time window
    counts steps along the axis, so a date written twice or out of order puts other times
    into it."""
    if coord is None or coord.size < 2 or coord.dtype.kind not in "Mmfiu":
        return None
    diffs = np.diff(coord)
    zero = diffs.dtype.type(0)
    way = diffs > zero if diffs[0] > zero else diffs < zero
    bad = np.flatnonzero(~way)
    return int(bad[0]) if bad.size else None


def chunks_reaching(chunk_ids: np.ndarray, others: np.ndarray, grid: SampleGrid,
                    steps: SampleWindow) -> np.ndarray:
    """Those of ``chunk_ids`` (one split's) holding an anchor whose time steps (those it
    reads: its offsets, not its whole span) reach a chunk of ``others`` (the other
    splits'), ascending: a window read across a split boundary puts one split's steps into
    another's inputs or targets. Chunks of no split (a gap) may be read. Whole chunks go, as
    for missing steps."""
    ids = np.asarray(chunk_ids, dtype=np.int64)
    if ids.size == 0 or len(others) == 0 or steps.span == 1:
        return np.empty(0, dtype=np.int64)
    n_chunks = -(-grid.n_samples // grid.chunk_size)
    taken = np.zeros(n_chunks + 1, dtype=np.int64)
    taken[np.asarray(others, dtype=np.int64) + 1] = 1
    taken = np.cumsum(taken)  # taken[k]: chunks of other splits before chunk k
    first = np.maximum(ids * grid.chunk_size, grid.first)  # the chunk's anchors
    last = np.minimum((ids + 1) * grid.chunk_size, grid.end) - 1
    hit = np.zeros(ids.size, dtype=bool)
    for o in steps.offsets.tolist():  # the steps read at offset o: first+o .. last+o
        lo = np.clip(first + o, 0, grid.n_samples - 1) // grid.chunk_size
        hi = np.clip(last + o, 0, grid.n_samples - 1) // grid.chunk_size
        hit |= taken[hi + 1] - taken[lo] > 0
    return ids[hit & (last >= first)]


HALO_SHARE = 0.25  # at most this much extra reading for the halos of a run, by default


def default_run_chunks(steps: SampleWindow, chunk_size: int) -> int:
    """Chunks per contiguous run so that reading its halo (the chunks before and after it
    that its samples' steps reach into) adds at most ``HALO_SHARE`` to the run's reads: the
    run must be long for the halo, the window need not be (it holds several runs)."""
    halo = -(-steps.before // chunk_size) + -(-steps.after // chunk_size)
    return max(1, int(np.ceil(halo / HALO_SHARE)))


def steps_keyword(steps: SampleWindow | None, window: SampleWindow | None, where: str,
                  stacklevel: int = 3) -> SampleWindow | None:
    """``steps=``, the sample's time steps, given either by that name or by its old one,
    ``window=`` (deprecated: a ``DeprecationWarning`` naming ``steps=``; "window" is the
    shuffle window, ``block_chunks`` chunks). Both at once is a ``ConfigError``."""
    if window is None:
        return steps
    if steps is not None:
        raise ConfigError(f"{where} got both steps={steps!r} and window={window!r}: window= is "
                          "the old name of steps= (a sample's time steps); give steps= only")
    warnings.warn(f"{where}(window=...) is deprecated: give the sample's time steps as "
                  "steps=ib.SampleWindow(...) (a window is the shuffle window, block_chunks "
                  "chunks)", DeprecationWarning, stacklevel=stacklevel)
    return window
