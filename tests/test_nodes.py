"""Each node, used on its own, honours the torchdata resume protocol and its own job."""

import json
import threading
import time

import numpy as np
import pytest
import torch
from stores import BLOSC, Var, write_store
from torchdata.nodes import BaseNode

import insitubatch_nodes as ib
from insitubatch_nodes.graph import build_graph, resolve
from insitubatch_nodes.memory.arena import BatchArena
from insitubatch_nodes.memory.layout import build_layout
from insitubatch_nodes.memory.ledger import BufferPool
from insitubatch_nodes.nodes import (
    ChunkPermuteNode,
    PinOrCudaNode,
    ReadPlanNode,
    ShuffleBufferNode,
    SplitNode,
)
from insitubatch_nodes.sampling.items import (
    BatchDraw,
    DecodedBatch,
    DecodedWindow,
    ScheduledWindow,
)

STAGES = ["split", "permute", "plan", "fetch", "shuffle", "gather", "pin"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = tmp_path_factory.mktemp("nodes") / "s.zarr"
    data = write_store(path, [Var("x", (150, 4), (8, 4), compressors=BLOSC),
                              Var("y", (150, 2), (4, 2), dtype="int16")])
    src = ib.open_source(path)
    return src, ib.split_by_chunk(src, (0.9, 0.1)), data


def build(src, m, upto, seed=5, in_place=False, batch_size=7):
    """The standard graph (graph.py, as build_loader wires it), up to stage ``upto``: the
    window-and-gather path (these tests wire their own shuffle buffers), unless ``in_place``
    (None: as build_loader decides, chunks scattered into batches on this store)."""
    cfg = ib.LoaderConfig.of(seed=seed, block_chunks=3, max_inflight=4, batch_size=batch_size,
                             rank=0, world_size=1, in_place=in_place)
    return build_graph(src, m, "train", resolve(src, m, "train", cfg), upto=upto).root


def key(item):
    """A comparable rendering of any node's output."""
    if isinstance(item, ScheduledWindow):
        return (item.epoch, item.index, tuple(item.chunk_ids.tolist()))
    if isinstance(item, ib.ReadPlan):
        return (item.epoch, item.window, item.chunk_ids, item.draw_order.tolist(), item.reads)
    if isinstance(item, DecodedWindow):
        return (key(item.plan),
                tuple(sorted((i, a.tobytes()) for i, a in d.items()) for d in item.arrays))
    if isinstance(item, BatchDraw):
        return item.sample_index.tolist()
    if isinstance(item, DecodedBatch):  # waited for as iterated: the rows it was given
        return (item.sample_index.tolist(),
                tuple(sorted((k, v.tobytes()) for k, v in item.arrays.result().items())))
    if isinstance(item, dict):
        return tuple(sorted((k, v.numpy().tobytes()) for k, v in item.items()))
    return item


def run_epochs(node, n_epochs):
    out = []
    for _ in range(n_epochs):
        node.reset(None)
        out.append([key(x) for x in node])
    return out


@pytest.mark.parametrize("in_place", [False, None], ids=["gathered", "scattered"])
@pytest.mark.parametrize("stage", STAGES)
def test_node_resume_protocol(setup, stage, in_place):
    src, m, _ = setup
    ref = run_epochs(build(src, m, stage, in_place=in_place), 3)
    assert ref[0] and ref[1]
    if stage != "split":
        assert ref[0] != ref[1]  # a new epoch is a new order
    for ep in (0, 1):
        for k in sorted({0, 1, len(ref[ep]) // 2, len(ref[ep])}):
            node = build(src, m, stage, in_place=in_place)
            for _ in range(ep):
                node.reset(None)
                list(node)
            node.reset(None)
            for _ in range(k):
                next(node)
            state = json.loads(json.dumps(node.state_dict()))
            fresh = build(src, m, stage, in_place=in_place)
            fresh.reset(state)
            assert [key(x) for x in fresh] == ref[ep][k:], (stage, ep, k)
            fresh.reset(None)  # the epoch after a restored one is the next epoch
            assert [key(x) for x in fresh] == ref[ep + 1], (stage, ep, k, "next epoch")


def test_permute_node_deals_rank_shares(setup):
    src, m, _ = setup
    shares = []
    for r in range(3):
        node = ChunkPermuteNode(SplitNode(m, "train"), src.grid, seed=1, rank=r, world_size=3,
                                uneven="none")
        shares.append([c for w in node for c in w.chunk_ids.tolist()])
    flat = sorted(sum(shares, []))
    assert flat == m.chunk_ids("train").tolist()


class _Ids(BaseNode):
    """A hand-written upstream of chunk ids (not a SplitNode): iterated one by one."""

    def __init__(self, ids):
        super().__init__()
        self.ids = [int(i) for i in ids]

    def reset(self, initial_state=None):
        super().reset(initial_state)
        self.pos = 0 if initial_state is None else initial_state["pos"]

    def next(self):
        if self.pos >= len(self.ids):
            raise StopIteration
        self.pos += 1
        return self.ids[self.pos - 1]

    def get_state(self):
        return {"pos": self.pos}


def test_split_node_drains_what_next_would_yield_and_permute_takes_either(setup):
    src, m, _ = setup
    split = SplitNode(m, "train")
    split.reset(None)
    first = [next(split) for _ in range(3)]
    rest = split.drain()
    assert first + rest.tolist() == m.chunk_ids("train").tolist()
    assert split.state_dict() == {SplitNode.POSITION_KEY: len(m.chunk_ids("train"))}
    with pytest.raises(StopIteration):
        next(split)
    with pytest.raises(ValueError):
        rest[0] = -1  # read-only: the split's ids are not the caller's to change
    split.reset(None)
    assert [next(split) for _ in range(3)] == first  # a new epoch starts from the top
    windows = {}
    for name, head in (("split", SplitNode(m, "train")), ("other", _Ids(m.chunk_ids("train")))):
        node = ChunkPermuteNode(head, src.grid, seed=3, block_chunks=2)
        windows[name] = []
        for _ in range(2):  # two epochs: the ids are pulled again at each
            node.reset(None)
            windows[name].append([w.chunk_ids.tolist() for w in node])
    assert windows["split"] == windows["other"] and windows["split"][0] != windows["split"][1]


def test_shuffle_buffer_evicts_drained_stripes(setup):
    src, m, data = setup
    fetch = build(src, m, "fetch")
    shuffle = ShuffleBufferNode(fetch, src.variables, batch_size=5)
    shuffle.reset(None)
    for _ in range(12):  # batches across window edges too
        draw = next(shuffle)
        for v, var in enumerate(src.variables):
            # every row's stripe was handed to the gather, whether let go since or not
            for p in draw.parts[v]:
                np.testing.assert_array_equal(
                    p.array[p.offsets], data[var.name][draw.sample_index[p.start:p.stop]])
            for head in shuffle._resident:
                # exactly the stripes with undrawn samples are still held
                undrawn = head.window.plan.draw_order[head.offset:]
                assert (set(head.window.arrays[v])
                        == set((undrawn // var.sample_chunk).tolist()))
    fetch.close()


def test_gather_rows_match_store(setup):
    src, m, data = setup
    gather = build(src, m, "gather")
    for batch in gather:
        idx = batch["sample_index"].numpy()
        assert np.all(np.diff(idx) > 0)  # rows in ascending sample order
        for name in ("x", "y"):
            np.testing.assert_array_equal(batch[name].numpy(), data[name][idx])


def test_pin_or_cuda_on_cpu_is_a_pass_through(setup):
    src, m, _ = setup
    gather = build(src, m, "gather")
    gather.reset(None)
    ref = next(gather)
    pin = build(src, m, "pin")
    got = next(pin)
    assert all(v.device.type == "cpu" and not v.is_pinned() for v in got.values())
    assert key(got) == key(ref)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_without_cuda_is_a_clear_error(setup):
    src, m, _ = setup
    with pytest.raises(RuntimeError, match="no usable CUDA"):
        PinOrCudaNode(build(src, m, "gather"), device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_batches_equal_cpu_batches(setup):
    src, m, _ = setup
    cpu = [key(b) for b in build(src, m, "pin")]
    node = PinOrCudaNode(build(src, m, "gather"), device="cuda")
    gpu = [key({k: v.cpu() for k, v in b.items()}) for b in node]
    assert cpu == gpu


# -- AsyncFetchNode: errors and threads ---------------------------------------------------

def test_fetch_error_reaches_consumer_with_note_and_repeats(corrupt):
    src, m = corrupt
    loader = ib.build_loader(src, m, "train", batch_size=4, block_chunks=2)
    it = iter(loader)
    with pytest.raises(Exception) as info:
        for _ in range(100):
            next(it)
    err = info.value
    assert not isinstance(err, StopIteration)
    notes = "\n".join(getattr(err, "__notes__", []))
    assert "'x'" in notes and "x/c/5/0" in notes, notes
    # Asking again does not turn the failure into a quiet end of epoch.
    with pytest.raises(type(err)):
        next(it)
    loader.close()


class RecordingPlans(BaseNode):
    """Passes plans through, noting ``fetch.windows_pending()`` as each is pulled: windows
    submitted and not handed over (``pending``), and of those, made (``made``)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.fetch = None
        self.pending: list[int] = []
        self.made: list[int] = []

    def reset(self, initial_state=None):
        super().reset(initial_state)
        self.pending.clear()
        self.made.clear()
        self.inner.reset(initial_state)

    def next(self):
        pending, made = self.fetch.windows_pending()
        self.pending.append(pending)
        self.made.append(made)
        return next(self.inner)

    def get_state(self):
        return self.inner.state_dict()


def fetch_recording(src, m, batch_size=None, in_place=False):
    """A fetch over recorded plans; ``in_place``: decoding into batches of ``batch_size``."""
    plans = RecordingPlans(build(src, m, "plan", in_place=in_place, batch_size=batch_size or 7))
    arena = (BatchArena(build_layout(src.variables), BufferPool()) if in_place else None)
    plans.fetch = ib.AsyncFetchNode(plans, src, prefetch_windows=2, batch_size=batch_size,
                                    arena=arena)
    return plans, plans.fetch


def test_without_first_batch_the_first_window_is_fetched_alone(setup):
    """A hand-built fetch without ``batch_size``: no window ahead is submitted until the
    first one is out (it would share the cores with its last stripes); then the usual depth
    is kept."""
    src, m = setup[0], setup[1]
    plans, fetch = fetch_recording(src, m)
    try:
        for epoch in range(2):
            fetch.reset()
            next(fetch)
            # the first plan pulled with nothing in flight; the second only once the
            # first window was made (about to be handed over), then the third behind it
            assert plans.pending == [0, 1, 2] and plans.made[1] == 1, epoch
            next(fetch)  # and from then on two windows ahead of the one handed over
            assert plans.pending == [0, 1, 2, 2], epoch
    finally:
        fetch.shutdown()


@pytest.mark.parametrize(("batch", "restore_after", "together", "in_place"), [
    (7, 0, 1, False),  # within the first window (24 draws): it goes alone
    (30, 0, 2, False),  # runs into the second window: both go in at once
    # restored 21 draws into the head window: 3 left there, 4 from the next. Decoding in
    # place the fetch counts those draws itself, so both windows go in; delivering whole
    # windows only the shuffle buffer knows them, and the head window goes alone
    (7, 3, 2, True),
    (7, 3, 1, False),
    (7, 2, 1, True),  # restored 14 draws in: the batch is within the head window
])
def test_the_windows_of_the_first_batch_go_in_together(setup, batch, restore_after,
                                                        together, in_place):
    """Given its batch size, the fetch starts with every window the first batch (after a
    restore decoding in place: the next batch) draws from, and no more; the windows ahead
    go in once all of those are out."""
    src, m = setup[0], setup[1]
    state = None
    if restore_after:
        _, fetch = fetch_recording(src, m, batch, in_place)
        shuffle = ShuffleBufferNode(fetch, src.variables, batch)
        try:
            shuffle.reset()
            for _ in range(restore_after):
                next(shuffle)
            state = shuffle.state_dict()
        finally:
            shuffle.shutdown()
    plans, fetch = fetch_recording(src, m, batch, in_place)
    shuffle = ShuffleBufferNode(fetch, src.variables, batch)
    try:
        shuffle.reset(state)
        next(shuffle)
        # the first batch's windows pulled together (0, 1, ... pending), then, once all are
        # handed over, the windows ahead
        assert plans.pending[:together] == list(range(together))
        assert len(plans.pending) > together  # windows ahead went in
        if not in_place:  # (in place, windows handed on may be decoded, uncounted, by now)
            assert plans.pending[together] == 1
            assert plans.made[together] == 1  # no window ahead before the last was made
            # the two ahead (restored on whole windows, the batch then asks for the next
            # window, and one more goes in behind it)
            assert plans.pending[:together + 2] == [*range(together), 1, 2]
    finally:
        shuffle.shutdown()


class FailingOnce(RecordingPlans):
    """Raises once, at the ``at``-th plan asked for (counting from 1), before pulling it."""

    def __init__(self, inner, at):
        super().__init__(inner)
        self.at, self.asked = at, 0

    def next(self):
        self.asked += 1
        if self.asked == self.at:
            raise OSError("the plan stage failed once")
        return super().next()


@pytest.mark.parametrize("at", [2, 3, 4, 5])
def test_an_epoch_survives_a_plan_stage_that_fails_once(setup, at):
    """Pulling a plan can fail (the plan stage raises, an interrupt) while the fetch tops up
    its queue as a made window goes out, or while the shuffle buffer has taken some draws of
    a batch that runs into the next window: the error reaches the caller, and asking again
    serves what was in hand, once (before, the made window or the draws were lost while the
    state counted them delivered): the epoch is every sample once, in the same order."""
    src, m = setup[0], setup[1]

    def epoch(plans):
        plans.fetch = ib.AsyncFetchNode(plans, src, prefetch_windows=2)
        shuffle = ShuffleBufferNode(plans.fetch, src.variables, 7)
        out, errors = [], 0
        try:
            shuffle.reset()
            while True:
                try:
                    out.append(next(shuffle).sample_index.tolist())
                except StopIteration:
                    return out, errors
                except OSError:
                    errors += 1
        finally:
            shuffle.shutdown()

    want, _ = epoch(RecordingPlans(build(src, m, "plan")))
    got, errors = epoch(FailingOnce(build(src, m, "plan"), at))
    assert errors == 1
    assert got == want


def test_decoded_in_place_the_fetch_yields_the_batches_the_shuffle_buffer_passes_on(setup):
    """In place the fetch yields each batch of the plans (rows sorted, in plan order), and
    the shuffle buffer hands on exactly those: nothing is cut twice, no side channel."""
    src, m = setup[0], setup[1]
    fetch = build(src, m, "fetch", in_place=True)
    try:
        fetch.reset()
        batches = list(fetch)
        assert batches and all(isinstance(b, DecodedBatch) for b in batches)
        assert all(b.sample_index.tolist() == sorted(b.sample_index.tolist()) for b in batches)
        rows = [b.arrays.result() for b in batches]  # waited for, in order
        assert all(r["x"].shape[0] == b.sample_index.size
                   for r, b in zip(rows, batches, strict=True))
    finally:
        fetch.shutdown()
    shuffle = build(src, m, "shuffle", in_place=True)
    try:
        shuffle.reset()
        draws = list(shuffle)
        assert [d.sample_index.tolist() for d in draws] == [
            b.sample_index.tolist() for b in batches]
        assert all(d.ready is not None and not d.parts for d in draws)
    finally:
        shuffle.shutdown()


def fetch_epochs(src, m, n, ahead=True, between=None):
    """``n`` epochs of windows from a fetch over the standard plans (``between(fetch, e)``
    runs after epoch ``e`` ends); returns them and the state at each epoch's end."""
    fetch = ib.AsyncFetchNode(build(src, m, "plan"), src, prefetch_windows=2,
                              prefetch_next_epoch=ahead)
    out, ends = [], []
    try:
        for e in range(n):
            fetch.reset(None)
            out.append([key(w) for w in fetch])
            ends.append(json.loads(json.dumps(fetch.state_dict())))
            if between is not None:
                between(fetch, e)
    finally:
        fetch.shutdown()
    return out, ends


def test_the_next_epoch_is_fetched_before_it_starts(setup):
    """Once an epoch's plans are all submitted, the fetch starts the next epoch's windows:
    right after ``reset(None)`` they are already in flight or made. Windows and the states
    at each epoch's end equal a fetch that starts every epoch empty."""
    src, m = setup[0], setup[1]
    want, want_ends = fetch_epochs(src, m, 3, ahead=False)
    seen = []

    def check(fetch, e):
        assert fetch.epochs_ahead == 1  # the upstream is in epoch e + 1 already
        seen.append(fetch.windows_pending()[0])

    got, got_ends = fetch_epochs(src, m, 3, between=check)
    assert got == want and got_ends == want_ends
    assert seen == [3, 3, 3]  # prefetch_windows + 1: the usual depth, all the next epoch's


@pytest.mark.parametrize("how", ["restore", "close", "plan fails"])
def test_a_next_epoch_begun_early_is_dropped_cleanly(setup, how):
    """A restore drops the windows fetched ahead; ``close()`` and a plan stage failing while
    the next epoch is fetched early drop them too, and the epoch that follows is still the
    next one (not one further: the upstream is put back at its start, not reset twice)."""
    src, m = setup[0], setup[1]
    want, want_ends = fetch_epochs(src, m, 3, ahead=False)
    restored = []

    def between(fetch, e):
        if how == "restore" and e == 0:
            # back to the end of epoch 0, then on: the same epoch 1
            fetch.reset(want_ends[0])
            restored.append([key(w) for w in fetch])  # nothing left of epoch 0
        elif how == "close":
            fetch.close()

    if how == "plan fails":
        # asks 1..n: epoch 0; n + 1: its end; n + 2: epoch 1 early; n + 3 fails
        plans = FailingOnce(build(src, m, "plan"), at=len(want[0]) + 3)
        fetch = ib.AsyncFetchNode(plans, src, prefetch_windows=2)
        plans.fetch = fetch
        got = []
        try:
            for e in range(3):
                fetch.reset(None)
                got.append([key(w) for w in fetch])
                if e == 0:  # it failed while epoch 0 was ending, in the fetch ahead
                    assert plans.asked >= len(want[0]) + 3
        finally:
            fetch.shutdown()
    else:
        got, _ = fetch_epochs(src, m, 3, between=between)
        assert restored == ([[]] if how == "restore" else [])
    assert got == want


def test_reset_twice_with_nothing_drawn_restarts_the_epoch_it_adopted(setup):
    """A second ``reset(None)`` before anything of an epoch begun early was drawn starts
    that epoch again (the upstream moves on only once asked), not the one after."""
    src, m = setup[0], setup[1]
    want, _ = fetch_epochs(src, m, 3, ahead=False)
    fetch = ib.AsyncFetchNode(build(src, m, "plan"), src, prefetch_windows=2)
    got = []
    try:
        for _ in range(3):
            fetch.reset(None)
            fetch.reset(None)  # e.g. iter() twice
            got.append([key(w) for w in fetch])
    finally:
        fetch.shutdown()
    assert got == want


def test_close_stops_threads(setup):
    src, m, _ = setup
    fetch = build(src, m, "fetch")
    next(fetch)
    names = {t.name for t in threading.enumerate()}
    assert any(n.startswith("insitubatch-fetch") for n in names)
    thread = fetch._lt.thread
    fetch.close()
    time.sleep(0.05)
    assert not thread.is_alive()


def test_one_loop_thread_for_the_nodes_lifetime(setup):
    src, m, _ = setup
    fetch = build(src, m, "fetch")
    next(fetch)
    first = fetch._lt.thread
    for _ in range(3):
        fetch.reset(None)
        list(fetch)
    assert fetch._lt.thread is first and first.is_alive()
    fetch.close()


def test_grouped_local_reads_fall_back_to_single_reads_on_error(tmp_path):
    """Small stripes are read several per pool task; a bad one is still named exactly."""
    path = tmp_path / "many.zarr"
    data = write_store(path, [Var("x", (160, 3), (2, 3), compressors=BLOSC)])
    (path / "x" / "c" / "37" / "0").write_bytes(b"garbage, not blosc")
    src = ib.open_source(path)
    loader = ib.build_loader(src, ib.split_by_chunk(src, (1.0,)), "train", batch_size=4,
                             block_chunks=40, retry=ib.RetryPolicy(attempts=2, base_delay=0))
    fetch, planner = loader.node(ib.AsyncFetchNode), loader.node(ReadPlanNode)
    planner.reset(None)
    assert any(len(idxs) > 1 for _, idxs in fetch._jobs(next(planner)))
    seen = []
    with pytest.raises(Exception) as info:  # noqa: B017 - the codec's own error type
        for b in loader:
            seen.append(b)
            np.testing.assert_array_equal(b["x"].numpy(), data["x"][b["sample_index"].numpy()])
    notes = "\n".join(info.value.__notes__)
    assert "x/c/37/0" in notes and ("gave up after" in notes or "not retried" in notes)
    loader.close()


def test_dtype_alone_casts_every_variable(tmp_path):
    """build_loader(dtype=...) without stats must still cast (it adds NormalizeNode for it),
    and a variable the stats do not cover is cast too; an integer variable served raw whose
    stored range the float type cannot hold whole (label ids) is refused, naming it."""
    path = tmp_path / "s.zarr"
    write_store(path, [Var("x", (40, 3), (8, 3)), Var("y", (40, 2), (8, 2), dtype="int8"),
                       Var("ids", (40, 2), (8, 2), dtype="uint16")])
    src = ib.open_source(path, variables=["x", "y"])
    m = ib.split_by_chunk(src, (1.0,))
    b = next(iter(ib.build_loader(src, m, "train", batch_size=4, dtype=torch.bfloat16)))
    assert b["x"].dtype == b["y"].dtype == torch.bfloat16
    assert b["sample_index"].dtype == torch.int64
    stats = ib.compute_stats(ib.open_source(path, variables=["x"]), m, "train")
    # statistics that miss a served variable: refused, naming it and both ways out
    with pytest.raises(ValueError, match=r"no entry for 'y'.*\['x'\].*normalize=\{'y': 'none'\}"):
        ib.build_loader(src, m, "train", batch_size=4, stats=stats, dtype=torch.float16)
    b = next(iter(ib.build_loader(src, m, "train", batch_size=4, stats=stats,
                                  dtype=torch.float16, normalize={"y": "none"})))
    assert b["x"].dtype == b["y"].dtype == torch.float16
    labelled = ib.open_source(path, variables=["x", "ids"])
    for kw in ({}, {"stats": stats, "normalize": {"ids": "none"}}):
        with pytest.raises(ib.ConfigError, match=r"dtype=torch.bfloat16 would cast 'ids' "
                           r"\(uint16, served raw.*only up to 256, and a uint16 reaches 65535"):
            ib.build_loader(labelled, m, "train", batch_size=4, dtype=torch.bfloat16, **kw)
    full = ib.compute_stats(labelled, m, "train")  # measurements: normalized, then cast
    b = next(iter(ib.build_loader(labelled, m, "train", batch_size=4, stats=full,
                                  dtype=torch.bfloat16)))
    assert b["ids"].dtype == torch.bfloat16
    b = next(iter(ib.build_loader(labelled, m, "train", batch_size=4, dtype=torch.float32)))
    assert b["ids"].dtype == torch.float32  # float32 holds every uint16 whole


def test_copy_state_is_deep_and_keeps_foreign_values():
    from insitubatch_nodes.nodes.state import copy_state

    marker = np.arange(3)
    state = {"a": [1, {"b": 2.5, "c": None}], "d": "x", "e": True, "f": marker}
    got = copy_state(state)
    assert got == {**state, "f": got["f"]} and np.array_equal(got["f"], marker)
    got["a"][1]["b"] = 9
    got["a"].append(3)
    got["f"][0] = 7
    assert state["a"] == [1, {"b": 2.5, "c": None}] and marker[0] == 0


def test_a_misconfigured_transform_is_refused_before_the_fetch_starts(setup, monkeypatch):
    """The per-batch stages are planned (and checked) before any stage is built: a bad
    patch size starts no decode worker only to be refused."""
    src, m = setup[0], setup[1]
    started = []
    monkeypatch.setattr(ib.AsyncFetchNode, "start", lambda self: started.append(self))
    with pytest.raises(ib.ConfigError, match=r"patch_size=\(2, 2\) cuts the last 2 dims"):
        ib.build_loader(src, m, "train", batch_size=4, patch_size=(2, 2), workers=1)
    assert not started


def test_a_patch_bigger_than_the_grid_is_refused_before_the_fetch_starts(tmp_path,
                                                                         monkeypatch):
    """The patch size against the grid is part of the plan too: refused before a decode
    worker starts, naming the size and the grid."""
    url = tmp_path / "grid.zarr"
    write_store(url, [Var("t2m", (16, 8, 12), (1, 8, 12))])
    src = ib.open_source(str(url))
    m = ib.split_by_chunk(src, fractions=(1.0, 0.0, 0.0))
    started = []
    monkeypatch.setattr(ib.AsyncFetchNode, "start", lambda self: started.append(self))
    with pytest.raises(ib.ConfigError, match=r"patch size \(4, 16\) does not fit in the "
                                             r"spatial shape \(8, 12\)"):
        ib.build_loader(src, m, "train", batch_size=4, patch_size=(4, 16), workers=1)
    assert not started
