"""Decoded stripes kept across epochs (``fetch.keep_decoded``): a split that fits in one
window is decoded once, later epochs copy from memory, and the batches are exactly those
of a loader that decodes every epoch (the stored samples, each once, the same order)."""

import json
import threading

import numpy as np
import pytest
from stores import BLOSC, Var, assert_rows_stored, write_store

import insitubatch_nodes as ib
from insitubatch_nodes.memory.kept_stripes import KeptStripes

# several samples per chunk (8 and 4): 13 chunks of x, the split in one window of 16
MANY = [Var("x", (100, 6, 5), (8, 6, 5), compressors=BLOSC),
        Var("y", (100, 3, 4), (4, 3, 4), dtype="int16")]


@pytest.fixture(scope="module")
def many(tmp_path_factory):
    path = tmp_path_factory.mktemp("kept") / "many.zarr"
    data = write_store(path, MANY)
    src = ib.open_source(path)
    return src, ib.split_by_chunk(src, (1.0,)), data


def epochs(loader, n=3):
    return [[{k: v.clone() for k, v in b.items()} for b in loader] for _ in range(n)]


def assert_same(got, want):
    assert len(got) == len(want)
    for g_epoch, w_epoch in zip(got, want, strict=True):
        assert len(g_epoch) == len(w_epoch)
        for g, w in zip(g_epoch, w_epoch, strict=True):
            assert g.keys() == w.keys()
            for k in g:
                np.testing.assert_array_equal(g[k], w[k], err_msg=k)


def stripes_of(src) -> int:
    return sum(v.n_sample_chunks for v in src.variables)


@pytest.mark.parametrize("path", [{}, {"in_place": True}, {"in_place": False}],
                         ids=["default", "in-place", "gathered"])
def test_a_split_in_one_window_is_decoded_once(many, path):
    src, m, data = many
    kw = dict(batch_size=7, seed=3, workers=0)
    with ib.build_loader(src, m, "train", **path, **kw) as kept, \
            ib.build_loader(src, m, "train", keep_decoded=0, **path, **kw) as fresh:
        got, want = epochs(kept), epochs(fresh)
        s_kept, s_fresh = kept.stats(), fresh.stats()
    assert_same(got, want)
    for epoch in got:
        assert_rows_stored(epoch, data)
        served = np.concatenate([b["sample_index"].numpy() for b in epoch])
        assert sorted(served.tolist()) == list(range(100))
    assert s_fresh.stripes_kept == 0 and s_fresh.stripes_fetched >= 3 * stripes_of(src)
    # each stripe read once, served from memory after (the next epoch's prefetched window
    # on the gathered path counts too)
    assert s_kept.stripes_fetched == stripes_of(src)
    assert s_kept.stripes_kept >= 2 * stripes_of(src)


def test_the_default_gathers_a_split_that_fits_and_decodes_a_larger_one_in_place(many):
    src, m, _ = many
    with ib.build_loader(src, m, "train", batch_size=7, workers=0) as small, \
            ib.build_loader(src, m, "train", batch_size=7, workers=0, block_chunks=4) as big:
        assert small.node(ib.AsyncFetchNode).arena is None  # gathered from kept stripes
        assert big.node(ib.AsyncFetchNode).arena is not None  # in place, nothing kept
        epochs(big, 2)
        assert big.stats().stripes_kept == 0


@pytest.mark.parametrize("in_place", [True, False])
def test_a_size_keeps_that_many_bytes_and_reads_the_rest_every_epoch(many, in_place):
    src, m, data = many
    x, y = src.variables
    size = 5 * x.stripe_nbytes  # not every stripe of a split in four windows
    kw = dict(batch_size=5, block_chunks=4, seed=1, workers=0, in_place=in_place)
    with ib.build_loader(src, m, "train", keep_decoded=size, **kw) as kept, \
            ib.build_loader(src, m, "train", keep_decoded=0, **kw) as fresh:
        got, want = epochs(kept), epochs(fresh)
        s = kept.stats()
        assert s.resident_bound_bytes == fresh.stats().resident_bound_bytes + size
        assert s.resident_peak_bytes <= s.resident_bound_bytes
    assert_same(got, want)
    assert_rows_stored(got[-1], data)
    assert s.stripes_kept > 0 and s.stripes_fetched > stripes_of(src)


