"""The remote path: a real S3 server on loopback, faults injected by a proxy, icechunk,
clear errors, no leaked secrets, no hang under fork."""

import json
import logging
import multiprocessing
import pickle
import time
from pathlib import Path

import numpy as np
import obstore
import obstore.exceptions as oe
import pytest
import torch
from stores import BLOSC, Var, stores_on_s3, write_store

import insitubatch_nodes as ib
from insitubatch_nodes.io.retry import ChunkReadError
from insitubatch_nodes.testing.faultproxy import FaultPlan, FaultProxy

VARS = [Var("x", (400, 4, 4), (4, 4, 4), compressors=BLOSC),
        Var("y", (400, 3), (8, 3), dtype="int16")]
FAST_RETRY = ib.RetryPolicy(attempts=5, base_delay=0.02, max_delay=0.2)


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with stores_on_s3(tmp_path_factory.mktemp("s3"), {"era5.zarr": VARS}) as (server, data):
        yield server, data["era5.zarr"]


def _retry_config():
    from datetime import timedelta

    return {"max_retries": 1, "retry_timeout": timedelta(seconds=10),
            "backoff": {"init_backoff": timedelta(milliseconds=10),
                        "max_backoff": timedelta(milliseconds=50), "base": 2}}


def open_s3(server, endpoint=None, **opts):
    options = server.options(endpoint=endpoint, retry_config=_retry_config(), **opts)
    return ib.open_source("s3://data/era5.zarr", storage_options=options)


def epoch(loader):
    return [{k: v.numpy().copy() for k, v in b.items()} for b in loader]


def check_exact(batches, data, n=400):
    idx = np.concatenate([b["sample_index"] for b in batches])
    assert sorted(idx.tolist()) == list(range(n))
    for b in batches:
        for name, arr in data.items():
            np.testing.assert_array_equal(b[name], arr[b["sample_index"]])


def test_s3_epoch_is_exact_and_resumes(s3):
    server, data = s3
    src = open_s3(server)
    assert src.url == "s3://data/era5.zarr"
    m = ib.split_by_chunk(src, (1.0,))
    loader = ib.build_loader(src, m, "train", batch_size=16, block_chunks=8)
    assert loader.node(ib.AsyncFetchNode).readers[0].mode == "object"
    full = epoch(loader)
    check_exact(full, data)
    ref = ib.build_loader(src, m, "train", batch_size=16, block_chunks=8)
    it = iter(ref)
    for _ in range(7):
        next(it)
    resumed = ib.build_loader(open_s3(server), m, "train", batch_size=16, block_chunks=8)
    resumed.load_state_dict(ref.state_dict())
    rest = epoch(resumed)
    for a, b in zip(rest, full[7:], strict=True):
        np.testing.assert_array_equal(a["sample_index"], b["sample_index"])
        np.testing.assert_array_equal(a["x"], b["x"])


def test_epoch_survives_faults_and_latency(s3):
    server, data = s3
    plan = FaultPlan(latency_s=0.02, error_rate=0.02, reset_rate=0.015, truncate_rate=0.015,
                     seed=3)
    with FaultProxy(server.address, plan) as proxy:
        src = open_s3(server, endpoint=proxy.endpoint)
        m = ib.split_by_chunk(src, (1.0,))
        loader = ib.build_loader(src, m, "train", batch_size=16, block_chunks=8,
                                 max_inflight=32, retry=FAST_RETRY)
        for _ in range(2):
            check_exact(epoch(loader), data)
        st = proxy.stats
    assert st.errors and st.resets and st.truncations, st  # every fault kind was exercised
    assert loader.node(ib.AsyncFetchNode).stats.retries > 0


