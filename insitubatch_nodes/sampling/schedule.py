"""Epoch schedules: which windows each rank serves, equal step counts, elastic remainders.

Everything here is a pure function of (split, seed, epoch, world size, resume history), so
a rank computes every other rank's share without talking to it, and a loader state needs
only counters.

Generation 0 of an epoch deals the epoch's global chunk order (independent of the world
size) round-robin to the ranks and cuts each share into windows of ``block_chunks``. An
*elastic* resume merges the progress of all ranks (window index and draws taken in it) and
starts generation k+1: the undrawn tails of partly drawn windows, then the chunks of untouched
windows back in the epoch's global order, are laid end to end and cut into one run per new
rank, the runs' sample counts differing by at most one. So over one epoch no sample is lost
and none repeats, whatever the world sizes before and after and wherever the epoch stopped,
and every new rank has work (equal steps cost at most one padded sample per rank).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from ..errors import ConfigError, StateError
from .geometry import SampleGrid, VariableGeometry
from .permute import DRAW_STREAM, epoch_chunk_order, rank_share, seeded_rng
from .plan import BatchSlots, ReadPlan

UNEVEN_POLICIES: tuple[str, ...] = ("pad", "drop", "none")
_PAD_STREAM = 0x9A


@dataclass(frozen=True)
class Progress:
    """How far one rank got in one generation: windows finished, draws taken in the next."""

    window: int
    offset: int


@dataclass(frozen=True)
class Resumption:
    """An elastic resume: the world size before it and every old rank's progress."""

    world_size: int
    progress: tuple[Progress, ...]

    def to_json(self) -> list:
        return [self.world_size, [[p.window, p.offset] for p in self.progress]]

    @classmethod
    def from_json(cls, obj: Sequence) -> Resumption:
        return cls(int(obj[0]), tuple(Progress(int(w), int(o)) for w, o in obj[1]))


