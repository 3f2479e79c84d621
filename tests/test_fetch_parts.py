"""The parts AsyncFetchNode runs over (fetch/): the next epoch started early, the
first-batch hold and the choice of submit path, each on its own."""

from collections import deque
from concurrent.futures import Future

from stores import Var, write_store

import insitubatch_nodes as ib
from insitubatch_nodes.fetch.epoch_ahead import EpochAhead
from insitubatch_nodes.fetch.hold import FirstBatchHold
from insitubatch_nodes.fetch.loop_submit import LoopSubmit
from insitubatch_nodes.fetch.thread_submit import ThreadSubmit
from insitubatch_nodes.fetch.windows import Entry


def _entry() -> Entry:
    return Entry(Future(), {}, None)


def test_epoch_ahead_resets_the_upstream_once_and_fills_the_room():
    ahead = EpochAhead(enabled=True)
    restarts = []

    def pull(queue: deque) -> bool:
        queue.append(_entry())
        return True

    ahead.top_up(2, lambda: restarts.append(1) or {"at": "start"}, pull)
    ahead.top_up(3, lambda: restarts.append(1) or {"at": "again"}, pull)
    assert restarts == [1] and ahead.start == {"at": "start"} and len(ahead.queue) == 3
    assert ahead.epochs_ahead == 1
    queue, exhausted = ahead.take()
    assert len(queue) == 3 and not exhausted and not ahead.queue
    ahead.clear()
    assert ahead.start is None and ahead.epochs_ahead == 0


def test_epoch_ahead_failing_drops_its_windows_and_keeps_the_start():
    ahead = EpochAhead(enabled=True)
    pulled: list[Entry] = []

    def pull(queue: deque) -> bool:
        if pulled:
            raise OSError("the upstream failed")
        pulled.append(_entry())
        queue.append(pulled[0])
        return True

    ahead.top_up(2, lambda: {"at": "start"}, pull)
    assert ahead.failed and not ahead.queue and pulled[0].window.cancelled()
    assert ahead.start == {"at": "start"}  # the reset that starts it goes back there
    ahead.top_up(2, lambda: {"at": "again"}, pull)  # failed: nothing more this epoch
    assert not ahead.queue


def test_the_hold_keeps_windows_ahead_until_the_first_batchs_are_out():
    hold = FirstBatchHold(in_place=False)
    asked = []
    hold.begin(lambda draws: asked.append(draws) or 3)
    assert asked == [1] and hold.started and hold.holding and hold.start_draws == 3
    assert not hold.let_go(2)  # another of the first batch's windows queued
    assert hold.let_go(1) and not hold.holding
    hold.reset()
    assert not (hold.started or hold.holding or hold.deferred)


def test_in_place_the_hold_defers_windows_ahead_to_the_first_batch_going_out():
    hold = FirstBatchHold(in_place=True)
    hold.draws = 4
    hold.begin(lambda draws: 2 * draws)
    assert not hold.let_go(1)
    assert hold.deferred
    assert hold.resume() and not hold.resume()  # once


def test_in_place_the_hold_lets_windows_ahead_go_when_the_start_holds_one_batch():
    hold = FirstBatchHold(in_place=True)
    hold.draws = 4
    hold.begin(lambda draws: draws + 3)  # less than a batch more than the first one
    assert hold.let_go(1) and not hold.deferred


def test_local_stores_go_to_the_decode_threads_and_others_to_the_loop(tmp_path):
    path = tmp_path / "s.zarr"
    write_store(path, [Var("x", (32, 3), (8, 3))])
    src = ib.open_source(path)
    plans = ib.build_loader(src, ib.split_by_chunk(src, (1.0,)), "train", batch_size=4,
                            block_chunks=2).node(ib.ReadPlanNode)
    fetch = ib.AsyncFetchNode(plans, src)
    assert isinstance(fetch._path, ThreadSubmit)
    assert not isinstance(fetch._path, LoopSubmit)
    fetch.shutdown()
