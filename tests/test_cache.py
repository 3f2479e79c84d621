"""ChunkCache: later epochs read stored chunks from local disk, exactly the store's bytes.

On a moto S3 server on loopback and icechunk repositories in tmp dirs: hits are the store's
bytes, the size bound holds, processes share a directory, damaged entries are refetched, a
moved branch misses, and no credential reaches a cache path or entry.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import insitubatch_nodes as ib
from insitubatch_nodes.io.chunk_cache import CacheScope
from tests.stores import BLOSC, Var, stores_on_s3, write_store

VARS = [Var("x", (96, 4, 4), (4, 4, 4), compressors=BLOSC),
        Var("y", (96, 3), (8, 3), dtype="int16")]
N = 96
# Hits and misses are counted per epoch here: the next epoch's first windows are not read
# while an epoch ends (the counts would include them).
ONE_EPOCH = {"prefetch_next_epoch": False}
# zarr's own getitem reads this one (sharding): byte ranges through a CachingStore
SHARDED = [Var("s", (96, 6), (4, 6), shards=(16, 6), compressors=BLOSC)]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with stores_on_s3(tmp_path_factory.mktemp("s3"),
                      {"era5.zarr": VARS, "sharded.zarr": SHARDED}) as (server, data):
        yield server, data["era5.zarr"], data["sharded.zarr"]


def open_s3(server):
    return ib.open_source("s3://data/era5.zarr", storage_options=server.options())


def epoch(loader):
    return [{k: v.numpy().copy() for k, v in b.items()} for b in loader]


def check_exact(batches, data, n=N):
    idx = np.concatenate([b["sample_index"] for b in batches])
    assert sorted(idx.tolist()) == list(range(n))
    for b in batches:
        for name, arr in data.items():
            np.testing.assert_array_equal(b[name], arr[b["sample_index"]])


def stored_chunks(server) -> dict[str, bytes]:
    """Every chunk object of the store, by key (metadata left out)."""
    client = server.boto3()
    keys = [o["Key"] for o in client.list_objects_v2(Bucket="data", Prefix="era5.zarr/")
            ["Contents"]]
    return {k.removeprefix("era5.zarr/"): client.get_object(Bucket="data", Key=k)["Body"].read()
            for k in keys if "/c/" in k}


def entry_files(cache: ib.ChunkCache) -> list[Path]:
    return [p for p in cache.root.rglob("*") if p.is_file() and p.parent.name != "tmp"
            and p.name != "total"]


def filled(server, data, tmp_path, **kw):
    """A loader over the S3 store with a fresh cache, after one exact epoch has filled it
    (and the background writes are flushed): (cache, loader)."""
    cache = ib.ChunkCache(tmp_path / "cache", max_bytes="1GB")
    src = open_s3(server)
    loader = ib.build_loader(src, ib.split_by_chunk(src, (1.0,)), "train", batch_size=8,
                             cache=cache, **ONE_EPOCH, **kw)
    check_exact(epoch(loader), data)
    cache.flush()
    return cache, loader


def test_hits_are_the_stores_bytes_and_are_counted(s3, tmp_path):
    server, data, _ = s3
    cache = ib.ChunkCache(tmp_path / "cache", max_bytes="1GB")
    src = open_s3(server)
    m = ib.split_by_chunk(src, (1.0,))
    loader = ib.build_loader(src, m, "train", batch_size=8, block_chunks=4, cache=cache,
                             **ONE_EPOCH)
    assert loader.node(ib.AsyncFetchNode).readers[0].mode == "cached"
    check_exact(epoch(loader), data)
    cache.flush()  # entries are written in the background
    first = loader.stats()
    chunks = stored_chunks(server)
    assert (first.cache_hits, first.cache_misses) == (0, len(chunks))
    assert first.cache_store_bytes == sum(len(b) for b in chunks.values())
    assert cache.entries() == len(chunks) and cache.verify() == 0

    check_exact(epoch(loader), data)
    second = loader.stats()
    assert second.cache_misses == len(chunks)  # nothing more from the store
    assert second.cache_hits == len(chunks) and second.cache_bytes == first.cache_store_bytes
    assert second.cache_hit_ratio == 0.5 and "chunk cache 50.0% hits" in second.summary()
    # Byte for byte what the store holds, under the store's scope.
    scope = CacheScope.of(f"s3://data/era5.zarr at {server.endpoint}", None)
    for key, blob in chunks.items():
        assert cache.get(scope.ident(key)) == blob
    loader.close()


def test_decode_workers_share_the_loaders_cache(s3, tmp_path):
    """Workers open the loader's cache (it pickles to a handle on the same directory): what
    they fetch lands there, and later epochs are served exactly from it."""
    import time

    server, data, _ = s3
    cache = ib.ChunkCache(tmp_path / "cache", max_bytes="1GB")
    src = open_s3(server)
    with ib.build_loader(src, ib.split_by_chunk(src, (1.0,)), "train", batch_size=8,
                         cache=cache, workers=2, in_place=True, **ONE_EPOCH) as loader:
        check_exact(epoch(loader), data)
        chunks = stored_chunks(server)
        end = time.monotonic() + 20  # the workers write their entries in the background
        while cache.entries() < len(chunks) and time.monotonic() < end:
            time.sleep(0.05)
        assert cache.entries() == len(chunks) and cache.verify() == 0
        check_exact(epoch(loader), data)


def test_a_warm_window_goes_straight_to_the_pool_and_refetches_what_went_missing(
        s3, tmp_path, monkeypatch):
    """Windows whose chunks are all cached are read on the pool from the consumer thread
    (no event-loop hop); an entry that disappears between the check and the read is
    fetched from the store, so the epoch stays exact."""
    server, data, _ = s3
    _, loader = filled(server, data, tmp_path, block_chunks=4)
    fetch = loader.node(ib.AsyncFetchNode)
    submitted, refetched = [], []
    real_submit, real_refetch = fetch._submit_cached, fetch._refetch
    monkeypatch.setattr(fetch, "_submit_cached",
                        lambda plan, lt: submitted.append(plan) or real_submit(plan, lt))
    monkeypatch.setattr(fetch, "_refetch",
                        lambda misses: refetched.extend(misses) or real_refetch(misses))
    reader = fetch.readers[0]
    real_read = reader.read_cached
    lost = []

    def read_cached(indices, outs, submitted=None):
        if not lost:  # the first stripe read from the cache "went missing" meanwhile
            lost.append(indices[0])
            return [indices[0], *[i for i in real_read(indices[1:], outs[1:], submitted)]]
        return real_read(indices, outs, submitted)

    monkeypatch.setattr(reader, "read_cached", read_cached)
    before = fetch.stats.stripes
    check_exact(epoch(loader), data)
    assert submitted and len(submitted) == loader.stats().windows_fetched // 2
    assert [i for _, i, _ in refetched] == lost
    # every stripe counted once, the refetched one included
    assert fetch.stats.stripes - before == sum(len(r) for p in submitted for r in p.reads)
    loader.close()


def test_zarrs_own_reads_are_cached_after_they_decode(s3, tmp_path):
    server, _, data = s3
    cache = ib.ChunkCache(tmp_path / "cache", max_bytes="1GB")
    src = ib.open_source("s3://data/sharded.zarr", storage_options=server.options())
    loader = ib.build_loader(src, ib.split_by_chunk(src, (1.0,)), "train", batch_size=8,
                             cache=cache, **ONE_EPOCH)
    assert loader.node(ib.AsyncFetchNode).readers[0].mode == "cached-zarr"
    check_exact(epoch(loader), data)
    cache.flush()
    first = loader.stats()
    # epoch 1 can hit only the index of a shard an earlier window of the epoch cached: at
    # most once per chunk read after its shard's first (24 chunks in 6 shards)
    assert first.cache_misses > 0 and cache.entries() > 0
    assert first.cache_hits <= 24 - 6
    # keyed by the endpoint too, as on the decode path: another endpoint's bucket of the
    # same name is another store
    from insitubatch_nodes.io.chunk_cache import _read_entry

    entries = sorted((tmp_path / "cache" / "v1").glob("??/*"))
    assert len(entries) == cache.entries()  # every entry's identity is read below
    for path in entries:
        with open(path, "rb") as f:
            ident = _read_entry(f)[0].decode()
        assert ident.startswith(f"s3://data/sharded.zarr at {server.endpoint}\n"), ident
    check_exact(epoch(loader), data)
    second = loader.stats()
    assert second.cache_misses == first.cache_misses  # epoch 2: all from the cache
    assert second.cache_hits - first.cache_hits == first.cache_misses + first.cache_hits
    assert cache.verify() == 0
    loader.close()


def test_frames_for_device_decode_are_cached(s3, tmp_path):
    from insitubatch_nodes.testing.host_frames import HostFrameDecoder

    server, data, _ = s3
    cache = ib.ChunkCache(tmp_path / "cache", max_bytes="1GB")
    src = open_s3(server)
    loader = ib.build_loader(src, ib.split_by_chunk(src, (1.0,)), "train", batch_size=8,
                             decode=HostFrameDecoder(), cache=cache, **ONE_EPOCH)
    check_exact(epoch(loader), data)
    cache.flush()
    first = loader.stats()
    assert first.cache_hits == 0 and first.cache_misses == len(stored_chunks(server))
    check_exact(epoch(loader), data)
    second = loader.stats()
    assert second.cache_hits == first.cache_misses == second.cache_misses
    loader.close()


def test_local_stores_are_never_cached(tmp_path):
    data = write_store(tmp_path / "local.zarr", VARS)
    cache = ib.ChunkCache(tmp_path / "cache", max_bytes="1GB")
    src = ib.open_source(str(tmp_path / "local.zarr"))
    loader = ib.build_loader(src, ib.split_by_chunk(src, (1.0,)), "train", batch_size=8,
                             cache=cache, **ONE_EPOCH)
    check_exact(epoch(loader), data)
    assert {r.mode for r in loader.node(ib.AsyncFetchNode).readers} == {"local"}
    assert cache.entries() == 0 and loader.stats().cache_hit_ratio is None


@settings(max_examples=15, deadline=None)
@given(sizes=st.lists(st.integers(1, 1000), min_size=1, max_size=40),
       bound=st.integers(4000, 20000))
def test_eviction_keeps_the_bound_and_drops_the_least_recently_used(tmp_path_factory, sizes,
                                                                    bound):
    cache = ib.ChunkCache(tmp_path_factory.mktemp("evict"), max_bytes=bound)
    cache.put("keep", b"k" * 100)
    for i, n in enumerate(sizes):
        assert cache.get("keep") == b"k" * 100  # read before every put: never the oldest
        cache.put(f"e{i}", bytes([i % 256]) * n)
        assert cache.usage() <= bound
    assert cache.get("keep") == b"k" * 100
    # What survives is the newest entries (and the one kept in use), each intact.
    for i, n in enumerate(sizes):
        got = cache.get(f"e{i}")
        assert got is None or got == bytes([i % 256]) * n
    assert cache.get(f"e{len(sizes) - 1}") is not None  # the newest is never evicted


def test_an_entry_larger_than_the_bound_is_not_cached(tmp_path):
    cache = ib.ChunkCache(tmp_path / "c", max_bytes=1000)
    cache.put("big", b"x" * 2000)
    assert cache.get("big") is None and cache.usage() == 0


_WORKER = """
import json, sys
import insitubatch_nodes as ib
opts, cache_dir, out = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
src = ib.open_source("s3://data/era5.zarr", storage_options=opts)
loader = ib.build_loader(src, ib.split_by_chunk(src, (1.0,)), "train", batch_size=8,
                         block_chunks=2, cache=ib.ChunkCache(cache_dir, max_bytes="1GB"),
                         prefetch_next_epoch=False)
