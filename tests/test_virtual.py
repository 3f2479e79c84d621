"""NetCDF4/HDF5 files through virtual Zarr: virtualizarr writes references into an icechunk
repository, ``open_icechunk(..., virtual_chunk_access=...)`` trains from it, reading the byte
ranges of the original files (HDF5's shuffle + zlib decoded by our own decoder)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
import zarr
from hypothesis import given, settings
from hypothesis import strategies as st
from zarr.codecs import BytesCodec
from zarr.codecs.numcodecs import Shuffle, Zlib

import insitubatch_nodes as ib
from insitubatch_nodes.inspection import inspect_source
from insitubatch_nodes.io.decode import decoder_for

STEPS = (8, 8, 6)  # time steps per file: the time axis split across three files


def write_netcdf(folder: Path, t2m_chunks: tuple[int, ...], z_chunks: tuple[int, ...]
                 ) -> list[Path]:
    """Three NetCDF4 files, shuffle + zlib: ``t2m`` float32 chunked inside a sample (an edge
    chunk along lon), ``z`` float64 with ``level`` and its own chunks, a NaN in ``t2m``."""
    rng = np.random.default_rng(0)
    paths, start = [], 0
    for i, n in enumerate(STEPS):
        steps = np.arange(start, start + n, dtype="float32")[:, None, None]
        t2m = rng.standard_normal((n, 4, 5)).astype("float32") + steps
        if i == 1:
            t2m[3, 2, 4] = np.nan
        z = rng.standard_normal((n, 3, 4)) * 1000
        ds = xr.Dataset(
            {"t2m": (("time", "lat", "lon"), t2m), "z": (("time", "level", "lat"), z)},
            coords={"time": np.datetime64("2020-01-01", "ns") + np.arange(start, start + n)
                    * np.timedelta64(6, "h"),
                    "lat": np.linspace(-60, 60, 4), "lon": np.arange(5.0),
                    "level": np.array([500, 700, 850])})
        ds.time.encoding["units"] = "hours since 2020-01-01"
        path = folder / f"era_{i}.nc"
        ds.to_netcdf(path, engine="h5netcdf", encoding={
            "t2m": {"zlib": True, "shuffle": True, "complevel": 4, "chunksizes": t2m_chunks},
            "z": {"zlib": True, "shuffle": True, "complevel": 1, "chunksizes": z_chunks}})
        paths.append(path)
        start += n
    return paths


def virtualize(paths: list[Path], data_dir: Path, repo_dir: Path) -> str:
    """The documented flow: virtualizarr references in an icechunk repository whose virtual
    chunk container is the folder of the files. Returns the container's url prefix."""
    import icechunk
    from obspec_utils.registry import ObjectStoreRegistry
    from obstore.store import LocalStore
    from virtualizarr import open_virtual_mfdataset
    from virtualizarr.parsers import HDFParser

    prefix = f"file://{data_dir}/"
    registry = ObjectStoreRegistry({"file://": LocalStore()})
    vds = open_virtual_mfdataset([f"file://{p}" for p in paths], registry=registry,
                                 parser=HDFParser(), concat_dim="time", combine="nested")
    config = icechunk.RepositoryConfig.default()
    config.set_virtual_chunk_container(
        icechunk.VirtualChunkContainer(prefix, icechunk.local_filesystem_store(str(data_dir))))
    repo = icechunk.Repository.create(icechunk.local_filesystem_storage(str(repo_dir)), config,
                                      authorize_virtual_chunk_access={prefix: None})
    session = repo.writable_session("main")
    vds.vz.to_icechunk(session.store)
    session.commit("virtual references to the NetCDF files")
    return prefix


def on_files(paths: list[Path]) -> xr.Dataset:
    """What xarray reads from the files themselves (dask-free open_mfdataset)."""
    return xr.concat([xr.open_dataset(p, engine="h5netcdf").load() for p in paths], "time")


