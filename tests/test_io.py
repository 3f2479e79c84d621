"""The fast read path must agree with zarr for every codec chain, and fall back otherwise."""

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numcodecs
import numpy as np
import pytest
import zarr
import zarr.codecs as zc
from hypothesis import given, settings
from hypothesis import strategies as st
from stores import Var, write_store

import insitubatch_nodes as ib
from insitubatch_nodes.io.reader import StripeReader


def read_all(src):
    """Every stripe of every variable through StripeReader, stitched back together."""
    pool = ThreadPoolExecutor(2)
    loop = asyncio.new_event_loop()
    out = {}
    readers = []
    try:
        for arr, g in zip(src.arrays, src.variables, strict=True):
            r = StripeReader(arr, g, src.url)
            readers.append(r)
            parts = []
            for i in range(g.n_sample_chunks):
                buf = np.full(g.stripe_shape, 77, dtype=g.dtype)
                loop.run_until_complete(r.read(i, buf, loop, pool))
                parts.append(buf)
            out[g.name] = np.concatenate(parts)[: g.shape[0]]
    finally:
        loop.close()
        pool.shutdown()
    return out, readers


CASES = {
    "raw": Var("a", (37, 5, 6), (8, 5, 6), compressors=None),
    "blosc": Var("a", (37, 5, 6), (8, 5, 6), compressors=zc.BloscCodec(cname="lz4")),
    "zstd-checksum": Var("a", (37, 5, 6), (8, 5, 6), compressors=zc.ZstdCodec(checksum=True)),
    "gzip": Var("a", (37, 5, 6), (8, 5, 6), compressors=zc.GzipCodec()),
    "crc32c": Var("a", (37, 5, 6), (8, 5, 6), compressors=(zc.ZstdCodec(), zc.Crc32cCodec())),
    "inner-chunks-padded": Var("a", (37, 5, 6), (8, 2, 4)),
    "float16": Var("a", (37, 5), (8, 5), dtype="float16"),
    "int32": Var("a", (37, 5), (8, 5), dtype="int32"),
    "uint8": Var("a", (37, 5), (8, 5), dtype="uint8"),
    "bool": Var("a", (37, 5), (8, 5), dtype="bool"),
    "one-sample-per-chunk": Var("a", (9, 4, 4), (1, 4, 4)),
    "big-endian": Var("a", (37, 5), (8, 5), dtype="float64",
                      extra={"serializer": zc.BytesCodec(endian="big")}),
    "v2-zstd": Var("a", (37, 5), (8, 5), zarr_format=2),
    "sharded": Var("a", (37, 5, 6), (4, 5, 3), shards=(8, 5, 6)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_stripes_equal_zarr(store_factory, case):
    path, data = store_factory([CASES[case]])
    src = ib.open_source(path)
    got, readers = read_all(src)
    np.testing.assert_array_equal(got["a"], zarr.open_array(path / "a")[:])
    np.testing.assert_array_equal(got["a"], data["a"])
    want_mode = "zarr" if case == "sharded" else "local"
    assert readers[0].mode == want_mode


def test_missing_chunks_read_as_fill_value(tmp_path):
    g = zarr.open_group(tmp_path / "s.zarr", mode="w")
    a = g.create_array("a", shape=(30, 4), chunks=(8, 2), dtype="int32", fill_value=-7)
    a[0:8] = 1  # chunks (1, *) and (2, *) and (3, *) never written
    a[16:24, 2:4] = 5
    src = ib.open_source(tmp_path / "s.zarr")
    got, _ = read_all(src)
    np.testing.assert_array_equal(got["a"], a[:])


def test_memory_store_goes_through_zarr_store_api():
    store = zarr.storage.MemoryStore()
    g = zarr.open_group(store, mode="w")
    g.create_array("a", shape=(20, 3), chunks=(8, 3), dtype="float32")[:] = \
        np.arange(60, dtype="float32").reshape(20, 3)
    src = ib.open_source(g)
    got, readers = read_all(src)
    assert readers[0].mode == "zarr-store"
    np.testing.assert_array_equal(got["a"], np.arange(60, dtype="float32").reshape(20, 3))


@pytest.mark.parametrize("case,mode,groups", [("raw", "local", True),
                                              ("sharded", "zarr", False),
                                              ("memory", "zarr-store", False)])
def test_read_paths_group_only_local_files(store_factory, case, mode, groups):
    """One read path per reader: its name is ``mode``, and only local files read several
    stripes in one pool task; ``read_group`` fills the same stripes either way."""
    if case == "memory":
        g = zarr.open_group(zarr.storage.MemoryStore(), mode="w")
        g.create_array("a", shape=(37, 5), chunks=(8, 5), dtype="float32")[:] = \
            np.arange(185, dtype="float32").reshape(37, 5)
        src, want = ib.open_source(g), np.arange(185, dtype="float32").reshape(37, 5)
    else:
        path, data = store_factory([CASES[case]])
        src, want = ib.open_source(path), data["a"]
    geom = src.variables[0]
    reader = StripeReader(src.arrays[0], geom, src.url)
    assert (reader.mode, reader.groups_reads) == (mode, groups)
    pool = ThreadPoolExecutor(2)
    loop = asyncio.new_event_loop()
    try:
        idx = list(range(geom.n_sample_chunks))
        outs = [np.full(geom.stripe_shape, 77, dtype=geom.dtype) for _ in idx]
        attempts = loop.run_until_complete(reader.read_group(idx, outs, loop, pool))
    finally:
        loop.close()
        pool.shutdown()
    assert attempts == len(idx)
    np.testing.assert_array_equal(np.concatenate(outs)[: geom.shape[0]], want)
    if not groups:
        with pytest.raises(TypeError, match="not from local files"):
            reader.read_local(0, outs[0])


def test_corrupt_chunk_raises_an_error_naming_it(tmp_path):
    from insitubatch_nodes.io.retry import ChunkDecodeError, CorruptChunkError

    write_store(tmp_path / "s.zarr", [Var("a", (16, 4), (8, 4))])
    (tmp_path / "s.zarr" / "a" / "c" / "1" / "0").write_bytes(b"not zstd at all")
    src = ib.open_source(tmp_path / "s.zarr")
    with pytest.raises(CorruptChunkError, match=r"chunk 'a/c/1/0' of variable 'a' in file://.*"
                       r"did not decode in 1 attempt .*Zstd decompression error") as info:
        read_all(src)
    assert isinstance(info.value.__cause__, ChunkDecodeError)
    assert isinstance(info.value.__cause__.__cause__, RuntimeError)  # numcodecs' own error


def test_truncated_blosc_frame_is_an_error_not_stale_data():
    """Blosc trusts its header's size: a short body must be refused before decoding."""
    import numcodecs

    from insitubatch_nodes.io.decode import ChunkDecoder

    x = np.arange(4000, dtype="f4")
    frame = numcodecs.Blosc(cname="zstd").encode(x)
    dec = ChunkDecoder((numcodecs.Blosc(),), False, "bytes -> blosc")
    out = np.empty_like(x)
    dec.decode_into(frame, out)
    np.testing.assert_array_equal(out, x)
    for cut in (10, len(frame) // 2, len(frame) - 1):
        with pytest.raises(ValueError, match="blosc frame"):
            dec.decode_into(frame[:cut], out)
    with pytest.raises(ValueError, match="expected 16"):
        dec.decode_into(numcodecs.Blosc().encode(np.arange(2, dtype="f4")), np.empty(2, "f8"))


@pytest.mark.parametrize("codec,fmt", [("zstd", 3), ("zstd", 2), ("gzip", 3), ("gzip", 2),
                                       ("lz4", 2)])
def test_a_chunk_that_decodes_short_is_refused_not_padded_with_old_bytes(tmp_path, codec,
                                                                          fmt):
    """A chunk that is a valid stream of the codec but decodes to fewer bytes than the chunk
    (metadata rewritten without its chunks): zarr raises; so do we, naming the chunk, where
    numcodecs alone would leave the buffer's older bytes in the rest of the chunk."""
    import numcodecs

    from insitubatch_nodes.io.retry import CorruptChunkError

    nc = {"zstd": numcodecs.Zstd(), "gzip": numcodecs.GZip(), "lz4": numcodecs.LZ4()}[codec]
    v3 = {"zstd": zc.ZstdCodec(), "gzip": zc.GzipCodec()}.get(codec)
    path = tmp_path / "s.zarr"
    write_store(path, [Var("a", (16, 4), (8, 4), zarr_format=fmt,
                           compressors=nc if fmt == 2 else v3)])
    key = "a/1.0" if fmt == 2 else "a/c/1/0"
    (path / key).write_bytes(nc.encode(np.full(16, 5.0, "f4").tobytes()))  # half a chunk
    with pytest.raises(ValueError):
        zarr.open_array(path / "a")[:]
    with pytest.raises(CorruptChunkError, match=f"chunk '{key}' of variable 'a'"):
        read_all(ib.open_source(path))


def test_a_corrupt_gzip_chunk_on_zarrs_path_is_corrupt_not_transient(tmp_path):
    """zarr decodes what we do not (here a Fortran-order v2 array); gzip's BadGzipFile is an
    OSError, which must not read as a store error to retry for the network's sake."""
    from insitubatch_nodes.io.retry import CorruptChunkError

    path = tmp_path / "f.zarr"
    g = zarr.open_group(path, mode="w", zarr_format=2)
    g.create_array("a", shape=(16, 4), chunks=(8, 4), dtype="f4", order="F",
                   compressors=numcodecs.GZip())[:] = 1
    (path / "a" / "1.0").write_bytes(b"\x1f\x8b" + b"garbage" * 5)
    src = ib.open_source(path)
    with pytest.raises(CorruptChunkError, match=r"chunk 'a/1.0' of variable 'a'.*Unknown "
                       r"compression method") as info:
        read_all(src)
    assert info.value.__cause__ is not None


@pytest.mark.parametrize("chunks", [(4, 5, 6), (4, 5, 3)])
def test_a_damaged_shard_is_named_by_its_own_key(tmp_path, chunks):
    """zarr's chunk grid is the shard grid: the error names the stored shard, not a key
    made of inner-chunk coordinates (another, healthy shard, or no object at all)."""
    from insitubatch_nodes.io.retry import CorruptChunkError

    path = tmp_path / "s.zarr"
    write_store(path, [Var("a", (37, 5, 6), chunks, shards=(8, 5, 6))])
    shard = path / "a" / "c" / "1" / "0" / "0"  # rows 8..16
    raw = bytearray(shard.read_bytes())
    raw[:20] = b"\xff" * 20
    shard.write_bytes(bytes(raw))
    with pytest.raises(CorruptChunkError, match=r"^shard 'a/c/1/0/0' of variable 'a'") as info:
        read_all(ib.open_source(path))
    assert info.value.key == "a/c/1/0/0"


def test_a_zstd_chunk_of_several_frames_decodes():
    """Concatenated frames are valid zstd (streaming and multithreaded writers make them):
    the first frame's size is not the chunk's, and that is no damage."""
    from insitubatch_nodes.io.decode import ChunkDecoder

    x = np.arange(1000, dtype="f4")
    two = numcodecs.Zstd().encode(x[:300]) + numcodecs.Zstd().encode(x[300:])
    out = np.empty_like(x)
    ChunkDecoder((numcodecs.Zstd(),), False, "zstd").decode_into(two, out)
    np.testing.assert_array_equal(out, x)


@pytest.mark.parametrize("n", [0, 1, 255, 256, 257, 65535, 65791, 65792, 70000])
@pytest.mark.parametrize("level", [1, 19])
def test_zstd_frame_header_states_the_decoded_size(n, level):
    from insitubatch_nodes.io.decode import _zstd_content_size

    frame = numcodecs.Zstd(level=level).encode(np.arange(n, dtype="u1"))
    assert _zstd_content_size(frame) == n
    assert _zstd_content_size(b"not zstd") is None


def test_local_reads_grow_the_thread_buffer_and_keep_what_was_read(tmp_path):
    """``LocalFiles.get_scratch`` reads into a per-thread buffer sized by the largest chunk
    so far: a larger file (and one exactly the buffer's size) must come back whole."""
    import threading

    from insitubatch_nodes.io.read_paths import LocalFiles

    rng = np.random.default_rng(0)
    sizes = [10, 1 << 16, (1 << 16) + 1, 300_000, 300_000, 5, 700_001]
    blobs = {f"c/{i}": rng.integers(0, 256, n, dtype=np.uint8).tobytes()
             for i, n in enumerate(sizes)}
    (tmp_path / "c").mkdir()
    for key, blob in blobs.items():
        (tmp_path / key).write_bytes(blob)
    files = LocalFiles(str(tmp_path))
    got: dict[str, bytes | None] = {}

    def read_all() -> None:  # a fresh thread: its buffer starts small
        for key in blobs:
            view = files.get_scratch(key)
            got[key] = None if view is None else bytes(view)
        got["missing"] = files.get_scratch("c/none")

    t = threading.Thread(target=read_all)
    t.start()
    t.join()
    assert got.pop("missing") is None
    assert got == blobs


def test_chunks_that_cover_part_of_a_stripe_decode_without_fresh_memory(tmp_path):
    """A chunk covering only part of its stripe (inner chunks, an edge chunk past the
    array's end) decodes into a per-thread buffer, then into place: a fresh chunk-sized
    array per chunk was a fresh mapping, page-faulted in every time."""
    import tracemalloc

    data = write_store(tmp_path / "s.zarr", [Var("x", (6, 300, 500), (4, 128, 256))])["x"]
    src = ib.open_source(tmp_path / "s.zarr")
    reader = StripeReader(src.arrays[0], src.variables[0], src.url)
    chunk_bytes = 4 * 128 * 256 * 4
    for index in (0, 1, 0):  # stripe 1 is the edge: 2 of its chunk's 4 samples exist
        out = np.zeros(src.variables[0].stripe_shape, "f4")
        tracemalloc.start()
        reader.read_local(index, out)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        np.testing.assert_array_equal(out[: len(data[4 * index:4 * index + 4])],
                                      data[4 * index:4 * index + 4])
    assert peak < chunk_bytes // 4, peak  # the last read: no chunk-sized allocation


@pytest.mark.parametrize("codec", ["gzip", "zlib"])
def test_inflate_takes_libdeflate_where_installed_and_numcodecs_decides_the_rest(
        tmp_path, codec, monkeypatch):
    """gzip and zlib chunks decode with imagecodecs' libdeflate when it is installed; what
    it cannot decode whole (a gzip stream of two members, bytes that do not inflate) goes to
    numcodecs, so the result and the errors are numcodecs' either way."""
    import gzip
    import sys

    import numcodecs
    from zarr.codecs.numcodecs import Zlib

    from insitubatch_nodes.io.decode import decoder_for
    from insitubatch_nodes.io.retry import ChunkDecodeError

    pytest.importorskip("imagecodecs")
    x = np.linspace(0, 1, 3000, dtype="f4").reshape(30, 100)
    arr = zarr.create_array(tmp_path / "a.zarr", shape=x.shape, chunks=x.shape, dtype="f4",
                            compressors=zc.GzipCodec(level=3) if codec == "gzip"
                            else Zlib(level=3))
    arr[:] = x
    enc = numcodecs.GZip(level=3) if codec == "gzip" else numcodecs.Zlib(level=3)
    dec = decoder_for(arr)
    assert dec is not None and any(dec.fast)
    out = np.empty_like(x)
    dec.decode_into(enc.encode(x), out)
    np.testing.assert_array_equal(out, x)
    if codec == "gzip":  # two members: a valid gzip stream libdeflate reads only half of
        half = x.size // 2
        two = (gzip.compress(x.reshape(-1)[:half].tobytes())
               + gzip.compress(x.reshape(-1)[half:].tobytes()))
        out[:] = 0
        dec.decode_into(two, out)
        np.testing.assert_array_equal(out, x)
    with pytest.raises(ChunkDecodeError):
        dec.decode_into(enc.encode(x)[:-20], out)
    monkeypatch.setitem(sys.modules, "imagecodecs", None)  # not installed: numcodecs alone
    slow = decoder_for(arr)
    assert slow is not None and not any(slow.fast)
    out[:] = 0
    slow.decode_into(enc.encode(x), out)
    np.testing.assert_array_equal(out, x)


def test_hdf5_shuffle_over_zlib_decodes_chunks_of_any_size_one_after_another(tmp_path):
    """The inflate under HDF5's shuffle goes to a buffer each decode thread reuses: chunks of
    different sizes (edge chunks, other variables) decoded in turn on one thread each come
    out as numcodecs decodes them, whichever came before."""
    import numcodecs
    from zarr.codecs.numcodecs import Shuffle, Zlib

    from insitubatch_nodes.io.decode import decoder_for

    pytest.importorskip("imagecodecs")
    rng = np.random.default_rng(0)
    cases = []
    for shape, dtype in [((40, 50), "f4"), ((3, 7), "f8"), ((64, 64), "i2"), ((5,), "f4")]:
        x = rng.normal(size=shape).astype(dtype)
        arr = zarr.create_array(tmp_path / f"{dtype}{x.size}.zarr", shape=shape, chunks=shape,
                                dtype=dtype,
                                compressors=[Shuffle(elementsize=x.itemsize), Zlib(level=3)])
        arr[:] = x
        dec = decoder_for(arr)
        assert dec is not None and any(dec.fast)
        stored = (tmp_path / f"{dtype}{x.size}.zarr" / "c" / "/".join("0" * x.ndim)).read_bytes()
        cases.append((dec, stored, x))
    for dec, stored, x in cases + cases[::-1]:
        out = np.empty_like(x)
        dec.decode_into(stored, out)
        np.testing.assert_array_equal(out, x)
        ref = numcodecs.Shuffle(x.itemsize).decode(numcodecs.Zlib().decode(stored))
        np.testing.assert_array_equal(out.reshape(-1).view(np.uint8),
                                      np.frombuffer(ref, np.uint8))


_BLOSC_CASES = st.tuples(st.sampled_from(["zstd", "lz4", "lz4hc", "blosclz", "zlib"]),
                         st.sampled_from([0, 1, 2]),  # no shuffle, byte, bit
                         st.sampled_from(["u1", "<i2", "<f4", "<f8"]),
                         st.integers(1, 70_000), st.sampled_from([0, 256, 65536]))


@settings(max_examples=60, deadline=None)
@given(case=_BLOSC_CASES, seed=st.integers(0, 2**16))
def test_blosc_frames_decode_with_c_blosc2_as_numcodecs_does(case, seed):
    """Where python-blosc2 is installed, blosc chunks decode with c-blosc2 on a context per
    thread; every codec, shuffle, type size, length and block size numcodecs writes comes
    out as numcodecs decodes it, and a frame cut short, padded or of another chunk's size is
    an error either way."""
    from insitubatch_nodes.io import blosc2_lib
    from insitubatch_nodes.io.decode import ChunkDecoder
    from insitubatch_nodes.io.retry import ChunkDecodeError

    if blosc2_lib.load() is None:
        pytest.skip("python-blosc2 not installed")
    cname, shuffle, dtype, n, blocksize = case
    x = (np.random.default_rng(seed).normal(size=n) * 1000).astype(dtype)
    frame = numcodecs.Blosc(cname=cname, clevel=5, shuffle=shuffle,
                            blocksize=blocksize).encode(x)
    dec = ChunkDecoder((numcodecs.Blosc(),), False, "blosc",
                       (blosc2_lib.load().decompress_into,), "c-blosc2")
    out = np.full_like(x, 7)
    dec.decode_into(frame, out)
    np.testing.assert_array_equal(out.view(np.uint8), x.view(np.uint8))
    halves = [frame[: len(frame) // 2]] if len(frame) > 32 else []
    for bad in [frame[:-1], frame + b"\0", *halves]:
        with pytest.raises(ChunkDecodeError):
            dec.decode_into(bad, out)
    with pytest.raises(ChunkDecodeError):
        dec.decode_into(frame, np.empty(n - 1, dtype))


def test_blosc_decoder_takes_c_blosc2_where_installed_and_numcodecs_otherwise(
        tmp_path, monkeypatch):
    """A v2 blosc array's decoder names the library that decodes it (``inspect`` shows it):
    c-blosc2 with python-blosc2 installed, numcodecs without; the chunks read the same, and
    frames damaged in their body fail the same way through both."""
    from insitubatch_nodes.io import blosc2_lib
    from insitubatch_nodes.io.decode import decoder_for
    from insitubatch_nodes.io.retry import ChunkDecodeError

    x = np.linspace(0, 1, 181 * 36, dtype="f4").reshape(181, 36)
    arr = zarr.create_array(tmp_path / "a.zarr", shape=x.shape, chunks=x.shape, dtype="f4",
                            zarr_format=2, compressors=numcodecs.Blosc("zstd", 5, 1))
    arr[:] = x
    frame = (tmp_path / "a.zarr" / "0.0").read_bytes()
    damaged = bytearray(frame)
    damaged[40:48] = b"\xff" * 8  # inside the first block's stream
    decoders = {}
    if blosc2_lib.load() is not None:
        decoders["c-blosc2"] = decoder_for(arr)
    monkeypatch.setattr(blosc2_lib, "_loaded", [None])  # not installed
    decoders["numcodecs"] = decoder_for(arr)
    errors = {}
    for name, dec in decoders.items():
        assert dec is not None and dec.libraries.startswith(name)
        out = np.zeros_like(x)
        dec.decode_into(frame, out)
        np.testing.assert_array_equal(out, x)
        try:
            dec.decode_into(bytes(damaged), out)
            errors[name] = out.tobytes()
        except ChunkDecodeError:
            errors[name] = "error"
    assert len(set(errors.values())) == 1, errors


def test_c_blosc2_decodes_on_many_threads_at_once():
    """One c-blosc2 context per thread: chunks decoded on eight threads at once all come
    out whole (a context shared between threads would mix their blocks)."""
    from insitubatch_nodes.io import blosc2_lib

    lib = blosc2_lib.load()
    if lib is None:
        pytest.skip("python-blosc2 not installed")
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=20_000 + 1000 * i).astype("f4") for i in range(16)]
    frames = [numcodecs.Blosc("zstd", 3, 1, blocksize=4096).encode(x) for x in xs]

    def work(k: int) -> bool:
        ok = True
        for i in range(60):
            j = (k + i) % len(xs)
            out = np.empty_like(xs[j])
            ok &= lib.decompress_into(frames[j], out) and np.array_equal(out, xs[j])
        return ok

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(work, range(8)))


def _outcome(decode, frame, like):
    """What decoding ``frame`` gives: its bytes, or "error"."""
    from insitubatch_nodes.io.retry import ChunkDecodeError

    out = np.zeros_like(like)
    try:
        decode(frame, out)
    except ChunkDecodeError:
        return "error"
    return out.tobytes()


@pytest.mark.parametrize("cname", ["zstd", "lz4", "blosclz"])
def test_damaged_blosc_headers_fail_as_numcodecs_fails_and_spoil_no_later_chunk(cname):
    """c-blosc2 is laxer than c-blosc 1 with a damaged header (a wrong block size or codec
    version it decodes anyway, at times into wrong values), and reads both shuffle bits as
    its own extended header; such a frame once left the thread's context decoding later,
    valid frames wrong while reporting success (a reviewer's fuzzing). Every header byte
    damaged in turn: the decoder's outcome is numcodecs' (the same error or the same bytes),
    and a valid frame decoded after each on the same thread comes out right."""
    from insitubatch_nodes.io import blosc2_lib
    from insitubatch_nodes.io.decode import ChunkDecoder

    lib = blosc2_lib.load()
    if lib is None:
        pytest.skip("python-blosc2 not installed")
    rng = np.random.default_rng(1)
    x = (rng.normal(size=30_000) * 10).astype("f4")
    codec = numcodecs.Blosc(cname, 5, numcodecs.Blosc.SHUFFLE, blocksize=4096)
    valid = codec.encode(x)
    fast = ChunkDecoder((codec,), False, "blosc", (lib.decompress_into,), "c-blosc2")
    slow = ChunkDecoder((codec,), False, "blosc")
    damaged = []
    for at in range(16):
        for value in (0, 1, 0x05 | valid[at], valid[at] ^ 0x80, 255):
            frame = bytearray(valid)
            frame[at] = value & 0xFF
            damaged.append(bytes(frame))
    for frame in damaged:
        assert _outcome(fast.decode_into, frame, x) == _outcome(slow.decode_into, frame, x)
        assert _outcome(fast.decode_into, valid, x) == x.tobytes()


def test_a_c_blosc2_of_an_unknown_major_is_left_to_numcodecs(tmp_path, monkeypatch):
    """Another major version of c-blosc2 may lay out its parameters otherwise: the binding
    refuses to open it, and blosc chunks decode with numcodecs, as without python-blosc2."""
    from insitubatch_nodes.io import blosc2_lib
    from insitubatch_nodes.io.decode import decoder_for

    if blosc2_lib.library_path() is None:
        pytest.skip("python-blosc2 not installed")
    monkeypatch.setattr(blosc2_lib, "_MAJORS", ("99",))
    monkeypatch.setattr(blosc2_lib, "_loaded", [])  # opened again, under the new rule
    assert blosc2_lib.load() is None
    x = np.arange(1000, dtype="f4").reshape(10, 100)
    arr = zarr.create_array(tmp_path / "a.zarr", shape=x.shape, chunks=x.shape, dtype="f4",
                            zarr_format=2, compressors=numcodecs.Blosc("zstd", 5, 1))
    arr[:] = x
    dec = decoder_for(arr)
    assert dec is not None and dec.libraries == "numcodecs"
    out = np.zeros_like(x)
    dec.decode_into((tmp_path / "a.zarr" / "0.0").read_bytes(), out)
    np.testing.assert_array_equal(out, x)