seen = []
for _ in range(2):
    seen.append([int(i) for b in loader for i in b["sample_index"]])
json.dump({"seen": seen, "x_sum": [float(b["x"].double().sum()) for b in loader]}, open(out, "w"))
"""


def test_two_processes_share_a_cache_directory(s3, tmp_path):
    server, data, _ = s3
    opts = server.options()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, json.dumps(opts),
                               str(tmp_path / "cache"), str(tmp_path / f"out{i}.json")],
                              env=env) for i in range(2)]
    assert [p.wait(timeout=240) for p in procs] == [0, 0]
    for i in range(2):
        out = json.loads((tmp_path / f"out{i}.json").read_text())
        for seen in out["seen"]:
            assert sorted(seen) == list(range(N))  # every sample exactly once, both epochs
        assert sum(out["x_sum"]) == pytest.approx(float(data["x"].astype(np.float64).sum()))
    cache = ib.ChunkCache(tmp_path / "cache", max_bytes="1GB")
    assert cache.entries() == len(stored_chunks(server)) and cache.verify() == 0
    assert not list((cache.root / "tmp").iterdir())  # no temp file left behind


def test_a_damaged_entry_is_refetched_never_served(s3, tmp_path):
    server, data, _ = s3
    cache, loader = filled(server, data, tmp_path)
    files = sorted(entry_files(cache))
    flipped, cut, emptied = files[0], files[1], files[2]
    raw = bytearray(flipped.read_bytes())
    raw[-1] ^= 0xFF  # a bit flip in the payload: same length, bad checksum
    flipped.write_bytes(bytes(raw))
    cut.write_bytes(cut.read_bytes()[:-5])  # a torn tail
    emptied.write_bytes(b"")
    assert cache.verify() == 3
    misses = loader.stats().cache_misses
    check_exact(epoch(loader), data)  # the damaged entries decoded nothing wrong
    cache.flush()
    assert loader.stats().cache_misses == misses + 3 and cache.corrupt == 3
    assert cache.verify() == 0  # refetched and rewritten
    loader.close()


def _write_repo(path, value):
    import icechunk
    import zarr

    repo = icechunk.Repository.open_or_create(icechunk.local_filesystem_storage(str(path)))
    session = repo.writable_session("main")
    g = zarr.open_group(session.store, mode="a")
    arr = g.create_array("x", shape=(24, 3), chunks=(4, 3), dtype="float32", overwrite=True)
    data = np.full((24, 3), value, dtype="float32") + np.arange(24, dtype="float32")[:, None]
    arr[:] = data
    return session.commit(f"x = {value}"), {"x": data}


def test_a_moved_icechunk_branch_misses(tmp_path):
    pytest.importorskip("icechunk")
    cache = ib.ChunkCache(tmp_path / "cache", max_bytes="1GB")

    def run(src, data):
        loader = ib.build_loader(src, ib.split_by_chunk(src, (1.0,)), "train", batch_size=5,
                                 cache=cache, **ONE_EPOCH)
        check_exact(epoch(loader), data, n=24)
        cache.flush()
        st = loader.stats()
        return st.cache_hits, st.cache_misses

    first, data1 = _write_repo(tmp_path / "repo", 1.0)
    assert run(ib.open_icechunk(str(tmp_path / "repo")), data1) == (0, 6)
    assert run(ib.open_icechunk(str(tmp_path / "repo")), data1) == (6, 0)
    second, data2 = _write_repo(tmp_path / "repo", 500.0)  # the branch moves on
    moved = ib.open_icechunk(str(tmp_path / "repo"))
    assert moved.snapshot_id == second != first
    assert run(moved, data2) == (0, 6)  # new bytes, never the old ones
    pinned = ib.open_icechunk(str(tmp_path / "repo"), snapshot_id=first)
    assert run(pinned, data1) == (6, 0)  # the old snapshot is still cached as itself


def test_credentials_never_reach_cache_paths_or_entries(s3, tmp_path):
    server, data, _ = s3
    cache, loader = filled(server, data, tmp_path)
    loader.close()
    files = list(cache.root.rglob("*"))
    assert len(entry_files(cache)) == len(stored_chunks(server))
    for f in files:
        assert server.secret not in str(f) and server.key_id not in str(f)
        if f.is_file():
            blob = f.read_bytes()
            assert server.secret.encode() not in blob and server.key_id.encode() not in blob
    scope = CacheScope.of("s3://AKIAUSER:s3cr3t@bucket/x.zarr?X-Amz-Signature=abc "
                          "at http://me:pw@10.0.0.1:9000", "snap")
    assert "s3cr3t" not in scope.ident("k") and "abc" not in scope.ident("k")
    assert "pw" not in scope.ident("k") and "10.0.0.1:9000" in scope.ident("k")


def test_the_option_is_checked(tmp_path):
    with pytest.raises(TypeError, match=r"fetch.cache must be an ib.ChunkCache.*'/tmp'"):
        ib.FetchConfig(cache="/tmp")
    with pytest.raises(ValueError, match="cannot read a byte size from 'lots'"):
        ib.ChunkCache(tmp_path, max_bytes="lots")
    cache = ib.ChunkCache(tmp_path, max_bytes="2MB")
    assert ib.LoaderConfig.of(cache=cache, **ONE_EPOCH).fetch.cache is cache
    import pickle

    again = pickle.loads(pickle.dumps(cache))  # workers get their own lock file handle
    again.put("a", b"abc")
    assert cache.get("a") == b"abc" and again.max_bytes == 2_000_000
    cache.put_later("b", memoryview(b"later"))
    cache.flush()
    assert again.get("b") == b"later"
    roomy = ib.ChunkCache(tmp_path / "roomy", max_bytes="1GB")  # put() would take it
    roomy.put_later("huge", bytes(65 << 20))  # more than the writer's backlog: not cached
    roomy.flush()
    assert roomy.skipped == 1 and roomy.get("huge") is None


def test_the_cache_scope_names_the_server_and_account_however_they_were_given(monkeypatch):
    """The endpoint in the options, or in AWS_ENDPOINT_URL (obstore reads it), and an Azure
    account: without them a bucket of one name on MinIO and on AWS (or a container in two
    accounts) shared entries, and the other server's bytes were served."""
    import obstore.store

    from insitubatch_nodes.io.read_paths import store_place

    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT", "AZURE_STORAGE_ACCOUNT_NAME",
                 "AZURE_STORAGE_ACCOUNT", "AZURE_STORAGE_ENDPOINT", "AZURE_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)

    def s3(**kw):
        return obstore.store.from_url("s3://data/x.zarr", region="us-east-1",
                                      skip_signature=True, **kw)

    assert store_place(s3()) == ""
    assert store_place(s3(endpoint="http://minio:9000")) == " at http://minio:9000"
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9999")
    assert store_place(s3()) == " at http://127.0.0.1:9999"
    assert store_place(s3(endpoint="http://minio:9000")) == " at http://minio:9000"
    az = obstore.store.from_url("az://cont/x.zarr", account_name="acct", skip_signature=True)
    assert store_place(az) == " account_name acct"


