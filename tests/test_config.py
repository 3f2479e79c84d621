"""LoaderConfig: groups that check themselves, flat keywords that land in their group, and
build_loader giving the same loader from a config as from keywords."""

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from stores import Var, write_store

import insitubatch_nodes as ib
from insitubatch_nodes.config import LoaderConfig


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("config") / "s.zarr"
    write_store(path, [Var("x", (120, 3), (8, 3)), Var("y", (120, 2), (4, 2))])
    src = ib.open_source(path)
    return src, ib.split_by_chunk(src, (0.8, 0.2))


@pytest.mark.parametrize("option, value, words", [
    ("batch_size", 0, "sampling.batch_size must be an integer >= 1, got 0"),
    ("batch_size", 2.5, "sampling.batch_size must be an integer >= 1, got 2.5"),
    ("block_chunks", True, "sampling.block_chunks must be an integer >= 1, got True"),
    ("uneven", "even", "sampling.uneven must be one of"),
    ("max_inflight", 0, "fetch.max_inflight must be an integer >= 1, got 0"),
    ("prefetch_windows", -1, "fetch.prefetch_windows must be an integer >= 0, got -1"),
    ("decode_threads", 0, "fetch.decode_threads must be an integer >= 1"),
    ("decode", "nvcomp", "fetch.decode must be 'cpu' or 'gpu', got 'nvcomp'"),
    ("prefetch_next_epoch", 1, "fetch.prefetch_next_epoch must be True or False, got 1"),
    ("in_place", 0, "fetch.in_place must be None, True or False, got 0"),
    ("ring_size", 0, "device.ring_size must be an integer >= 1, got 0"),
    ("keep_states", -1, "checkpoint.keep_states must be an integer >= 0, got -1"),
    ("log_every_s", 0, "checkpoint.log_every_s must be > 0"),
    ("patch_stride", (2, 2), "sample.patch_stride needs patch_size"),
])
def test_each_group_checks_its_values_and_names_the_field(option, value, words):
    with pytest.raises(ValueError) as info:
        LoaderConfig.of(**{option: value})
    assert words in str(info.value)


@pytest.mark.parametrize("option, value, words", [
    ("steps", (2, 1), "sample.steps must be a SampleWindow"),
    ("dtype", "bfloat16", "sample.dtype must be a torch.dtype"),
    ("retry", 3, "fetch.retry must be a RetryPolicy"),
    ("channels", "t2m", "sample.channels must be a sequence"),
])
def test_wrong_types_are_named(option, value, words):
    with pytest.raises(TypeError, match=words.replace("(", r"\(").replace(")", r"\)")):
        LoaderConfig.of(**{option: value})


def test_an_unknown_option_lists_the_known_ones():
    with pytest.raises(TypeError, match="unknown option 'batchsize'.*batch_size"):
        LoaderConfig.of(batchsize=4)


def test_flat_keywords_land_in_their_group():
    win = ib.SampleWindow(2, (1,))
    cfg = LoaderConfig.of(batch_size=8, max_inflight=4, steps=win, device="cpu",
                          keep_states=2, channels=["x"])
    assert cfg.sampling.batch_size == 8 and cfg.fetch.max_inflight == 4
    assert cfg.sample.steps == win and cfg.sample.channels == ("x",)
    assert cfg.device.device == "cpu" and cfg.checkpoint.keep_states == 2
    # a group can be replaced whole, and "device" the option is not "device" the group
    cfg2 = cfg.replace(device=ib.DeviceConfig(ring_size=5))
    assert cfg2.device.ring_size == 5 and cfg2.sampling == cfg.sampling
    assert LoaderConfig.of(**cfg.as_kwargs()) == cfg


@settings(max_examples=30, deadline=None)
@given(batch=st.integers(1, 64), block=st.integers(1, 32), seed=st.integers(0, 2**31),
       inflight=st.integers(1, 64), ring=st.integers(1, 8))
