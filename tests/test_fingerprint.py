"""Loader states are checked on load: a state saved by a loader built differently, or a
malformed one, is one ValueError naming the field; never a silent loss or repeat."""

import copy
import dataclasses
import json
import re
import warnings

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from stores import Var, write_store

import insitubatch_nodes as ib
from insitubatch_nodes.state.fingerprint import StateFingerprint, check_fingerprint

KW = dict(batch_size=8, block_chunks=2, seed=0)
K = 3  # batches taken before the state is saved


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("fingerprint") / "s.zarr"
    write_store(path, [Var("x", (120, 3), (4, 3))])
    src = ib.open_source(path)
    return src, ib.split_by_chunk(src, (0.8, 0.1, 0.1))


def split_samples(m, split):
    return m.grid.samples_of(m.chunk_ids(split)).tolist()


def saved_after(src, m, k=K, split="train", **kw):
    """(state after k batches, samples of those batches)."""
    with ib.build_loader(src, m, split, **{**KW, **kw}) as ld:
        it = iter(ld)
        seen = [i for _ in range(k) for i in next(it)["sample_index"].tolist()]
        return ld.state_dict(), seen


def rest_of_epoch(src, m, state, split="train", **kw):
    with ib.build_loader(src, m, split, **{**KW, **kw}) as ld:
        ld.load_state_dict(state)
        return [i for b in ld for i in b["sample_index"].tolist()]


def test_state_records_its_fingerprint(store):
    src, m = store
    state, _ = saved_after(src, m)
    assert state["format"] == 4
    fp = state["fingerprint"]
    assert fp["manifest"] == m.content_hash and fp["split"] == "train"
    assert (fp["seed"], fp["batch_size"], fp["block_chunks"]) == (0, 8, 2)
    assert (fp["rank"], fp["world_size"], fp["n_samples"], fp["chunk_size"]) == (0, 1, 120, 4)
    assert len(json.dumps(state)) < 2048


# -- the table, one test per row ----------------------------------------------------

def test_a_state_saved_with_another_seed_is_refused(store):
    src, m = store
    state, _ = saved_after(src, m, seed=0)
    with ib.build_loader(src, m, "train", **{**KW, "seed": 1}) as ld, \
            pytest.raises(ValueError, match=r"seed: saved 0, this loader 1 \(.*saved seed"):
        ld.load_state_dict(state)


def test_a_state_from_another_manifest_is_refused(store):
    src, m = store
    other = ib.split_by_chunk(src, (0.5, 0.5))
    state, _ = saved_after(src, m)
    with ib.build_loader(src, other, "train", **KW) as ld, \
            pytest.raises(ValueError, match=rf"manifest: saved '{m.content_hash}', this loader "
                                            rf"'{other.content_hash}'.*from_json"):
        ld.load_state_dict(state)


def test_a_train_state_into_a_val_loader_is_refused(store):
    src, m = store
    state, _ = saved_after(src, m, k=1)
    with ib.build_loader(src, m, "val", **KW) as ld, \
            pytest.raises(ValueError, match="split: saved 'train', this loader 'val'"):
        ld.load_state_dict(state)


@pytest.mark.parametrize(("bad", "match"), [
    ({}, "loader state has no field 'root'"),
    ({"x": 1}, r"unknown field\(s\) \['x'\]"),
    (None, "a loader state is a dict.*got NoneType"),
    ({"root": {}, "num_yielded": 0, "format": 3}, "has no field 'fingerprint'"),
    ({"root": [], "num_yielded": 0}, "loader state field 'root' must be a dict"),
])
def test_malformed_states_are_one_value_error(store, bad, match):
    src, m = store
    with ib.build_loader(src, m, "train", **KW) as ld:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # format-1 states warn; the error is the point
            with pytest.raises(ValueError, match=match):
                ld.load_state_dict(bad)
        # the refused state left the loader as it was: a full epoch
        assert sorted(i for b in ld for i in b["sample_index"].tolist()) == \
            split_samples(m, "train")


