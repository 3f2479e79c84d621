"""Split manifests are checked on construction and load: a manifest that would serve a
sample twice, or one that does not exist, is a ValueError naming the splits and ranges."""

import copy
import json

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from stores import Var, write_store

import insitubatch_nodes as ib

N_CHUNKS = 30


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("manifest") / "s.zarr"
    write_store(path, [Var("x", (118, 3), (4, 3))])  # 30 chunks, the last one short
    return ib.open_source(path)


@pytest.fixture(scope="module")
def manifest(source):
    return ib.split_by_chunk(source, (0.8, 0.1, 0.1))  # train [0, 24), val [24, 27), test


def edited(tmp_path, manifest, edit, keep_hash=False):
    d = manifest.to_dict()
    edit(d)
    if not keep_hash:
        del d["content_hash"]  # a hand edit that also dropped the hash: validation decides
    path = tmp_path / "m.json"
    path.write_text(json.dumps(d))
    return path


def test_round_trip_records_the_content_hash(manifest, tmp_path):
    path = tmp_path / "m.json"
    manifest.to_json(path)
    d = json.loads(path.read_text())
    assert d["content_hash"] == manifest.content_hash
    assert ib.SplitManifest.from_json(path) == manifest


def test_the_hash_covers_the_splits_not_the_metadata(source, manifest):
    d = manifest.to_dict()
    d.update(source_url="s3://elsewhere/s.zarr", seed=9)
    del d["content_hash"]
    assert ib.SplitManifest.from_dict(d).content_hash == manifest.content_hash
    assert ib.split_by_chunk(source, (0.5, 0.5)).content_hash != manifest.content_hash
    renamed = ib.split_by_chunk(source, (0.8, 0.1, 0.1), names=("fit", "val", "test"))
    assert renamed.content_hash != manifest.content_hash


# -- the table: an edited manifest JSON --------------------------------------------

def test_val_overlapping_train_is_refused(manifest, tmp_path):
    path = edited(tmp_path, manifest, lambda d: d["splits"].update(val=[[20, 27]]))
    with pytest.raises(ValueError, match=r"m.json: splits 'train' and 'val' overlap: 'train' has "
                                         r"chunks \[0, 24\) and 'val' has \[20, 27\), so chunks "
                                         r"\[20, 24\) \(samples \[80, 96\)\) would serve both"):
        ib.SplitManifest.from_json(path)


def test_ranges_past_the_last_chunk_are_refused(manifest, tmp_path):
    path = edited(tmp_path, manifest, lambda d: d["splits"].update(test=[[27, 33]]))
    with pytest.raises(ValueError, match=r"split 'test': chunk range \[27, 33\) runs past the "
                                         r"last chunk: 118 samples in chunks of 4 are chunks "
                                         r"\[0, 30\)"):
        ib.SplitManifest.from_json(path)


@pytest.mark.parametrize(("ranges", "match"), [
    ([[5, 9], [0, 3]], r"split 'train': chunk range \[0, 3\) comes before the range before it "
                       r"\[5, 9\)"),
    ([[0, 9], [4, 12]], r"chunk range \[4, 12\) overlaps the range before it \[0, 9\)"),
    ([[0, 9], [0, 9]], r"chunk range \[0, 9\) overlaps the range before it \[0, 9\)"),
    ([[3, 3]], r"split 'train': chunk range \[3, 3\) is empty or negative"),
    ([[-2, 3]], r"chunk range \[-2, 3\) is empty or negative"),
    ([[6, 2]], r"chunk range \[6, 2\) is empty or negative"),
    ([[0, 1.5]], r"'splits.train' must be a list of \[start, stop\] chunk-id pairs"),
    ([[0, 1, 2]], r"'splits.train' must be a list of \[start, stop\]"),
    ("0-24", r"'splits.train' must be a list"),
])
def test_bad_ranges_name_the_split_and_range(manifest, tmp_path, ranges, match):
    path = edited(tmp_path, manifest, lambda d: d["splits"].update(train=ranges))
    with pytest.raises(ValueError, match=match):
        ib.SplitManifest.from_json(path)


@pytest.mark.parametrize(("edit", "match"), [
    (lambda d: d.pop("n_samples"), "split manifest has no field 'n_samples'"),
    (lambda d: d.update(chunk_size="4"), "field 'chunk_size' must be int, got '4'"),
    (lambda d: d.update(chunk_size=0), "chunk_size must be an integer >= 1, got 0"),
    (lambda d: d.update(n_samples=-1), "n_samples must be an integer >= 0, got -1"),
    (lambda d: d.update(splits=[[0, 24]]), "field 'splits' must be dict"),
])
def test_bad_fields_are_named(manifest, tmp_path, edit, match):
    with pytest.raises(ValueError, match=match):
        ib.SplitManifest.from_json(edited(tmp_path, manifest, edit))