def messages(exc: BaseException | None) -> str:
    """An error's text with the errors it was raised from, type names included (a
    PermissionError subclass, such as ``ib.StoreAccessError``, as "PermissionError" too)."""
    out = []
    while exc is not None:
        kind = type(exc).__name__
        if isinstance(exc, PermissionError) and kind != "PermissionError":
            kind += " (PermissionError)"
        out.append(f"{kind}: {exc}")
        exc = exc.__cause__ or exc.__context__
    return "\n".join(out)


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(f"u{a.dtype.itemsize}")


@pytest.fixture(params=["chunked", "one-sample"])
def archive(request, tmp_path):
    """Files and their repository: chunks of 2 steps (window path) or of 1 step (decoded in
    place, straight into the batch rows)."""
    for name in ("h5netcdf", "icechunk", "virtualizarr"):
        pytest.importorskip(name)
    data = tmp_path / "netcdf"
    data.mkdir()
    if request.param == "chunked":
        paths = write_netcdf(data, t2m_chunks=(2, 4, 3), z_chunks=(2, 3, 4))
    else:
        paths = write_netcdf(data, t2m_chunks=(1, 4, 5), z_chunks=(1, 3, 4))
    prefix = virtualize(paths, data, tmp_path / "repo")
    return paths, prefix, tmp_path / "repo"


@pytest.mark.parametrize("workers", [0, 2], ids=["threads", "workers"])
def test_every_sample_once_and_bit_identical_to_the_files(archive, workers):
    """Through decode threads, or worker processes that each open the repository's
    session (its virtual chunk containers and credentials) themselves."""
    paths, prefix, repo = archive
    src = ib.open_icechunk(str(repo), virtual_chunk_access={prefix: None})
    assert set(src.names) == {"t2m", "z"} and src.n_samples == sum(STEPS)
    report = inspect_source(src, quality=None)
    for v in report.variables:  # our decoder takes HDF5's chain; reads go through icechunk
        assert v.codecs == "bytes -> shuffle -> zlib" and v.fast_decoder is not None
        assert v.read_mode == "zarr-store"
    ref = on_files(paths)
    manifest = ib.split_by_chunk(src, (1.0,))
    loader = ib.build_loader(src, manifest, "train", batch_size=5, block_chunks=3, seed=3,
                             workers=workers, in_place=True if workers else None)
    batches = [{k: v.numpy().copy() for k, v in b.items()} for b in loader]
    loader.shutdown()
    seen = np.concatenate([b["sample_index"] for b in batches])
    assert sorted(seen.tolist()) == list(range(sum(STEPS)))
    assert not np.array_equal(seen, np.sort(seen))  # shuffled, not read in file order
    times = ref["time"].values.astype("datetime64[ns]").astype(np.int64)
    for b in batches:
        idx = b["sample_index"]
        for name in ("t2m", "z"):
            want = ref[name].values[idx]
            assert b[name].dtype == want.dtype
            np.testing.assert_array_equal(bits(b[name]), bits(want))
        np.testing.assert_array_equal(b["time"], times[idx])
    # the one NaN the files hold came through the loader (bit for bit, above)
    assert np.isnan(ref["t2m"].values).sum() == 1
    assert sum(int(np.isnan(b["t2m"]).sum()) for b in batches) == 1


def test_zarr_reads_the_same_bytes(archive):
    """Our decoder against zarr's own decoding of the same virtual chunks."""
    import icechunk

    paths, prefix, repo = archive
    opened = icechunk.Repository.open(icechunk.local_filesystem_storage(str(repo)),
                                      authorize_virtual_chunk_access={prefix: None})
    group = zarr.open_group(opened.readonly_session("main").store, mode="r")
    src = ib.open_icechunk(str(repo), virtual_chunk_access={prefix: None})
    manifest = ib.split_by_chunk(src, (1.0,))
    loader = ib.build_loader(src, manifest, "train", batch_size=4, seed=1)
    for b in loader:
        idx = b["sample_index"].numpy()
        for name in ("t2m", "z"):
            np.testing.assert_array_equal(bits(b[name].numpy()), bits(group[name][:][idx]))


