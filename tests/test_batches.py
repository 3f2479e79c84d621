"""``fetch/batches.BatchCut`` (the batches a window decoded in place completes, cut once a
window on the training thread) against the code it replaced: the same batches, rows,
futures and positions, from an epoch's start or a restore's head window (issue 33)."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from test_jobs import restore_point
from test_schedule import cases

from insitubatch_nodes.errors import InternalError
from insitubatch_nodes.fetch.batches import BatchCut, CutBatch
from insitubatch_nodes.sampling.items import DecodedBatch


class Futures:
    """An arena's ``future``: here the batch number."""

    def future(self, b: int) -> int:
        return b


class OldBatchCut(BatchCut):
    """``add`` as it was: a sort per batch of the pieces it collected."""

    def add(self, plan, before, after, skip, arena):
        slots = plan.slots
        batch = slots.batch
        n = int(batch.size)
        if skip >= n:
            return
        edges = np.flatnonzero(batch[skip + 1:] != batch[skip:-1]) + skip + 1
        starts = [skip, *edges.tolist()]
        ends = [*edges.tolist(), n]
        for a, e in zip(starts, ends, strict=True):
            b = int(batch[a])
            if b < 0:
                continue
            if b != self._batch:
                if self._pieces:
                    raise InternalError("inconsistent")
                self._batch = b
            self._pieces.append(plan.draw_order[a:e])
            self._have += e - a
            if self._have < slots.rows_in(b):
                continue
            pieces, self._pieces, self._have = self._pieces, [], 0
            samples = np.sort(np.concatenate(pieces) if len(pieces) > 1 else pieces[0])
            at = (after, 0) if e == n else (before, e)
            self.out.append(CutBatch(DecodedBatch(samples, arena.future(b)), *at))


@settings(max_examples=300, deadline=None)
@given(case=cases(max_n=300), data=st.data())
def test_batches_are_cut_as_by_the_code_before(case, data):
    """From window ``head`` on (a restore, ``skip`` draws into it at a batch edge) to the
    epoch's end: every batch, its sorted samples, future and the position after it."""
    _, c = case
    plans = c.plans()
    head, skip = restore_point(c, data)
    cuts = []
    for cut in (BatchCut(), OldBatchCut()):
        cut.reset({"window": head}, skip)
        got = []
        for i, plan in enumerate(plans[head:], head):
            cut.add(plan, {"window": i}, {"window": i + 1}, cut.take_skip(), Futures())
            while cut.out:
                item = cut.out[0]
                got.append((item.batch.sample_index, item.batch.arrays, item.state,
                            item.offset))
                cut.take()
        cut.end({"window": len(plans)})
        cuts.append(got)
    new, old = cuts
    assert len(new) == len(old)
    for (a, fa, sa, oa), (b, fb, sb, ob) in zip(new, old, strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)
        assert (fa, sa, oa) == (fb, sb, ob)