def test_the_fault_proxy_gives_each_key_its_own_faults_whatever_the_order(s3):
    """A key's faults follow from (seed, key, how often it was asked), not from the order
    requests reach the proxy: a chunk retried alone at an epoch's tail cannot meet a cluster
    of faults another interleaving would have spread over other chunks (CI saw one chunk
    truncated three times running that way)."""
    from obstore.store import S3Store

    server, _ = s3
    keys = [f"era5.zarr/y/c/{i}/0" for i in range(6)]
    plan = FaultPlan(truncate_rate=0.5, error_rate=0.2, seed=11)

    def outcomes(order):
        seen = {k: [] for k in keys}
        with FaultProxy(server.address, plan) as proxy:
            store = S3Store("data", **server.options(endpoint=proxy.endpoint,
                                                     retry_config=_retry_config()
                                                     | {"max_retries": 0}))
            for k in order:
                try:
                    seen[k].append(len(obstore.get(store, k).bytes()))
                except Exception as e:  # noqa: BLE001 (the injected 5xx, by kind)
                    seen[k].append(type(e).__name__)
        return seen

    forward = outcomes([k for k in keys for _ in range(4)])
    backward = outcomes([k for _ in range(4) for k in reversed(keys)])
    assert forward == backward
    flat = [o for k in keys for o in forward[k]]
    lengths = {o for o in flat if isinstance(o, int)}
    assert any(isinstance(o, str) for o in flat) and len(lengths) > 1  # errors, truncations


def test_device_decode_path_over_s3_survives_faults(s3):
    """decode= fetches compressed frames through obstore (with the same retries): both the
    blosc and the zstd variable take the device path (here the numcodecs stand-in)."""
    from insitubatch_nodes.testing.host_frames import HostFrameDecoder

    server, data = s3
    plan = FaultPlan(latency_s=0.01, error_rate=0.02, reset_rate=0.015, truncate_rate=0.04,
                     seed=5)
    with FaultProxy(server.address, plan) as proxy:
        src = open_s3(server, endpoint=proxy.endpoint)
        m = ib.split_by_chunk(src, (1.0,))
        dec = HostFrameDecoder()
        loader = ib.build_loader(src, m, "train", batch_size=16, block_chunks=8,
                                 retry=FAST_RETRY, decode=dec)
        for _ in range(2):
            check_exact(epoch(loader), data)
        st = proxy.stats
    assert st.errors and st.truncations, st
    fetch = loader.node(ib.AsyncFetchNode)
    assert set(fetch.window_decoder.chains) == {0, 1}  # "x" (blosc-zstd), "y" (zstd)
    assert {a for a, _ in dec.calls} == {"zstd"} and fetch.stats.retries > 0


def test_stall_longer_than_timeout_is_retried(s3):
    server, data = s3
    plan = FaultPlan(stall_first=2, stall_s=4.0)
    with FaultProxy(server.address, plan) as proxy:
        src = open_s3(server, endpoint=proxy.endpoint,
                      client_options={"allow_http": True, "timeout": "1s"})
        m = ib.split_by_chunk(src, (1.0,))
        loader = ib.build_loader(src, m, "train", batch_size=50, retry=FAST_RETRY)
        t = time.monotonic()
        check_exact(epoch(loader), data)
        assert time.monotonic() - t < 30
        assert proxy.stats.stalls == 2


def test_a_chunk_that_always_fails_ends_the_epoch_loudly(s3):
    server, _ = s3
    plan = FaultPlan(always_fail=("/x/c/5/",))
    with FaultProxy(server.address, plan) as proxy:
        src = open_s3(server, endpoint=proxy.endpoint)
        m = ib.split_by_chunk(src, (1.0,))
        loader = ib.build_loader(src, m, "train", batch_size=16, retry=FAST_RETRY)
        it = iter(loader)
        t = time.monotonic()
        with pytest.raises(ChunkReadError) as info:
            for _ in range(1000):
                next(it)
        assert time.monotonic() - t < 30  # not a hang
        text = str(info.value)  # the message itself names the chunk, not only a note
        assert "gave up after 5 attempts" in text, text
        assert "'x'" in text and "s3://data/era5.zarr" in text and "'x/c/5/0/0'" in text
        assert "503 Service Unavailable" in text and "<Error>" not in text
        assert isinstance(info.value.__cause__, oe.GenericError)
        assert loader.stats().retries >= 4  # the failed chunk's retries count too
        with pytest.raises(type(info.value)):  # not a silent short epoch either
            next(it)
        loader.close()
        assert proxy.stats.always_failed >= 5


