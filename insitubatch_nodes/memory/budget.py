"""The resident-memory bound of a loader configuration, and byte sizes written by humans.

Pure index math: ``build_loader`` refuses a configuration whose bound exceeds
``memory_budget`` and ``insitubatch inspect`` recommends a ``block_chunks`` from the same
function, so a recommendation always builds.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from ..errors import ConfigError
from ..sampling.geometry import SampleGrid, VariableGeometry
from ..sampling.plan import max_window_nbytes
from ..sampling.windows import SampleWindow

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(value: int | str) -> int:
    """``4_000_000``, ``"4GB"``, ``"512MiB"`` -> bytes."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", str(value))
    if not m or m.group(2).upper() not in _UNITS:
        raise ConfigError(f"cannot read a byte size from {value!r}; write e.g. 4GB or 512MiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def resident_bound(grid: SampleGrid, variables: Sequence[VariableGeometry], block_chunks: int,
                   prefetch_windows: int, batch_size: int,
                   steps: SampleWindow | None = None, in_place: bool = False,
                   runs: int = 1) -> int:
    """Decoded bytes that can be resident: the window being drawn, the prefetched ones, and
    the stripes of the previous window that a batch straddling the edge still needs (each
    with its halo of neighbouring chunks when a sample spans several time ``steps``; a
    window of ``runs`` contiguous runs has a halo per run).

    ``in_place`` (chunks decoded into the batches): the batches that the windows being
    drawn, prefetched and just finished feed, two partly filled batches at their edges,
    and the batch the training step holds; with several samples per chunk, also the
    stripes a start's head window holds for the copies after its first batch (one window's:
    a batch straddling its end brings the next windows in before those copies are done). A
    decode thread's scratch stripe is not counted: one chunk per thread."""
    halo = _halo(grid, steps)
    window_bytes = held_stripes_nbytes(grid, variables, block_chunks, steps, runs)
    if in_place:
        per_row = 1 if steps is None else steps.history + len(steps.lead)
        sample_bytes = per_row * sum(v.sample_nbytes for v in variables)
        window_samples = block_chunks * grid.chunk_size
        batches = -(-(2 + prefetch_windows) * window_samples // batch_size) + 3
        held = window_bytes if any(v.sample_chunk != 1 for v in variables) else 0
        return batches * batch_size * sample_bytes + held
    window_samples = block_chunks * grid.chunk_size
    if batch_size > window_samples:
        # A batch spans whole windows: all of them (and the one it starts in) stay resident
        # until the batch is gathered, besides the prefetched ones.
        spans = -(-batch_size // window_samples) + 1
        return (spans + prefetch_windows) * window_bytes
    straddle = max_window_nbytes(grid, variables, min(batch_size, block_chunks)
                                 + 2 * halo * min(runs, batch_size))
    return (1 + prefetch_windows) * window_bytes + straddle


def _halo(grid: SampleGrid, steps: SampleWindow | None) -> int:
    """Chunks a run of time windows reads beyond each of its ends."""
    return 0 if steps is None else -(-max(steps.before, steps.after) // grid.chunk_size)


def held_stripes_nbytes(grid: SampleGrid, variables: Sequence[VariableGeometry],
                        block_chunks: int, steps: SampleWindow | None = None,
                        runs: int = 1) -> int:
    """One window's decoded stripes, each of its ``runs`` runs with its halo: what the
    resident bound holds for a start's head window, or for the stripes kept across epochs
    of a split that fits in one window (``defaults.resolve_keep_decoded``)."""
    return max_window_nbytes(grid, variables, block_chunks + 2 * _halo(grid, steps) * runs)


def largest_block_chunks(grid: SampleGrid, variables: Sequence[VariableGeometry], budget: int,
                         prefetch_windows: int, batch_size: int, hi: int,
                         steps: SampleWindow | None = None, in_place: bool = False,
                         run_chunks: int | None = None) -> int | None:
    """Largest ``block_chunks`` in ``[1, hi]`` whose resident bound fits ``budget``. A scan,
    not a bisection: the bound is not monotone where batches span several windows."""
    fits = [b for b in range(1, hi + 1)
            if resident_bound(grid, variables, b, prefetch_windows, batch_size, steps,
                              in_place, runs_in(b, run_chunks)) <= budget]
    return fits[-1] if fits else None


def runs_in(block_chunks: int, run_chunks: int | None) -> int:
    """Contiguous runs a window of ``block_chunks`` holds (1 without time steps)."""
    return 1 if run_chunks is None else max(1, block_chunks // min(run_chunks, block_chunks))


def check_budget(grid: SampleGrid, variables: Sequence[VariableGeometry],
                 memory_budget: int | str | None, block_chunks: int, prefetch_windows: int,
                 batch_size: int, steps: SampleWindow | None = None,
                 in_place: bool = False, run_chunks: int | None = None,
                 kept: int = 0) -> int:
    """The resident bound of this configuration, with ``kept`` bytes of stripes kept
    across epochs (``fetch.keep_decoded``); a ``ConfigError`` naming the largest
    ``block_chunks`` that fits when it exceeds ``memory_budget``."""
    need = kept + resident_bound(grid, variables, block_chunks, prefetch_windows, batch_size,
                                 steps, in_place, runs_in(block_chunks, run_chunks))
    if memory_budget is None:
        return need
    budget = parse_bytes(memory_budget)
    if need > budget:
        fits = largest_block_chunks(grid, variables, budget, prefetch_windows, batch_size,
                                    block_chunks - 1, steps, in_place, run_chunks)
        hint = (f"block_chunks={fits} fits" if fits else
                "even block_chunks=1 does not fit; lower prefetch_windows or raise the budget")
        raise ConfigError(
            f"memory_budget={memory_budget!r} ({budget:,} B) is below the {need:,} B that "
            f"block_chunks={block_chunks} with prefetch_windows={prefetch_windows}"
            + (f" and keep_decoded={kept:,} B" if kept else "") + f" can hold resident; {hint}"
        )
    return need
