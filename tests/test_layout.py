"""Channels written straight into their slice of the batch (memory/layout.py) give bit for bit the
batches of gathering each variable and stacking afterwards (StackChannelsNode)."""

import numpy as np
import pytest
import torch
import zarr
from hypothesis import given, settings
from hypothesis import strategies as st
from stores import BLOSC

import insitubatch_nodes as ib
from insitubatch_nodes.graph import build_graph, resolve
from insitubatch_nodes.memory.layout import CHANNELS_KEY, Channel, Placement, build_layout
from insitubatch_nodes.nodes import NormalizeNode, PinOrCudaNode
from insitubatch_nodes.nodes.channels import StackChannelsNode, resolve_channels
from insitubatch_nodes.store.statistics import Stats


@pytest.fixture(scope="module")
def weather(tmp_path_factory):
    """t2m (4 steps per chunk), z with 3 levels (1 step per chunk), q int16 (8 per chunk)."""
    path = tmp_path_factory.mktemp("layout") / "w.zarr"
    g = zarr.open_group(path, mode="w")
    n = 61
    rng = np.random.default_rng(3)
    g.create_array("t2m", shape=(n, 5, 6), chunks=(4, 5, 6), dtype="float32",
                   compressors=BLOSC, dimension_names=("time", "lat", "lon"))[:] = \
        rng.standard_normal((n, 5, 6)).astype("f4") + 280
    g.create_array("z", shape=(n, 3, 5, 6), chunks=(1, 3, 5, 6), dtype="float32",
                   dimension_names=("time", "level", "lat", "lon"))[:] = \
        (rng.standard_normal((n, 3, 5, 6)) * 10 + 500).astype("f4")
    g.create_array("q", shape=(n, 5, 6), chunks=(8, 5, 6), dtype="int16",
                   dimension_names=("time", "lat", "lon"))[:] = \
        rng.integers(-900, 900, (n, 5, 6)).astype("i2")
    g.create_array("level", shape=(3,), dtype="int64", dimension_names=("level",))[:] = \
        [500, 850, 1000]
    src = ib.open_source(path, variables=["t2m", "z"])
    return src, ib.split_by_chunk(src, (1.0,))


def test_whole_levels_and_picks_become_ranges():
    from insitubatch_nodes.sampling.geometry import VariableGeometry

    def geom(name, shape):
        return VariableGeometry(name=name, shape=shape, chunks=(1, *shape[1:]),
                                dtype=np.dtype("f4"), dimension_names=None, shards=None)

    t2m, z = geom("t2m", (10, 5, 6)), geom("z", (10, 3, 5, 6))
    chans = [Channel("z", 0), Channel("z", 1), Channel("z", 2), Channel("t2m")]
    lay = build_layout([t2m, z], chans)
    assert lay.placements == ((Placement(CHANNELS_KEY, 3),),
                              (Placement(CHANNELS_KEY, slice(0, 3)),))
    assert lay.direct(0) and lay.direct(1)  # both decode straight into their slice
    lay = build_layout([t2m, z], [Channel("z", 2), Channel("t2m"), Channel("z", 0),
                                  Channel("z", 1)])
    assert lay.placements[1] == (Placement(CHANNELS_KEY, slice(0, 1), slice(2, 3)),
                                 Placement(CHANNELS_KEY, slice(2, 4), slice(0, 2)))
    assert lay.direct(1) is None and lay.key(CHANNELS_KEY).row_shape == (4, 5, 6)


def _reference(src, m, cfg):
    """The same graph, gathering each variable and stacking after (the earlier path)."""
    resolved = resolve(src, m, "train", cfg.replace(in_place=False, workers=0))
    gather = build_graph(src, m, "train", resolved, upto="gather").root
    gather.layout = build_layout(src.variables)
    node = gather
    sm = cfg.sample
    if sm.stats is not None or sm.dtype is not None:
        node = NormalizeNode(node, sm.stats or Stats("", ()), src.variables, dtype=sm.dtype)
    node = StackChannelsNode(node, resolve_channels(src, sm.channels))
    return ib.InSituLoader(PinOrCudaNode(node))


CHOICES = ["t2m", "z", ("z", 500), ("z", 850), ("z", 1000)]


