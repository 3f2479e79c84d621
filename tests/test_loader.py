"""The contract of build_loader: exactly once, shuffled, deterministic, exact resume, bounded."""

import gc
import itertools
import json
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from stores import BLOSC, Var, state_after, write_store

import insitubatch_nodes as ib

_counter = itertools.count()


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("loader-stores")


def make(store_dir, variables):
    path = store_dir / f"s{next(_counter)}.zarr"
    data = write_store(path, variables)
    return ib.open_source(path), data


def epoch(loader, limit=None):
    out = []
    for i, b in enumerate(loader):
        out.append({k: v.numpy().copy() for k, v in b.items()})
        if limit is not None and i + 1 >= limit:
            break
    return out


def check_rows(batches, data):
    for b in batches:
        for name, arr in data.items():
            np.testing.assert_array_equal(b[name], arr[b["sample_index"]])


def split_samples(manifest, split):
    return manifest.grid.samples_of(manifest.chunk_ids(split)).tolist()


def same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])


geometries = st.fixed_dictionaries({
    "n": st.integers(1, 90),
    "cs_a": st.integers(1, 12),
    "cs_b": st.integers(1, 12),
    "batch": st.integers(1, 20),
    "block": st.integers(1, 5),
    "drop_last": st.booleans(),
    "val": st.sampled_from([0.0, 0.3]),
})


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(g=geometries)
def test_exactly_once_over_shapes(store_dir, g):
    src, data = make(store_dir, [Var("a", (g["n"], 3), (g["cs_a"], 2), compressors=BLOSC),
                                 Var("b", (g["n"],), (g["cs_b"],), dtype="int16")])
    m = ib.split_by_chunk(src, (1 - g["val"], g["val"]))
    want = split_samples(m, "train")
    if g["drop_last"] and len(want) < g["batch"]:  # an epoch of no batch: refused at build
        with pytest.raises(ValueError, match="yields no batch"):
            ib.build_loader(src, m, "train", batch_size=g["batch"], block_chunks=g["block"],
                            drop_last=True)
        return
    with ib.build_loader(src, m, "train", batch_size=g["batch"], block_chunks=g["block"],
                         drop_last=g["drop_last"]) as loader:
        batches = epoch(loader)
    check_rows(batches, data)
    seen = np.concatenate([b["sample_index"] for b in batches]) if batches else np.array([])
    assert len(set(seen.tolist())) == len(seen)  # never twice
    if g["drop_last"]:
        assert all(len(b["sample_index"]) == g["batch"] for b in batches)
        assert len(want) - len(seen) < g["batch"] and set(seen.tolist()) <= set(want)
    else:
        assert sorted(seen.tolist()) == want
        assert all(len(b["sample_index"]) == g["batch"] for b in batches[:-1])


def test_geometries_of_issue(store_dir):
    """Sharded, inner-chunked, one-sample-per-chunk and mixed dtypes in one loader."""
    src, data = make(store_dir, [
        Var("sharded", (61, 4, 6), (4, 4, 3), shards=(8, 4, 6)),
        Var("inner", (61, 5, 6), (8, 2, 4), compressors=BLOSC),
        Var("half", (61, 3), (8, 3), dtype="float16"),
        Var("ints", (61,), (8,), dtype="int64"),
    ])
    m = ib.split_by_chunk(src, (1.0,))
    batches = epoch(ib.build_loader(src, m, "train", batch_size=5, block_chunks=3))
    check_rows(batches, data)
    assert batches[0]["half"].dtype == np.float16
    assert sorted(np.concatenate([b["sample_index"] for b in batches]).tolist()) == list(range(61))

    src1, data1 = make(store_dir, [Var("grib", (40, 8, 8), (1, 8, 8))])
    m1 = ib.split_by_chunk(src1, (1.0,))
    batches = epoch(ib.build_loader(src1, m1, "train", batch_size=4, block_chunks=8))
    check_rows(batches, data1)
    assert sorted(np.concatenate([b["sample_index"] for b in batches]).tolist()) == list(range(40))


@pytest.fixture(scope="module")
def medium(store_dir):
    src, data = make(store_dir, [Var("x", (400, 6), (8, 6), compressors=BLOSC),
                                 Var("y", (400,), (16,), dtype="int32")])
    return src, data, ib.split_by_chunk(src, (0.8, 0.2))


