"""Defaults and policy: what an option left to the loader (``None``, ``"auto"``) becomes.

``graph.resolve`` and ``inspection.recommend`` both read this module, so a recommendation
sizes windows for the path the loader will take and with its prefetch depth; the numbers
are measured (DESIGN.md names each measurement), the wiring lives in ``graph.py``.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys

import numpy as np

from .config import FetchConfig, SamplingConfig
from .errors import ConfigError
from .io.device_decode import FrameDecoder
from .io.reader import groups_reads
from .memory.budget import held_stripes_nbytes, parse_bytes, runs_in
from .sampling.windows import SampleWindow, default_run_chunks
from .store.cut_array import stored_arrays
from .store.source import Source
from .workers.engine import CREDIT

log = logging.getLogger("insitubatch_nodes")

# Windows fetched ahead of the one being drawn. nodes/async_fetch.DEFAULT_PREFETCH_WINDOWS,
# the node's own default, is the same number (that layer may import this one).
PREFETCH_WINDOWS = 2

CORES_ENV = "INSITUBATCH_CORES"  # overrides the cores the loader sizes itself for
WORKERS_FROM_CORES = 4  # "auto" starts worker processes from this many cores per rank
MAX_WORKERS = 32

DEFAULT_BLOCK_CHUNKS = 16
# In-place windows of one sample per chunk: (decoded bytes, chunks) at most. The same for
# every executor (threads, workers, "auto" on any core count): the window is part of the
# plan, so it must not depend on who decodes. The training thread plans and cuts each window
# (~0.5 ms on a 2-core VM whose cores the workers keep busy): at 256 one-step t2m chunks a
# window that left the training process 7.5-7.6 us of CPU a sample with 2 workers, at 512
# 6.1-6.3 (``benchmarks.profile_workers --block-chunks``, docs/benchmarks.md). The second
# is what a ``memory_budget`` that does not hold the first gets.
IN_PLACE_WINDOWS = ((128 << 20, 512), (64 << 20, 256))
WINDOW_RUNS = (4, 8)  # runs per window with time steps: at least, at most
WINDOW_BYTES = 256 << 20  # decoded bytes of a window with time steps, by default


def every_steps(source: Source, every: int | str) -> tuple[int, int]:
    """``sampling.every`` as (k, phase): keep the steps ``i ≡ phase`` (mod k). An int keeps
    every k-th step from the first; a duration (``"6h"``, ``"1D"``) keeps the steps whose
    time is a whole multiple of it, on a regular time axis (anemoi's ``frequency``)."""
    if not isinstance(every, str):
        return int(every), 0
    import pandas as pd

    times = source.sample_coord
    if times is None or not np.issubdtype(np.asarray(times).dtype, np.datetime64):
        raise ConfigError(f"sampling.every={every!r} is a duration, but {source.url} has no "
                         "time coordinate on its sample axis; give a number of steps instead")
    try:
        period = pd.Timedelta(every).to_timedelta64().astype("timedelta64[ns]")
    except ValueError as e:
        raise ConfigError(f"sampling.every={every!r} is not a duration such as '6h' or '1D' "
                         f"({e})") from None
    t = np.asarray(times).astype("datetime64[ns]")
    steps = np.unique(np.diff(t))
    if t.size < 2 or steps.size != 1:
        said = ", ".join(str(pd.Timedelta(x)) for x in steps[:4])
        raise ConfigError(f"sampling.every={every!r} needs a regular time axis; {source.url}'s "
                         f"steps are {said} (give a number of steps instead)")
    k, rest = divmod(int(period.astype(np.int64)), int(steps[0].astype(np.int64)))
    if k < 1 or rest:
        raise ConfigError(f"sampling.every={every!r} is not a whole number of the time axis' "
                         f"steps ({np.timedelta64(steps[0], 'm')})")
    aligned = np.flatnonzero(t[:k].astype(np.int64) % int(period.astype(np.int64)) == 0)
    if aligned.size == 0:
        raise ConfigError(f"sampling.every={every!r}: no step among the first {k} of "
                         f"{source.url} falls on a multiple of {every} (times from {t[0]})")
    return k, int(aligned[0])


# -- prefetch depth and decode threads ----------------------------------------------------
def default_prefetch_windows() -> int:
    """2 windows ahead of the one being drawn, on every store. On object stores one would
    expose a round trip at each window edge; on local disks the decode pool ran dry whenever
    the consumer was slow at a window edge (DESIGN.md "Prefetch depth on local disks").
    Decode worker processes deepen it (``resolve_prefetch``)."""
    return PREFETCH_WINDOWS


def default_decode_threads(one_sample_in_place: bool = False) -> int:
    """``fetch.decode_threads=None``: one more decode thread than cores, at most 4. A decode
    thread waits for the GIL around every chunk (open, read, close, decode each release and
    retake it) while the training thread runs Python (the gather copy among it); a third
    thread on two cores keeps them busy meanwhile (DESIGN.md "Decode threads"). Decoding in
    place one sample per chunk there is no copy at all, and the extra thread only adds
    switches: as many as cores. Chunks of several samples scattered in place keep the extra
    thread: their row copies take the GIL back several times per chunk."""
    return min(4, (os.cpu_count() or 1) + (0 if one_sample_in_place else 1))


def workers_prefetch(workers: int, batch_size: int, window_samples: int) -> int:
    """Windows ahead that keep ``workers`` processes busy: each holds up to ``CREDIT`` jobs
    of about a batch, so at least that many batches must be planned (on 16 cores, 15
    workers want 30 batches in flight; two windows of 256 one-sample chunks ahead hold 24).
    The resident bound counts the windows ahead, so it grows with them."""
    want = CREDIT * workers * batch_size
    return -(-want // max(1, window_samples))


def resolve_prefetch(f: FetchConfig, workers: int, batch_size: int,
                     window_samples: int) -> int:
    """``fetch.prefetch_windows``, or the default, deepened so ``workers``
    processes stay busy; a given value is kept as given (the budget check counts it)."""
    if f.prefetch_windows is not None:
        return f.prefetch_windows
    prefetch = default_prefetch_windows()
    if workers:
        prefetch = max(prefetch, workers_prefetch(workers, batch_size, window_samples))
    return prefetch


# -- worker processes ---------------------------------------------------------------------
def cores_per_rank() -> int:
    """The cores this process may run on (its affinity: taskset, cgroups, Slurm), or
    ``INSITUBATCH_CORES`` where set (a container whose CPU quota is below its affinity,
    or a test running what a bigger node gets), shared by the ranks torchrun started on
    this node (``LOCAL_WORLD_SIZE``)."""
    given = os.environ.get(CORES_ENV)
    if given:  # set and not empty
        try:
            cores = int(given)
        except ValueError:
            cores = 0
        if cores < 1:
            raise ConfigError(f"{CORES_ENV}={given!r}: give a whole number of cores >= 1, "
                              "or unset it to use this process's CPU affinity")
    else:
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # macOS
            cores = os.cpu_count() or 1
    try:
        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        ranks = 1
    return max(1, cores // ranks)


def default_workers(in_place: bool, cores: int | None = None) -> int:
    """``workers="auto"``: a decode process per core but one (the training process keeps
    one), from ``WORKERS_FROM_CORES`` cores per rank, where decoding is in place; else 0,
    the decode threads. Threads share one GIL and stop scaling at about 4 cores (16-core
    node: 9.6k samples/s at 4 threads, 4.6k at 16), processes do not (a prototype: 58.6k
    at 15); on 2 cores 2 workers were barely faster than the threads and 0.3 s slower to a
    first batch (docs/benchmarks.md "Decode worker processes"). A free-threaded CPython is
    not measured yet: it gets the threads."""
    if not in_place or not getattr(sys, "_is_gil_enabled", lambda: True)():
        return 0
    cores = cores_per_rank() if cores is None else cores
    if cores < WORKERS_FROM_CORES:
        return 0
    return min(MAX_WORKERS, cores - 1)


def _unsendable(source: Source) -> str | None:
    """Why the source's arrays cannot reach a worker process (each worker opens its own
    readers from the pickled arrays: store and path), or ``None``."""
    try:
        pickle.dumps(tuple(source.arrays))
    except Exception as e:
        return (f"the arrays of {source.url} cannot be sent to a worker process "
                f"(pickling their store failed: {type(e).__name__}: {e})")
    return None


def decode_threads(f: FetchConfig, source: Source, in_place: bool) -> int:
    """The decode threads a loader runs: ``fetch.decode_threads``, or the default for its
    path (``default_decode_threads``: one sample per chunk decoded in place, or not)."""
    return f.decode_threads or default_decode_threads(in_place and _one_sample_per_chunk(source))


def resolve_workers(source: Source, f: FetchConfig, in_place_possible: bool,
                    threads: int) -> int:
    """``fetch.workers`` as a number of processes: ``"auto"`` by ``default_workers`` wherever
    the loader can decode in place (every layout but ``decode="gpu"``, object stores with
    several samples per chunk included: the worker makes their copies), saying what it chose
    in one INFO line: worker processes or decode threads (``threads``: the loader's, if it
    keeps them), how many, and why. A source whose arrays do not pickle cannot reach a
    worker: an error when workers were asked for."""
    if isinstance(f.workers, int):
        auto, workers = False, f.workers
    else:  # "auto": the one string ``FetchConfig`` takes
        auto, workers = True, default_workers(in_place_possible)
    unsendable = _unsendable(source) if workers else None
    if unsendable is not None and not auto:
        raise ConfigError(f"workers={workers} (fetch.workers): {unsendable}. Use workers=0 "
                         "(decode threads in this process).")
    if not auto:
        return workers
    if unsendable is None and workers:
        cores = cores_per_rank()
        log.info("insitubatch: decode worker processes, workers='auto' chose %d: %s cores per "
                 "rank%s, at or above the %d from which worker processes start; one core is "
                 "left to the training process%s", workers, cores, _cores_from(),
                 WORKERS_FROM_CORES, f"; at most {MAX_WORKERS} workers"
                 if workers == MAX_WORKERS < cores - 1 else "")
        return workers
    log.info("insitubatch: decode threads, not worker processes: workers='auto' chose %d "
             "decode threads in this process: %s", threads,
             unsendable or _why_threads(in_place_possible))
    return 0


def _cores_from() -> str:
    """Where the cores per rank were read from, for the INFO line on ``workers="auto"``."""
    given = os.environ.get(CORES_ENV)
    ranks = os.environ.get("LOCAL_WORLD_SIZE")
    where = f" ({CORES_ENV}={given}" if given else " (this process's CPU affinity"
    return where + (f" over LOCAL_WORLD_SIZE={ranks} ranks)" if ranks else ")")


def _why_threads(in_place_possible: bool) -> str:
    """Why ``workers="auto"`` kept the decode threads (for the INFO line)."""
    if not in_place_possible:
        return ("this loader does not decode into its batches (decode='gpu' or "
                "in_place=False), which worker processes do")
    if not getattr(sys, "_is_gil_enabled", lambda: True)():
        return "a free-threaded Python (no GIL to escape; processes not measured there)"
    return (f"{cores_per_rank()} cores per rank{_cores_from()}; worker processes start from "
            f"{WORKERS_FROM_CORES} (below that they are not measured faster than the threads)")


# -- decoding in place --------------------------------------------------------------------
def _one_sample_per_chunk(source: Source) -> bool:
    """Every variable chunked one sample at a time (ARCO-ERA5, WeatherBench2, anemoi)."""
    return all(v.sample_chunk == 1 for v in source.variables)


def _in_place_by_default(source: Source) -> bool:
    """Where ``in_place=None`` decodes into batches: one sample per chunk on any store;
    several samples per chunk on local files, where the scatter copy runs on the decode
    threads (measured: README "Speed"); a remote store's reads await on the event loop,
    which would make the copies there, so its windows are gathered as before."""
    return _one_sample_per_chunk(source) or all(groups_reads(a) for arr in source.arrays
                                                for a in stored_arrays(arr))


def _not_in_place(decoder: FrameDecoder | None) -> str | None:
    """Why the chunks cannot be decoded straight into batch rows (``None``: they can). Every
    host layout can: a variable split across channels (some levels, an anemoi variable
    subset) or cast to the stacked dtype is decoded into scratch and its parts copied into
    their slots (``memory.slots``)."""
    if decoder is not None:
        return "decode='gpu' decodes on the device"
    return None


def decodes_in_place(source: Source) -> bool:
    """Whether ``build_loader`` with its defaults decodes ``source`` straight into batches
    (one sample per chunk, as ARCO-ERA5 / WeatherBench2 / anemoi stores, or several on
    local files), with or without time steps: ``inspection.recommend`` sizes windows for
    that path."""
    return _in_place_by_default(source)


def in_place_possible(f: FetchConfig, decoder: FrameDecoder | None) -> bool:
    """Whether this loader may decode into its batches (with threads or workers)."""
    return f.in_place is not False and _not_in_place(decoder) is None


def resolve_in_place(source: Source, f: FetchConfig, decoder: FrameDecoder | None) -> bool:
    """``fetch.in_place`` decided: ``True`` where this loader can and was asked to (or to
    start workers, which decode in place), ``None`` by ``_in_place_by_default``; ``"auto"``
    workers make it ``True`` in ``graph.resolve``. Asking for what it cannot do is an error
    saying why not."""
    why_not = _not_in_place(decoder)
    if f.in_place and why_not:
        raise ConfigError(f"in_place=True (fetch.in_place), but this loader cannot decode "
                         f"into its batches: {why_not}. Leave in_place=None to decide per "
                         "store.")
    asked = f.workers if f.workers != "auto" else 0
    if asked and (why_not or f.in_place is False):
        raise ConfigError(f"workers={asked} (fetch.workers): worker processes decode straight "
                         f"into batches in shared memory, which this loader cannot: "
                         f"{why_not or 'in_place=False (fetch.in_place) was given'}. Use "
                         "workers=0 (decode threads) or workers='auto'.")
    return f.in_place is not False and why_not is None and (
        bool(f.in_place) or bool(asked) or _in_place_by_default(source))


# -- window size --------------------------------------------------------------------------
def default_block_chunks(source: Source, in_place: bool, run_chunks: int | None = None,
                         smaller: bool = False) -> int:
    """16 chunks per window; decoding in place without time steps (one sample per chunk,
    where the window's size does not change the shuffle: every chunk is one sample of a
    global permutation; with time steps windows are runs of adjacent chunks, and size does),
    windows of about 128 MB, at most 512 chunks (``smaller``: 64 MB and 256, for a
    ``memory_budget``), so the per-window planning is spread over enough chunks; batches go
    out as their rows land, so a larger window does not delay the first batch. With time
    steps (``run_chunks``), 4 to 8 runs per window, as many as ~256 MB allow. Never a
    function of the executor: the window is part of the plan."""
    sample_bytes = sum(v.stripe_nbytes for v in source.variables)
    if run_chunks is not None:
        # time steps: several runs from scattered places mix a batch across the split;
        # as many as ~256 MB allow, between 4 and 8
        runs = WINDOW_BYTES // max(1, run_chunks * sample_bytes)
        return run_chunks * int(min(max(runs, WINDOW_RUNS[0]), WINDOW_RUNS[1]))
    if not in_place or not _one_sample_per_chunk(source):
        return DEFAULT_BLOCK_CHUNKS  # several samples per chunk: window size is mixing
    nbytes, most = IN_PLACE_WINDOWS[1 if smaller else 0]
    return max(DEFAULT_BLOCK_CHUNKS, min(most, nbytes // max(1, sample_bytes)))


def window_size(source: Source, s: SamplingConfig, steps: SampleWindow | None,
                in_place: bool, smaller: bool = False) -> tuple[int, int | None]:
    """(block_chunks, run_chunks): the configured values or the defaults for the path
    (``smaller``: the window a ``memory_budget`` falls back to); with time steps a window
    holds whole runs."""
    run_chunks = None
    if steps is not None:
        run_chunks = (s.run_chunks if s.run_chunks is not None
                      else default_run_chunks(steps, source.grid.chunk_size))
    block_chunks = (s.block_chunks if s.block_chunks is not None
                    else default_block_chunks(source, in_place and steps is None, run_chunks,
                                              smaller))
    if run_chunks is not None:
        if s.run_chunks is not None and s.run_chunks > block_chunks:
            raise ConfigError(f"sampling.run_chunks={s.run_chunks} exceeds block_chunks="
                             f"{block_chunks}: a window holds whole runs")
        run_chunks = min(run_chunks, block_chunks)
    return block_chunks, run_chunks


# -- decoded stripes kept across epochs ---------------------------------------------------
def why_not_kept(source: Source, in_place: bool, workers: int, device: bool) -> str | None:
    """Why this loader cannot keep decoded stripes (``None``: it can): its decode threads
    must decode them, for a window of a local store or a batch's copies (in place)."""
    if workers:
        return "decode workers decode into batches themselves"
    if device:
        return "decode='gpu' decodes on the device"
    if in_place:
        return ("every variable holds one sample per chunk, decoded straight into its batch "
                "row" if _one_sample_per_chunk(source) else None)
    local = all(groups_reads(a) for arr in source.arrays for a in stored_arrays(arr))
    return None if local else "windows of object stores are read on the event loop"


def resolve_keep_decoded(source: Source, f: FetchConfig, in_place: bool, workers: int,
                         device: bool, n_chunks: int, block_chunks: int,
                         steps: SampleWindow | None, run_chunks: int | None,
                         ) -> tuple[int, int, bool]:
    """``fetch.keep_decoded`` as (bytes of stripes kept, bytes the resident bound adds,
    ``in_place``). ``None``: a split that fits in one window (``n_chunks <=
    block_chunks``) whose stripes the decode threads decode keeps them, in the memory the
    bound holds for one window's (nothing added), so every epoch after the first copies
    from memory; with ``in_place=None`` its batches are then gathered from the kept
    stripes (a few batches in memory at once, not a window's: the first epoch touches
    half the fresh memory). A size: that many, added to the
    bound, or an error saying why stripes cannot be kept here."""
    if f.keep_decoded is None:
        if n_chunks > block_chunks:
            return 0, 0, in_place
        if (f.in_place is None and in_place and not workers and not device
                and not _one_sample_per_chunk(source)):
            in_place = False  # several samples a chunk of a local store: gathered
        if why_not_kept(source, in_place, workers, device) is not None:
            return 0, 0, in_place
        held = held_stripes_nbytes(source.grid, source.variables, block_chunks, steps,
                                   runs_in(block_chunks, run_chunks))
        return held, 0, in_place
    why_not = why_not_kept(source, in_place, workers, device)
    kept = parse_bytes(f.keep_decoded)
    if kept and why_not is not None:
        raise ConfigError(f"keep_decoded={f.keep_decoded!r} (fetch.keep_decoded): decoded "
                          f"stripes are kept only where the decode threads decode them for a "
                          f"window or a batch's copies, not here: {why_not}. Use "
                          "keep_decoded=None or 0.")
    return kept, kept, in_place