def test_bad_remote_inputs_are_clear(s3):
    server, _ = s3
    t = time.monotonic()
    with pytest.raises(ConnectionError, match=r"cannot read from s3://data/era5.zarr .*:9\)"):
        open_s3(server, endpoint="http://127.0.0.1:9")
    assert time.monotonic() - t < 15
    with pytest.raises(PermissionError, match="denied.*SignatureDoesNotMatch") as info:
        open_s3(server, secret_access_key="RECOGNISABLE-bad-secret-42")
    assert "RECOGNISABLE" not in str(info.value)
    with pytest.raises(FileNotFoundError, match="bucket does not exist"):
        ib.open_source("s3://nobucket/era5.zarr", storage_options=server.options())
    with pytest.raises(FileNotFoundError, match="nothing is stored under that prefix"):
        ib.open_source("s3://data/missing.zarr", storage_options=server.options())
    with pytest.raises(ValueError, match="storage_options keys"):
        ib.open_source("s3://data/era5.zarr", storage_options={"no_such_option": "x"})


def test_plain_http_endpoint_without_allow_http_says_so(s3):
    """obstore refuses http:// endpoints unless allowed, with only "builder error"."""
    server, data = s3
    with pytest.raises(ConnectionError, match=r"plain http://.*'allow_http': True") as info:
        open_s3(server, client_options={"timeout": "5s"})
    assert "Check that the endpoint is reachable" not in str(info.value)
    # allow_http at the top level of storage_options is taken as the client option it is
    src = open_s3(server, client_options={"timeout": "5s"}, allow_http=True)
    loader = ib.build_loader(src, ib.split_by_chunk(src, (1.0,)), "train", batch_size=100)
    check_exact(epoch(loader), data)


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_the_path_of_an_array_says_to_open_its_group(tmp_path, zarr_format):
    write_store(tmp_path / "s.zarr", [Var("x", (16, 3), (8, 3), zarr_format=zarr_format)])
    with pytest.raises(ValueError, match=r"s\.zarr/x is a Zarr array, not a group") as info:
        ib.open_source(tmp_path / "s.zarr" / "x")
    parent = (tmp_path / "s.zarr").resolve()
    assert f"open_source('file://{parent}', variables=['x'])" in str(info.value)


def test_secrets_never_leak(s3, caplog):
    server, _ = s3
    secret = server.secret
    caplog.set_level(logging.DEBUG)
    src = open_s3(server)
    m = ib.split_by_chunk(src, (1.0,))
    loader = ib.build_loader(src, m, "train", batch_size=64)
    it = iter(loader)
    next(it)
    outputs = [repr(src), str(src), src.url, json.dumps(m.to_dict()), repr(m),
               json.dumps(loader.state_dict()), repr(loader.node(ib.AsyncFetchNode).readers[0]),
               caplog.text]
    for i, text in enumerate(outputs):
        assert secret not in text, i
    loader.close()


# -- icechunk --------------------------------------------------------------------------------

def _write_repo(storage, data_vars, message="first"):
    import icechunk
    import zarr

    repo = icechunk.Repository.open_or_create(storage)
    session = repo.writable_session("main")
    g = zarr.open_group(session.store, mode="a")
    data = {}
    for i, v in enumerate(data_vars):
        arr = g.create_array(v.name, shape=v.shape, chunks=v.chunks, dtype=v.dtype,
                             overwrite=True)
        data[v.name] = (np.arange(np.prod(v.shape)).reshape(v.shape) * (i + 1)).astype(v.dtype)
        arr[:] = data[v.name]
    return repo, session.commit(message), data


def test_icechunk_branch_tag_snapshot_and_moved_branch(tmp_path):
    pytest.importorskip("icechunk")
    import icechunk

    storage = icechunk.local_filesystem_storage(str(tmp_path / "repo"))
    small = [Var("x", (40, 3), (8, 3))]
    repo, first, data = _write_repo(storage, small)
    repo.create_tag("v1", first)
    src = ib.open_icechunk(str(tmp_path / "repo"))
    assert src.snapshot_id == first and "branch 'main'" in src.url
    m = ib.split_by_chunk(src, (1.0,))
    assert m.snapshot_id == first
    loader = ib.build_loader(src, m, "train", batch_size=6)
    check_exact(epoch(loader), data, n=40)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    assert state["snapshot_id"] == first
    assert ib.open_icechunk(str(tmp_path / "repo"), tag="v1").snapshot_id == first
    assert ib.open_icechunk(str(tmp_path / "repo"), snapshot_id=first).snapshot_id == first
    with pytest.raises(KeyError, match=r"branch 'dev' not found.*\['main'\].*\['v1'\]"):
        ib.open_icechunk(str(tmp_path / "repo"), branch="dev")

    _, second, _ = _write_repo(storage, small, "second")  # the branch moves on
    moved = ib.open_icechunk(str(tmp_path / "repo"))
    assert moved.snapshot_id == second
    with pytest.raises(ValueError, match=f"{first}.*{second}"):
        ib.build_loader(moved, m, "train", batch_size=6)
    fresh = ib.build_loader(moved, ib.split_by_chunk(moved, (1.0,)), "train", batch_size=6)
    with pytest.raises(ValueError, match=f"snapshot {first}.*snapshot {second}"):
        fresh.load_state_dict(state)
    ok = ib.build_loader(moved, m, "train", batch_size=6, allow_snapshot_change=True)
    ok.load_state_dict(state)
    assert len(epoch(ok)) > 0
    # Resuming on the recorded snapshot is exact.
    pinned = ib.open_icechunk(str(tmp_path / "repo"), snapshot_id=first)
    again = ib.build_loader(pinned, m, "train", batch_size=6)
    again.load_state_dict(state)
    assert len(epoch(again)) == 6  # 40 samples / 6 = 7 batches, one already taken