@dataclass(frozen=True, eq=False)
class ScheduleContext:
    """What every schedule of a loader depends on besides epoch, rank and history."""

    chunk_ids: np.ndarray  # the split's chunks, canonical order
    grid: SampleGrid
    seed: int
    block_chunks: int
    uneven: str = "pad"
    contiguous: bool = False  # windows are runs of adjacent chunks (samples span chunks)
    # Contiguous mode: chunks per run (what a sample's halo needs); a window holds
    # ``block_chunks // run_chunks`` runs from scattered places (what mixing needs).
    # None: one run of ``block_chunks``.
    run_chunks: int | None = None

    def __post_init__(self) -> None:
        if self.uneven not in UNEVEN_POLICIES:
            raise ConfigError(f"uneven must be one of {UNEVEN_POLICIES}, got {self.uneven!r}")
        if self.block_chunks < 1:
            raise ConfigError(f"block_chunks must be >= 1, got {self.block_chunks}")
        if self.run_chunks is not None and not 1 <= self.run_chunks <= self.block_chunks:
            raise ConfigError(f"run_chunks must be between 1 and block_chunks="
                             f"{self.block_chunks}, got {self.run_chunks}")

    @property
    def run_length(self) -> int:
        """Chunks per contiguous run (contiguous mode)."""
        return self.block_chunks if self.run_chunks is None else self.run_chunks

    @property
    def runs_per_window(self) -> int:
        return max(1, self.block_chunks // self.run_length)


@dataclass(frozen=True, eq=False)
class WindowSpec:
    """One window of one rank: its chunks and, for an elastic tail, its explicit draws.

    ``key`` seeds the draw order of a fresh window. ``limit`` drops draws past it and
    ``extra`` appends padding draws (equal steps); both touch only a rank's last windows.
    """

    ctx: ScheduleContext
    epoch: int
    key: tuple[int, ...]
    chunk_ids: np.ndarray
    draws: np.ndarray | None = None
    limit: int | None = None
    extra: np.ndarray | None = None

    def base_draws(self) -> np.ndarray:
        """The window's draws before equal-steps adjustments."""
        if self.draws is not None:
            return self.draws
        samples = self.ctx.grid.samples_of(self.chunk_ids)
        rng = seeded_rng(DRAW_STREAM, self.ctx.seed, self.epoch, *self.key)
        # shuffling a copy makes the swaps permutation(size) would: the same order
        return rng.permutation(samples)

    @property
    def n_base(self) -> int:
        if self.draws is not None:
            return int(self.draws.size)
        return self.ctx.grid.n_samples_of(self.chunk_ids)

    @property
    def n_final(self) -> int:
        """``final_draws().size``, without drawing the permutation."""
        n = self.n_base if self.limit is None else min(self.n_base, self.limit)
        return n + (0 if self.extra is None else int(self.extra.size))

    def final_draws(self) -> np.ndarray:
        d = self.base_draws()
        if self.limit is not None:
            d = d[: self.limit]
        if self.extra is not None:
            d = np.concatenate([d, self.extra])
        return d


@dataclass(frozen=True, eq=False)
class RankSchedule:
    """A rank's windows for one epoch (adjusted) and the per-rank sample counts behind it."""

    windows: tuple[WindowSpec, ...]
    own_samples: int  # this rank's real samples
    target: int  # samples it yields after equal-steps adjustment
    counts: tuple[int, ...]  # every rank's real samples, for reports and errors

    @cached_property
    def _draws(self) -> dict[int, np.ndarray]:
        return {}

    def draws_of(self, window: int) -> np.ndarray:
        """``windows[window].final_draws()``, drawn once per schedule: planning a window
        into batches reads its neighbours' draws too (a batch runs across window edges)."""
        cache = self._draws
        got = cache.get(window)
        if got is None:
            got = cache[window] = self.windows[window].final_draws()
            # the window being planned and those ahead are what is asked for next
            for old in [k for k in cache if k < window - 2]:
                del cache[old]
        return got

    @cached_property
    def draw_starts(self) -> np.ndarray:
        """Where each window's draws start in the epoch's draw sequence (and its length
        last): batches are that sequence cut every ``batch_size`` draws."""
        sizes = [w.n_final for w in self.windows]
        return np.concatenate(([0], np.cumsum(sizes, dtype=np.int64)))


def batch_slots(schedule: RankSchedule, window: int, batch_size: int, drop_last: bool,
                ) -> tuple[np.ndarray, np.ndarray]:
    """(batch, row) of every draw of ``window``, in draw order: the epoch's draws are cut
    into batches of ``batch_size`` across window edges and each batch's rows sorted by
    sample index (as ``ShuffleBufferNode`` hands them out). A draw of the short last batch
    that ``drop_last`` drops gets batch -1. Pure: where a sample will land is known before
    it is read, so it can be decoded straight into its row."""
    starts = schedule.draw_starts
    total = int(starts[-1])
    g0, g1 = int(starts[window]), int(starts[window + 1])
    batch = np.empty(g1 - g0, dtype=np.int64)
    row = np.empty(g1 - g0, dtype=np.int64)
    if g1 == g0:
        return batch, row
    own = schedule.draws_of(window)
    b_first, b_last = g0 // batch_size, (g1 - 1) // batch_size
    # The batches wholly inside the window at once: one argsort over a (batches, rows) view
    # (this runs on the consumer thread, once per window, for every window of an epoch).
    inner0 = -(-g0 // batch_size)  # the first batch that starts in the window
    inner1 = max(inner0, min(g1, total) // batch_size)  # past the last one whole in it
    if inner1 > inner0:
        lo, hi = inner0 * batch_size - g0, inner1 * batch_size - g0
        order = np.argsort(own[lo:hi].reshape(-1, batch_size), axis=1, kind="stable")
        # each row of ``order`` is a permutation: sorting it again inverts it (the ranks)
        row[lo:hi].reshape(-1, batch_size)[...] = np.argsort(order, axis=1)
        batch[lo:hi].reshape(-1, batch_size)[...] = np.arange(inner0, inner1)[:, None]
    # the batches at the window's edges (partly in it, or short at the epoch's end)
    for b in [*range(b_first, min(inner0, b_last + 1)), *range(inner1, b_last + 1)]:
        lo, hi = b * batch_size, min((b + 1) * batch_size, total)
        if lo >= g0 and hi <= g1:
            draws = own[lo - g0 : hi - g0]
        else:  # the batch runs across window edges: collect its draws from each
            pieces = []
            for k in range(int(np.searchsorted(starts, lo, side="right")) - 1, len(starts) - 1):
                s0 = int(starts[k])
                if s0 >= hi:
                    break
                d = own if k == window else schedule.draws_of(k)
                pieces.append(d[max(lo - s0, 0) : hi - s0])
            draws = np.concatenate(pieces)
        rank = np.empty(hi - lo, dtype=np.int64)
        rank[np.argsort(draws, kind="stable")] = np.arange(hi - lo)
        a, z = max(lo, g0), min(hi, g1)
        batch[a - g0 : z - g0] = -1 if drop_last and hi - lo < batch_size else b
        row[a - g0 : z - g0] = rank[a - lo : z - lo]
    return batch, row


def contiguous_blocks(ctx: ScheduleContext) -> list[np.ndarray]:
    """The split's runs of adjacent chunks, cut into blocks of ``run_length`` chunks (the
    units dealt in contiguous mode; a window takes ``runs_per_window`` of them)."""
    ids = np.sort(np.asarray(ctx.chunk_ids, dtype=np.int64))
    if ids.size == 0:
        return []
    runs = np.split(ids, np.flatnonzero(np.diff(ids) != 1) + 1)
    b = ctx.run_length
    return [run[i:i + b] for run in runs for i in range(0, run.size, b)]


def n_units(ctx: ScheduleContext) -> int:
    """How many units are dealt to ranks: chunks, or contiguous blocks."""
    return len(contiguous_blocks(ctx)) if ctx.contiguous else int(np.asarray(ctx.chunk_ids).size)


def _permuted_blocks(ctx: ScheduleContext, epoch: int) -> list[np.ndarray]:
    """Contiguous mode: the split's blocks in this epoch's order."""
    blocks = contiguous_blocks(ctx)
    return [blocks[i] for i in epoch_chunk_order(np.arange(len(blocks)), ctx.seed, epoch)]


def _global_order(ctx: ScheduleContext, epoch: int) -> np.ndarray:
    """The epoch's chunk order, the same for every world size (blocks kept whole)."""
    if not ctx.contiguous:
        return epoch_chunk_order(ctx.chunk_ids, ctx.seed, epoch)
    blocks = _permuted_blocks(ctx, epoch)
    return np.concatenate(blocks) if blocks else np.empty(0, np.int64)


def _generation0(ctx: ScheduleContext, epoch: int, world_size: int) -> list[list[WindowSpec]]:
    if ctx.contiguous:
        dealt = _permuted_blocks(ctx, epoch)
        k = ctx.runs_per_window  # runs from scattered places in one window: they mix
        out: list[list[WindowSpec]] = []
        for r in range(world_size):
            mine = dealt[r::world_size]
            out.append([WindowSpec(ctx, epoch, (0, r, world_size, i // k),
                                   np.concatenate(mine[i:i + k]))
                        for i in range(0, len(mine), k)])
        return out
    order = epoch_chunk_order(ctx.chunk_ids, ctx.seed, epoch)
    out = []
    for r in range(world_size):
        share = rank_share(order, r, world_size)
        b = ctx.block_chunks
        out.append([WindowSpec(ctx, epoch, (0, r, world_size, i), share[i * b:(i + 1) * b])
                    for i in range(-(-share.size // b))])
    return out


def _remainder(ctx: ScheduleContext, prev: list[list[WindowSpec]],
               last: Resumption) -> tuple[list[WindowSpec], list[np.ndarray]]:
    """What the ranks of the generation before ``last`` left undrawn: the tails of partly
    drawn (and of explicit-draw) windows, in old-rank order, and the untouched windows'
    chunks (contiguous mode: blocks)."""
    if len(last.progress) != last.world_size:
        raise StateError(f"resume record has {len(last.progress)} rank progresses for world "
                         f"size {last.world_size}")
    tails: list[WindowSpec] = []
    untouched: list[np.ndarray] = []
    for r, (wins, p) in enumerate(zip(prev, last.progress, strict=True)):
        if not 0 <= p.window <= len(wins) or p.offset < 0:
            raise StateError(
                f"resume record says rank {r} of {last.world_size} finished {p.window} windows "
                f"and took {p.offset} draws of the next, but it had {len(wins)} windows in that "
                f"epoch (valid: 0 <= window <= {len(wins)}, offset >= 0)")
        for i, spec in enumerate(wins):
            if i < p.window:
                continue
            if i == p.window or spec.draws is not None:
                d = spec.base_draws()[p.offset if i == p.window else 0:]
                if d.size:
                    chunks = (spec.chunk_ids if ctx.contiguous
                              else np.unique(d // ctx.grid.chunk_size))
                    tails.append(WindowSpec(ctx, spec.epoch, (), chunks, draws=d))
            else:
                untouched.append(spec.chunk_ids)
    return tails, untouched


def _pooled_units(ctx: ScheduleContext, epoch: int, untouched: list[np.ndarray],
                  ) -> list[np.ndarray]:
    """The untouched chunks back in the epoch's global order, a window's worth per unit
    (``block_chunks`` chunks; contiguous mode: the windows, kept whole, their neighbours
    are their halo): O(windows) units, not O(chunks). Units without samples left out."""
    order = _global_order(ctx, epoch)
    rank_in_order = np.zeros(int(order.max()) + 1 if order.size else 0, dtype=np.int64)
    rank_in_order[order] = np.arange(order.size)
    if ctx.contiguous:
        units = sorted(untouched, key=lambda ids: int(rank_in_order[ids[0]]))
    else:
        pool = np.concatenate(untouched) if untouched else np.empty(0, dtype=np.int64)
        pool = pool[np.argsort(rank_in_order[pool], kind="stable")]
        b = ctx.block_chunks
        units = [pool[i:i + b] for i in range(0, pool.size, b)]
    return [u for u in units if ctx.grid.n_samples_of(u)]


def _unit_window(ctx: ScheduleContext, epoch: int, key: tuple[int, ...], unit: np.ndarray,
                 lo: int, hi: int) -> WindowSpec:
    """The window of samples ``[lo, hi)`` of a pooled unit. Part of a unit (the rest went to
    a neighbouring rank) gets explicit draws: a permutation keyed like a fresh window's."""
    if lo == 0 and hi == ctx.grid.n_samples_of(unit):
        return WindowSpec(ctx, epoch, key, unit)
    samples = ctx.grid.samples_of(unit)[lo:hi]
    chunks = unit if ctx.contiguous else np.unique(samples // ctx.grid.chunk_size)
    rng = seeded_rng(DRAW_STREAM, ctx.seed, epoch, *key)
    return WindowSpec(ctx, epoch, key, chunks, draws=samples[rng.permutation(samples.size)])


def _redeal(ctx: ScheduleContext, epoch: int, g: int, world_size: int,
            tails: list[WindowSpec], units: list[np.ndarray]) -> list[list[WindowSpec]]:
    """Generation ``g``: tails, then pooled units, laid end to end and cut into
    ``world_size`` runs whose sample counts differ by at most one, so every rank has work
    and equal steps cost at most one padded (or dropped) sample per rank. Each tail or unit
    (or the part of it in a run) is a window; one cut between two runs is read by both."""
    sizes = [t.n_base for t in tails] + [ctx.grid.n_samples_of(u) for u in units]
    starts = np.concatenate(([0], np.cumsum(sizes, dtype=np.int64)))
    q, rem = divmod(int(starts[-1]), world_size)
    bounds = [r * q + min(r, rem) for r in range(world_size + 1)]
    out = []
    for r in range(world_size):
        lo, hi = bounds[r], bounds[r + 1]
        mine: list[WindowSpec] = []
        first = int(np.searchsorted(starts, lo, side="right")) - 1
        for k in range(max(first, 0), len(sizes)):
            s0 = int(starts[k])
            if s0 >= hi:
                break
            a, z = max(lo - s0, 0), min(hi - s0, sizes[k])
            key = (g, r, world_size, len(mine))
            if k < len(tails):
                d = tails[k].base_draws()[a:z]  # a tail's draws, always explicit
                chunks = (tails[k].chunk_ids if ctx.contiguous
                          else np.unique(d // ctx.grid.chunk_size))
                mine.append(WindowSpec(ctx, epoch, key, chunks, draws=d))
            else:
                mine.append(_unit_window(ctx, epoch, key, units[k - len(tails)], a, z))
        if not mine:  # nothing left for it: one empty window that padding can fill
            mine.append(WindowSpec(ctx, epoch, (g, r, world_size, 0), np.empty(0, np.int64),
                                   draws=np.empty(0, np.int64)))
        out.append(mine)
    return out


def _windows(ctx: ScheduleContext, epoch: int, history: Sequence[Resumption],
             world_size: int) -> list[list[WindowSpec]]:
    """Every rank's unadjusted windows in the generation after ``history``."""
    if not history:
        return _generation0(ctx, epoch, world_size)
    *earlier, last = history
    prev = _windows(ctx, epoch, earlier, last.world_size)
    tails, untouched = _remainder(ctx, prev, last)
    return _redeal(ctx, epoch, len(history), world_size, tails,
                   _pooled_units(ctx, epoch, untouched))


def rank_schedule(ctx: ScheduleContext, epoch: int, rank: int, world_size: int,
                  history: Sequence[Resumption] = ()) -> RankSchedule:
    """This rank's windows, adjusted so that every rank yields the same number of samples.

    ``pad`` repeats draws of the rank's own last window (no extra reads; a rank with no
    samples at all repeats some of the other ranks'), ``drop`` cuts each rank to the
    smallest share, ``none`` leaves shares unequal (not for DDP).
    """
    return _adjusted(ctx, epoch, rank, world_size, history,
                     _windows(ctx, epoch, history, world_size))


def rank_schedules(ctx: ScheduleContext, epoch: int, world_size: int,
                   history: Sequence[Resumption] = ()) -> list[RankSchedule]:
    """``rank_schedule`` of every rank, the epoch's windows dealt once (checking a restored
    state's history needs all of a past generation's ranks)."""
    all_windows = _windows(ctx, epoch, history, world_size)
    return [_adjusted(ctx, epoch, r, world_size, history, all_windows)
            for r in range(world_size)]


def _adjusted(ctx: ScheduleContext, epoch: int, rank: int, world_size: int,
              history: Sequence[Resumption],
              all_windows: list[list[WindowSpec]]) -> RankSchedule:
    """``rank``'s share of ``all_windows`` (every rank's, as dealt) with the equal-steps
    adjustment."""
    counts = tuple(sum(w.n_base for w in wins) for wins in all_windows)
    wins = list(all_windows[rank])
    own = counts[rank]
    target = {"pad": max(counts), "drop": min(counts), "none": own}[ctx.uneven]
    if target < own:
        kept, total = [], 0
        for w in wins:
            if total >= target:
                break
            n = w.n_base
            kept.append(w if total + n <= target else replace(w, limit=target - total))
            total += n
        wins = kept
    elif target > own:
        nonempty = [i for i, w in enumerate(wins) if w.n_base]
        if not wins:
            raise ConfigError(
                f"rank {rank} of {world_size} has no windows to pad in epoch {epoch} "
                f"(samples per rank: {list(counts)}); use fewer ranks (at most one per chunk)"
            )
        last_i = nonempty[-1] if nonempty else len(wins) - 1
        last = wins[last_i]
        # Its own last window, already resident; a rank left with nothing (fewer samples
        # left in the epoch than ranks) pads from what the other ranks still draw.
        pool = (last.base_draws() if nonempty else
                np.concatenate([w.base_draws() for ws in all_windows for w in ws]))
        rng = seeded_rng(_PAD_STREAM, ctx.seed, epoch, len(history), rank, world_size)
        # Cycle through a shuffled copy: each sample repeats as few times as possible.
        extra = np.resize(rng.permutation(pool), target - own).astype(np.int64)
        if not nonempty and last.draws is not None:  # an empty window of a re-deal
            last = replace(last, chunk_ids=np.unique(extra // ctx.grid.chunk_size))
        wins[last_i] = replace(last, extra=extra)
    return RankSchedule(tuple(wins), own, target, counts)


def plan_window(spec: WindowSpec, variables: Sequence[VariableGeometry], window: int,
                offsets: np.ndarray | None = None, draws: np.ndarray | None = None,
                slots: BatchSlots | None = None) -> ReadPlan:
    """The read plan of one window: its final draw order (``draws`` when already drawn)
    and the stripes those draws need (every time step of each sample, when
    ``offsets`` are given); ``slots``, where its draws land in batches, go in as given.
    Runs once a window on the training thread: one sort per distinct sample chunking."""
    draws = spec.final_draws() if draws is None else draws
    steps = np.zeros(1, dtype=np.int64) if offsets is None else np.asarray(offsets, np.int64)
    single = steps.size == 1 and steps[0] == 0
    rows = draws if single else (draws[:, None] + steps[None, :]).ravel()  # ReadPlan.rows
    reads, last_use = [], []
    per_chunking: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    nbytes = 0
    for v in variables:
        got = per_chunking.get(v.sample_chunk)
        if got is None:
            got = per_chunking[v.sample_chunk] = _last_uses(
                rows if v.sample_chunk == 1 else rows // v.sample_chunk, steps.size)
        reads.append(got[0])
        last_use.append(got[1])
        nbytes += len(got[0]) * v.stripe_nbytes
    return ReadPlan(epoch=spec.epoch, window=window,
                    chunk_ids=tuple(np.asarray(spec.chunk_ids).tolist()), draw_order=draws,
                    reads=tuple(reads), nbytes=nbytes, last_use=tuple(last_use),
                    offsets=steps,
                    slots=slots)


def _last_uses(stripes: np.ndarray, n_steps: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The distinct ``stripes`` (ascending) and, for each, the draw of its last row
    (rows are draw-major, ``n_steps`` a draw). One stable sort: the last of each run of
    equal stripes is the last use (what ``np.unique`` of the reversed rows gave, less its
    reversal and its Python overhead)."""
    if not stripes.size:
        return (), ()
    order = np.argsort(stripes, kind="stable")
    ordered = stripes[order]
    last = np.empty(ordered.size, dtype=bool)
    np.not_equal(ordered[1:], ordered[:-1], out=last[:-1])
    last[-1] = True
    uses = order[last]
    if n_steps > 1:
        uses //= n_steps
    return tuple(ordered[last].tolist()), tuple(uses.tolist())
