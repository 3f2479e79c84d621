"""``fetch/batches.BatchCut`` (the batches a window decoded in place completes, cut once a
window on the training thread) against its definition: the epoch's draws cut every
``batch_size``, rows sorted, from an epoch's start or a restore's head window (issue 41)."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from test_jobs import restore_point
from test_schedule import cases

from insitubatch_nodes.fetch.batches import BatchCut


class Futures:
    """An arena's ``future``: here the batch number."""

    def future(self, b: int) -> int:
        return b


@settings(max_examples=150, deadline=None)
@given(case=cases(max_n=300), data=st.data())
def test_batches_are_the_epochs_draws_cut_every_batch_size(case, data):
    """``BatchCut`` against its definition: batch ``b`` is the epoch's draws ``[b * size,
    (b + 1) * size)`` (the windows' draw orders end to end), its rows sorted by sample
    index, a short last batch dropped with ``drop_last``; from a restore, the batches from
    its position on; after each, the position counts the draws up to its end."""
    _, c = case
    plans = c.plans()
    if not plans:  # a rank dealt no window (uneven="drop" late in an elastic epoch)
        cut = BatchCut()
        cut.reset({"window": 0}, 0)
        cut.end({"window": 0})
        assert not cut.out  # serves no batch
        return
    starts = c.schedule.draw_starts
    head, skip = restore_point(c, data)
    draws = np.concatenate([p.draw_order for p in plans])
    size, total = c.batch_size, draws.size
    last = total // size if c.drop_last else -(-total // size)
    first = -(-(int(starts[head]) + skip) // size)
    cut = BatchCut()
    cut.reset({"window": head}, skip)
    got = []
    for i, plan in enumerate(plans[head:], head):
        cut.add(plan, {"window": i}, {"window": i + 1}, cut.take_skip(), Futures())
        while cut.out:
            got.append((cut.out[0].batch, cut.at))
            cut.take()
            got[-1] = (*got[-1], cut.at)
    cut.end({"window": len(plans)})
    assert [batch.arrays for batch, _, _ in got] == list(range(first, last))
    for b, (batch, _, (state, offset)) in zip(range(first, last), got, strict=True):
        want = np.sort(draws[b * size:(b + 1) * size], kind="stable")
        np.testing.assert_array_equal(batch.sample_index, want)
        assert int(starts[state["window"]]) + offset == min((b + 1) * size, total)


def test_the_restore_skip_is_handed_to_the_head_window_once():
    """The restore's skip, kept once (``BatchCut``): the first window submitted since the
    reset and the first cut each get it, every later one 0; a new reset sets it again."""
    cut = BatchCut()
    assert cut.submit_skip() == 0 and cut.take_skip() == 0  # never reset: nothing to skip
    cut.reset({"window": 3}, 10)
    assert cut.at == ({"window": 3}, 10)
    assert cut.submit_skip() == 10 and cut.submit_skip() == 0
    assert cut.take_skip() == 10 and cut.take_skip() == 0
    cut.reset({"window": 0}, 0)
    assert cut.submit_skip() == 0 and cut.take_skip() == 0
