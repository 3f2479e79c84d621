"""``build_loader``: the standard graph in a ``torchdata.nodes.Loader`` that resumes exactly.

The graph is wired by ``graph.py`` from a ``LoaderConfig``; this module is the loader
around it: exact resume (two torchdata 0.11 defects fixed), stats and shutdown. The state
formats it writes and loads (versions, elastic resume) are ``state/checkpoint.py``'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch
from torchdata.nodes import BaseNode, Loader
from torchdata.nodes.loader import LoaderIterator

from .config import LoaderConfig, check_split_args
from .errors import ConfigError, ConfigTypeError, LoaderUsageError, StateError, UnknownNameError
from .graph import Resolved, build_graph, resolve
from .graph_stats import collect_stats, current_epoch, first_node, maybe_log
from .memory.ledger import MemoryLedger
from .metrics.counters import ConsumerMeter
from .metrics.loader_stats import LoaderStats
from .nodes import AsyncFetchNode, ChunkPermuteNode, GatherNode, NormalizeNode, ShuffleBufferNode
from .nodes.read_groups import axis_from_end
from .nodes.state import copy_state, shutdown_source
from .state.checkpoint import (
    Resumed,
    check_loader_state,
    fingerprint_of_nodes,
    rank_state,
)
from .state.fingerprint import StateFingerprint
from .store.source import Source
from .store.splits import SplitManifest

__all__ = ["InSituLoader", "build_loader"]


_AHEAD_NONE: Any = object()  # no item looked ahead to


class _EpochIterator(BaseNode):
    """One epoch of the loader's graph, as torchdata's ``LoaderIterator`` serves it (state
    ``{"root": ..., "num_yielded": ...}``, a look-ahead by ``has_next()`` after a restore),
    written here on ``BaseNode``'s public protocol, so no torchdata private attribute is
    read or written. Unlike torchdata 0.11's, it counts the item it looked ahead to once
    (upstream issue 1453) and forgets the state before the look-ahead on every ``reset``.

    An error escaping the graph (a failed read, a transform's error, an interrupt) may come
    after a stage took the failed batch's draws from upstream, so the graph's state already
    counts that batch delivered. The graph goes back to the state after the last batch
    delivered (kept at each one: ~3 us), so asking again serves the failed batch, and a
    ``state_dict()`` taken after the error resumes at it; a lasting failure raises again."""

    ROOT_KEY = LoaderIterator.ROOT_KEY
    NUM_YIELDED_KEY = LoaderIterator.NUM_YIELDED_KEY

    def __init__(self, loader: InSituLoader) -> None:
        super().__init__()
        self.loader = loader
        self.root = loader.root
        self.num_yielded = 0  # batches delivered this epoch
        self._ahead: Any = _AHEAD_NONE  # the item has_next() pulled, not yet delivered
        self._ahead_state: dict[str, Any] | None = None  # the state before it
        self._busy = threading.Lock()
        self._delivered: dict[str, Any] | None = None  # set by reset()
        self._ended = False  # the epoch raised StopIteration (nothing left to go on with)

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is not None:
            self.root.reset(initial_state[self.ROOT_KEY])
            self.num_yielded = initial_state[self.NUM_YIELDED_KEY]
        else:
            self.root.reset(None)
            self.num_yielded = 0
        self._ahead, self._ahead_state = _AHEAD_NONE, None
        self._ended = False
        self._delivered = self.root.state_dict()
        ring = self.loader._recent_states
        if ring is not None:
            # States are keyed by batches delivered *this epoch*: never answer from another.
            ring.clear()

    def has_next(self) -> bool:
        """Whether the epoch has another batch: pulled now and kept for the next ``next()``
        (the state stays the one before it until then)."""
        if self._ahead is _AHEAD_NONE:
            self._ahead_state = self.get_state()
            with contextlib.suppress(StopIteration):
                self._ahead = self.next()
        return self._ahead is not _AHEAD_NONE

    def get_state(self) -> dict[str, Any]:
        if self._ahead_state is not None:
            return self._ahead_state
        return {self.ROOT_KEY: self.root.state_dict(), self.NUM_YIELDED_KEY: self.num_yielded}

    def rewind(self, restart: bool) -> None:
        """The graph as it was after the last batch delivered, its work in flight dropped
        (``InSituLoader.close``): iterating on serves the next batch, fetched again. With
        ``restart`` (nothing of an epoch begun afresh was asked for) the epoch is started
        again instead: a restored state counts as begun, and the next iter() would move on.
        Skipped once the epoch ended (its state says so; with ``drop_last`` the state after
        the last batch would point at the dropped rows) and while another thread is inside
        ``next()`` (its wait fails, and that rewinds)."""
        if self._delivered is None or self._ended or not self._busy.acquire(blocking=False):
            return
        try:
            self.root.reset(None if restart else copy_state(self._delivered))
        finally:
            self._busy.release()

    def _go_back(self, error: BaseException) -> None:
        """After ``error``: the graph as it was after the last batch delivered."""
        assert self._delivered is not None
        try:
            self.root.reset(copy_state(self._delivered))  # kept whole for another error
        except BaseException as e:  # the error the caller sees stays the first one
            error.add_note(f"insitubatch: going back to the state after batch "
                           f"{self.num_yielded} of this epoch failed too: {e!r}")

    def next(self) -> Any:  # noqa: D102
        # One consumer at a time: two threads drawing from one graph break exactly-once
        # silently (draws taken twice, windows let go early). Refused, not serialised.
        busy = False
        try:
            self.loader.check_not_shut_down()
            busy = self._busy.acquire(blocking=False)
            if not busy:
                raise LoaderUsageError("this loader is already being iterated by another thread: "
                                       "a loader serves one consumer (build one loader per "
                                       "consumer, or hand batches on through a queue)")
            return self._next_item()
        finally:
            if busy:
                self._busy.release()

    def _next_item(self) -> Any:
        if self._ahead is not _AHEAD_NONE:
            item, self._ahead, self._ahead_state = self._ahead, _AHEAD_NONE, None
        else:
            meter = self.loader._meter
            before = self._delivered
            t0 = t1 = time.perf_counter()
            try:
                item = next(self.root)
                t1 = time.perf_counter()
                # Everything up to the return is undone on an error (an interrupt landing
                # here included): the batch is not delivered until it is returned.
                state = self.root.state_dict()
                self.num_yielded += 1
                self._delivered = state
                if meter.next_log is not None:
                    maybe_log(self.loader.nodes(), meter, self.loader.resident_bound, t1)
                # Recorded when the item is pulled: an item looked ahead to (by has_next)
                # was recorded then, with the same count and state.
                ring = self.loader._recent_states
                if ring is not None:
                    ring.append((self.num_yielded,
                                 self.loader.snapshot(state, self.num_yielded)))
            except StopIteration:
                t1 = meter.epoch_end = time.perf_counter()
                self._ended = True
                raise
            except BaseException as e:
                if self._delivered is not before:  # counted, then failed before the return
                    self.num_yielded -= 1
                    self._delivered = before
                self._go_back(e)
                raise
            finally:
                meter.waited(t1 - t0)
        return item


class InSituLoader(Loader):
    """A ``torchdata.nodes.Loader`` that resumes exactly and can be shut down.

    It keeps ``Loader``'s protocol (``iter()`` per epoch, ``state_dict``/``load_state_dict``,
    ``restart_on_stop_iteration``) but serves it itself, with its own iterator
    (``_EpochIterator``), so it reads and writes none of torchdata's private attributes and
    fixes two torchdata 0.11 resume defects: the item looked ahead to after a restore is
    counted once (upstream issue 1453), and a state loaded with ``load_state_dict`` always
    applies at the next ``iter()``, even when ``state_dict()`` was called on the fresh loader
    first (upstream PR 1548). States are copied in and out, so a caller mutating one cannot
    corrupt the loader; they carry a format version, older formats converted on load.

    Built by ``build_loader``, it exposes what the build computed: ``config`` (the
    ``LoaderConfig``), ``ledger`` (live decoded bytes), ``resident_bound`` (the bound those
    stay under), ``shuffle_quality`` (the model's score; with time steps over runs of
    ``run_chunks`` adjacent chunks), ``workers`` (decode worker processes, 0 for threads),
    ``snapshot_id`` (the icechunk snapshot read, checked on resume), ``fingerprint`` (what
    every state records and ``load_state_dict`` checks) and, with ``read_group=G``,
    ``grid_part`` (this rank's slice of the grid), ``grid_axes`` and ``grid_axis``
    (``gather_grid``'s axis, from the end). A hand-built graph leaves them unset.
    """

    def __init__(self, root: BaseNode, restart_on_stop_iteration: bool = True,
                 keep_states: int = 0, log_every_s: float | None = None, *,
                 resolved: Resolved | None = None, ledger: MemoryLedger | None = None,
                 snapshot_id: str | None = None,
                 fingerprint: StateFingerprint | None = None) -> None:
        super().__init__(root, restart_on_stop_iteration)
        self._epoch_it: _EpochIterator | None = None  # made by the first iter()/state_dict()
        self._loaded: dict[str, Any] | None = None  # a loaded state the next iter() applies
        self.config: LoaderConfig | None = resolved.config if resolved is not None else None
        self.resident_bound: int | None = (resolved.resident_bound if resolved is not None
                                           else None)
        self.shuffle_quality: float | None = (resolved.shuffle_quality if resolved is not None
                                              else None)
        # time steps: chunks per contiguous run, the unit shuffle_quality counts
        self.run_chunks: int | None = resolved.run_chunks if resolved is not None else None
        # decode worker processes (fetch.workers resolved; 0: decode threads)
        self.workers: int | None = resolved.workers if resolved is not None else None
        # what each channel of the stacked key is (e.g. "geopotential@500"), in order
        self.channel_names: tuple[str, ...] | None = (
            tuple(c.label or c.variable for c in resolved.channels)
            if resolved is not None and resolved.channels else None)
        # read_group: this rank's part of the grid, its axes (nodes/read_groups.py)
        self.grid_part: slice = resolved.grid_part if resolved is not None else slice(None)
        self.grid_axes: dict[str, int] = dict(resolved.grid_axes) if resolved is not None else {}
        self.grid_axis: int | None = None if resolved is None else axis_from_end(
            resolved.source, resolved.grid_axes, resolved.config.sample.channels_last)
        self.ledger: MemoryLedger | None = ledger
        self.snapshot_id: str | None = snapshot_id
        self.allow_snapshot_change: bool = (resolved is not None and
                                            resolved.config.checkpoint.allow_snapshot_change)
        # A hand-built graph's fingerprint is read off its nodes (a seed or batch size
        # changed between save and resume would otherwise repeat and skip samples silently).
        self._fingerprint_from_nodes = fingerprint is None
        self.fingerprint: StateFingerprint | None = (
            fingerprint if fingerprint is not None else fingerprint_of_nodes(self.nodes()))
        self.allow_state_change: bool = (resolved is not None and
                                         resolved.config.checkpoint.allow_state_change)
        self._recent_states: deque | None = deque(maxlen=keep_states) if keep_states else None
        # (epoch, draws) a loaded state resumes in, until the iter() that applies it
        self._pending: Resumed | None = None
        self._meter = ConsumerMeter()
        self._shut_down = False
        if log_every_s is not None:
            self.log_stats_every(log_every_s)

    def state_dict_at(self, num_yielded: int) -> dict[str, Any]:
        """The state as it was right after batch ``num_yielded`` of the current epoch.

        For trainers that fetch ahead of the step they checkpoint (Lightning prefetches one
        batch): build with ``keep_states=k`` and ask for the batches actually consumed.
        """
        if self._recent_states is None:
            raise ConfigError("state_dict_at needs the loader built with keep_states >= 1")
        if self._epoch_it is not None and self._epoch_it.num_yielded == num_yielded:
            return self.state_dict()
        for n, state in reversed(self._recent_states):
            if n == num_yielded:
                return json.loads(json.dumps(state))
        kept = [n for n, _ in self._recent_states]
        raise StateError(f"no state kept for num_yielded={num_yielded}; kept: {kept} "
                         "(raise keep_states)")

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        """One epoch's batches: each a ``dict`` of tensors by key (``"sample_index"``
        included), as every stage of the standard graph yields them."""
        self.check_not_shut_down()
        if self._epoch_it is None:
            self._epoch_it = _EpochIterator(self)
        it = self._epoch_it
        gather = first_node(self.nodes(), GatherNode)
        self._meter.start_epoch(time.perf_counter(), (gather.stats.batches, gather.stats.samples)
                                if gather is not None else (0, 0))
        pending, self._loaded = self._loaded, None
        try:
            if pending is None:
                it.reset(None)
            else:
                it.reset(pending)
                # A restored epoch with nothing left: the next one (unless the ranks must
                # sit out the rest of theirs, restart_on_stop_iteration=False).
                if self.restart_on_stop_iteration and not it.has_next():
                    it.reset(None)
        except BaseException:
            # The look-ahead after a restore failed (a read): the next iter() must resume
            # the loaded state again, not start a new epoch skipping the rest of this one.
            if pending is not None and self._loaded is None:
                self._loaded = pending
            raise
        self._meter.epoch_end = None  # a restored, finished epoch rolled on to the next one
        return it

    # -- metrics ----------------------------------------------------------------------
    def stats(self) -> LoaderStats:
        """A snapshot of the per-stage counters (``LoaderStats``), at any time."""
        return collect_stats(self.nodes(), self._meter, self.resident_bound)

    def log_stats_every(self, seconds: float | None, logger: Any = None,
                        level: int | None = None) -> None:
        """Log ``stats().summary()`` at most every ``seconds``, from the training thread as
        batches are delivered (``None`` turns it off). Default logger ``insitubatch_nodes``,
        level INFO."""
        if seconds is not None and not seconds > 0:
            raise ConfigError(f"log_stats_every wants seconds > 0 (or None), got {seconds!r}")
        meter = self._meter
        meter.log_every_s = seconds
        meter.next_log = None if seconds is None else time.perf_counter() + seconds
        if logger is not None:
            meter.logger = logger
        if level is not None:
            meter.level = level

    # -- states -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where this loader stands: the state after the last batch delivered (a fresh
        loader's graph is reset to its start for it), or a loaded state not applied yet."""
        state = self._loaded
        if state is None:  # else loaded, no iter() since: that is where this loader stands
            if self._epoch_it is None:
                self._epoch_it = _EpochIterator(self)
            state = self._epoch_it.state_dict()  # BaseNode: reset(None) first if never reset
        return json.loads(json.dumps(self.snapshot(state[_EpochIterator.ROOT_KEY],
                                                   state[_EpochIterator.NUM_YIELDED_KEY])))

    def snapshot(self, root_state: dict[str, Any], num_yielded: int) -> dict[str, Any]:
        """The loader state for the graph state ``root_state`` after ``num_yielded`` batches
        (``checkpoint.rank_state``: node states, format, progress, snapshot, fingerprint)."""
        return rank_state(self.nodes(), root_state, num_yielded, self.fingerprint,
                          self.snapshot_id)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Apply a state at the next ``iter()``: one rank's own state, or the output of
        ``merge_rank_states`` (any world size).

        Checked now, before anything is read: a malformed state (fields missing, retyped,
        negative or out of range) or one saved by a loader built differently (another
        manifest, split, seed, sample grid, rank or shuffle) is one ``StateError`` naming
        every such field (``state/problems.py``). Only changes that keep the
        rest of the epoch exactly-once (``batch_size`` unless decoding in place,
        ``drop_last``) pass, and only with ``allow_state_change=True``. Formats 1 and 2 (no
        fingerprint) load with a warning.
        """
        if not isinstance(state_dict, dict):
            raise StateError(f"a loader state is a dict (from state_dict() or "
                             f"merge_rank_states), got {type(state_dict).__name__}")
        try:
            state_dict = json.loads(json.dumps(state_dict))
        except (TypeError, ValueError) as e:
            raise StateError(f"a loader state is plain JSON data (from state_dict()); this "
                             f"one is not: {e}") from None
        state_dict, resumed = check_loader_state(
            self.nodes(), state_dict, snapshot_id=self.snapshot_id,
            allow_snapshot_change=self.allow_snapshot_change, fingerprint=self.fingerprint,
            from_nodes=self._fingerprint_from_nodes, allow_state_change=self.allow_state_change)
        shuffle = first_node(self.nodes(), ShuffleBufferNode)
        if (resumed is not None and shuffle is not None and self.restart_on_stop_iteration
                and resumed.finished(shuffle.batch_size, shuffle.drop_last)):
            # torchdata rolls a restored epoch with nothing left over to the next one at
            # iter(): epoch and len() say so from the load on (a loop resumed from an
            # end-of-epoch checkpoint starts at the next epoch, not the finished one).
            # Without restart (uneven="none" on several ranks) the rest is served empty.
            epoch = resumed.epoch + 1
            draws = self.node(ChunkPermuteNode).draws_in(epoch)
            resumed = Resumed(epoch, draws, draws)
        self._loaded = state_dict  # applied by the next iter()
        self._pending = resumed

    # -- graph ------------------------------------------------------------------------
    def nodes(self) -> list[BaseNode]:
        """The graph's nodes from the root (last stage) up to the head, following each
        stage's ``source``."""
        out, node = [], self.root
        while node is not None:
            out.append(node)
            node = getattr(node, "source", None)
            if not isinstance(node, BaseNode):
                break
        return out

    def node(self, kind: type) -> Any:
        """The first node of type ``kind`` in the graph (e.g. ``AsyncFetchNode``)."""
        found = first_node(self.nodes(), kind)
        if found is None:
            raise UnknownNameError(f"no {kind.__name__} in this loader's graph")
        return found

    def __len__(self) -> int:
        """Batches of this rank in the epoch ``loader.epoch`` names (before the first
        ``iter()``, the first): for learning-rate schedules and progress bars. With
        ``uneven="pad"`` or ``"drop"`` (equal steps on every rank) epochs differ by at most
        a chunk's samples; ``drop_last`` drops a short last batch."""
        permute = first_node(self.nodes(), ChunkPermuteNode)
        shuffle = first_node(self.nodes(), ShuffleBufferNode)
        if permute is None or shuffle is None:  # TypeError: list() then does without
            raise ConfigTypeError("this loader's graph has no ChunkPermuteNode and "
                                  "ShuffleBufferNode, so its length is not known")
        pending = self._pending_resume()
        draws = pending.draws if pending is not None else permute.draws_in(self.epoch)
        size = shuffle.batch_size
        return draws // size if shuffle.drop_last else -(-draws // size)

    def denormalize(self, x: torch.Tensor, key: str = "channels") -> torch.Tensor:
        """``x`` (a prediction shaped like batch key ``key``: a variable, ``"channels"``,
        or their ``target/``) back in the units of the store: ``x * scale + offset`` with
        the statistics and schemes the loader normalized that key with (a new tensor, on
        ``x``'s device and dtype)."""
        norm = first_node(self.nodes(), NormalizeNode)
        if norm is None:
            raise ConfigError("this loader does not normalize (no stats=): its batches are "
                             "in the store's units already")
        offset, scale = norm.parameters(key)
        return x * scale.to(x.device, x.dtype) + offset.to(x.device, x.dtype)

    def __bool__(self) -> bool:
        return True  # not len() == 0: a loader is a loader, whatever its epoch holds

    @property
    def epoch(self) -> int:
        """The epoch being served: the current pass's; between passes the one just finished
        (the next ``iter()`` starts the next); before the first ``iter()``, the first; after
        ``load_state_dict``, the one the next ``iter()`` serves: the loaded state's, or the
        next when the state had finished its epoch (so ``range(loader.epoch, n)`` resumes
        a training loop at the right epoch)."""
        self.node(ChunkPermuteNode)  # a clear error for a graph without one
        pending = self._pending_resume()
        return pending.epoch if pending is not None else current_epoch(self.nodes())

    def _pending_resume(self) -> Resumed | None:
        """Where a loaded state resumes (the next epoch when it had finished its own), until
        the ``iter()`` that applies it (``check_root_state`` computed it at the load)."""
        if self._loaded is None:
            return None
        return self._pending

    def shutdown(self) -> None:
        """Stop the graph's background threads now (instead of at garbage collection).

        Every stage of this package passes ``shutdown()`` upstream; it is called on each
        node here too, so a foreign node in between (torchdata 0.11's ``Prefetcher`` has
        no ``shutdown``) does not hide the fetch thread behind it. Idempotent.
        """
        self._shut_down = True
        for node in self.nodes():
            shutdown_source(node)

    def check_not_shut_down(self) -> None:
        """Refuse to serve after ``shutdown()`` (final, unlike ``close()``)."""
        if self._shut_down:
            raise LoaderUsageError("this loader was shut down (loader.shutdown(), which is "
                                   "final): build a new loader (close() and the end of a "
                                   "with block only pause it; iterating again restarts it)")

    def close(self) -> None:
        """Stop the fetch thread now (``with loader:`` does this on exit); iterating the
        loader again starts it again, and going on with an iterator taken before serves
        the batch after the last one delivered (the windows in flight were dropped: the
        graph goes back to that state, as after an error). ``shutdown()`` is final."""
        fetches = [n for n in self.nodes() if isinstance(n, AsyncFetchNode)]
        for node in fetches:
            node.close()
        if fetches and self._epoch_it is not None:
            self._epoch_it.rewind(restart=all(f.epoch_untouched for f in fetches))

    def __enter__(self) -> InSituLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def build_loader(source: Source, manifest: SplitManifest, split: str,
                 config: LoaderConfig | None = None, **options: Any) -> InSituLoader:
    """Compose Split -> ChunkPermute -> ReadPlan -> AsyncFetch -> ShuffleBuffer -> Gather ->
    PinOrCuda (``graph.py``) and wrap it in a loader; each ``iter(loader)`` is one epoch.

    ``manifest`` is a ``SplitManifest`` and ``split`` the name of one of its splits.
    ``config`` (a ``LoaderConfig``) holds every option by concern; keywords override it and
    land in their group (``config.py`` documents each group, README "Options" each option:
    ``batch_size``, ``block_chunks``, ``seed``, ``steps=SampleWindow(...)``, ``stats``,
    ``channels``, ``device``, ``keep_states``, ...).
    """
    check_split_args(manifest, split)
    cfg = (config if config is not None else LoaderConfig()).replace(**options)
    resolved = resolve(source, manifest, split, cfg)
    graph = build_graph(source, manifest, split, resolved)
    # With unequal shares a rank restored with its share done must sit out the rest of that
    # epoch, not start the next while the other ranks finish theirs (torchdata restarts a
    # restored iterator that is exhausted): its next iter() is the empty rest of the epoch.
    restart = not (cfg.sampling.uneven == "none" and resolved.deal.groups > 1)
    fingerprint = fingerprint_of_nodes(list(graph.stages.values()))
    if fingerprint is not None and resolved.deal.read_group > 1:
        fingerprint = dataclasses.replace(fingerprint, read_group=resolved.deal.read_group)
    return InSituLoader(graph.root, restart, keep_states=cfg.checkpoint.keep_states,
                        log_every_s=cfg.checkpoint.log_every_s, resolved=resolved,
                        ledger=graph.ledger, snapshot_id=source.snapshot_id,
                        fingerprint=fingerprint)