def test_virtual_chunks_without_access_name_the_prefix(archive, tmp_path):
    paths, prefix, repo = archive
    src = ib.open_icechunk(str(repo))  # metadata and inlined coordinates still open
    manifest = ib.split_by_chunk(src, (1.0,))
    loader = ib.build_loader(src, manifest, "train", batch_size=4)
    with pytest.raises(OSError) as info:  # a PermissionError, maybe inside the read's error
        next(iter(loader))
    text = messages(info.value)
    assert "PermissionError" in text
    assert f"virtual_chunk_access={{{prefix!r}: None}}" in text
    assert "open_icechunk" in text and "is a virtual reference into" in text

    with pytest.raises(ValueError, match=r"no virtual chunk container.*containers: \["):
        ib.open_icechunk(str(repo), virtual_chunk_access={f"file://{tmp_path}/elsewhere/": None})
    with pytest.raises(TypeError, match="not icechunk credentials"):
        ib.open_icechunk(str(repo), virtual_chunk_access={prefix: {"secret_access_key": "s3cr3t"}})


def test_a_repository_object_is_authorized_too(archive):
    import icechunk

    paths, prefix, repo_dir = archive
    repo = icechunk.Repository.open(icechunk.local_filesystem_storage(str(repo_dir)))
    src = ib.open_icechunk(repo, ["t2m"], virtual_chunk_access={prefix: None})
    manifest = ib.split_by_chunk(src, (1.0,))
    batches = list(ib.build_loader(src, manifest, "train", batch_size=7))
    ref = on_files(paths)["t2m"].values
    for b in batches:
        np.testing.assert_array_equal(bits(b["t2m"].numpy()), bits(ref[b["sample_index"].numpy()]))
    assert sum(len(b["sample_index"]) for b in batches) == sum(STEPS)


# -- HDF5's shuffle + zlib on our own decode path ---------------------------------------------

@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from(["u1", "i2", "f4", "f8", "c8"]), big=st.booleans(),
       shape=st.tuples(st.integers(1, 9), st.integers(1, 7)),
       chunks=st.tuples(st.integers(1, 4), st.integers(1, 5)),
       elementsize=st.sampled_from(["itemsize", None]), level=st.integers(0, 9),
       seed=st.integers(0, 2**16))
