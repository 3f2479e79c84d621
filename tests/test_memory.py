"""BufferPool and MemoryLedger: memory is reused only once nothing can read it, and the
ledger counts what is really resident."""

import gc
import threading

import numpy as np
import torch

from insitubatch_nodes.memory.ledger import BufferPool, MemoryLedger


def test_a_buffer_comes_back_only_when_every_user_let_go():
    ledger = MemoryLedger()
    pool = BufferPool(ledger)
    a = pool.take((4, 3), np.float32)
    base = a.base
    t = torch.from_numpy(a)  # a batch tensor the user keeps
    del a
    gc.collect()
    b = pool.take((4, 3), np.float32)
    assert b.base is not base  # still read through ``t``: not handed out again
    assert ledger.resident == 2 * 48
    del t
    gc.collect()
    assert ledger.resident == 48
    c = pool.take((4, 3), np.float32)
    assert c.base is base  # now free: reused, not allocated anew
    assert ledger.peak == 2 * 48


def test_take_many_counts_each_buffer_and_reuses_by_shape_and_dtype():
    ledger = MemoryLedger()
    pool = BufferPool(ledger)
    bufs = pool.take_many((2, 5), np.float64, 3)
    assert [b.shape for b in bufs] == [(2, 5)] * 3
    assert len({id(b.base) for b in bufs}) == 3
    assert ledger.resident == 3 * 80
    bases = {id(b.base) for b in bufs}
    del bufs
    assert ledger.resident == 0
    assert {id(b.base) for b in pool.take_many((2, 5), np.float64, 2)} <= bases
    assert id(pool.take((2, 5), np.float32).base) not in bases  # another dtype: a fresh one
    assert pool.take_many((1,), np.int8, 0) == []


def test_disowned_memory_is_never_reused_and_leaves_the_ledger_when_freed():
    ledger = MemoryLedger()
    pool = BufferPool(ledger)
    a = pool.take((8,), np.float32)
    base = a.base
    part = a[2:4]  # what a decode still running would write into
    pool.disown(a)
    del a
    gc.collect()
    other = pool.take((8,), np.float32)
    assert other.base is not base
    assert ledger.resident == 2 * 32  # the disowned one is alive through ``part``
    del part, base
    gc.collect()
    assert ledger.resident == 32
    del other
    assert ledger.resident == 0


def test_a_give_back_from_a_collection_inside_the_pool_does_not_deadlock():
    """A view in a reference cycle dies when a collection runs, which an allocation on a
    thread already inside the pool can start: the give-back must not wait on itself."""
    ledger = MemoryLedger()
    pool = BufferPool(ledger)
    view = pool.take((3,), np.float32)
    base = view.base
    cycle: list = [view]
    cycle.append(cycle)
    del view, cycle

    def collect_under_the_lock() -> None:
        with pool._lock:  # as if an allocation under the lock started the collection
            gc.collect()

    # on a thread, so a give-back that waits on itself fails the test instead of hanging it
    t = threading.Thread(target=collect_under_the_lock, daemon=True)
    t.start()
    t.join(timeout=30)
    assert not t.is_alive(), "the give-back deadlocked on the pool's lock"
    assert ledger.resident == 0  # given back during the collection
    assert pool.take((3,), np.float32).base is base