def test_as_kwargs_round_trips(batch, block, seed, inflight, ring):
    cfg = LoaderConfig.of(batch_size=batch, block_chunks=block, seed=seed,
                          max_inflight=inflight, ring_size=ring)
    assert LoaderConfig.of(**cfg.as_kwargs()) == cfg
    assert cfg.replace() is cfg


def test_a_config_and_keywords_build_the_same_loader(store):
    src, m = store
    kw = dict(batch_size=5, block_chunks=3, seed=7, drop_last=True)
    cfg = LoaderConfig.of(**kw)
    with ib.build_loader(src, m, "train", **kw) as a, ib.build_loader(src, m, "train", cfg) as b, \
            ib.build_loader(src, m, "train", cfg.replace(seed=0), seed=7) as c:
        assert b.config == cfg and c.config == cfg
        runs = [[(bt["sample_index"].tolist(), bt["x"].numpy().tobytes()) for bt in ld]
                for ld in (a, b, c)]
    assert runs[0] == runs[1] == runs[2] and len(runs[0]) > 3


def test_the_loader_exposes_what_the_build_computed(store):
    src, m = store
    with ib.build_loader(src, m, "train", batch_size=4, block_chunks=2) as ld:
        assert ld.resident_bound > 0 and 0 < ld.shuffle_quality <= 1
        assert ld.ledger is not None and ld.snapshot_id is None
        next(iter(ld))
        assert 0 < ld.ledger.peak <= ld.resident_bound
        assert ld.stats().resident_bound_bytes == ld.resident_bound


def test_a_format_1_state_is_converted_on_load(store):
    """Format 1 counted chunks in ChunkPermuteNode and windows in ReadPlanNode; a state in
    that layout resumes exactly like the format-2 state of the same point."""
    src, m = store
    kw = dict(batch_size=3, block_chunks=2, seed=1)
    with ib.build_loader(src, m, "train", **kw) as ld:
        it = iter(ld)
        for _ in range(5):
            next(it)
        state = ld.state_dict()
        want = [b["sample_index"].tolist() for b in it]
        sched = ld.node(ib.ChunkPermuteNode).schedule
    assert state["format"] == 4 and state["progress"]["offset"] >= 0
    # Rewrite into format 1: the planner's counter, the scheduler's position in chunks.
    old = json.loads(json.dumps(state))
    del old["format"], old["progress"], old["fingerprint"]
    d = old["root"]
    while "offset" not in d:
        d = d["source"]
    plan = d["source"]["source"]
    perm = plan["source"]
    windows = perm["position"]
    perm["position"] = int(sum(w.chunk_ids.size for w in sched.windows[:windows]))
    d["source"]["source"] = {"window": windows, "source": perm}
    with ib.build_loader(src, m, "train", **kw) as ld:
        with pytest.warns(UserWarning, match="format 1.*cannot be checked"):
            ld.load_state_dict(old)
        assert [b["sample_index"].tolist() for b in ld] == want


@pytest.mark.parametrize("bad", [[], "state", 3])
def test_a_state_that_is_not_a_dict_is_refused(store, bad):
    src, m = store
    with ib.build_loader(src, m, "train", batch_size=3) as ld, \
            pytest.raises(ValueError, match="a loader state is a dict"):
        ld.load_state_dict(bad)


def test_a_state_missing_a_node_field_names_it(store):
    src, m = store
    with ib.build_loader(src, m, "train", batch_size=3, block_chunks=2) as ld:
        it = iter(ld)
        next(it)
        state = ld.state_dict()
    d = state["root"]
    while "offset" not in d:
        d = d["source"]
    del d["offset"]
    with ib.build_loader(src, m, "train", batch_size=3, block_chunks=2) as ld, \
            pytest.raises(ValueError, match="ShuffleBufferNode state has no field 'offset'"):
        ld.load_state_dict(state)  # refused on load, before anything is read


def test_cpu_config_never_touches_cuda(store, monkeypatch):
    src, m = store
    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("asked for CUDA"))
    with ib.build_loader(src, m, "train", LoaderConfig.of(batch_size=4, device=None)) as ld:
        b = next(iter(ld))
    assert np.all(np.diff(b["sample_index"].numpy()) > 0)