def test_store_objects_are_cached_apart_and_memory_stores_not_at_all(tmp_path):
    """Two stores handed to ``open_source`` as zarr store objects: each is named by zarr's
    own name for it (its root), so one cache never serves one store's chunks for the
    other's. A memory store (named by an id that another store may get later) is read
    without the cache."""
    import obstore.store
    import zarr.storage

    cache = ib.ChunkCache(tmp_path / "cache", max_bytes="1GB")
    for i, name in enumerate(("a.zarr", "b.zarr")):
        path = tmp_path / name
        data = write_store(path, VARS, seed=i)
        store = zarr.storage.ObjectStore(obstore.store.LocalStore(prefix=str(path)),
                                         read_only=True)
        src = ib.open_source(store)
        assert str(path) in src.url
        with ib.build_loader(src, ib.split_by_chunk(src, (1.0,)), "train", batch_size=8,
                             cache=cache, **ONE_EPOCH) as loader:
            check_exact(epoch(loader), data)
            assert loader.stats().cache_misses > 0 and loader.stats().cache_hits == 0
    memory = zarr.storage.MemoryStore()
    data = write_store(memory, VARS)
    src = ib.open_source(memory)
    with ib.build_loader(src, ib.split_by_chunk(src, (1.0,)), "train", batch_size=8,
                         cache=cache, **ONE_EPOCH) as loader:
        check_exact(epoch(loader), data)
        assert loader.stats().cache_hit_ratio is None


def test_store_objects_known_only_by_their_repr_are_not_cached(tmp_path):
    """An icechunk session's store names itself ``<IcechunkStore object at 0x...>``: an
    address another store gets once this one is freed, with no snapshot. Its chunks are
    read without the cache (open_icechunk names repository and snapshot, and caches)."""
    import icechunk

    cache = ib.ChunkCache(tmp_path / "cache", max_bytes="1GB")
    for i in range(3):
        repo = icechunk.Repository.create(icechunk.in_memory_storage())
        session = repo.writable_session("main")
        data = write_store(session.store, VARS, seed=i)
        src = ib.open_source(session.store)
        assert " object at 0x" in src.url
        with ib.build_loader(src, ib.split_by_chunk(src, (1.0,)), "train", batch_size=8,
                             cache=cache, **ONE_EPOCH) as loader:
            check_exact(epoch(loader), data)
            assert loader.stats().cache_hit_ratio is None
    assert cache.entries() == 0
