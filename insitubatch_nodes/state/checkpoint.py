"""Loader state formats: what a checkpoint holds, and how one is checked and read back.

A rank's state nests each stage's state (``root``) under the format version, the progress
``merge_rank_states`` reads, the icechunk snapshot and the fingerprint; a merged state holds
the ``elastic`` history instead. ``InSituLoader`` writes and loads states through here, so
the format is described in one place and checked field by field before anything is read.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torchdata.nodes import BaseNode
from torchdata.nodes.loader import LoaderIterator

from ..errors import StateError
from ..graph_stats import first_node
from ..nodes import (
    AsyncFetchNode,
    ChunkPermuteNode,
    GatherNode,
    PinOrCudaNode,
    ReadPlanNode,
    ShuffleBufferNode,
    SplitNode,
    TransformNode,
)
from ..nodes.chunk_permute import parse_history
from ..nodes.state import Resumable, require_count, require_dict
from ..sampling.schedule import Resumption
from .fingerprint import StateFingerprint, check_fingerprint, parse_fingerprint
from .problems import StateProblems
from .ranks import (
    ELASTIC_KEY,
    FINGERPRINT_KEY,
    FORMAT_KEY,
    PROGRESS_KEY,
    SNAPSHOT_KEY,
    STATE_FORMAT,
)


def _nested_key(node: BaseNode) -> str | None:
    """Where ``node``'s state keeps its upstream's state, for the stages of this package
    (a foreign node nests it its own way, e.g. torchdata's ``Prefetcher``)."""
    if isinstance(node, (ShuffleBufferNode, ReadPlanNode, GatherNode, PinOrCudaNode,
                         AsyncFetchNode, TransformNode)):
        return node.SOURCE_KEY
    return None


def _levels(nodes: list[BaseNode], root_state: Any) -> Iterator[tuple[BaseNode, dict]]:
    """(node, its state) down the nested ``root_state``, alongside ``nodes`` (root first),
    as far as the stages of this package say where their upstream's state is (a foreign node
    nests it its own way, e.g. torchdata's ``Prefetcher``)."""
    d = root_state
    for node in nodes:
        if not isinstance(d, dict):
            return
        yield node, d
        key = _nested_key(node)
        if key is None:
            return
        d = d.get(key)


def state_progress(nodes: list[BaseNode], root_state: dict[str, Any]) -> dict[str, Any] | None:
    """Epoch, windows finished, draws taken in the head window and the elastic history,
    read from ``root_state`` by walking it alongside ``nodes`` (root first); ``None`` when
    the graph lacks a stage that says so."""
    offset = None
    for node, d in _levels(nodes, root_state):
        if isinstance(node, (ShuffleBufferNode, AsyncFetchNode)):
            # draws into the head window: the shuffle buffer's, or decoding in place the
            # fetch's (the other one's is 0)
            offset = (offset or 0) + d.get(node.OFFSET_KEY, 0)
        if isinstance(node, ChunkPermuteNode):
            if offset is None:
                return None
            return {"epoch": d[node.EPOCH_KEY], "window": d[node.POSITION_KEY],
                    "offset": offset, "history": d.get(node.HISTORY_KEY, [])}
    return None


def check_top_level(state: dict[str, Any], problems: StateProblems) -> bool:
    """A rank's state has ``root`` (a dict) and ``num_yielded`` (a count), a merged one
    ``elastic``; both may have the format, snapshot and fingerprint. Each problem is added
    to ``problems``, naming the field; True when the node states can be read on."""
    elastic = ELASTIC_KEY in state
    known = ({ELASTIC_KEY} if elastic else
             {LoaderIterator.ROOT_KEY, LoaderIterator.NUM_YIELDED_KEY, PROGRESS_KEY})
    known |= {FORMAT_KEY, SNAPSHOT_KEY, FINGERPRINT_KEY}
    unknown = sorted(set(state) - known)
    if unknown:
        problems.add(
            f"loader state has unknown field(s) {unknown} (a {'merged' if elastic else 'rank'} "
            f"state has {sorted(known)}): load a state saved by state_dict() or "
            "merge_rank_states")
    if elastic:
        return True
    if LoaderIterator.ROOT_KEY not in state:
        problems.add(
            f"loader state has no field {LoaderIterator.ROOT_KEY!r} (a rank's state, from "
            f"state_dict()) nor {ELASTIC_KEY!r} (a merged state, from merge_rank_states); it "
            f"has {sorted(state)}")
        readable = False
    else:
        readable = problems.check(require_dict, state, LoaderIterator.ROOT_KEY,
                                  "loader") is not None
    problems.check(require_count, state, LoaderIterator.NUM_YIELDED_KEY, "loader")
    return readable


def parse_elastic(el: Any, problems: StateProblems) -> tuple[int, list[Resumption]] | None:
    """(epoch, history) of a merged state's ``elastic`` field, checked field by field;
    ``None`` with each problem added to ``problems``."""
    if not isinstance(el, dict) or sorted(el) != ["epoch", "history"]:
        problems.add(f"loader state field {ELASTIC_KEY!r} must be "
                     f"{{'epoch': ..., 'history': [...]}}, got {el!r}")
        return None
    epoch = problems.check(require_count, el, "epoch", f"loader {ELASTIC_KEY!r}")
    history = problems.check(parse_history, el["history"],
                             f"loader state field '{ELASTIC_KEY}.history'")
    if history is not None and not history:
        problems.add(f"loader state field '{ELASTIC_KEY}.history' is empty: a merged "
                     "state records at least the resume that made it")
        return None
    return None if epoch is None or history is None else (epoch, list(history))


@dataclass(frozen=True)
class Resumed:
    """Where a loaded state resumes on this rank: its epoch, the draws (samples or anchors)
    this rank has in that epoch, and how many of them are still to be served."""

    epoch: int
    draws: int
    left: int

    def finished(self, batch_size: int, drop_last: bool) -> bool:
        """Nothing left to serve: the next ``iter()`` rolls over to the next epoch."""
        return self.left < batch_size if drop_last else self.left == 0


def check_root_state(nodes: list[BaseNode], root_state: Any, problems: StateProblems,
                     ) -> tuple[dict[str, Any], Resumed] | None:
    """Check ``root_state`` against the graph before anything is read: every nested state
    a dict, counters integers >= 0, the scheduler's position within its epoch's windows and
    the draws taken within the head window's. Each problem is added to ``problems``, naming
    the node and field. Returns the progress ``state_progress`` reads and where it resumes
    (the draws of the state's epoch on this rank, an elastic history included); ``None``
    without the standard stages or after a problem."""
    offset = None
    d = root_state
    owner = ShuffleBufferNode.__name__  # the stage whose offset counts (place_offset)
    for node in nodes:
        if isinstance(node, (ShuffleBufferNode, AsyncFetchNode)):
            got = problems.check(require_count, d, node.OFFSET_KEY, node)
            if got:
                owner = type(node).__name__
            offset = (offset or 0) + (got or 0)
        if isinstance(node, ChunkPermuteNode):
            resumed = _check_permute_state(node, d, offset, owner, problems)
            progress = state_progress(nodes, root_state) if resumed is not None else None
            return None if progress is None or resumed is None else (progress, resumed)
        key = _nested_key(node)
        if key is None:
            return None  # a foreign node nests its upstream's state its own way
        d = problems.check(require_dict, d, key, node)
        if d is None:
            return None
    return None


def _check_permute_state(node: ChunkPermuteNode, d: dict[str, Any], offset: int | None,
                         owner: str, problems: StateProblems) -> Resumed | None:
    """The scheduler's fields, each checked; then, if the whole state has no other problem
    (the schedule it is checked against is this loader's, and the draws counted above are
    sound), its position and the head window's draws against the schedule they resume."""
    problems.check(require_count, d, node.EPOCH_KEY, node)
    problems.check(require_count, d, node.POSITION_KEY, node)
    problems.check(parse_history, d.get(node.HISTORY_KEY, []),
                   f"{type(node).__name__} state field {node.HISTORY_KEY!r}")
    if len(problems):
        return None
    schedule = problems.check(node.check_state, d, offset, owner)
    if schedule is None:
        return None
    epoch, pos, _ = node.parse_state(d)
    taken = sum(w.n_final for w in schedule.windows[:pos]) + (offset or 0)
    return Resumed(epoch, schedule.target, schedule.target - taken)


_PROGRESS_FIELDS = {"epoch": "ChunkPermuteNode state field 'epoch'",
                    "window": "ChunkPermuteNode state field 'position'",
                    "offset": "the draws into the head window (state field 'offset' of "
                              "ShuffleBufferNode or, decoding in place, AsyncFetchNode)",
                    "history": "ChunkPermuteNode state field 'history'"}


def progress_mismatch(progress: Any, found: dict[str, Any]) -> str:
    """Which field of the state's progress disagrees with the node states, both named."""
    if not isinstance(progress, dict):
        return (f"loader state field {PROGRESS_KEY!r} must be a dict like {found!r}, "
                f"got {progress!r}")
    for key, where in _PROGRESS_FIELDS.items():
        if progress.get(key) != found[key]:
            return (f"loader state field '{PROGRESS_KEY}.{key}' is {progress.get(key)!r}, but "
                    f"{where} is {found[key]!r}: the state was edited (merge_rank_states "
                    "reads the progress, the loader the node states; they must agree)")
    return (f"loader state field {PROGRESS_KEY!r} has unknown fields "
            f"{sorted(set(progress) - set(found))} (expected {sorted(found)})")


def elastic_root_state(nodes: list[BaseNode], epoch: int,
                       history: list[Resumption]) -> dict[str, Any]:
    """The graph state that starts ``epoch`` after ``history`` (an elastic resume): the
    ``ChunkPermuteNode``'s start state, wrapped by each stage above it through its own
    ``start_state``; restored by the ordinary ``reset(state)`` of every stage."""
    idx = next((i for i, n in enumerate(nodes) if isinstance(n, ChunkPermuteNode)), None)
    if idx is None:
        raise StateError("an elastic (merged) state needs a ChunkPermuteNode in the graph")
    state: dict[str, Any] = ChunkPermuteNode.start_state(epoch, history)
    for node in reversed(nodes[:idx]):
        if not isinstance(node, Resumable):
            raise StateError(
                f"cannot resume a merged state through {type(node).__name__}: an elastic "
                "resume needs every stage below ChunkPermuteNode to have start_state()")
        state = node.start_state(state)
    return state


def upgrade_v1(nodes: list[BaseNode], root_state: Any) -> None:
    """Format 1 -> 2, in place: ``ReadPlanNode`` counted windows and ``ChunkPermuteNode``
    chunks; now the scheduler counts windows and the planner keeps no counter."""
    for node, d in _levels(nodes, root_state):
        if isinstance(node, ReadPlanNode) and "window" in d:
            upstream = d.get(node.SOURCE_KEY)
            if isinstance(upstream, dict):
                upstream[ChunkPermuteNode.POSITION_KEY] = d.pop("window")
            return



def upgrade_v3(nodes: list[BaseNode], root_state: Any) -> None:
    """Formats 1-3 -> 4, in place: decoding in place, the fetch (not the shuffle buffer)
    counts the draws delivered into its head window, and every fetch state has the count
    (0 for whole windows)."""
    shuffle: dict | None = None
    for node, d in _levels(nodes, root_state):
        if isinstance(node, ShuffleBufferNode):
            shuffle = d
        if isinstance(node, AsyncFetchNode):
            if node.OFFSET_KEY not in d:
                moved = 0
                if node.in_place and shuffle is not None:
                    moved = shuffle.get(ShuffleBufferNode.OFFSET_KEY, 0)
                    shuffle[ShuffleBufferNode.OFFSET_KEY] = 0
                d[node.OFFSET_KEY] = moved
            return


def place_offset(nodes: list[BaseNode], root_state: Any) -> None:
    """The draws delivered into the head window, kept where this graph counts them: the
    fetch's state when it decodes in place, else the shuffle buffer's (a state saved in
    place resumes on the gather path)."""
    fetch = shuffle = None
    for node, d in _levels(nodes, root_state):
        if isinstance(node, ShuffleBufferNode):
            shuffle = d
        if isinstance(node, AsyncFetchNode):
            fetch = (node, d)
            break
    if fetch is None or shuffle is None:
        return
    node, d = fetch
    key = ShuffleBufferNode.OFFSET_KEY
    if node.OFFSET_KEY not in d or key not in shuffle:
        return  # check_root_state names the missing field
    values = (d[node.OFFSET_KEY], shuffle[key])
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return  # check_root_state names the field
    total = sum(values)
    d[node.OFFSET_KEY], shuffle[key] = (total, 0) if node.in_place else (0, total)


def fingerprint_of_nodes(nodes: list[BaseNode]) -> StateFingerprint | None:
    """What a loader's states record, read off its graph's stages (build_loader's or a
    hand-built one): everything that decides which samples its counters point at
    (``fingerprint.StateFingerprint``). ``None`` unless the graph has a ``SplitNode``, a
    ``ChunkPermuteNode`` and a ``ShuffleBufferNode``."""
    split = first_node(nodes, SplitNode)
    permute = first_node(nodes, ChunkPermuteNode)
    shuffle = first_node(nodes, ShuffleBufferNode)
    if split is None or permute is None or shuffle is None:
        return None
    fetch = first_node(nodes, AsyncFetchNode)
    grid = permute.grid
    return StateFingerprint(
        manifest=split.manifest.content_hash, split=split.split, seed=permute.seed,
        n_samples=grid.n_samples, chunk_size=grid.chunk_size, first=grid.first, end=grid.end,
        block_chunks=permute.block_chunks, uneven=permute.uneven,
        contiguous=permute.contiguous, run_chunks=permute.run_chunks or 0,
        excluded=_excluded_hash(split.exclude), batch_size=shuffle.batch_size,
        drop_last=shuffle.drop_last, rank=permute.rank, world_size=permute.world_size,
        in_place=fetch is not None and fetch.arena is not None, every=grid.every,
        phase=grid.phase,
        members=json.dumps(list(split.manifest.members)) if split.manifest.members else None)


def _excluded_hash(excluded: tuple[int, ...]) -> str:
    return (hashlib.sha256(json.dumps(list(excluded)).encode()).hexdigest()[:16]
            if excluded else "")


def rank_state(nodes: list[BaseNode], root_state: dict[str, Any], num_yielded: int,
               fingerprint: StateFingerprint | None, snapshot_id: str | None,
               ) -> dict[str, Any]:
    """The loader state for the graph state ``root_state`` after ``num_yielded`` batches:
    the nested node states, the format version, the progress ``merge_rank_states`` reads
    (when the graph has the standard stages), the icechunk snapshot and the fingerprint
    ``load_state_dict`` checks."""
    state: dict[str, Any] = {LoaderIterator.ROOT_KEY: root_state,
                             LoaderIterator.NUM_YIELDED_KEY: num_yielded,
                             FORMAT_KEY: STATE_FORMAT}
    if fingerprint is not None:
        state[FINGERPRINT_KEY] = fingerprint.to_json()
    progress = state_progress(nodes, root_state)
    if progress is not None:
        state[PROGRESS_KEY] = progress
    if snapshot_id is not None:
        state[SNAPSHOT_KEY] = snapshot_id
    return state


def read_format(state: dict[str, Any]) -> int:
    """Pop the state's format version (1 when absent); one this version cannot read is an
    error naming the formats it reads."""
    fmt = state.pop(FORMAT_KEY, 1)
    if isinstance(fmt, bool) or not isinstance(fmt, int) or fmt not in range(1, STATE_FORMAT + 1):
        raise StateError(f"loader state field {FORMAT_KEY!r} is {fmt!r}; this version of "
                         f"insitubatch_nodes reads formats 1 to {STATE_FORMAT}")
    return fmt


def check_snapshot(state: dict[str, Any], snapshot_id: str | None,
                   allow_change: bool) -> None:
    """Pop the icechunk snapshot the state was saved on and compare it with the one the
    source reads now: a moved branch would resume on other data unless allowed."""
    saved = state.pop(SNAPSHOT_KEY, None)
    if saved is not None and not isinstance(saved, str):
        raise StateError(f"loader state field {SNAPSHOT_KEY!r} must be an icechunk "
                         f"snapshot id (a string), got {saved!r}")
    if (saved is not None and snapshot_id is not None and saved != snapshot_id
            and not allow_change):
        raise StateError(
            f"this loader state was saved while reading icechunk snapshot {saved}, but the "
            f"source now resolves to snapshot {snapshot_id} (the branch moved since). "
            "Resume on the saved snapshot (open_icechunk(..., snapshot_id=...)) or build "
            "the loader with allow_snapshot_change=True to continue on the new data."
        )


def check_state_fingerprint(state: dict[str, Any], fmt: int | None,
                            fingerprint: StateFingerprint | None, from_nodes: bool,
                            allow_change: bool, problems: StateProblems) -> None:
    """Pop the state's fingerprint and compare it with the loader's (``state/fingerprint.py``);
    each problem is added to ``problems``. States of formats 1 and 2 have none and load
    with a warning, as do a hand-built graph's (``from_nodes``: its fingerprint was read
    off its nodes); ``fmt`` is ``None`` when the state's format is not one this version
    reads. The warning points at ``load_state_dict``'s caller."""
    raw = state.pop(FINGERPRINT_KEY, None)
    if fingerprint is None:
        return  # a graph without the standard stages: nothing to compare with
    if raw is None:
        if fmt is None:
            return  # read_format named the format; without it, nothing to say here
        # A hand-built graph's states carried no fingerprint before it was read off the
        # nodes: those load with the warning below.
        if fmt >= 3 and not from_nodes:
            problems.add(
                f"loader state has no field {FINGERPRINT_KEY!r}, which every format-"
                f"{fmt} state saved by build_loader has: load a state saved by "
                "state_dict() or merge_rank_states")
            return
        warnings.warn(
            f"this loader state has format {fmt}, which records no fingerprint, so it "
            "cannot be checked against this loader (manifest, split, seed, ranks, "
            "shuffle): make sure it was saved by a loader built the same way. "
            "state_dict() after resuming gives a checked (format 3) state.",
            UserWarning, stacklevel=4)
        return
    saved = parse_fingerprint(raw, ELASTIC_KEY in state, problems)
    if saved is not None:
        problems.check(check_fingerprint, saved, fingerprint, allow_change)


def loadable_state(nodes: list[BaseNode], state: dict[str, Any], fmt: int,
                   problems: StateProblems) -> tuple[dict[str, Any], Resumed | None]:
    """A checked state (top level, format, snapshot and fingerprint popped) as the rank
    state torchdata's ``Loader`` loads: a merged state becomes the graph state that starts
    its epoch, a format-1 state is upgraded, and the progress must agree with the node
    states; each problem is added to ``problems``. Also where it resumes on this rank;
    ``None`` without the stages (or after a problem)."""
    progress = state.pop(PROGRESS_KEY, None)
    if ELASTIC_KEY in state:
        parsed = parse_elastic(state[ELASTIC_KEY], problems)
        root = None if parsed is None else problems.check(elastic_root_state, nodes, *parsed)
        if root is None:
            return state, None
        state = {LoaderIterator.ROOT_KEY: root, LoaderIterator.NUM_YIELDED_KEY: 0}
    else:
        if fmt == 1:
            upgrade_v1(nodes, state[LoaderIterator.ROOT_KEY])
        if fmt < 4:
            upgrade_v3(nodes, state[LoaderIterator.ROOT_KEY])
        place_offset(nodes, state[LoaderIterator.ROOT_KEY])
    checked = check_root_state(nodes, state[LoaderIterator.ROOT_KEY], problems)
    if progress is not None and checked is not None and progress != checked[0]:
        problems.add(progress_mismatch(progress, checked[0]))
    elif progress is not None and checked is None and not isinstance(progress, dict):
        problems.add(f"loader state field {PROGRESS_KEY!r} must be a dict with fields "
                     f"{sorted(_PROGRESS_FIELDS)}, got {progress!r}")
    return state, (None if checked is None else checked[1])


def check_loader_state(nodes: list[BaseNode], state: dict[str, Any], *,
                       snapshot_id: str | None, allow_snapshot_change: bool,
                       fingerprint: StateFingerprint | None, from_nodes: bool,
                       allow_state_change: bool) -> tuple[dict[str, Any], Resumed | None]:
    """``load_state_dict``'s checks of a state (plain JSON data, a copy: fields are
    popped): its top level, format, snapshot, fingerprint and node states. Every problem
    found is named in one ``StateError`` (``state/problems.py``); checking stops only
    where it cannot go on (no node states to read, a format this version cannot read, a
    merged state's history unreadable). Returns the rank state torchdata's ``Loader``
    loads and where it resumes (``loadable_state``)."""
    problems = StateProblems()
    readable = check_top_level(state, problems)
    fmt = problems.check(read_format, state)
    problems.check(check_snapshot, state, snapshot_id, allow_snapshot_change)
    check_state_fingerprint(state, fmt, fingerprint, from_nodes, allow_state_change, problems)
    resumed = None
    if readable and fmt is not None:
        state, resumed = loadable_state(nodes, state, fmt, problems)
    problems.raise_any()
    return state, resumed
