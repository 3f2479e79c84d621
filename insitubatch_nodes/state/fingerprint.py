"""What a loader state was taken under, so it is never applied to another sampling.

A state holds only counters (windows finished, draws taken); they mean the right samples
only under the same manifest, split, seed, sample grid, ranks and shuffle parameters. Every
state records those as a ``StateFingerprint``; loading compares them field by field.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import StateError
from ..sampling.schedule import UNEVEN_POLICIES
from .problems import StateProblems

# Fields whose change leaves the rest of the epoch exactly-once: the counters count windows
# and draws, never batches, so another batch size (or drop_last) only cuts the remaining
# draws differently. allow_state_change=True accepts these and nothing else. Except the
# batch size when decoding in place: there batches are planned from the epoch's start, so a
# resume point is a batch boundary only for the batch size it was saved with.
SOUND_CHANGES: tuple[str, ...] = ("batch_size", "drop_last")
_IN_PLACE_BATCH = ("this loader decodes straight into batches planned from the epoch's "
                   "start, so a state resumes only with the batch size it was saved with: "
                   "build it with the saved batch_size, and change it for an epoch started "
                   "without a state (or resume with in_place=False and the saved "
                   "block_chunks, where batches are cut as draws come)")
# Per-rank fields; a merged (elastic) state has none: any world size may load it.
RANK_FIELDS: tuple[str, ...] = ("rank", "world_size")
# Not compared for a merged state: the resumed generation deals the rest of the epoch
# afresh over the new ranks. ``uneven`` is compared: the old ranks' schedules, against which
# their recorded progress is checked and the rest is found, are rebuilt with it (a merged
# state loaded under another policy was refused as "edited").
MERGED_FREE: tuple[str, ...] = RANK_FIELDS
# Recorded since a later version: a state without it loads, the field unknown.
OPTIONAL_FIELDS: tuple[str, ...] = ("in_place", "every", "phase", "members", "read_group")
# Saved, never compared: with reader groups ``rank``/``world_size`` are the deal's (model
# group ``r // G`` of ``W // G``), which is all the counters depend on, so a state resumes
# under another read_group wherever the deal is the same (4 ranks in groups of 2 as 2
# ranks alone), and merged states on any group count. ``read_group`` says how the ranks
# were grouped (merge_rank_states takes one state per group); saved only when above 1.
DEAL_ONLY: tuple[str, ...] = ("read_group",)
# Fields of the loader's own fingerprint that say how it runs, not what it plans: a state
# saved under threads, workers or either path resumes under any other, so they are not
# saved, and are ignored in states that carry them.
NOT_SAVED: tuple[str, ...] = ("in_place",)

_HOW = {
    "manifest": "load it into a loader built with the split manifest it was saved with "
                "(SplitManifest.from_json of that file), or start this one fresh",
    "split": "each split's loader has its own state: load it into the loader of the split "
             "it was saved from, or start this one fresh",
    "seed": "the seed decides the order of the rest of the epoch: build the loader with the "
            "saved seed (a new seed can start with a fresh loader)",
    "n_samples": "the sample grid changed (another store, or other time steps): resume "
                 "on the store and steps= the state was saved with",
    "chunk_size": "the sample grid changed (another store or chunking): resume on the store "
                  "the state was saved with",
    "first": "the valid samples changed (another history of steps=): resume with the "
             "steps= the state was saved with",
    "end": "the valid samples changed (another lead of steps=): resume with the "
           "steps= the state was saved with",
    "every": "the anchors kept (sampling.every) changed: build the loader with the saved "
             "every=",
    "phase": "the anchors kept (sampling.every) fall on other steps: build the loader with "
             "the saved every=",
    "members": "resume on the stores the state was saved with, or start this loader fresh",
    "block_chunks": "windows are cut by block_chunks: build the loader with the saved value",
    "uneven": "the equal-steps policy changes every rank's share: build with the saved value",
    "contiguous": "time steps deal contiguous blocks: build with the saved steps= setting",
    "run_chunks": "time steps deal runs of run_chunks adjacent chunks: build the loader with "
                  "the saved run_chunks (and steps=)",
    "excluded": "the chunks left out for the store's missing dates, because their time "
                "steps reach another split or because they hold no anchor whose steps fit, "
                "differ (the store's missing_dates, steps= or the split changed, or the state "
                "was saved by a version of insitubatch_nodes before 2026-11-25, which left out "
                "chunks by the steps' span rather than the steps read): resume on the "
                "store, split and steps= the state was saved with, or start the epoch afresh",
    "rank": "a rank's state belongs to that rank: load each rank's own state, or to resume "
            "on another world size load merge_rank_states(all ranks' states) on every rank "
            "(with read_group=G the rank is the model group's, rank // G)",
    "world_size": "to resume on another world size, load merge_rank_states(all ranks' "
                  "states) on every rank (with read_group=G the world size is the number "
                  "of model groups, world_size // G)",
    "batch_size": "continuing is sound (the rest of the epoch is served exactly once in "
                  "batches of the new size; num_yielded keeps counting batches): build the "
                  "loader with allow_state_change=True, or with the saved value",
    "drop_last": "continuing is sound (only the epoch's last short batch differs): build the "
                 "loader with allow_state_change=True, or with the saved value",
}


@dataclass(frozen=True)
class StateFingerprint:
    """Everything that decides which samples a loader state's counters point at.

    ``manifest`` is ``SplitManifest.content_hash``; ``n_samples``/``chunk_size`` and the
    valid samples ``[first, end)`` the grid the schedule deals (anchors, with time steps);
    ``rank``/``world_size`` are ``None`` in a merged state.
    """

    manifest: str
    split: str
    seed: int
    n_samples: int
    chunk_size: int
    first: int
    end: int
    block_chunks: int
    uneven: str
    contiguous: bool
    run_chunks: int  # chunks per contiguous run with time steps; 0 without
    excluded: str  # hash of the chunks left out (missing dates, split edges; "" when none)
    batch_size: int
    drop_last: bool
    rank: int | None = None
    world_size: int | None = None
    # Whether this loader decodes into batches planned from the epoch's start (then the
    # batch size cannot change mid-epoch). Not a plan parameter: never saved, never compared
    # (states saved before 2026-11-29 carry it; it is read and ignored). A gathered state
    # resumes in place exactly, its resume point being one of the same batch edges; one
    # that is not (a batch size changed on the gather path) is refused by the fetch, naming
    # the offset (``fetch.batches.BatchCut.check_head``).
    in_place: bool | None = None
    # The anchors kept: indices ≡ phase (mod every) (sampling.every); None in older states.
    every: int | None = None
    phase: int | None = None
    # A composed source's stores (``SplitManifest.members``, a JSON list of texts); None
    # for one store. A state resumes only into the same composition.
    members: str | None = None
    # Ranks per model group (sampling.read_group) when above 1; ``rank``/``world_size`` are
    # then the model group's and the number of groups. Saved, not compared (``DEAL_ONLY``).
    read_group: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items()
                if k not in NOT_SAVED
                and not ((k in RANK_FIELDS or k in OPTIONAL_FIELDS) and v is None)}

    @classmethod
    def from_json(cls, obj: object, *, merged: bool) -> StateFingerprint:
        """Parse a state's fingerprint; a field missing, extra or of the wrong type is a
        ValueError naming each (a merged state has no rank fields)."""
        problems = StateProblems()
        fingerprint = parse_fingerprint(obj, merged, problems)
        problems.raise_any()
        assert fingerprint is not None
        return fingerprint

    def merged(self) -> StateFingerprint:
        """The fingerprint of a merged state: the same, without rank and world size (nor
        read_group: a merged state loads on any number of model groups)."""
        return dataclasses.replace(self, rank=None, world_size=None, read_group=None)

    def differences(self, other: StateFingerprint) -> list[tuple[str, Any, Any]]:
        """(field, this value, other value) for every field that differs; where either side
        is merged (no rank), the ``MERGED_FREE`` fields are not compared."""
        merged = self.rank is None or other.rank is None
        out = []
        for f in dataclasses.fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if ((merged and f.name in MERGED_FREE) or f.name in NOT_SAVED
                    or f.name in DEAL_ONLY):
                continue
            if f.name in OPTIONAL_FIELDS and (a is None or b is None):
                continue
            if a != b:
                out.append((f.name, a, b))
        return out


# Each field's JSON type, from the annotations ("int | None" for the rank fields is int).
_FIELD_KINDS: dict[str, type] = {
    f.name: {"str": str, "bool": bool, "int": int}[str(f.type).split(" |")[0]]
    for f in dataclasses.fields(StateFingerprint)}


def parse_fingerprint(obj: object, merged: bool,
                      problems: StateProblems) -> StateFingerprint | None:
    """A state's fingerprint, or ``None`` with each field missing, extra or of the wrong
    type (or value) added to ``problems`` (a merged state has no rank fields)."""
    if not isinstance(obj, Mapping):
        problems.add(f"loader state field 'fingerprint' must be a dict, got {obj!r}")
        return None
    before = len(problems)
    want = [f.name for f in dataclasses.fields(StateFingerprint)
            if not (merged and f.name in RANK_FIELDS)]
    missing = sorted(set(want) - set(obj) - set(OPTIONAL_FIELDS))
    extra = sorted(set(obj) - set(want))
    if missing or extra:
        kind = "a merged" if merged else "a rank's"
        problems.add(
            f"loader state field 'fingerprint' of {kind} state has "
            f"{'no fields ' + str(missing) if missing else ''}"
            f"{' and ' if missing and extra else ''}"
            f"{'unknown fields ' + str(extra) if extra else ''} (expected {sorted(want)}); "
            "load a state saved by state_dict() or merge_rank_states")
    values = {}
    for name in want:
        if name not in obj:  # missing (named above), or optional and an older state's
            continue
        v = obj[name]
        field_kind = _FIELD_KINDS[name]
        ok = (isinstance(v, bool) if field_kind is bool else
              isinstance(v, int) and not isinstance(v, bool) and v >= 0
              if field_kind is int else isinstance(v, str))
        if not ok:
            what = "an integer >= 0" if field_kind is int else field_kind.__name__
            problems.add(f"loader state field 'fingerprint.{name}' must be {what}, got {v!r}")
        elif name == "read_group" and v < 1:
            problems.add(f"loader state field 'fingerprint.read_group' must be an integer "
                         f">= 1, got {v!r}")
        elif name == "uneven" and v not in UNEVEN_POLICIES:
            problems.add(f"loader state field 'fingerprint.uneven' must be one of "
                         f"{UNEVEN_POLICIES}, got {v!r}")
        else:
            values[name] = v
    return None if len(problems) > before else StateFingerprint(**values)


def _members_line(saved: str, now: str) -> str:
    """The first member of a composed source that differs from the saved one, named."""
    a, b = json.loads(saved), json.loads(now)
    how = ("resume on the stores the state was saved with (the same members, snapshots and "
           "chunking), or start this loader fresh")
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return f"members: member {i} was {x!r} when saved, is {y!r} now ({how})"
    return f"members: the state was saved on {len(a)} stores, this loader reads {len(b)} ({how})"


def check_fingerprint(saved: StateFingerprint, current: StateFingerprint,
                      allow_state_change: bool = False) -> None:
    """Refuse a state saved under ``saved`` for a loader built as ``current``: one
    ValueError naming every differing field, both values and how to proceed. With
    ``allow_state_change`` the ``SOUND_CHANGES`` pass (the batch size not when ``current``
    decodes in place); no other change ever does."""
    in_place = bool(current.in_place)
    how = {**_HOW, "batch_size": _IN_PLACE_BATCH} if in_place else _HOW
    sound = set(SOUND_CHANGES) - ({"batch_size"} if in_place else set())
    diffs = [d for d in saved.differences(current)
             if not (allow_state_change and d[0] in sound)]
    if not diffs:
        return
    lines = [_members_line(a, b) if name == "members" else
             f"{name}: saved {a!r}, this loader {b!r} ({how[name]})" for name, a, b in diffs]
    raise StateError("this loader state was saved by a loader built differently, so its "
                     "counters would point at other samples; " + "; ".join(lines))