def node_state(state, key):
    """The deepest stage state holding ``key`` (the offset: the fetch's, decoding in place)."""
    d, found = state["root"], None
    while isinstance(d, dict):
        found = d if key in d else found
        d = d.get("source")
    return found


@pytest.mark.parametrize(("field", "value", "match"), [
    ("position", 999, r"ChunkPermuteNode state field 'position' is 999, past the 12 windows"),
    ("position", -1, "ChunkPermuteNode state field 'position' must be an integer >= 0"),
    ("epoch", "1", "ChunkPermuteNode state field 'epoch' must be an integer >= 0, got '1'"),
    ("offset", 999, "AsyncFetchNode state field 'offset' is 999, past the 8 draws"),
    ("history", [[2, [[0, 0]]]], r"'history'\[0\] must be \[world_size"),
])
def test_out_of_range_node_fields_are_refused(store, field, value, match):
    src, m = store
    state, _ = saved_after(src, m)
    node_state(state, field)[field] = value
    state.pop("progress")  # else the progress/node mismatch is found first
    with ib.build_loader(src, m, "train", **KW) as ld, pytest.raises(ValueError, match=match):
        ld.load_state_dict(state)


@pytest.mark.parametrize("value", [-5, 1.5, "3", True, None])
def test_a_bad_num_yielded_is_refused(store, value):
    src, m = store
    state, _ = saved_after(src, m)
    state["num_yielded"] = value
    with ib.build_loader(src, m, "train", **KW) as ld, \
            pytest.raises(ValueError, match="loader state field 'num_yielded' must be an "
                                            f"integer >= 0, got {value!r}"):
        ld.load_state_dict(state)


def test_progress_that_disagrees_with_the_nodes_is_refused(store):
    src, m = store
    state, _ = saved_after(src, m)
    state["progress"]["offset"] += 1
    with ib.build_loader(src, m, "train", **KW) as ld, \
            pytest.raises(ValueError, match=r"field 'progress.offset' is 1, but the draws "
                                            r"into the head window \(state field 'offset' "
                                            r"of ShuffleBufferNode or.*AsyncFetchNode\) is 0"):
        ld.load_state_dict(state)


# -- sound changes -------------------------------------------------------------------------

def test_another_batch_size_needs_allow_state_change_and_is_then_exact(store):
    """On the gather path (in place: the next test)."""
    src, m = store
    state, seen = saved_after(src, m, in_place=False)
    with ib.build_loader(src, m, "train", **{**KW, "batch_size": 5}, in_place=False) as ld, \
            pytest.raises(ValueError, match=r"batch_size: saved 8, this loader 5 .*sound.*"
                                            "allow_state_change=True"):
        ld.load_state_dict(state)
    rest = rest_of_epoch(src, m, state, batch_size=5, allow_state_change=True,
                         in_place=False)
    assert sorted(seen + rest) == split_samples(m, "train")


def test_allow_state_change_does_not_allow_an_unsound_change(store):
    src, m = store
    state, _ = saved_after(src, m)
    with ib.build_loader(src, m, "train", **{**KW, "block_chunks": 3},
                         allow_state_change=True) as ld, \
            pytest.raises(ValueError, match="block_chunks: saved 2, this loader 3"):
        ld.load_state_dict(state)


def test_every_differing_field_is_named_at_once():
    a = StateFingerprint(manifest="h1", split="train", seed=0, n_samples=10, chunk_size=2,
                         first=0, end=10, block_chunks=4, uneven="pad", contiguous=False,
                         run_chunks=0, excluded="", batch_size=8, drop_last=False, rank=0,
                         world_size=1)
    b = dataclasses.replace(a, manifest="h2", split="val", seed=1)
    with pytest.raises(ValueError, match="manifest: .*; split: .*; seed: saved 0, this loader 1"):
        check_fingerprint(a, b)


# -- older formats -------------------------------------------------------------------------

