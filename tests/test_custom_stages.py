"""A user's own stages slot into the graph: the items between the stages are the whole
contract (``sampling/items.py``), so a shuffle or gather written against them replaces ours,
on the window path and decoding in place, with resume."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from stores import BLOSC, Var, assert_rows_stored, write_store
from torchdata.nodes import BaseNode

import insitubatch_nodes as ib
from insitubatch_nodes.graph import build_graph, resolve
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
