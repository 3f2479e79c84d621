"""Time to first batch: a fresh loader, and one resumed from a saved state.

What a job restarted from a checkpoint waits before training resumes; several loaders
(versions, variants) are timed in rotating order so a drifting VM touches them alike.
"""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Callable, Mapping
from typing import Any

import insitubatch_nodes as ib

from .common import rotated
from .core_config import SPLIT, CoreConfig


def time_first_batch(source: ib.Source, manifest: ib.SplitManifest, cfg: CoreConfig,
                     repeats: int = 3, build: Callable[..., Any] | None = None,
                     **overrides: Any) -> dict[str, Any]:
    """Seconds from building a loader to holding its first batch: fresh, and resumed from a
    state taken after ``resume_after`` batches, at most half the epoch's (build a loader,
    take k batches, save the state, build a fresh loader, load it, time the first batch).
    Best of ``repeats``.

    Each loader is collected before the next clock starts: a resumed job is a fresh process,
    and freeing the last loader's windows inside the timing (a cyclic GC and hundreds of MB
    unmapped) doubled the medians on 178 MB windows. ``overrides``: more ``build_loader``
    keywords (``benchmarks/bench_variants.py`` times its variants with them); ``build``:
    another ``build_loader`` (another version's, ``benchmarks/bench_revisions.py``)."""
    build = build if build is not None else ib.build_loader
    kw = {**cfg.loader_kwargs(), **overrides}
    # At most halfway through the full batches: the batch timed after the restore is a full
    # one, not the epoch's short last batch (which a 200-step store's 10 batches in were).
    full = manifest.n_samples_in(SPLIT) // cfg.batch_size
    k = max(1, min(cfg.resume_after, (full - 1) // 2))
    with build(source, manifest, SPLIT, **kw) as loader:
        it = iter(loader)
        for _ in range(k):
            next(it)
        state = loader.state_dict()

    def once(resume: bool) -> tuple[float, float]:
        gc.collect()  # the previous loader's memory goes now, not inside the timing
        t0 = time.perf_counter()
        with build(source, manifest, SPLIT, **kw) as fresh:
            if resume:
                fresh.load_state_dict(state)
            t1 = time.perf_counter()
            next(iter(fresh))
            t2 = time.perf_counter()
        return t2 - t0, t1 - t0

    fresh = [once(False) for _ in range(repeats)]
    resumed = [once(True) for _ in range(repeats)]
    return {"first_batch_s": min(t for t, _ in fresh),
            "first_batch_after_resume_s": min(t for t, _ in resumed),
            "build_s": min(b for _, b in fresh), "resume_after_batches": k,
            "state_json_bytes": len(json.dumps(state)),
            "all_fresh_s": [t for t, _ in fresh], "all_resumed_s": [t for t, _ in resumed]}


def alternating_first_batches(timers: Mapping[str, Callable[[], dict[str, Any]]],
                              rounds: int) -> dict[str, dict[str, list[float]]]:
    """First batches of several loaders side by side: each ``timers[name]()`` is one
    ``time_first_batch`` (``repeats=1``), called ``rounds`` times in rotating order so a
    drifting VM touches every loader alike. Name -> {"fresh": [...], "resumed": [...]}."""
    out: dict[str, dict[str, list[float]]] = {n: {"fresh": [], "resumed": []}
                                              for n in timers}
    for r in range(rounds):
        for n in rotated(list(timers), r):
            t = timers[n]()
            out[n]["fresh"].append(t["first_batch_s"])
            out[n]["resumed"].append(t["first_batch_after_resume_s"])
    return out