def test_exact_resume_mid_epoch(many):
    src, m, _ = many
    kw = dict(batch_size=6, seed=5, workers=0)
    with ib.build_loader(src, m, "train", **kw) as ld:
        for _ in ld:  # the first epoch decodes and keeps every stripe
            pass
        it = iter(ld)
        for _ in range(5):
            next(it)
        state = json.loads(json.dumps(ld.state_dict()))
        rest = [b["sample_index"].tolist() for b in it]
    assert rest
    with ib.build_loader(src, m, "train", **kw) as ld:
        ld.load_state_dict(state)
        assert [b["sample_index"].tolist() for b in ld] == rest


def test_a_corrupt_chunk_is_never_kept(tmp_path):
    path = tmp_path / "bad.zarr"
    write_store(path, [Var("x", (40, 4), (4, 4), compressors=BLOSC)])
    (path / "x" / "c" / "3" / "0").write_bytes(b"garbage, not blosc")
    src = ib.open_source(path)
    with ib.build_loader(src, ib.split_by_chunk(src, (1.0,)), "train", batch_size=4,
                         workers=0, retry=ib.RetryPolicy(attempts=1)) as ld:
        for _ in range(2):  # every epoch reads it again and fails again, naming it
            with pytest.raises(Exception) as info:  # noqa: B017 - the codec's own error
                for _ in ld:
                    pass
            text = str(info.value) + "\n".join(getattr(info.value, "__notes__", []))
            assert "x/c/3/0" in text, text


@pytest.mark.parametrize(("kw", "names"), [
    ({"workers": 1}, ["keep_decoded", "decode workers"]),
    ({"workers": 0, "in_place": True, "chunk": 1}, ["keep_decoded", "one sample per chunk"]),
])
def test_refused_where_nothing_can_be_kept(tmp_path, kw, names):
    chunk = kw.pop("chunk", 4)
    path = tmp_path / "s.zarr"
    write_store(path, [Var("x", (40, 4), (chunk, 4), compressors=BLOSC)])
    src = ib.open_source(path)
    with pytest.raises(ib.ConfigError) as info:
        ib.build_loader(src, ib.split_by_chunk(src, (1.0,)), "train", batch_size=4,
                        keep_decoded="1MB", **kw)
    for name in names:
        assert name in str(info.value)


@pytest.mark.parametrize("bad", [-1, True, 1.5, [1], "lots"])
def test_a_bad_size_is_named(bad):
    with pytest.raises(ib.ConfigError, match="keep_decoded"):
        ib.FetchConfig(keep_decoded=bad)


def test_one_decode_waits_for_another_and_a_failed_one_is_claimed_again():
    kept = KeptStripes(1 << 20)
    stripe = kept.get("a", (4, 3), np.dtype("float32"))
    assert stripe is not None and kept.get("b", (1 << 20,), np.dtype("uint8")) is None
    assert stripe.claim() is True  # this task decodes
    assert stripe.claim(wait=False) is None  # the loop never waits: reads it itself
    seen: list[object] = []
    waiter = threading.Thread(target=lambda: seen.append(stripe.claim()))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # waits for the decode
    stripe.done(False)  # it failed: the waiter decodes it now
    waiter.join(5)
    assert seen == [True]
    stripe.array[:] = 7
    stripe.done(True)
    assert stripe.claim() is False and stripe.claim(wait=False) is False
    kept.clear()
    assert len(kept) == 0 and kept.nbytes == 0