def test_shuffle_zlib_decodes_as_zarr_does(dtype, big, shape, chunks, elementsize, level,
                                           seed):
    """Every stored chunk (edge chunks, 1-byte items, big-endian items, a shuffle without its
    element size) decodes bit for bit to what zarr reads."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 255, (*shape, np.dtype(dtype).itemsize), dtype="u1")
    data = np.ascontiguousarray(data).view(dtype).reshape(shape)
    config = {} if elementsize is None else {"elementsize": np.dtype(dtype).itemsize}
    with tempfile.TemporaryDirectory() as tmp:
        arr = zarr.create_array(tmp, shape=shape, chunks=chunks, dtype=dtype,
                                serializer=BytesCodec(endian="big" if big else "little"),
                                compressors=[Shuffle(**config), Zlib(level=level)],
                                # every chunk stored, even one equal to the fill value
                                config={"write_empty_chunks": True})
        arr[:] = data
        decoder = decoder_for(arr)
        assert decoder is not None and decoder.chain == "bytes -> shuffle -> zlib"
        for i in range(-(-shape[0] // chunks[0])):
            for j in range(-(-shape[1] // chunks[1])):
                out = np.empty(chunks, dtype=np.dtype(dtype).newbyteorder("="))
                decoder.decode_into(Path(tmp, "c", str(i), str(j)).read_bytes(), out)
                rows = slice(i * chunks[0], (i + 1) * chunks[0])
                cols = slice(j * chunks[1], (j + 1) * chunks[1])
                want = arr[rows, cols]
                got = out[: want.shape[0], : want.shape[1]]
                np.testing.assert_array_equal(bits(got), bits(want.astype(got.dtype)))


def test_a_shuffled_chunk_of_the_wrong_size_is_refused(tmp_path):
    """numcodecs' unshuffle writes as many bytes as it gets: a short or long chunk is a
    decode error, never a write past the buffer."""
    import zlib

    arr = zarr.create_array(tmp_path / "a", shape=(4, 4), chunks=(4, 4), dtype="f8",
                            compressors=[Shuffle(elementsize=8), Zlib(level=1)])
    decoder = decoder_for(arr)
    out = np.zeros((4, 4))
    for n in (8 * 15, 8 * 17):
        with pytest.raises(ValueError, match=f"shuffled chunk has {n} bytes, expected 128"):
            decoder.decode_into(zlib.compress(bytes(n)), out)
    assert not out.any()


# -- files in object storage: credentials for the container, never in a message ---------------

def test_files_on_s3_with_credentials_that_never_leak(tmp_path, caplog):
    """NetCDF files in a bucket (moto, with real signature checks): the container's
    credentials go to icechunk only; wrong ones fail without showing the secret."""
    import json
    import logging

    for name in ("h5netcdf", "icechunk", "virtualizarr", "moto"):
        pytest.importorskip(name)
    import icechunk
    from obspec_utils.registry import ObjectStoreRegistry
    from obstore.store import S3Store
    from virtualizarr import open_virtual_mfdataset
    from virtualizarr.parsers import HDFParser

    from insitubatch_nodes.testing.s3server import REGION, serving

    data = tmp_path / "netcdf"
    data.mkdir()
    paths = write_netcdf(data, t2m_chunks=(2, 4, 3), z_chunks=(2, 3, 4))
    with serving(tmp_path, "archive", {"nc": data}) as server:
        store = S3Store("archive", endpoint=server.endpoint, region=REGION,
                        access_key_id=server.key_id, secret_access_key=server.secret,
                        client_options={"allow_http": True})
        vds = open_virtual_mfdataset([f"s3://archive/nc/{p.name}" for p in paths],
                                     registry=ObjectStoreRegistry({"s3://archive": store}),
                                     parser=HDFParser(), concat_dim="time", combine="nested")
        prefix = "s3://archive/nc/"
        config = icechunk.RepositoryConfig.default()
        config.set_virtual_chunk_container(icechunk.VirtualChunkContainer(prefix, icechunk.s3_store(
            region=REGION, endpoint_url=server.endpoint, allow_http=True, s3_compatible=True,
            force_path_style=True)))
        repo = icechunk.Repository.create(icechunk.local_filesystem_storage(str(tmp_path / "r")),
                                          config)
        session = repo.writable_session("main")
        vds.vz.to_icechunk(session.store)
        session.commit("virtual references into the bucket")

        caplog.set_level(logging.DEBUG)
        creds = icechunk.s3_credentials(access_key_id=server.key_id,
                                        secret_access_key=server.secret)
        src = ib.open_icechunk(str(tmp_path / "r"), virtual_chunk_access={prefix: creds})
        manifest = ib.split_by_chunk(src, (1.0,))
        loader = ib.build_loader(src, manifest, "train", batch_size=6, block_chunks=4)
        ref = on_files(paths)
        batches = list(loader)
        seen = np.concatenate([b["sample_index"].numpy() for b in batches])
        assert sorted(seen.tolist()) == list(range(sum(STEPS)))
        for b in batches:
            idx = b["sample_index"].numpy()
            for name in ("t2m", "z"):
                np.testing.assert_array_equal(bits(b[name].numpy()), bits(ref[name].values[idx]))

        wrong = icechunk.s3_credentials(access_key_id=server.key_id,
                                        secret_access_key="not-" + server.secret)
        bad = ib.open_icechunk(str(tmp_path / "r"), virtual_chunk_access={prefix: wrong})
        bad_loader = ib.build_loader(bad, manifest, "train", batch_size=6,
                                     retry=ib.RetryPolicy(attempts=1))
        with pytest.raises(OSError) as info:  # a PermissionError, maybe inside the read's
            next(iter(bad_loader))
        outputs = [repr(src), src.url, json.dumps(manifest.to_dict()),
                   json.dumps(loader.state_dict()), repr(bad), messages(info.value),
                   caplog.text]
        for i, text in enumerate(outputs):
            assert server.secret not in text, i
        text = messages(info.value)
        assert "PermissionError" in text and "SignatureDoesNotMatch" in text
        assert f"virtual_chunk_access for {prefix}" in text
