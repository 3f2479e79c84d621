"""Combining the loader states of all ranks, for resuming an epoch on another world size.

``merge_rank_states`` reads each rank's progress (windows finished, draws taken in the
head window) out of its ``state_dict()`` and records it as one ``Resumption``. Any rank of a
new world size loads the merged state; the schedule then deals what is left of the epoch
(see ``sampling/schedule.py``), so over the epoch no sample is lost and none repeats.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from ..errors import StateError
from ..sampling.schedule import Progress, Resumption
from .fingerprint import DEAL_ONLY, RANK_FIELDS, StateFingerprint

ELASTIC_KEY = "elastic"
SNAPSHOT_KEY = "snapshot_id"
FORMAT_KEY = "format"
PROGRESS_KEY = "progress"
FINGERPRINT_KEY = "fingerprint"
# 2: ChunkPermuteNode's position counts windows (was chunks) and ReadPlanNode keeps no
# counter; the loader writes the format and a "progress" summary. Format 1 is converted
# on load (state.checkpoint.upgrade_v1).
# 3: every state built by build_loader carries a "fingerprint" (state/fingerprint.py), checked
# on load; formats 1 and 2 have none and load with a warning that they cannot be checked.
# 4: decoding in place the fetch yields batches, and AsyncFetchNode's state counts the draws
# delivered into its head window ("offset", 0 for whole windows; ShuffleBufferNode's is 0
# then); formats 1-3 are converted on load (state.checkpoint.upgrade_v3).
STATE_FORMAT = 4


def rank_progress(state: dict[str, Any]) -> tuple[int, tuple[Resumption, ...], Progress]:
    """(epoch, history, progress) of one rank's loader state, from the ``progress`` the
    loader writes into every state it hands out."""
    progress = state.get(PROGRESS_KEY) if isinstance(state, dict) else None
    if not isinstance(progress, dict):
        keys = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise StateError(
            f"not an insitubatch loader state with progress (it has {keys}): pass each "
            "rank's loader.state_dict() from this version (load an older state into a "
            "loader and take state_dict() again to convert it)"
        )
    try:
        history = tuple(Resumption.from_json(h) for h in progress["history"])
        return (int(progress["epoch"]), history,
                Progress(int(progress["window"]), int(progress["offset"])))
    except (KeyError, TypeError, ValueError) as e:
        raise StateError(f"the progress of this loader state is malformed ({e!r}): "
                         f"{progress!r}") from None


def merge_rank_states(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One state for the whole job, from the ``state_dict()`` of every rank, in rank order.

    Load it with ``loader.load_state_dict(merged)`` on every rank of the new job, whatever
    its world size: the rest of the epoch is re-dealt, then epochs run normally. With reader
    groups (``read_group=G``) pass every rank's state (one per model group is kept, the
    group's ranks checked to agree) or one per group; the merged state loads on any number
    of groups.
    """
    if not states:
        raise StateError("merge_rank_states needs the state of every rank, got none")
    states = one_per_group(states)
    parsed = [rank_progress(s) for s in states]
    epochs = {p[0] for p in parsed}
    histories = {repr([r.to_json() for r in p[1]]) for p in parsed}
    if len(epochs) != 1 or len(histories) != 1:
        raise StateError(
            f"rank states come from different epochs or resumes (epochs {sorted(epochs)}); "
            "take every rank's state_dict() at the same step"
        )
    snapshots = {s.get(SNAPSHOT_KEY) for s in states}
    if len(snapshots) != 1:
        raise StateError(f"rank states were read from different icechunk snapshots: {snapshots}")
    epoch, history, _ = parsed[0]
    resumption = Resumption(len(states), tuple(p[2] for p in parsed))
    merged: dict[str, Any] = {FORMAT_KEY: STATE_FORMAT, ELASTIC_KEY: {"epoch": epoch, "history": [
        h.to_json() for h in (*history, resumption)]}}
    if (snap := snapshots.pop()) is not None:
        merged[SNAPSHOT_KEY] = snap
    fingerprint = merged_fingerprint(states)
    if fingerprint is not None:
        merged[FINGERPRINT_KEY] = fingerprint.to_json()
    return merged