def test_a_format_2_state_still_loads_with_a_warning_and_resumes_exactly(store):
    src, m = store
    state, seen = saved_after(src, m)
    old = copy.deepcopy(state)
    old["format"] = 2
    del old["fingerprint"]
    with ib.build_loader(src, m, "train", **KW) as ld:
        with pytest.warns(UserWarning, match="format 2.*cannot be checked"):
            ld.load_state_dict(old)
        rest = [i for b in ld for i in b["sample_index"].tolist()]
    assert rest == rest_of_epoch(src, m, state)
    assert sorted(seen + rest) == split_samples(m, "train")


def _stage_states(state):
    """The nested stage states of a loader state, root first."""
    out, d = [], state["root"]
    while isinstance(d, dict):
        out.append(d)
        d = d.get("source")
    return out


@pytest.mark.parametrize("in_place", [True, False])
def test_a_format_3_state_resumes_exactly(store, in_place):
    """Format 3 kept the draws into the head window in the shuffle buffer's state; decoding
    in place the fetch keeps them now (it cuts the batches), and an older state is moved
    there on load."""
    src, m = store
    kw = dict(batch_size=6, in_place=in_place)
    state, seen = saved_after(src, m, **kw)
    old = copy.deepcopy(state)
    old["format"] = 3
    stages = _stage_states(old)
    fetch = next(d for d in stages if "offset" in d and "offset" not in d["source"])
    shuffle = stages[stages.index(fetch) - 1]
    shuffle["offset"] += fetch.pop("offset")
    assert shuffle["offset"] > 0  # mid-window: 18 draws into windows of 8
    assert [d.get("offset") for d in _stage_states(state) if "offset" in d] == (
        [0, shuffle["offset"]] if in_place else [shuffle["offset"], 0])
    rest = rest_of_epoch(src, m, old, **kw)
    assert rest == rest_of_epoch(src, m, state, **kw)
    assert sorted(seen + rest) == split_samples(m, "train")


def test_a_state_saved_in_place_resumes_on_the_gather_path_mid_window(store):
    src, m = store
    state, seen = saved_after(src, m, batch_size=6)
    want = rest_of_epoch(src, m, state, batch_size=6)
    assert rest_of_epoch(src, m, state, batch_size=6, in_place=False) == want
    assert sorted(seen + want) == split_samples(m, "train")


# -- merged (elastic) states ---------------------------------------------------------------

def _rank_states(src, m, world, k=1, **kw):
    states, seen = [], []
    for r in range(world):
        s, got = saved_after(src, m, k=k, rank=r, world_size=world, **kw)
        states.append(s)
        seen += got
    return states, seen


def test_merge_carries_the_fingerprint_without_rank(store):
    src, m = store
    states, seen = _rank_states(src, m, 2, uneven="none")
    merged = ib.merge_rank_states(states)
    fp = merged["fingerprint"]
    assert "rank" not in fp and "world_size" not in fp
    assert fp["seed"] == 0 and fp["manifest"] == m.content_hash
    rest = []
    for r in range(3):
        rest += rest_of_epoch(src, m, merged, rank=r, world_size=3, uneven="none")
    assert sorted(seen + rest) == split_samples(m, "train")
    with ib.build_loader(src, m, "train", **{**KW, "seed": 5}, rank=0, world_size=3) as ld, \
            pytest.raises(ValueError, match="seed: saved 0, this loader 5"):
        ld.load_state_dict(merged)
    # the old ranks' schedules are rebuilt with the saved policy: another one is refused by
    # name (it used to pass this check and fail later, calling the state edited)
    with ib.build_loader(src, m, "train", **KW, rank=0, world_size=3, uneven="pad") as ld, \
            pytest.raises(ValueError, match="uneven: saved 'none', this loader 'pad'"):
        ld.load_state_dict(merged)


def test_merge_refuses_ranks_out_of_order_or_built_differently(store):
    src, m = store
    states, _ = _rank_states(src, m, 2)
    with pytest.raises(ValueError, match=r"every rank, in rank order: got \(rank, world_size\) "
                                         r"\[\(1, 2\), \(0, 2\)\]"):
        ib.merge_rank_states(states[::-1])
    with pytest.raises(ValueError, match="in rank order"):
        ib.merge_rank_states(states[:1])
    other, _ = saved_after(src, m, k=1, rank=1, world_size=2, seed=3)
    with pytest.raises(ValueError, match="rank states disagree on seed: rank 0 has 0, rank 1 "
                                         "has 3"):
        ib.merge_rank_states([states[0], other])