def test_batch_contract(medium):
    src, _, m = medium
    b = next(iter(ib.build_loader(src, m, "train", batch_size=32)))
    assert set(b) == {"x", "y", "sample_index"}
    assert b["x"].shape == (32, 6) and b["x"].dtype == torch.float32
    assert b["y"].shape == (32,) and b["sample_index"].dtype == torch.int64
    assert b["x"].device.type == "cpu"


def test_new_permutation_every_epoch_and_deterministic(medium):
    src, _, m = medium
    a = ib.build_loader(src, m, "train", batch_size=16, seed=3)
    b = ib.build_loader(src, m, "train", batch_size=16, seed=3)
    c = ib.build_loader(src, m, "train", batch_size=16, seed=4)
    a0, a1 = epoch(a), epoch(a)
    same(a0, epoch(b))
    same(a1, epoch(b))
    order = lambda bs: np.concatenate([x["sample_index"] for x in bs]).tolist()  # noqa: E731
    assert order(a0) != order(a1)
    assert order(a0) != order(epoch(c))
    assert sorted(order(a0)) == sorted(order(a1)) == split_samples(m, "train")


def test_batches_mix_the_whole_window(medium):
    src, _, m = medium
    loader = ib.build_loader(src, m, "train", batch_size=32, block_chunks=16)
    batches = epoch(loader)
    distinct = [np.unique(b["sample_index"] // 8).size for b in batches[:-1]]
    # 32 draws from 16 chunks of 8: about 14 distinct chunks, never one chunk at a time.
    assert np.mean(distinct) > 11
    measured = ib.measured_shuffle_quality([b["sample_index"] for b in batches], 8, 40)
    assert measured == pytest.approx(loader.shuffle_quality, rel=0.15)


def test_measured_quality_rises_with_block_chunks(medium):
    src, _, m = medium
    scores = []
    for block in (1, 4, 16, 40):
        batches = epoch(ib.build_loader(src, m, "train", batch_size=8, block_chunks=block))
        scores.append(ib.measured_shuffle_quality([b["sample_index"] for b in batches], 8, 40))
    assert scores == sorted(scores) and scores[0] < 0.4 < 0.8 < scores[-1]


# -- exact resume ------------------------------------------------------------------------

def _resume_check(src, m, k, epoch_of_cut, **kw):
    ref = ib.build_loader(src, m, "train", **kw)
    full = [epoch(ref) for _ in range(epoch_of_cut + 2)]
    run = ib.build_loader(src, m, "train", **kw)
    for _ in range(epoch_of_cut):
        epoch(run)
    it = iter(run)
    if k == "initial":
        state = ib.build_loader(src, m, "train", **kw).state_dict()
        done = 0
    else:
        for _ in range(k):
            next(it)
        state = run.state_dict()
        done = k
    text = json.dumps(state)
    assert len(text) < 2048
    resumed = ib.build_loader(src, m, "train", **kw)
    resumed.load_state_dict(json.loads(text))
    if k == "initial":
        rest = [epoch(resumed) for _ in range(2)]
        same(rest[0], full[0])
        same(rest[1], full[1])
        return
    same(epoch(resumed), full[epoch_of_cut][done:])
    same(epoch(resumed), full[epoch_of_cut + 1])


@pytest.mark.parametrize("stage", [ib.ShuffleBufferNode, ib.GatherNode, ib.PinOrCudaNode])
@pytest.mark.parametrize("chunk", [1, 4])  # one sample per chunk: decoded in place
def test_an_error_after_a_stage_took_its_batch_loses_nothing(store_dir, stage, chunk):
    """A stage that raises after it took its batch from upstream (a transform's error, a
    CUDA error, Ctrl-C in a notebook) left the graph's state counting that batch delivered:
    asking again skipped it, and so did a checkpoint taken after the error. The loader goes
    back to the state after the last batch it delivered; both now serve it."""
    src, _ = make(store_dir, [Var("x", (60, 3), (chunk, 3), compressors=BLOSC)])
    m = ib.split_by_chunk(src, (1.0,))
    kw = dict(batch_size=5, block_chunks=3, seed=2)
    want = epoch(ib.build_loader(src, m, "train", **kw))
    loader = ib.build_loader(src, m, "train", **kw)
    node = loader.node(stage)
    took = node.next
    calls = itertools.count(1)

    def take_then_fail():
        item = took()
        if next(calls) == 3:
            raise KeyboardInterrupt
        return item

    node.next = take_then_fail
    it = iter(loader)
    got = []
    with pytest.raises(KeyboardInterrupt):
        while True:
            got.append({k: v.numpy().copy() for k, v in next(it).items()})
    state = loader.state_dict()
    got += [{k: v.numpy().copy() for k, v in b.items()} for b in it]
    same(got, want)
    resumed = ib.build_loader(src, m, "train", **kw)
    resumed.load_state_dict(state)
    same(epoch(resumed), want[2:])


@pytest.mark.parametrize("chunk", [1, 4])
def test_an_interrupt_after_the_graph_made_a_batch_loses_nothing(store_dir, chunk):
    """Ctrl-C landing after the graph produced a batch but before the loader returned it
    (while it records the state after it): the batch is served by the next call, and a
    checkpoint taken after the interrupt resumes at it."""
    src, _ = make(store_dir, [Var("x", (60, 3), (chunk, 3), compressors=BLOSC)])
    m = ib.split_by_chunk(src, (1.0,))
    kw = dict(batch_size=5, block_chunks=3, seed=2)
    want = epoch(ib.build_loader(src, m, "train", **kw))
    loader = ib.build_loader(src, m, "train", **kw)
    it = iter(loader)
    got = [{k: v.numpy().copy() for k, v in next(it).items()} for _ in range(2)]
    root, calls = loader.root, itertools.count(1)
    real = root.state_dict

    def interrupted():
        if next(calls) == 1:
            raise KeyboardInterrupt
        return real()

    root.state_dict = interrupted
    with pytest.raises(KeyboardInterrupt):
        next(it)
    del root.state_dict
    state = loader.state_dict()
    assert state["num_yielded"] == 2
    got += [{k: v.numpy().copy() for k, v in b.items()} for b in it]
    same(got, want)
    resumed = ib.build_loader(src, m, "train", **kw)
    resumed.load_state_dict(state)
    same(epoch(resumed), want[2:])


def test_state_dict_between_load_and_iter_is_the_loaded_state(medium):
    """A checkpoint taken after load_state_dict and before the first batch (a preemption
    handler, a callback on resume) records where the loader will go on, not epoch 0."""
    src, _, m = medium
    a = ib.build_loader(src, m, "train", batch_size=16)
    it = iter(a)
    for _ in range(4):
        next(it)
    state = a.state_dict()
    for used in (False, True):
        b = ib.build_loader(src, m, "train", batch_size=16)
        if used:
            epoch(b, limit=2)
        b.load_state_dict(state)
        again = b.state_dict()
        assert again["num_yielded"] == 4 and again["root"] == state["root"]
        c = ib.build_loader(src, m, "train", batch_size=16)
        c.load_state_dict(again)
        same(epoch(c), epoch(b))


def _small_store(tmp_path, chunk):
    """A 64-sample store in ``chunk``-sample chunks, its loader options and its epoch."""
    path = tmp_path / "s.zarr"
    write_store(path, [Var("x", (64, 3), (chunk, 3), compressors=BLOSC)])
    src = ib.open_source(path)
    m = ib.split_by_chunk(src, (1.0,))
    kw = dict(batch_size=4, block_chunks=2, seed=3)
    return path, src, m, kw, epoch(ib.build_loader(src, m, "train", **kw))


@pytest.mark.parametrize("chunk", [1, 8])
def test_a_read_error_on_the_first_batch_after_a_resume_keeps_the_resume(tmp_path, chunk):
    """torchdata looks one batch ahead in iter() after applying a loaded state: a read
    failing there escaped iter(), and the next iter() started a new epoch, skipping the
    rest of the resumed one. Asked again, the loader resumes there again."""
    path, src, m, kw, want = _small_store(tmp_path, chunk)
    a = ib.build_loader(src, m, "train", **kw)
    epoch(a, limit=5)
    state = a.state_dict()
    row = int(want[5]["sample_index"][0])  # a chunk the first batch after the resume reads
    key = path / "x" / "c" / str(row // chunk) / "0"
    good = key.read_bytes()
    key.write_bytes(b"damaged")
    b = ib.build_loader(src, m, "train", **kw)
    b.load_state_dict(state)
    with pytest.raises(ib.CorruptChunkError):
        for _ in b:
            pass
    key.write_bytes(good)
    same(epoch(b), want[5:])


def test_a_gathered_state_resumes_in_place_and_back(store_dir):
    """The path (gathered or in place) is how a loader runs, not what it plans: a state
    saved on either resumes exactly on the other (same batches as one uninterrupted run),
    and the fingerprint records no path."""
    src, _ = make(store_dir, [Var("x", (60, 3), (1, 3), compressors=BLOSC)])
    m = ib.split_by_chunk(src, (1.0,))
    kw = dict(batch_size=7, block_chunks=3, seed=1)
    want = epoch(ib.build_loader(src, m, "train", **kw))
    same(epoch(ib.build_loader(src, m, "train", in_place=False, **kw)), want)
    gathered = ib.build_loader(src, m, "train", in_place=False, **kw)
    epoch(gathered, limit=2)
    state = gathered.state_dict()
    assert "in_place" not in state["fingerprint"]
    back = ib.build_loader(src, m, "train", **kw)
    back.load_state_dict(state)
    same(epoch(back), want[2:])
    placed = ib.build_loader(src, m, "train", **kw)
    epoch(placed, limit=2)
    onto = ib.build_loader(src, m, "train", in_place=False, **kw)
    onto.load_state_dict(placed.state_dict())
    same(epoch(onto), want[2:])
    old = placed.state_dict()
    old["fingerprint"]["in_place"] = False  # a state saved before 2026-11-29: read, ignored
    resumed = ib.build_loader(src, m, "train", **kw)
    resumed.load_state_dict(old)
    same(epoch(resumed), want[2:])
    # 1 batch of 7, then 1 of 5 on the gather path: draw 12 is inside batch 1 of the plan
    # in place (7-13), which a loader decoding in place cannot start from: refused by name
    odd = ib.build_loader(src, m, "train", in_place=False, **kw)
    epoch(odd, limit=1)
    fives = ib.build_loader(src, m, "train", in_place=False, allow_state_change=True,
                            **{**kw, "batch_size": 5})
    fives.load_state_dict(odd.state_dict())
    epoch(fives, limit=1)
    mid = fives.state_dict()
    placed5 = ib.build_loader(src, m, "train", **{**kw, "batch_size": 5})
    placed5.load_state_dict(mid)
    with pytest.raises(ib.StateError, match=r"'offset' is 0, inside batch 2 of this "
                                            r"loader's plans \(draw 12 of the epoch, batches "
                                            r"of 5\)"):
        next(iter(placed5))


def test_one_loader_refuses_a_second_consumer_thread(medium):
    src, _, m = medium
    loader = ib.build_loader(src, m, "train", batch_size=16)
    it = iter(loader)
    gather = loader.node(ib.GatherNode)
    inside, go_on = threading.Event(), threading.Event()
    real = gather.next

    def slow():
        inside.set()
        go_on.wait(10)
        return real()

    gather.next = slow
    first = threading.Thread(target=lambda: next(it))
    first.start()
    assert inside.wait(10)
    with pytest.raises(RuntimeError, match="already being iterated by another thread"):
        next(it)
    go_on.set()
    first.join()
    gather.next = real
    assert len(list(it)) == -(-m.n_samples_in("train") // 16) - 1
    loader.close()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(k=st.integers(0, 12), ep=st.integers(0, 1), batch=st.integers(1, 24),
       block=st.integers(1, 6))
def test_resume_is_exact(medium, k, ep, batch, block):
    src, _, m = medium
    n_batches = -(-m.n_samples_in("train") // batch)
    _resume_check(src, m, min(k, n_batches), ep, batch_size=batch, block_chunks=block, seed=7)


def test_resume_from_initial_state(medium):
    src, _, m = medium
    _resume_check(src, m, "initial", 0, batch_size=16, block_chunks=4)


def test_resume_at_epoch_end_starts_next_epoch(medium):
    src, _, m = medium
    a = ib.build_loader(src, m, "train", batch_size=16)
    e0 = epoch(a)
    state = a.state_dict()
    e1 = epoch(a)
    b = ib.build_loader(src, m, "train", batch_size=16)
    b.load_state_dict(state)
    assert len(e0) > 0
    same(epoch(b), e1)


@pytest.mark.parametrize("reload", [False, True])
def test_the_next_epoch_fetched_early_changes_no_batch_state_or_epoch(medium, reload):
    """While an epoch's last batches go out the fetch is already in the next one: batches,
    every state (resumed from, on a fresh loader, or loaded into this one at the epoch's
    end) and ``loader.epoch``/``stats().epoch`` are those of a loader that starts each
    epoch empty."""
    src, _, m = medium
    # the window path (decoding in place fills this epoch's batches: never the next's)
    kw = dict(batch_size=16, block_chunks=3, in_place=False)
    plain = ib.build_loader(src, m, "train", prefetch_next_epoch=False, **kw)
    want = [epoch(plain) for _ in range(3)]
    with ib.build_loader(src, m, "train", **kw) as a:
        got, states = [], []
        for e in range(3):
            batches = []
            for b in a:
                assert a.epoch == a.stats().epoch == e
                batches.append(b)
                states.append(a.state_dict())
            assert a.epoch == e and a.node(ib.AsyncFetchNode).epochs_ahead == 1
            got.append(batches)
            if reload and e == 0:
                a.load_state_dict(states[-1])  # the epoch's end: the next iter() is epoch 1
        for g, w in zip(got, want, strict=True):
            same(g, w)
    n = len(want[0])
    # saved at epoch 0's end (the next iter() is all of epoch 1), and 3 batches into epoch 1
    for saved, rest in ((states[n - 1], want[1]), (states[n + 2], want[1][3:])):
        b = ib.build_loader(src, m, "train", **kw)
        b.load_state_dict(saved)
        same(epoch(b), rest)


@pytest.mark.parametrize("chunk", [8, 1])  # 1: decoded in place
@pytest.mark.parametrize("ahead", [True, False])
def test_going_on_after_close_serves_the_rest_of_the_epoch_once(store_dir, chunk, ahead):
    """``close()`` mid-epoch drops the windows in flight; an iterator taken before goes on
    with the next batch (fetched again), and the epoch is still every sample once (before,
    the dropped windows were lost, or in place the batches failed as "a bug")."""
    src, _ = make(store_dir, [Var("x", (160, 3), (chunk, 3), compressors=BLOSC)])
    m = ib.split_by_chunk(src, (1.0,))
    kw = dict(batch_size=16, block_chunks=3, prefetch_next_epoch=ahead)
    want = epoch(ib.build_loader(src, m, "train", **kw))
    loader = ib.build_loader(src, m, "train", **kw)
    it = iter(loader)
    got = epoch(it, limit=3)
    loader.close()
    got += epoch(it)
    same(got, want)
    loader.shutdown()


def test_close_at_an_epoch_end_keeps_the_epoch_end_state(medium):
    """After the epoch ended, ``close()`` leaves the state as it was (with ``drop_last``
    the state after the last batch would point at the dropped rows)."""
    src, _, m = medium
    loader = ib.build_loader(src, m, "train", batch_size=7, block_chunks=3, drop_last=True)
    epoch(loader)
    ended = loader.state_dict()
    loader.close()
    assert loader.state_dict() == ended
    loader.shutdown()


@pytest.mark.parametrize("chunk", [8, 1])
def test_close_after_a_failed_first_batch_goes_on_with_that_epoch(tmp_path, chunk):
    """The epoch's first batch fails (a damaged chunk), then ``close()``: the graph went
    back to the epoch's start after the error, and going on serves that epoch from its
    first batch, once the chunk is repaired (close() must not restart the next epoch)."""
    path, src, m, kw, want = _small_store(tmp_path, chunk)
    row = int(want[0]["sample_index"][0])  # a chunk the epoch's first batch reads
    key = path / "x" / "c" / str(row // chunk) / "0"
    good = key.read_bytes()
    key.write_bytes(b"damaged")
    loader = ib.build_loader(src, m, "train", **kw)
    it = iter(loader)
    with pytest.raises(ib.CorruptChunkError):
        next(it)
    loader.close()
    key.write_bytes(good)
    same(epoch(it), want)
    assert loader.epoch == 0
    loader.shutdown()


@pytest.mark.parametrize("between", ["iter", "close"])
@pytest.mark.parametrize("ahead", [True, False])
def test_an_epoch_nothing_was_drawn_from_is_not_skipped(medium, between, ahead):
    """``iter()`` again (or ``close()`` and ``iter()``, as a ``with loader:`` loop that
    stops on ``loader.epoch`` does) before a batch of the new epoch was drawn restarts that
    epoch, not the next: with the next epoch fetched early, its plans were already pulled,
    and every other epoch was skipped."""
    src, _, m = medium
    kw = dict(batch_size=16, block_chunks=3, prefetch_next_epoch=ahead)
    want = [epoch(ld) for ld in [ib.build_loader(src, m, "train", **kw)] for _ in range(3)]
    loader = ib.build_loader(src, m, "train", **kw)
    got, epochs = [], []
    for _ in range(3):
        iter(loader)
        if between == "close":
            loader.close()
        epochs.append(loader.epoch)
        got.append(epoch(loader))
    assert epochs == [0, 1, 2]
    for g, w in zip(got, want, strict=True):
        same(g, w)
    loader.shutdown()


def test_checkpoints_after_resuming_at_an_epoch_end_move_on(medium):
    """Restored at an epoch's end, the loader rolls over to the next epoch; the states it
    gives from then on are its own (torchdata kept the restored one and answered with it in
    every later epoch, so resuming from a later checkpoint replayed what was served)."""
    src, _, m = medium
    kw = dict(batch_size=16, block_chunks=3)
    a = ib.build_loader(src, m, "train", **kw)
    epoch(a)
    e1, e2 = epoch(a), epoch(a)
    b = ib.build_loader(src, m, "train", **kw)
    b.load_state_dict(_state_at_epoch_end(src, m, kw))
    it = iter(b)
    for _ in range(3):
        next(it)
    c = ib.build_loader(src, m, "train", **kw)
    c.load_state_dict(b.state_dict())
    same(epoch(c), e1[3:])
    for _ in it:
        pass
    it = iter(b)
    next(it)
    d = ib.build_loader(src, m, "train", **kw)
    d.load_state_dict(b.state_dict())
    same(epoch(d), e2[1:])


def _state_at_epoch_end(src, m, kw):
    a = ib.build_loader(src, m, "train", **kw)
    epoch(a)
    return a.state_dict()


def test_num_yielded_is_exact_after_restore(medium):
    src, _, m = medium
    a = ib.build_loader(src, m, "train", batch_size=16)
    it = iter(a)
    for _ in range(3):
        next(it)
    b = ib.build_loader(src, m, "train", batch_size=16)
    b.load_state_dict(a.state_dict())
    it = iter(b)
    next(it)
    next(it)
    assert b.state_dict()["num_yielded"] == 5


def test_state_dict_on_fresh_loader_does_not_hide_loaded_state(medium):
    src, _, m = medium
    a = ib.build_loader(src, m, "train", batch_size=16)
    ref = epoch(a)
    b = ib.build_loader(src, m, "train", batch_size=16)
    it = iter(b)
    for _ in range(4):
        next(it)
    state = b.state_dict()
    c = ib.build_loader(src, m, "train", batch_size=16)
    c.state_dict()  # torchdata 0.11 would ignore the state loaded after this
    c.load_state_dict(state)
    same(epoch(c), ref[4:])


def test_resume_refetches_at_most_one_window(medium):
    src, _, m = medium
    kw = dict(batch_size=16, block_chunks=4, prefetch_windows=0)
    a = ib.build_loader(src, m, "train", **kw)
    it = iter(a)
    for _ in range(5):  # 80 samples: two and a half windows of 32
        next(it)
    state = a.state_dict()
    b = ib.build_loader(src, m, "train", **kw)
    b.load_state_dict(state)
    rest = epoch(b)
    fetch = b.node(ib.AsyncFetchNode)
    windows_left = -(-(m.n_samples_in("train") - 80) // 32)
    assert fetch.stats.windows <= windows_left + 1
    assert sum(len(x["sample_index"]) for x in rest) == m.n_samples_in("train") - 80


# -- memory ------------------------------------------------------------------------------

@pytest.mark.parametrize("in_place", [False, None], ids=["gathered", "scattered"])
@pytest.mark.parametrize(("batch", "block", "ahead"),
                         [(8, 4, 1), (32, 1, 1), (32, 2, 1), (20, 3, 1), (8, 4, 2), (20, 3, 2)])
def test_resident_memory_stays_within_bound(store_dir, batch, block, ahead, in_place):
    src, _ = make(store_dir, [Var("x", (600, 32, 32), (8, 32, 32), compressors=BLOSC),
                              Var("y", (600, 16), (4, 16), dtype="int16")])
    m = ib.split_by_chunk(src, (1.0,))
    sample = 32 * 32 * 4 + 16 * 2
    window = block * 8 * sample
    loader = ib.build_loader(src, m, "train", batch_size=batch, block_chunks=block,
                             prefetch_windows=ahead, in_place=in_place)
    assert (loader.node(ib.AsyncFetchNode).arena is None) == (in_place is False)
    for _ in range(2):
        for _ in loader:
            assert loader.ledger.resident <= loader.resident_bound
    assert 0 < loader.ledger.peak <= loader.resident_bound
    # The bound is a few windows, independent of the epoch's length.
    if in_place is False:
        assert loader.resident_bound <= (1 + ahead + -(-batch // (8 * block))) * window
    else:  # the batches of the windows drawn, ahead and just done; those at their edges;
        # the stripes a start's head window holds for its later copies
        assert loader.resident_bound <= (3 + ahead) * window + 4 * batch * sample


@pytest.mark.parametrize(("cores", "threads"), [(1, 2), (2, 3), (3, 4), (16, 4), (None, 2)])
def test_default_fetch_depth_and_decode_threads(medium, monkeypatch, cores, threads):
    """Left unset: two windows ahead on a local disk too, and one decode thread more than
    cores (at most 4), so GIL waits around each chunk do not leave a core idle."""
    src, _, m = medium
    monkeypatch.setattr("os.cpu_count", lambda: cores)
    # the window path (in place: tests/test_in_place.py)
    with ib.build_loader(src, m, "train", batch_size=32, in_place=False) as loader:
        fetch = loader.node(ib.AsyncFetchNode)
        assert fetch.prefetch_windows == 2 and fetch.decode_threads == threads
        assert sum(len(b["sample_index"]) for b in loader) == m.n_samples_in("train")


@pytest.mark.parametrize("in_place", [False, True])
def test_the_memory_bound_holds_across_a_failure_and_its_rewind(store_dir, monkeypatch,
                                                                in_place):
    """A plan stage failing once mid-epoch: the loader goes back to the last batch
    delivered and refetches. The cancelled windows' buffers (queued pool tasks that never
    run, running ones waited for) are let go before the new windows are counted, so the
    ledger stays within the resident bound; every sample still comes once."""
    src, _ = make(store_dir, [Var("t", (120, 6, 8), (1, 6, 8), compressors=BLOSC),
                              Var("z", (120, 3, 6, 8), (1, 3, 6, 8), compressors=BLOSC)])
    m = ib.split_by_chunk(src, (1.0,))
    real = ib.ReadPlanNode.next
    for fail_at in range(2, 8):
        calls = [0]

        def failing(self, calls=calls, fail_at=fail_at):
            calls[0] += 1
            if calls[0] == fail_at:
                raise OSError("the plan stage failed once")
            return real(self)

        monkeypatch.setattr(ib.ReadPlanNode, "next", failing)
        with ib.build_loader(src, m, "train", batch_size=7, block_chunks=10, seed=1,
                             prefetch_windows=1, in_place=in_place) as ld:
            it, seen, errors = iter(ld), [], 0
            while True:
                try:
                    seen += next(it)["sample_index"].tolist()
                except StopIteration:
                    break
                except OSError:
                    errors += 1
            assert errors == 1 and sorted(seen) == list(range(120)), fail_at
            assert ld.ledger.peak <= ld.resident_bound, (fail_at, ld.ledger.peak)


def test_memory_budget_is_checked(medium):
    src, _, m = medium
    with pytest.raises(ValueError, match=r"block_chunks=\d+ fits"):
        ib.build_loader(src, m, "train", block_chunks=16, memory_budget="5kB")
    ib.build_loader(src, m, "train", block_chunks=2, memory_budget="1MB")
    assert ib.parse_bytes("2GiB") == 2 * 2**30
    with pytest.raises(ValueError, match="byte size"):
        ib.parse_bytes("lots")


# -- bad input ---------------------------------------------------------------------------

@pytest.mark.parametrize(("kw", "match"), [
    ({"batch_size": 0}, "batch_size"),
    ({"block_chunks": 0}, "block_chunks"),
    ({"max_inflight": 0}, "max_inflight"),
    ({"seed": -1}, r"sampling.seed must be an integer >= 0, got -1"),
    ({"seed": 1.5}, r"sampling.seed must be an integer >= 0, got 1.5"),
    ({"drop_last": "yes"}, r"sampling.drop_last must be True or False, got 'yes'"),
])
def test_bad_arguments(medium, kw, match):
    src, _, m = medium
    with pytest.raises(ValueError, match=match):
        ib.build_loader(src, m, "train", **kw)


def test_unknown_and_empty_split(store_dir):
    src, _ = make(store_dir, [Var("x", (40, 2), (8, 2))])
    m = ib.split_by_chunk(src, (1.0, 0.0, 0.0))
    with pytest.raises(KeyError, match=r"'tran'.*\['train', 'val', 'test'\]"):
        ib.build_loader(src, m, "tran")
    with pytest.raises(ValueError, match=r"'val' has no chunks.*\['train'\]"):
        ib.build_loader(src, m, "val")


def test_no_threads_leak(medium):
    src, _, m = medium
    gc.collect()
    before = {t.ident for t in threading.enumerate()}
    for _ in range(3):
        loader = ib.build_loader(src, m, "train", batch_size=16)
        for _ in range(2):
            epoch(loader)
        epoch(loader, limit=2)  # an abandoned epoch too
        del loader
    with ib.build_loader(src, m, "train") as loader:
        epoch(loader, limit=1)
    gc.collect()
    # A collected loader's threads are told to end, not joined (joining from a GC finalizer
    # can deadlock): they end on their own, at once.
    deadline = time.monotonic() + 10
    leaked = [t for t in threading.enumerate() if t.ident not in before]
    while leaked and time.monotonic() < deadline:
        time.sleep(0.02)
        leaked = [t for t in leaked if t.is_alive()]
    assert not leaked, leaked


def test_state_dict_at_answers_only_for_the_current_epoch(medium):
    src, _, m = medium
    loader = ib.build_loader(src, m, "train", batch_size=16, keep_states=4)
    epoch(loader)
    it = iter(loader)
    next(it)
    next(it)
    assert loader.state_dict_at(2) == loader.state_dict()
    with pytest.raises(ValueError, match="kept: \\[1, 2\\]"):
        loader.state_dict_at(5)  # batch 5 of the *previous* epoch must not be returned
    fresh = ib.build_loader(src, m, "train", batch_size=16)
    fresh.load_state_dict(loader.state_dict_at(1))
    nxt = next(iter(fresh))
    assert nxt["sample_index"].tolist() != []


@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(5, 60), chunk=st.integers(1, 6), batch=st.integers(1, 9),
       drop_last=st.booleans(), world=st.integers(1, 3), rank_seed=st.integers(0, 2),
       uneven=st.sampled_from(["pad", "drop", "none"]), block=st.integers(1, 5),
       windowed=st.booleans(), stop=st.floats(0, 1))
def test_len_is_the_batches_of_the_epoch_being_served(tmp_path_factory, n, chunk, batch,
                                                      drop_last, world, rank_seed, uneven,
                                                      block, windowed, stop):
    """len(loader): the batches this rank yields in the epoch ``loader.epoch`` names, over
    ranks, equal-steps policies, drop_last, windows and time windows; after a restore, the
    restored epoch's (batches before the state included), or the next epoch's when the
    state had served its epoch (torchdata rolls over to it at the next iter())."""
    path = tmp_path_factory.mktemp("len") / "s.zarr"
    write_store(path, [Var("x", (n, 3), (chunk, 3))])
    src = ib.open_source(path)
    m = ib.split_by_chunk(src, (1.0,))
    window = ib.SampleWindow(1, (1,)) if windowed else None
    if world > -(-n // chunk) or (window is not None and n < 3):
        return  # more ranks than chunks, or no anchor: refused at build (tested elsewhere)
    kw = dict(batch_size=batch, drop_last=drop_last, rank=rank_seed % world, world_size=world,
              uneven=uneven, block_chunks=block, steps=window, seed=1)
    try:
        ld = ib.build_loader(src, m, "train", **kw)
    except ValueError:
        return  # e.g. more ranks than runs of chunks with time windows
    counts = []
    with ld:
        before = len(ld)
        for epoch in range(4):
            got = list(iter(ld))
            counts.append(len(got))
            if epoch == 0:
                assert before == len(got)
            assert len(ld) == len(got), (epoch, ld.epoch)  # after the pass: the same epoch
    k = int(stop * counts[2])  # a state in the third epoch, at its end included
    with ib.build_loader(src, m, "train", **kw) as a:
        state = state_after(a, k, epochs=2)
    # Several ranks of unequal shares sit out the rest of the epoch a rank finished.
    rolls = k == counts[2] and not (uneven == "none" and world > 1)
    with ib.build_loader(src, m, "train", **kw) as again:
        again.load_state_dict(state)
        want = 3 if rolls else 2
        assert again.epoch == want and len(again) == counts[want], (k, counts)
        served = len(list(iter(again)))
        assert served == counts[want] - (0 if rolls else k)
        assert again.epoch == want
