"""Combining the loader states of all ranks, for resuming an epoch on another world size.

``merge_rank_states`` reads each rank's progress (windows finished, draws taken in the
head window) out of its ``state_dict()`` and records it as one ``Resumption``. Any rank of a
new world size loads the merged state; the schedule then deals what is left of the epoch
(see ``schedule.py``), so over the epoch no sample is lost and none repeats.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .schedule import Progress, Resumption

ELASTIC_KEY = "elastic"
SNAPSHOT_KEY = "snapshot_id"


def _chain(state: dict[str, Any]) -> list[dict[str, Any]]:
    out, d = [], state.get("root", state)
    while isinstance(d, dict):
        out.append(d)
        d = d.get("source")
    return out


def rank_progress(state: dict[str, Any]) -> tuple[int, tuple[Resumption, ...], Progress]:
    """(epoch, history, progress) of one rank's loader state."""
    chain = _chain(state)
    try:
        shuffle_i = next(i for i, d in enumerate(chain) if "offset" in d)
        plan = next(d for d in chain[shuffle_i + 1:] if "window" in d)
        perm = next(d for d in chain if "epoch" in d and "position" in d)
    except StopIteration:
        raise ValueError(
            "not an insitubatch loader state: expected nested node states with 'offset' "
            "(ShuffleBufferNode), 'window' (ReadPlanNode) and 'epoch' (ChunkPermuteNode)"
        ) from None
    history = tuple(Resumption.from_json(h) for h in perm.get("history", ()))
    progress = Progress(int(plan["window"]), int(chain[shuffle_i]["offset"]))
    return int(perm["epoch"]), history, progress


def merge_rank_states(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One state for the whole job, from the ``state_dict()`` of every rank, in rank order.

    Load it with ``loader.load_state_dict(merged)`` on every rank of the new job, whatever
    its world size: the rest of the epoch is re-dealt, then epochs run normally.
    """
    if not states:
        raise ValueError("merge_rank_states needs the state of every rank, got none")
    parsed = [rank_progress(s) for s in states]
    epochs = {p[0] for p in parsed}
    histories = {repr([r.to_json() for r in p[1]]) for p in parsed}
    if len(epochs) != 1 or len(histories) != 1:
        raise ValueError(
            f"rank states come from different epochs or resumes (epochs {sorted(epochs)}); "
            "take every rank's state_dict() at the same step"
        )
    snapshots = {s.get(SNAPSHOT_KEY) for s in states}
    if len(snapshots) != 1:
        raise ValueError(f"rank states were read from different icechunk snapshots: {snapshots}")
    epoch, history, _ = parsed[0]
    resumption = Resumption(len(states), tuple(p[2] for p in parsed))
    merged: dict[str, Any] = {ELASTIC_KEY: {"epoch": epoch, "history": [
        h.to_json() for h in (*history, resumption)]}}
    if (snap := snapshots.pop()) is not None:
        merged[SNAPSHOT_KEY] = snap
    return merged