def test_a_rank_state_into_another_world_size_says_to_merge(store):
    src, m = store
    states, _ = _rank_states(src, m, 2)
    with ib.build_loader(src, m, "train", **KW, rank=0, world_size=3) as ld, \
            pytest.raises(ValueError, match="world_size: saved 2, this loader 3.*merge_rank"):
        ld.load_state_dict(states[0])
    with ib.build_loader(src, m, "train", **KW, rank=1, world_size=2) as ld, \
            pytest.raises(ValueError, match="rank: saved 0, this loader 1"):
        ld.load_state_dict(states[0])


def test_a_malformed_merged_state_names_the_field(store):
    src, m = store
    states, _ = _rank_states(src, m, 2)
    merged = ib.merge_rank_states(states)
    for mutate, match in [
        (lambda s: s["elastic"].update(epoch=-1), "'epoch' must be an integer >= 0"),
        (lambda s: s["elastic"].update(history=[]), "'elastic.history' is empty"),
        (lambda s: s["elastic"].update(history=[[2, [[0, -3], [0, 0]]]]),
         r"'elastic.history'\[0\] must be"),
        (lambda s: s["fingerprint"].update(rank=0), r"unknown fields \['rank'\]"),
        (lambda s: s.update(root={}), r"unknown field\(s\) \['root'\]"),
    ]:
        bad = copy.deepcopy(merged)
        mutate(bad)
        with ib.build_loader(src, m, "train", **KW, rank=0, world_size=3) as ld, \
                pytest.raises(ValueError, match=match):
            ld.load_state_dict(bad)


# -- fuzz: mutated states ------------------------------------------------------------------

def _paths(d, prefix=()):
    items = d.items() if isinstance(d, dict) else enumerate(d)
    for k, v in items:
        yield (*prefix, k)
        if isinstance(v, (dict, list)):
            yield from _paths(v, (*prefix, k))


def _mutate(state, path, how, values):
    bad = copy.deepcopy(state)
    parent = bad
    for k in path[:-1]:
        parent = parent[k]
    if how == "remove":
        del parent[path[-1]]
    else:
        parent[path[-1]] = copy.deepcopy(values[how])
    return bad


MUTATIONS = {
    "remove": None, "str": "7", "float": 2.5, "none": None, "list": [], "dict": {},
    "bool": True, "negative": -1, "zero": 0, "one": 1, "large": 999, "huge": 10**12,
}


@pytest.fixture(scope="module")
def fuzz_base(store):
    src, m = store
    state, seen = saved_after(src, m, k=4)
    with ib.build_loader(src, m, "train", **KW) as ld:
        nodes = [type(n).__name__ for n in ld.nodes()]
    return src, m, state, seen, sorted(_paths(state)), nodes


def _names(path, nodes):
    """Patterns an error about ``path`` must match: the field quoted ('position') or
    labelled (seed: saved ...), or for a whole node state (``root``/``source``) the node it
    belongs to or the node holding it."""
    if path[0] == "root" and path[-1] in ("root", "source"):
        depth = len(path) - 1
        return [nodes[depth], nodes[depth - 1] if depth else "'root'"]
    return [rf"['.]{path[-1]}'", rf"\b{path[-1]}: saved", rf"'{path[0]}['.]"]


