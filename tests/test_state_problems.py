"""A malformed loader state is refused once, naming every problem it has: the top level,
the fingerprint's fields, the node states' fields and counters (issue 46)."""

import copy
import re
import warnings

import pytest
from stores import Var, write_store
from test_fingerprint import node_state

import insitubatch_nodes as ib
from insitubatch_nodes.state.fingerprint import StateFingerprint

KW = dict(batch_size=8, block_chunks=2, seed=0)

UNKNOWN = r"loader state has unknown field\(s\) \['extra'\]"
EPOCH = r"ChunkPermuteNode state field 'epoch' must be an integer >= 0, got -1"
SEED = r"loader state field 'fingerprint.seed' must be an integer >= 0, got 'zero'"
YIELDED = r"loader state field 'num_yielded' must be an integer >= 0, got -3"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("problems") / "s.zarr"
    write_store(path, [Var("x", (120, 3), (4, 3))])
    src = ib.open_source(path)
    return src, ib.split_by_chunk(src, (0.8, 0.2))


@pytest.fixture(scope="module")
def saved(store):
    src, m = store
    with ib.build_loader(src, m, "train", **KW) as ld:
        it = iter(ld)
        next(it), next(it)
        return ld.state_dict()


def _refused(store, state, **kw):
    src, m = store
    with ib.build_loader(src, m, "train", **{**KW, **kw}) as ld:
        with pytest.raises(ib.StateError) as info:
            ld.load_state_dict(state)
        # the refused state left the loader as it was: a full epoch
        assert len([b for b in ld]) == len(ld)
    return str(info.value)


def _problems(message):
    """The numbered problems of a combined message."""
    head, *lines = message.split("\n")
    assert head == f"this loader state has {len(lines)} problems:", message
    assert [line.split(".")[0].strip() for line in lines] == \
        [str(i) for i in range(1, len(lines) + 1)], message
    return lines


def _each_once(lines, patterns):
    for p in patterns:
        assert sum(bool(re.search(p, line)) for line in lines) == 1, (p, lines)


def test_two_independent_problems_are_named_in_one_error(store, saved):
    bad = copy.deepcopy(saved)
    bad["extra"] = 1
    node_state(bad, "epoch")["epoch"] = -1
    lines = _problems(_refused(store, bad))
    assert len(lines) == 2
    _each_once(lines, [UNKNOWN, EPOCH])


def test_three_and_four_problems_top_level_fingerprint_andnode_state(store, saved):
    bad = copy.deepcopy(saved)
    bad["extra"] = 1
    node_state(bad, "epoch")["epoch"] = -1
    bad["fingerprint"]["seed"] = "zero"
    lines = _problems(_refused(store, bad))
    assert len(lines) == 3
    _each_once(lines, [UNKNOWN, SEED, EPOCH])
    bad["num_yielded"] = -3
    lines = _problems(_refused(store, bad))
    assert len(lines) == 4
    _each_once(lines, [UNKNOWN, YIELDED, SEED, EPOCH])


def test_every_bad_fingerprint_field_and_node_counter_is_named(store, saved):
    bad = copy.deepcopy(saved)
    bad["fingerprint"].update(seed=-1, drop_last="no", uneven="sometimes")
    node_state(bad, "offset")["offset"] = 1.5
    node_state(bad, "position")["position"] = "2"
    lines = _problems(_refused(store, bad))
    _each_once(lines, [r"'fingerprint.seed' must be an integer >= 0, got -1",
                       r"'fingerprint.drop_last' must be bool, got 'no'",
                       r"'fingerprint.uneven' must be one of .*, got 'sometimes'",
                       r"state field 'offset' must be an integer >= 0, got 1.5",
                       r"ChunkPermuteNode state field 'position' must be an integer >= 0, "
                       r"got '2'"])
    assert len(lines) == 5


def test_a_loader_built_differently_and_a_malformed_counter_are_both_named(store, saved):
    bad = copy.deepcopy(saved)
    bad["num_yielded"] = -3
    lines = _problems(_refused(store, bad, seed=1))
    assert len(lines) == 2
    _each_once(lines, [YIELDED, r"built differently.*seed: saved 0, this loader 1"])


def test_a_missing_root_is_named_beside_the_other_top_level_problems(store, saved):
    bad = copy.deepcopy(saved)
    del bad["root"]
    bad["format"] = "4"
    lines = _problems(_refused(store, bad))
    _each_once(lines, [r"loader state has no field 'root'",
                       r"loader state field 'format' is '4'; this version of "
                       r"insitubatch_nodes reads formats 1 to 4"])


def test_one_problem_keeps_its_own_message(store, saved):
    bad = copy.deepcopy(saved)
    node_state(bad, "epoch")["epoch"] = -1
    message = _refused(store, bad)
    assert message.startswith("ChunkPermuteNode state field 'epoch' must be an integer >= 0")
    assert "problems" not in message


def test_a_malformed_merged_state_names_each_problem(store):
    src, m = store
    states = []
    for r in range(2):
        with ib.build_loader(src, m, "train", **KW, rank=r, world_size=2) as ld:
            next(iter(ld))
            states.append(ld.state_dict())
    bad = ib.merge_rank_states(states)
    bad["elastic"]["epoch"] = -1
    bad["fingerprint"]["rank"] = 0
    lines = _problems(_refused(store, bad, rank=0, world_size=3))
    _each_once(lines, [r"loader 'elastic' state field 'epoch' must be an integer >= 0",
                       r"'fingerprint' of a merged state has unknown fields \['rank'\]"])


def test_a_fingerprint_with_several_bad_fields_names_each():
    fp = StateFingerprint(manifest="h", split="train", seed=0, n_samples=10, chunk_size=2,
                          first=0, end=10, block_chunks=4, uneven="pad", contiguous=False,
                          run_chunks=0, excluded="", batch_size=8, drop_last=False, rank=0,
                          world_size=1).to_json()
    fp.update(seed="0", batch_size=-8)
    del fp["split"]
    with pytest.raises(ib.StateError) as info:
        StateFingerprint.from_json(fp, merged=False)
    _each_once(_problems(str(info.value)),
               [r"'fingerprint' of a rank's state has no fields \['split'\]",
                r"'fingerprint.seed' must be an integer >= 0, got '0'",
                r"'fingerprint.batch_size' must be an integer >= 0, got -8"])


def test_the_format_2_warning_still_points_at_the_caller(store, saved):
    src, m = store
    old = copy.deepcopy(saved)
    old["format"] = 2
    del old["fingerprint"]
    with ib.build_loader(src, m, "train", **KW) as ld, \
            warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        ld.load_state_dict(old)
    assert [x.filename for x in w if "records no fingerprint" in str(x.message)] == [__file__]