def test_splits_edited_under_a_recorded_hash_are_refused(manifest, tmp_path):
    path = edited(tmp_path, manifest, lambda d: d["splits"].update(test=[[27, 29]]),
                  keep_hash=True)
    with pytest.raises(ValueError, match=rf"'content_hash' is '{manifest.content_hash}', but "
                                         "its splits hash to .* delete the 'content_hash'"):
        ib.SplitManifest.from_json(path)
    d = json.loads(path.read_text())
    del d["content_hash"]  # the edit was intended
    assert ib.SplitManifest.from_dict(d).ranges("test") == ((27, 29),)


def test_not_json_names_the_file(tmp_path):
    path = tmp_path / "m.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="m.json is not valid JSON"):
        ib.SplitManifest.from_json(path)


def test_construction_is_checked_too():
    with pytest.raises(ValueError, match="splits 'a' and 'b' overlap"):
        ib.SplitManifest(10, 2, (("a", ((0, 3),)), ("b", ((2, 5),))))
    with pytest.raises(ValueError, match="names a split twice"):
        ib.SplitManifest(10, 2, (("a", ((0, 1),)), ("a", ((2, 3),))))
    # adjacent ranges and empty splits are fine
    ok = ib.SplitManifest(10, 2, (("a", ((0, 1), (1, 3))), ("b", ()), ("c", ((3, 5),))))
    assert ok.chunk_ids("a").tolist() == [0, 1, 2]


# -- fuzz: mutated manifests ---------------------------------------------------------------

@st.composite
def mutated(draw, base):
    d = copy.deepcopy(base)
    names = sorted(d["splits"])
    for _ in range(draw(st.integers(1, 3))):
        name = draw(st.sampled_from(names))
        ranges = d["splits"][name]
        op = draw(st.sampled_from(["shift", "set", "copy", "swap", "drop", "add"]))
        if op == "add" or not ranges:
            a = draw(st.integers(-2, N_CHUNKS + 2))
            ranges.append([a, a + draw(st.integers(-1, 6))])
        elif op in ("shift", "set"):
            r = draw(st.sampled_from(ranges))
            i = draw(st.integers(0, 1))
            r[i] = (r[i] + draw(st.integers(-4, 4)) if op == "shift"
                    else draw(st.integers(-2, N_CHUNKS + 2)))
        elif op == "copy":  # a range of this split into another one
            other = draw(st.sampled_from(names))
            d["splits"][other].append(list(draw(st.sampled_from(ranges))))
        elif op == "swap" and len(ranges) > 1:
            i, j = draw(st.permutations(range(len(ranges))))[:2]
            ranges[i], ranges[j] = ranges[j], ranges[i]
        elif op == "drop":
            ranges.pop(draw(st.integers(0, len(ranges) - 1)))
    if draw(st.integers(0, 4)):  # mostly as a hand edit that dropped the hash
        del d["content_hash"]
    return d


@pytest.fixture(scope="module")
def random_base(source):
    return ib.split_by_chunk(source, (0.6, 0.2, 0.2), seed=3, mode="random").to_dict()


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_mutated_manifests_are_refused_or_serve_each_sample_once(source, random_base,
                                                                      data):
    d = data.draw(mutated(random_base))
    try:
        m = ib.SplitManifest.from_dict(d)
    except ValueError as e:
        msg = str(e)
        assert "content_hash" in msg or any(f"'{n}'" in msg for n in d["splits"]), msg
        event("refused")
        return
    event("accepted")
    served = []
    for name in m.names:
        ids = m.chunk_ids(name)
        assert ((ids >= 0) & (ids < N_CHUNKS)).all()
        if ids.size:
            with ib.build_loader(source, m, name, batch_size=7, block_chunks=2) as ld:
                got = sorted(i for b in ld for i in b["sample_index"].tolist())
            assert got == m.grid.samples_of(ids).tolist()  # each of its samples once
            served += got
    assert len(served) == len(set(served))  # no sample in two splits


@pytest.mark.parametrize(("edit", "match"), [
    (lambda d: d.update(fractions=[0.8, None]), "'fractions' must be a list of numbers"),
    (lambda d: d.update(periods=[["train", 1979]]), r"'periods' must be a list of \[split"),
    (lambda d: d.update(snapshot_id=7), "'snapshot_id' must be a string or null"),
    (lambda d: d.update(variables="x"), "field 'variables' must be list"),
])
def test_bad_metadata_is_named(manifest, tmp_path, edit, match):
    with pytest.raises(ValueError, match=match):
        ib.SplitManifest.from_json(edited(tmp_path, manifest, edit))