@settings(max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_mutated_states_raise_naming_the_field_or_resume_exactly(fuzz_base, data):
    src, m, state, seen, paths, nodes = fuzz_base
    path = data.draw(st.sampled_from(paths), label="path")
    how = data.draw(st.sampled_from(sorted(MUTATIONS)), label="mutation")
    bad = _mutate(state, path, how, MUTATIONS)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rest = rest_of_epoch(src, m, bad)
    except ValueError as e:
        assert any(re.search(w, str(e)) for w in _names(path, nodes)), (path, how, str(e))
        event("refused")
        return
    event("accepted")
    # accepted: then it is the same point of the same epoch, every sample exactly once
    assert sorted(seen + rest) == split_samples(m, "train"), (path, how)


@pytest.mark.parametrize(("path", "value"), [
    (("num_yielded",), 999),  # a counter of batches only: the samples do not depend on it
    (("format",), 2),  # an older format with a fingerprint: still checked, same point
    (("progress",), None),  # what merge_rank_states reads; loading reads the nodes
    (("format",), None),  # format 1: converted (nothing to convert here), fingerprint checked
])
def test_harmless_mutations_resume_exactly(fuzz_base, path, value):
    src, m, state, seen, _, _ = fuzz_base
    bad = copy.deepcopy(state)
    if value is None:
        del bad[path[0]]
    else:
        bad[path[0]] = value
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rest = rest_of_epoch(src, m, bad)
    assert rest == rest_of_epoch(src, m, state)
    assert sorted(seen + rest) == split_samples(m, "train")


# -- fuzz: mutated merged states -----------------------------------------------------------
# A merged state holds nothing twice (a rank's state repeats its node counters in
# "progress"), so an in-range edit of its history is another valid point of the epoch:
# mutations here are removals, other types and values out of range.

MERGED_MUTATIONS = {k: MUTATIONS[k] for k in
                    ("remove", "str", "float", "none", "list", "dict", "bool", "negative")}
PAST = 999  # out of range for a window or offset counter of this store


@pytest.fixture(scope="module")
def merged_base(store):
    src, m = store
    states, seen = _rank_states(src, m, 2, k=2, uneven="none")
    merged = ib.merge_rank_states(states)
    paths = sorted(p for p in _paths(merged) if p[-1] != "epoch")  # see above
    return src, m, merged, seen, paths


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_mutated_merged_states_raise_naming_the_field_or_resume_exactly(merged_base,
                                                                            data):
    src, m, merged, seen, paths = merged_base
    path = data.draw(st.sampled_from(paths), label="path")
    counter = path[:2] == ("elastic", "history") and len(path) == 6  # a window or offset
    how = data.draw(st.sampled_from(sorted(MERGED_MUTATIONS) + (["past"] if counter else [])),
                    label="mutation")
    bad = _mutate(merged, path, how, {**MERGED_MUTATIONS, "past": PAST})
    try:
        rest = []
        for r in range(3):
            rest += rest_of_epoch(src, m, bad, rank=r, world_size=3, uneven="none")
    except ValueError as e:
        words = [f"'{p}" for p in path if isinstance(p, str)] + [f"{p}:" for p in path
                                                                  if isinstance(p, str)]
        if path[:2] == ("elastic", "history"):
            words.append("'history'")
        assert any(w in str(e) for w in words), (path, how, str(e))
        event("refused")
        return
    event("accepted")
    assert sorted(seen + rest) == split_samples(m, "train"), (path, how)


def test_a_merged_history_past_a_window_is_refused(merged_base):
    src, m, merged, _, _ = merged_base
    bad = copy.deepcopy(merged)
    bad["elastic"]["history"][-1][1][1][1] = 500  # rank 1 took 500 draws of an 8-draw window
    with ib.build_loader(src, m, "train", **KW, rank=0, world_size=3, uneven="none") as ld, \
            pytest.raises(ValueError, match=r"'history'\[0\] says rank 1 of 2 finished \d+ "
                                            r"windows and took 500 draws of the next"):
        ld.load_state_dict(bad)


def test_a_state_saved_with_another_time_window_is_refused(store):
    src, m = store
    w2 = ib.SampleWindow(history=2, lead=1)
    state, _ = saved_after(src, m, k=1, steps=w2)
    assert state["fingerprint"]["contiguous"] is True
    with ib.build_loader(src, m, "train", **KW, steps=ib.SampleWindow(history=4, lead=1)) as ld, \
            pytest.raises(ValueError, match=r"first: saved 1, this loader 3 \(.*steps="):
        ld.load_state_dict(state)
    with ib.build_loader(src, m, "train", **KW) as ld, \
            pytest.raises(ValueError, match="contiguous: saved True, this loader False"):
        ld.load_state_dict(state)


def test_another_batch_size_in_place_is_refused_mid_epoch(tmp_path):
    """Decoding in place plans batches from the epoch's start: 24 draws taken are not a
    batch boundary for batches of 5, so resuming there would split a planned batch."""
    write_store(tmp_path / "one.zarr", [Var("x", (60, 3), (1, 3))])
    src = ib.open_source(tmp_path / "one.zarr")
    m = ib.split_by_chunk(src, (1.0,))
    state, seen = saved_after(src, m, block_chunks=4)
    with ib.build_loader(src, m, "train", **{**KW, "block_chunks": 4, "batch_size": 5},
                         allow_state_change=True) as ld, \
            pytest.raises(ValueError, match=r"batch_size: saved 8, this loader 5 \(this loader "
                                            "decodes straight into batches.*in_place=False"):
        ld.load_state_dict(state)
    rest = rest_of_epoch(src, m, state, block_chunks=4, batch_size=5, in_place=False,
                         allow_state_change=True)
    assert sorted(seen + rest) == list(range(60))


def test_a_hand_built_graph_records_build_loaders_fingerprint(store, tmp_path):
    """The same stages built by hand and by build_loader record the same fingerprint (so
    states move between them); a window and decoding in place show in theirs."""
    src, m = store
    with ib.build_loader(src, m, "train", in_place=False, **KW) as ld:  # windows, gathered
        assert _hand_built(src, m, seed=0).fingerprint == ld.fingerprint
        assert (ld.fingerprint.in_place, ld.fingerprint.contiguous) == (False, False)
    with ib.build_loader(src, m, "train", **KW) as ld:  # chunks of 4 scattered into batches
        assert ld.fingerprint.in_place
    with ib.build_loader(src, m, "train", steps=ib.SampleWindow(2, (1,)), **KW) as ld:
        fp = ld.fingerprint
        assert fp.contiguous and (fp.first, fp.end) == (1, 119) and fp.run_chunks >= 1
    path = tmp_path / "c1.zarr"
    write_store(path, [Var("x", (40, 3), (1, 3))])
    one = ib.open_source(path)
    with ib.build_loader(one, ib.split_by_chunk(one, (1.0,)), "train", batch_size=4) as ld:
        assert ld.fingerprint.in_place


def _hand_built(src, m, seed):
    from insitubatch_nodes.nodes import (
        AsyncFetchNode,
        ChunkPermuteNode,
        GatherNode,
        ReadPlanNode,
        ShuffleBufferNode,
        SplitNode,
    )

    node = SplitNode(m, "train")
    node = ChunkPermuteNode(node, src.grid, seed=seed, block_chunks=2)
    node = ReadPlanNode(node, src.variables)
    node = AsyncFetchNode(node, src)
    node = ShuffleBufferNode(node, src.variables, batch_size=8)
    return ib.InSituLoader(GatherNode(node, src.variables))


def test_a_hand_built_graph_refuses_a_state_saved_with_another_seed(store):
    """A hand-built graph had no fingerprint: resuming with another seed repeated and
    skipped samples silently (recipes/train_resume.py --resume --seed 1)."""
    src, m = store
    a = _hand_built(src, m, seed=0)
    it = iter(a)
    head = [i for _ in range(3) for i in next(it)["sample_index"].tolist()]
    state = a.state_dict()
    assert state["fingerprint"]["seed"] == 0
    with pytest.raises(ValueError, match=r"seed: saved 0, this loader 1"):
        _hand_built(src, m, seed=1).load_state_dict(state)
    b = _hand_built(src, m, seed=0)
    b.load_state_dict(state)
    rest = [i for batch in b for i in batch["sample_index"].tolist()]
    assert sorted(head + rest) == split_samples(m, "train")
    old = copy.deepcopy(state)
    del old["fingerprint"]  # saved by a hand-built graph before fingerprints: a warning
    with pytest.warns(UserWarning, match="records no fingerprint"):
        _hand_built(src, m, seed=0).load_state_dict(old)
    a.close(), b.close()