def test_icechunk_on_s3(s3):
    pytest.importorskip("icechunk")
    import icechunk

    server, _ = s3
    server.make_bucket("repos")
    opts = {"endpoint_url": server.endpoint, "allow_http": True, "region": "us-east-1",
            "access_key_id": server.key_id, "secret_access_key": server.secret,
            "force_path_style": True}
    storage = icechunk.s3_storage(bucket="repos", prefix="era5", **opts)
    _, snap, data = _write_repo(storage, [Var("x", (48, 3), (8, 3))])
    src = ib.open_icechunk("s3://repos/era5", storage_options=opts)
    assert src.snapshot_id == snap and server.secret not in repr(src)
    m = ib.split_by_chunk(src, (1.0,))
    check_exact(epoch(ib.build_loader(src, m, "train", batch_size=5)), data, n=48)


# -- processes -----------------------------------------------------------------------------

class _Wrapped(torch.utils.data.IterableDataset):
    def __init__(self, loader):
        self.loader = loader

    def __iter__(self):
        yield from self.loader


def test_forked_dataloader_workers_get_a_clear_error_not_a_hang(tmp_path):
    write_store(tmp_path / "s.zarr", [Var("x", (64, 3), (8, 3))])
    src = ib.open_source(tmp_path / "s.zarr")
    loader = ib.build_loader(src, ib.split_by_chunk(src, (1.0,)), "train", batch_size=8)
    next(iter(loader))  # the fetch thread is running in the parent
    dl = torch.utils.data.DataLoader(_Wrapped(loader), batch_size=None, num_workers=1,
                                     multiprocessing_context=multiprocessing.get_context("fork"),
                                     timeout=60)
    t = time.monotonic()
    it = iter(dl)
    with pytest.raises(RuntimeError, match="without DataLoader workers"):
        next(it)
    it._shutdown_workers()
    assert time.monotonic() - t < 60
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(loader.node(ib.AsyncFetchNode))
    loader.close()


def test_local_paths_never_touch_the_network(tmp_path):
    write_store(tmp_path / "s.zarr", [Var("x", (16, 3), (8, 3))])
    assert ib.open_source(Path(tmp_path / "s.zarr")).url.startswith("file://")


def test_local_paths_with_spaces_and_colons_open_however_they_are_given(tmp_path, monkeypatch):
    """``Path.as_uri()`` escapes a space as %20; a relative path with a colon is a path,
    not a URL scheme, when it exists (and always when given as a path object)."""
    spaced = tmp_path / "with space.zarr"
    data = write_store(spaced, [Var("x", (16, 3), (8, 3))])
    colon = tmp_path / "run:1.zarr"
    write_store(colon, [Var("x", (16, 3), (8, 3))])
    for url in (spaced.as_uri(), str(spaced), spaced):
        src = ib.open_source(url)
        assert src.variables[0].name == "x"
        assert np.array_equal(src.arrays[0][:], data["x"])
    monkeypatch.chdir(tmp_path)
    for url in ("run:1.zarr", Path("run:1.zarr"), colon.as_uri()):
        assert ib.open_source(url).variables[0].name == "x"
    with pytest.raises(ValueError, match="nope:1.zarr"):
        ib.open_source("nope:1.zarr")
