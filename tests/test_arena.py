"""``memory/arena.BatchArena`` and its futures, alone: a future knows its generation, so one
held across a reset (``clear``) raises ``StaleFuture`` instead of taking the new batch of
its number; futures of one generation resolve in any order; nothing is left behind."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest
from stores import Var, write_store

import insitubatch_nodes as ib
from insitubatch_nodes.memory.arena import BatchArena, StaleBatch, StaleFuture
from insitubatch_nodes.memory.layout import build_layout
from insitubatch_nodes.memory.ledger import BufferPool, MemoryLedger

ROWS = 2


@pytest.fixture(scope="module")
def variables(tmp_path_factory):
    path = tmp_path_factory.mktemp("arena") / "s.zarr"
    write_store(path, [Var("x", (8, 3), (1, 3)), Var("y", (8,), (1,), dtype="int16")])
    return ib.open_source(path).variables


def _arena(variables) -> tuple[BatchArena, MemoryLedger]:
    ledger = MemoryLedger()
    return BatchArena(build_layout(variables), BufferPool(ledger)), ledger


def _write(arena: BatchArena, b: int, mark: int) -> None:
    """Every row of batch ``b`` written (``mark`` in every value) and counted landed."""
    for a in arena.arrays_of(b, arena.generation).values():
        a[...] = mark
    arena.landed(b, ROWS * arena.writes_per_row, arena.generation)


def test_futures_resolve_in_any_order(variables):
    """Taking a batch hands over that batch only: the others stay, each with its rows."""
    arena, _ = _arena(variables)
    futures = [arena.future(b) for b in range(4)]
    for b in range(4):
        arena.expect(b, ROWS)
    for b in (2, 0, 3, 1):
        _write(arena, b, 10 + b)
    for b in (3, 0, 2, 1):
        got = futures[b].result()
        assert set(got) == {"x", "y"}
        assert all((a == 10 + b).all() for a in got.values()), b
    assert len(arena) == 0


def test_a_future_held_across_a_clear_raises_stale_future(variables):
    """Batch numbers restart at a reset: a future of before names its generation and
    raises ``StaleFuture`` (a ``StaleBatch``) instead of taking the new batch 0."""
    arena, _ = _arena(variables)
    arena.expect(0, ROWS)
    old = arena.future(0)
    assert old.generation == 0
    _write(arena, 0, 1)
    arena.clear()
    arena.expect(0, ROWS)
    new = arena.future(0)
    _write(arena, 0, 2)
    with pytest.raises(StaleFuture, match=r"batch 0 of generation 0 is gone.*generation 1"
                                          r".*cannot be held across a reset") as info:
        old.result()
    assert isinstance(info.value, StaleBatch) and isinstance(info.value, RuntimeError)
    assert len(arena) == 1  # the new batch 0 was not touched
    assert all((a == 2).all() for a in new.result().values())


def test_a_future_hands_its_batch_over_once(variables):
    arena, _ = _arena(variables)
    arena.expect(0, ROWS)
    fut = arena.future(0)
    _write(arena, 0, 3)
    fut.result()
    with pytest.raises(StaleFuture, match="handed over already"):
        fut.result()


def test_a_failed_batch_raises_again_and_fails_no_other(variables):
    arena, _ = _arena(variables)
    for b in range(2):
        arena.expect(b, ROWS)
    arena.fail([0], OSError("boom"), arena.generation)
    _write(arena, 1, 5)
    for _ in range(2):
        with pytest.raises(OSError, match="boom"):
            arena.future(0).result()
    assert all((a == 5).all() for a in arena.future(1).result().values())
    arena.fail([0], OSError("late"), arena.generation - 1)  # an earlier generation's read
    with pytest.raises(OSError, match="boom"):
        arena.future(0).result()


def test_a_clear_lets_a_waiting_consumer_through(variables):
    """A consumer blocked on a batch whose reads were dropped (a reset from another
    thread) is let through with ``StaleFuture``, not left waiting for rows that never
    land."""
    arena, _ = _arena(variables)
    arena.expect(0, ROWS)
    fut = arena.future(0)
    got: list[BaseException] = []
    waiting = threading.Event()

    def consume() -> None:
        waiting.set()
        try:
            fut.result()
        except BaseException as e:
            got.append(e)

    t = threading.Thread(target=consume)
    t.start()
    waiting.wait(5)
    arena.clear()
    t.join(5)
    assert not t.is_alive()
    assert len(got) == 1 and isinstance(got[0], StaleFuture), got


def test_batches_never_taken_are_forgotten_at_clear(variables):
    """A batch announced and never taken stays only until the next reset, which frees
    its memory (never recycled: a running read may still write into it)."""
    arena, ledger = _arena(variables)
    for b in range(3):
        arena.expect(b, ROWS)
        _write(arena, b, b)
    assert ledger.resident > 0
    kept = arena.future(1).result()
    assert len(arena) == 2
    arena.clear()
    assert len(arena) == 0
    gc.collect()
    assert ledger.resident == sum(a.nbytes for a in kept.values())
    np.testing.assert_array_equal(kept["y"], np.ones(ROWS, dtype="int16"))


@pytest.mark.parametrize("chunk", [1, 3], ids=["one-per-chunk", "several-per-chunk"])
@pytest.mark.parametrize("drop_last", [False, True])
def test_the_standard_graph_takes_every_batch_it_announces(tmp_path, chunk, drop_last):
    """Nothing waits for a ``clear`` in the standard graph: every batch announced is taken
    by the end of the epoch, from its start and from a restore (whose skipped draws and a
    dropped short batch are never announced)."""
    from insitubatch_nodes.nodes import AsyncFetchNode

    path = tmp_path / "s.zarr"
    data = write_store(path, [Var("x", (61, 3), (chunk, 3))])
    src = ib.open_source(path)
    m = ib.split_by_chunk(src, (1.0,))
    kw = dict(batch_size=4, block_chunks=3, seed=1, in_place=True, drop_last=drop_last)

    def arena_of(loader: ib.InSituLoader) -> BatchArena:
        (fetch,) = [n for n in loader.nodes() if isinstance(n, AsyncFetchNode)]
        assert fetch.arena is not None
        return fetch.arena

    loader = ib.build_loader(src, m, "train", **kw)
    it = iter(loader)
    for _ in range(5):
        next(it)
    state = loader.state_dict()
    assert state["root"]["source"]["source"]["source"]["offset"] > 0  # a window skipped into
    rest = list(it)
    assert len(arena_of(loader)) == 0
    again = ib.build_loader(src, m, "train", **kw)
    again.load_state_dict(state)
    got = list(again)
    assert len(arena_of(again)) == 0
    assert [b["sample_index"].tolist() for b in got] == [b["sample_index"].tolist()
                                                         for b in rest]
    for b in got:
        np.testing.assert_array_equal(b["x"].numpy(), data["x"][b["sample_index"].numpy()])