def merged_fingerprint(states: Sequence[dict[str, Any]]) -> StateFingerprint | None:
    """The fingerprint every rank's state shares, without rank and world size; the ranks
    must be 0..W-1 in order, all of world size W = len(states), and agree on the rest.
    ``None`` when no state has one (formats 1 and 2)."""
    raw = [s.get(FINGERPRINT_KEY) for s in states]
    if all(r is None for r in raw):
        return None
    if any(r is None for r in raw):
        lacking = [i for i, r in enumerate(raw) if r is None]
        raise StateError(f"rank states {lacking} have no fingerprint but the others do: pass "
                         "every rank's state_dict() from the same run")
    fps = [StateFingerprint.from_json(r, merged=False) for r in raw]
    ranks = [(f.rank, f.world_size) for f in fps]
    want = [(r, len(states)) for r in range(len(states))]
    if ranks != want:
        raise StateError(
            f"merge_rank_states needs the state of every rank, in rank order: got (rank, "
            f"world_size) {ranks} for {len(states)} states, expected {want}")
    first = fps[0].merged()
    for r, fp in enumerate(fps[1:], start=1):
        diffs = [d for d in dataclasses.asdict(first).items()
                 if d[0] not in RANK_FIELDS + DEAL_ONLY and getattr(fp, d[0]) != d[1]]
        if diffs:
            name, a = diffs[0]
            b = getattr(fp, name)
            raise StateError(f"rank states disagree on {name}: rank 0 has {a!r}, rank {r} has "
                             f"{b!r}; every rank's loader must be built the same way")
    return first


def _read_group(state: Any) -> Any:
    fp = state.get(FINGERPRINT_KEY) if isinstance(state, dict) else None
    return fp.get("read_group", 1) if isinstance(fp, dict) else 1


def one_per_group(states: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The states of a job run in reader groups, one per model group: every rank of a group
    draws the same samples, so its states agree (checked: progress and fingerprint) and one
    stands for the group. ``states`` are every rank's in rank order, or already one per
    group; without reader groups they are returned as they are."""
    kinds = {repr(_read_group(s)) for s in states}
    if kinds == {"1"}:
        return list(states)
    groups = sorted(kinds)
    size = _read_group(states[0])
    if len(kinds) > 1 or not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise StateError(f"rank states were saved under different read_group values "
                         f"({', '.join(groups)}): pass the states of one job, every rank's "
                         "state_dict() taken at the same step")
    n_groups = states[0][FINGERPRINT_KEY].get("world_size")
    if len(states) == n_groups:
        return list(states)  # one per group already
    if not isinstance(n_groups, int) or len(states) != n_groups * size:
        raise StateError(f"merge_rank_states got {len(states)} states saved with read_group="
                         f"{size} on {n_groups} model groups: pass every rank's state "
                         f"({n_groups} * {size}), in rank order, or one state per model group "
                         f"({n_groups})")
    out = []
    for g in range(n_groups):
        ranks = range(g * size, (g + 1) * size)
        first = states[ranks[0]]
        for r in ranks[1:]:
            for key in (PROGRESS_KEY, FINGERPRINT_KEY, SNAPSHOT_KEY):
                if states[r].get(key) != first.get(key):
                    raise StateError(
                        f"ranks {ranks[0]} and {r} are model group {g} (read_group={size}) "
                        f"and draw the same samples, but their states' {key} differ: rank "
                        f"{ranks[0]} has {first.get(key)!r}, rank {r} has "
                        f"{states[r].get(key)!r}; take every rank's state_dict() at the same "
                        "step, in rank order")
        out.append(first)
    return out