@settings(max_examples=25, deadline=None)
@given(picks=st.lists(st.sampled_from(CHOICES), min_size=1, max_size=4, unique=True),
       window=st.booleans(), normalize=st.sampled_from([None, "stats", "bf16"]),
       batch=st.integers(1, 9))
def test_channels_in_place_equal_gather_then_stack(weather, picks, window, normalize, batch):
    src, m = weather
    if "z" in picks and any(isinstance(p, tuple) for p in picks):
        picks = [p for p in picks if not isinstance(p, tuple)]
    stats = ib.compute_stats(src, m, "train") if normalize else None
    cfg = ib.LoaderConfig.of(batch_size=batch, block_chunks=3, seed=2, channels=picks,
                             steps=ib.SampleWindow(2, (1,)) if window else None, stats=stats,
                             dtype=torch.bfloat16 if normalize == "bf16" else None)
    with ib.build_loader(src, m, "train", cfg) as new, _reference(src, m, cfg) as old:
        got = [{k: v.float().numpy() for k, v in b.items()} for b in new]
        want = [{k: v.float().numpy() for k, v in b.items()} for b in old]
    assert len(got) == len(want) > 0
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys()
        for k in g:
            np.testing.assert_array_equal(g[k], w[k], err_msg=k)


@pytest.mark.parametrize("chunk", [1, 4])  # in place, and windows with a gather
def test_a_variable_with_one_level_named_alone_is_one_channel(tmp_path, chunk):
    """A (1, y, x) sample named alone in ``channels=`` was a whole-variable channel whose
    rows did not fit its (y, x) slot: the gather failed on every store with more than one
    step per chunk."""
    g = zarr.open_group(tmp_path / "s.zarr", mode="w")
    n = 12
    rng = np.random.default_rng(0)
    t = rng.standard_normal((n, 1, 5, 6)).astype("f4")
    t2m = rng.standard_normal((n, 5, 6)).astype("f4")
    g.create_array("t", shape=t.shape, chunks=(chunk, 1, 5, 6), dtype="f4",
                   dimension_names=("time", "level", "lat", "lon"))[:] = t
    g.create_array("t2m", shape=t2m.shape, chunks=(chunk, 5, 6), dtype="f4",
                   dimension_names=("time", "lat", "lon"))[:] = t2m
    g.create_array("level", shape=(1,), dtype="float64", dimension_names=("level",))[:] = [500.0]
    src = ib.open_source(tmp_path / "s.zarr", variables=["t", "t2m"])
    m = ib.split_by_chunk(src, (1.0,))
    assert [c.label for c in resolve_channels(src, ["t", "t2m"])] == ["t@500.0", "t2m"]
    for b in ib.build_loader(src, m, "train", batch_size=5, channels=["t", "t2m"]):
        idx = b["sample_index"].numpy()
        want = np.concatenate([t[idx], t2m[idx][:, None]], axis=1)
        np.testing.assert_array_equal(b["channels"].numpy(), want)


@pytest.mark.parametrize("workers", [0, 2])
def test_channels_of_different_dtypes_stack_in_place_in_the_promoted_dtype(weather, workers):
    """float32 t2m and int16 q stack in place as torch.stack would (float32), the int16
    channel cast as it is written: equal to gathering each and stacking afterwards."""
    src, m = weather
    both = ib.open_source(src.url, variables=["t2m", "q"])
    m2 = ib.split_by_chunk(both, (1.0,))
    cfg = ib.LoaderConfig.of(batch_size=4, block_chunks=3, seed=5, channels=["t2m", "q"],
                             workers=workers, in_place=True)
    with ib.build_loader(both, m2, "train", cfg) as ld, _reference(both, m2, cfg) as old:
        assert not any(isinstance(n, StackChannelsNode) for n in ld.nodes())
        for _ in range(2):  # two epochs
            got, want = list(ld), list(old)
            assert len(got) == len(want) > 0
            for g, w in zip(got, want, strict=True):
                assert g["channels"].dtype == torch.float32 and g["channels"].shape[1] == 2
                for k in w:
                    torch.testing.assert_close(g[k], w[k], rtol=0, atol=0, msg=k)
