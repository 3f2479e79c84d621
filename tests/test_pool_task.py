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
