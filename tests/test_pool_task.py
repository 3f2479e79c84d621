import gc
import weakref

import numpy as np
import pytest

from insitubatch_nodes.io.pool_task import OneShot


def test_a_one_shot_task_lets_go_of_its_buffer_once_it_has_run():
    buf = np.zeros(16)
    seen = weakref.ref(buf)
    task = OneShot(np.copyto, buf, 7.0)
    del buf
    gc.collect()
    assert seen() is not None  # held until it runs
    assert task() is None
    gc.collect()
    # The task object (what an executor's work item holds) lives on; the buffer does not.
    assert seen() is None
    with pytest.raises(RuntimeError, match="ran twice"):
        task()


def test_a_cancelled_window_lets_go_of_buffers_its_queued_tasks_hold():
    """A local window cancelled by a restore: its tasks still queued behind running ones
    never run, and their buffers are counted free at once (not when a worker dequeues the
    work item), while a task already running is waited for (``settle``)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from insitubatch_nodes.fetch.jobs import DirectWindow
    from insitubatch_nodes.memory.ledger import BufferPool, MemoryLedger

    ledger = MemoryLedger()
    buffers = BufferPool(ledger)  # kept: its give-backs uncount the ledger
    bufs = buffers.take_many((64,), np.float32, 3)
    started, gate = threading.Event(), threading.Event()

    def hold(buf):  # the running task: holds its buffer until let go
        started.set()
        gate.wait(5)

    with ThreadPoolExecutor(1) as pool:
        tasks = [OneShot(hold, bufs[0])] + [OneShot(np.copyto, b, 1.0) for b in bufs[1:]]
        window = DirectWindow(None, [], [], pool, tasks)
        del bufs
        assert started.wait(5)
        window.cancel()
        gc.collect()
        assert ledger.resident == 64 * 4  # only the running task's buffer is left
        threading.Timer(0.05, gate.set).start()
        window.settle()  # returns once the running task ended
        gc.collect()
        assert ledger.resident == 0
