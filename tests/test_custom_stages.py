"""A user's own stages slot into the graph: the items between the stages are the whole
contract (``sampling/items.py``), so a shuffle or gather written against them replaces ours,
on the window path and decoding in place, with resume."""

from __future__ import annotations

import re
import threading
from typing import Any

import numpy as np
import pytest
import torch
from stores import BLOSC, Var, assert_rows_stored, write_store
from torchdata.nodes import BaseNode

import insitubatch_nodes as ib
from insitubatch_nodes.graph import build_graph, resolve
from insitubatch_nodes.memory.arena import StaleFuture
from insitubatch_nodes.nodes import (
    AsyncFetchNode,
    ChunkPermuteNode,
    GatherNode,
    ReadPlanNode,
    ShuffleBufferNode,
    SplitNode,
)
from insitubatch_nodes.sampling.items import BatchDraw, DecodedBatch, DecodedWindow, GatherPart

BATCH = 5


class InOrderBatches(BaseNode[BatchDraw]):
    """A user's shuffle stage for debugging: each window's samples in ascending order, cut
    into batches within the window (no mixing, no batch across windows); batches decoded in
    place are passed on as the plans cut them. State: upstream state before the window
    being cut, and the batches taken from it."""

    def __init__(self, source: BaseNode[DecodedWindow | DecodedBatch],
                 variables: list[ib.VariableGeometry], batch_size: int) -> None:
        super().__init__()
        self.source, self.variables, self.batch_size = source, variables, batch_size

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.window: DecodedWindow | None = None
        self.taken = 0 if initial_state is None else initial_state["taken"]
        self.source.reset(None if initial_state is None else initial_state["source"])
        self.before = self.source.state_dict()

    def next(self) -> BatchDraw:
        while True:
            if self.window is None:
                self.before = self.source.state_dict()
                item = next(self.source)
                if isinstance(item, DecodedBatch):  # decoded in place: already a batch
                    self.before = self.source.state_dict()
                    return BatchDraw(item.sample_index, (), ready=item.arrays)
                self.window = item
            samples = np.sort(self.window.plan.draw_order)
            rows = samples[self.taken * self.batch_size:(self.taken + 1) * self.batch_size]
            if rows.size:
                self.taken += 1
                return BatchDraw(rows, tuple(self._parts(v, rows)
                                             for v in range(len(self.variables))))
            self.window, self.taken = None, 0

    def _parts(self, v: int, rows: np.ndarray) -> tuple[GatherPart, ...]:
        chunk = self.variables[v].sample_chunk
        assert self.window is not None
        return tuple(GatherPart(self.window.arrays[v][int(s) // chunk],
                                np.array([int(s) % chunk]), k, k + 1)
                     for k, s in enumerate(rows.tolist()))

    def get_state(self) -> dict[str, Any]:
        return {"source": self.before, "taken": self.taken if self.window is not None else 0}


class TorchGather(BaseNode[dict[str, torch.Tensor]]):
    """A user's gather stage: rows stacked with torch (or the batch decoded in place, as
    it is), plus the sample index."""

    def __init__(self, source: BaseNode[BatchDraw], names: list[str]) -> None:
        super().__init__()
        self.source, self.names = source, names

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.source.reset(initial_state)

    def next(self) -> dict[str, torch.Tensor]:
        draw = next(self.source)
        if draw.ready is not None:
            out = {k: torch.from_numpy(a) for k, a in draw.ready.result().items()}
        else:
            out = {}
            for name, parts in zip(self.names, draw.parts, strict=True):
                pieces = [torch.from_numpy(np.asarray(p.array))[torch.from_numpy(p.offsets)]
                          for p in parts]
                out[name] = torch.cat(pieces)
        out["sample_index"] = torch.from_numpy(draw.sample_index.astype(np.int64))
        return out

    def get_state(self) -> dict[str, Any]:
        return self.source.state_dict()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("custom") / "s.zarr"
    data = write_store(path, [Var("x", (90, 3, 2), (1, 3, 2), compressors=BLOSC),
                              Var("y", (90, 4), (3, 4), dtype="int16")])
    src = ib.open_source(path)
    return src, ib.split_by_chunk(src, (1.0,)), data


@pytest.fixture(scope="module")
def one_per_chunk(tmp_path_factory):
    """Every variable one sample per chunk: the decode threads take a batch's memory at
    its first write (``arrays_of``), where the store above has it taken as the window is
    prepared (``rows``: several samples per chunk)."""
    path = tmp_path_factory.mktemp("custom1") / "s.zarr"
    data = write_store(path, [Var("x", (60, 3, 2), (1, 3, 2), compressors=BLOSC),
                              Var("y", (60, 4), (1, 4), dtype="int16")])
    src = ib.open_source(path)
    return src, ib.split_by_chunk(src, (1.0,)), data


class ReadAhead(BaseNode[BatchDraw]):
    """A user's stage that reads ``depth`` draws ahead and hands them out last first (or
    in order), so the gather resolves the futures of batches decoded in place out of
    order. With ``keep`` set it keeps what it read ahead across the next reset (the bug of
    holding futures across one); its state is the upstream's (no exact resume)."""

    def __init__(self, source: BaseNode[BatchDraw], depth: int, last_first: bool = True,
                 ) -> None:
        super().__init__()
        self.source, self.depth, self.last_first = source, depth, last_first
        self.ahead: list[BatchDraw] = []
        self.keep = False

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if not self.keep:
            self.ahead = []
        self.keep = False
        self.source.reset(initial_state)

    def next(self) -> BatchDraw:
        while len(self.ahead) < self.depth:
            try:
                self.ahead.append(next(self.source))
            except StopIteration:
                break
        if not self.ahead:
            raise StopIteration
        return self.ahead.pop(-1 if self.last_first else 0)

    def get_state(self) -> dict[str, Any]:
        return self.source.state_dict()


def _read_ahead(store, depth: int, last_first: bool = True,
                **kw: Any) -> tuple[ib.InSituLoader, ReadAhead]:
    """The standard stages to the shuffle buffer (in place), a ``ReadAhead``, our gather."""
    src, m, _ = store
    cfg = ib.LoaderConfig.of(batch_size=BATCH, block_chunks=4, seed=5, in_place=True, **kw)
    graph = build_graph(src, m, "train", resolve(src, m, "train", cfg), upto="shuffle")
    stage = ReadAhead(graph.root, depth, last_first)
    return ib.InSituLoader(GatherNode(stage, src.variables)), stage


def _drain(it: Any, data: dict[str, np.ndarray], limit: int = 500) -> tuple[list, int]:
    """Every batch ``it`` serves (each checked against the store) and the ``StaleFuture``
    errors it raised on the way (the loader goes back and on after each), to the end."""
    got, stale = [], 0
    for _ in range(limit):
        try:
            batch = next(it)
        except StopIteration:
            return got, stale
        except StaleFuture as e:
            assert "cannot be held across a reset" in str(e)
            stale += 1
            continue
        batch = {k: v.clone() for k, v in batch.items()}
        _stored([batch], data)  # its own rows, never another batch's
        got.append(batch)
    raise AssertionError(f"no end after {limit} batches")


def _resolve_held(held: list[BatchDraw], data: dict[str, np.ndarray]) -> int:
    """Resolve futures held across a reset (in the order given): each raises
    ``StaleFuture`` naming the batch, the generations and the reset, or (never, as built)
    serves its own rows. Returns how many raised."""
    stale = 0
    for draw in held:
        assert draw.ready is not None
        try:
            arrays = draw.ready.result()
        except StaleFuture as e:
            assert re.search(r"batch \d+ of generation \d+ is gone.*at generation \d+.*"
                             r"cannot be held across a reset", str(e)), e
            stale += 1
            continue
        assert_rows_stored([{**arrays, "sample_index": draw.sample_index}], data)
    return stale


def _epoch(loader: ib.InSituLoader) -> list[dict[str, torch.Tensor]]:
    return [{k: v.clone() for k, v in b.items()} for b in loader]


def _stored(batches: list[dict[str, torch.Tensor]], data: dict[str, np.ndarray]) -> None:
    """``assert_rows_stored`` on numpy rows (a one-row tensor would index as an int)."""
    assert_rows_stored([{k: v.numpy() for k, v in b.items()} for b in batches], data)


def _samples(batches: list[dict[str, torch.Tensor]]) -> list[list[int]]:
    return [b["sample_index"].tolist() for b in batches]


def test_a_users_shuffle_replaces_ours_with_resume(store):
    """Hand-built as recipes/train_resume.py spells the graph, with the user's shuffle:
    every sample once, the stored values, and a mid-epoch state resumes exactly."""
    src, m, data = store

    def loader() -> ib.InSituLoader:
        node: BaseNode = SplitNode(m, "train")
        node = ChunkPermuteNode(node, src.grid, seed=3, block_chunks=4)
        node = ReadPlanNode(node, src.variables)
        node = AsyncFetchNode(node, src, batch_size=BATCH)
        node = InOrderBatches(node, list(src.variables), BATCH)
        return ib.InSituLoader(GatherNode(node, src.variables))

    full = _epoch(loader())
    assert sorted(i for b in _samples(full) for i in b) == list(range(90))
    assert all(s == sorted(s) for s in _samples(full))
    _stored(full, data)
    first = loader()
    it = iter(first)
    for _ in range(7):
        next(it)
    again = loader()
    again.load_state_dict(first.state_dict())
    assert _samples(_epoch(again)) == _samples(full)[7:]


def test_a_users_shuffle_passes_batches_decoded_in_place_on(store):
    """In place the fetch yields the plans' batches: a user's shuffle stage that passes them
    on serves exactly the standard loader's batches, and resumes."""
    src, m, data = store
    cfg = ib.LoaderConfig.of(batch_size=BATCH, block_chunks=4, seed=2, in_place=True)

    def loader() -> ib.InSituLoader:
        graph = build_graph(src, m, "train", resolve(src, m, "train", cfg), upto="fetch")
        node = InOrderBatches(graph.root, list(src.variables), BATCH)
        return ib.InSituLoader(GatherNode(node, src.variables))

    want = _epoch(ib.build_loader(src, m, "train", cfg))
    got = _epoch(loader())
    assert _samples(got) == _samples(want)
    _stored(got, data)
    first = loader()
    it = iter(first)
    for _ in range(4):
        next(it)
    again = loader()
    again.load_state_dict(first.state_dict())
    assert _samples(_epoch(again)) == _samples(want)[4:]


@pytest.mark.parametrize("in_place", [False, True], ids=["windows", "in-place"])
def test_a_users_gather_replaces_ours(store, in_place):
    """The standard stages up to the shuffle buffer (graph.build_graph), then the user's
    gather: the same batches as the standard loader, on both paths."""
    src, m, data = store
    cfg = ib.LoaderConfig.of(batch_size=BATCH, block_chunks=4, seed=2, in_place=in_place)
    want = _epoch(ib.build_loader(src, m, "train", cfg))
    graph = build_graph(src, m, "train", resolve(src, m, "train", cfg), upto="shuffle")
    assert isinstance(graph.root, ShuffleBufferNode)
    got = _epoch(ib.InSituLoader(TorchGather(graph.root, list(src.names))))
    assert _samples(got) == _samples(want)
    for g, w in zip(got, want, strict=True):
        for k in ("x", "y"):
            assert torch.equal(g[k], w[k]), k
    _stored(got, data)


@pytest.mark.parametrize("which", ["several-per-chunk", "one-per-chunk"])
def test_futures_resolved_out_of_order_give_each_batch_its_rows(store, one_per_chunk, which):
    """In place, a user's stage hands the batches out last first (the gather resolves
    their futures out of order): each batch has its own rows, checked against the store,
    and the epoch is the standard loader's batches, every sample once."""
    st = store if which == "several-per-chunk" else one_per_chunk
    src, m, data = st
    got = _epoch(_read_ahead(st, 4)[0])
    _stored(got, data)
    assert sorted(i for b in _samples(got) for i in b) == list(range(len(data["x"])))
    cfg = ib.LoaderConfig.of(batch_size=BATCH, block_chunks=4, seed=5, in_place=True)
    want = _samples(_epoch(ib.build_loader(src, m, "train", cfg)))
    assert sorted(_samples(got)) == sorted(want) and _samples(got) != want


def test_out_of_order_futures_with_decode_workers(one_per_chunk):
    """The same with decode workers (the engine thread takes a batch's memory)."""
    _, _, data = one_per_chunk
    loader, _ = _read_ahead(one_per_chunk, 3, workers=1)
    with loader:
        got = _epoch(loader)
    _stored(got, data)
    assert sorted(i for b in _samples(got) for i in b) == list(range(len(data["x"])))


HELD = [(w, o) for w in ("several-per-chunk", "one-per-chunk")
        for o in ("in-order", "last-first")]


@pytest.mark.parametrize(("which", "order"), HELD)
def test_futures_held_across_a_new_epoch_never_give_another_batchs_rows(
        store, one_per_chunk, which, order):
    """A user's stage keeps the draws it read ahead across a ``break`` and a new
    ``iter()`` (batch numbers restart there) and hands them on, in order or last first:
    the first held future the gather resolves raises ``StaleFuture`` instead of serving
    the new epoch's batch of its number (the loader goes back, and the stage's reset
    drops the rest); every batch served has the rows its ``sample_index`` names in the
    store, and the next epoch serves every sample once."""
    st = store if which == "several-per-chunk" else one_per_chunk
    _, _, data = st
    loader, stage = _read_ahead(st, 4, last_first=order == "last-first")
    it = iter(loader)
    _stored([next(it) for _ in range(3)], data)
    assert len(stage.ahead) == 3  # read ahead, their futures not resolved
    stage.keep = True
    got, stale = _drain(iter(loader), data)  # break; a new epoch, the held draws first
    assert stale == 1 and got
    again, stale = _drain(iter(loader), data)
    assert stale == 0
    assert sorted(i for b in _samples(again) for i in b) == list(range(len(data["x"])))


@pytest.mark.parametrize(("which", "order"), HELD)
def test_futures_held_across_a_restore_never_give_another_batchs_rows(
        store, one_per_chunk, which, order):
    """Futures of epoch 1 held across ``load_state_dict`` of a state in epoch 0, resolved
    in order or last first once the restored epoch's first windows are in: the batches
    of their numbers are epoch 0's now, and each raises ``StaleFuture``, never their
    rows under its own sample indices; the restored epoch serves the saved loader's
    remaining batches."""
    st = store if which == "several-per-chunk" else one_per_chunk
    _, _, data = st
    saver, _ = _read_ahead(st, 1)
    sit = iter(saver)
    for _ in range(2):
        next(sit)
    state = saver.state_dict()
    rest = _samples(list(sit))
    loader, stage = _read_ahead(st, 4, last_first=order == "last-first")
    _epoch(loader)
    it = iter(loader)  # epoch 1
    _stored([next(it) for _ in range(5)], data)
    held = list(stage.ahead)
    assert len(held) == 3  # read ahead, their futures not resolved
    loader.load_state_dict(state)
    it = iter(loader)
    restored = [{k: v.clone() for k, v in next(it).items()}]
    assert _resolve_held(held if order == "in-order" else held[::-1], data) == 3
    more, stale = _drain(it, data)
    restored += more
    assert stale == 0 and sorted(_samples(restored)) == sorted(rest)


def test_futures_held_across_close_raise_instead_of_waiting(one_per_chunk):
    """The fetch's ``close()`` cancels the reads in flight: a future held across it raises
    ``StaleFuture`` (a consumer already waiting is let through) instead of waiting for
    rows that will never land; iterating again serves the stored rows."""
    src, m, data = one_per_chunk
    cfg = ib.LoaderConfig.of(batch_size=BATCH, block_chunks=4, seed=5, in_place=True)
    fetch = build_graph(src, m, "train", resolve(src, m, "train", cfg), upto="fetch").root
    fetch.reset(None)
    held = [next(fetch) for _ in range(8)]
    fetch.close()
    outcomes: list[str] = []

    def resolve_all() -> None:
        for item in held[::-1]:
            try:
                item.arrays.result()
                outcomes.append("rows")
            except StaleFuture:
                outcomes.append("stale")

    t = threading.Thread(target=resolve_all, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "a future held across close() waited for cancelled reads"
    assert outcomes == ["stale"] * 8
    fetch.reset(None)
    got = []
    for item in fetch:
        got.append({**item.arrays.result(), "sample_index": item.sample_index})
    fetch.close()
    assert_rows_stored(got, data)
    assert sorted(i for b in got for i in b["sample_index"].tolist()) == list(range(60))
