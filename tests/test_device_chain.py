"""Which chains go to the GPU, and the host checks that keep damaged frames off it."""

import numcodecs
import numpy as np
import pytest
import zarr
import zarr.codecs as zc
from hypothesis import given, settings
from hypothesis import strategies as st
from stores import Var

from insitubatch_nodes.io.codec_chain import classify
from insitubatch_nodes.io.decode import decoder_for
from insitubatch_nodes.io.device_chain import (
    DeviceChain,
    HostOnly,
    check_gzip_frame,
    check_lz4_frame,
    check_zstd_frame,
    device_chain_for,
)

V2 = dict(zarr_format=2)
CASES = {
    # name: (variable, expected algorithm or a word of the HostOnly reason)
    "raw": (Var("a", (20, 4), (8, 4), compressors=None), None),
    "zstd": (Var("a", (20, 4), (8, 4), compressors=zc.ZstdCodec(level=3)), "zstd"),
    "gzip": (Var("a", (20, 4), (8, 4), compressors=zc.GzipCodec()), "gzip"),
    "zstd-checksum": (Var("a", (20, 4), (8, 4), compressors=zc.ZstdCodec(checksum=True)),
                      "checksums"),
    "blosc": (Var("a", (20, 4), (8, 4), compressors=zc.BloscCodec()), "blosc"),
    "blosc-lz4-noshuffle": (Var("a", (20, 4), (8, 4),
                                compressors=zc.BloscCodec(cname="lz4", shuffle="noshuffle")),
                            "blosc"),
    "blosc-bitshuffle": (Var("a", (20, 4), (8, 4),
                             compressors=zc.BloscCodec(cname="zstd", shuffle="bitshuffle")),
                         "blosc"),
    "blosc-blosclz": (Var("a", (20, 4), (8, 4),
                          compressors=zc.BloscCodec(cname="blosclz", shuffle="shuffle")),
                      "blosclz"),
    "crc32c": (Var("a", (20, 4), (8, 4), compressors=(zc.ZstdCodec(), zc.Crc32cCodec())),
               "more than one"),
    "big-endian": (Var("a", (20, 4), (8, 4), dtype="float64",
                       extra={"serializer": zc.BytesCodec(endian="big")}), "big-endian"),
    "big-endian-uint8": (Var("a", (20, 4), (8, 4), dtype="uint8", compressors=None,
                             extra={"serializer": zc.BytesCodec(endian="big")}), None),
    "sharded": (Var("a", (20, 4), (4, 4), shards=(8, 4)), "sharding"),
    "v2-raw": (Var("a", (20, 4), (8, 4), compressors=None, **V2), None),
    "v2-zstd": (Var("a", (20, 4), (8, 4), compressors=numcodecs.Zstd(), **V2), "zstd"),
    "v2-lz4": (Var("a", (20, 4), (8, 4), compressors=numcodecs.LZ4(), **V2), "lz4"),
    "v2-gzip": (Var("a", (20, 4), (8, 4), compressors=numcodecs.GZip(), **V2), "gzip"),
    "v2-blosc": (Var("a", (20, 4), (8, 4), compressors=numcodecs.Blosc(), **V2), "blosc"),
    "v2-blosc-auto-uint8": (Var("a", (20, 4), (8, 4), dtype="uint8", **V2,
                                compressors=numcodecs.Blosc(shuffle=-1)), "blosc"),
    "v2-blosc-zlib": (Var("a", (20, 4), (8, 4), compressors=numcodecs.Blosc("zlib"),
                          **V2), "zlib"),
    "v2-filters": (Var("a", (20, 4), (8, 4), compressors=numcodecs.Zstd(),
                       extra={"filters": [numcodecs.Delta(dtype="float32")]}, **V2),
                   "filters"),
    "v2-fortran": (Var("a", (20, 4), (8, 4), compressors=numcodecs.Zstd(),
                       extra={"order": "F"}, **V2), "Fortran"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_chain_classification(store_factory, case):
    var, want = CASES[case]
    path, _ = store_factory([var])
    got = device_chain_for(zarr.open_array(path / "a"))
    if want in (None, "zstd", "lz4", "gzip", "blosc"):
        assert isinstance(got, DeviceChain), got
        assert got.algorithm == want
        assert got.skip == (4 if want == "lz4" else 0)
    else:
        assert isinstance(got, HostOnly), got
        assert want in got.reason
        assert got.chain  # the log line names the chain


def test_stored_frames_pass_their_checks(store_factory):
    """Every chunk file zarr wrote passes the check of its chain (real frames, not ours)."""
    for case, (var, want) in CASES.items():
        if want not in (None, "zstd", "lz4", "gzip", "blosc"):
            continue
        path, _ = store_factory([var])
        arr = zarr.open_array(path / "a")
        chain = device_chain_for(arr)
        nbytes = int(np.prod(arr.chunks)) * arr.dtype.itemsize
        files = [f for f in (path / "a").rglob("*") if f.is_file()
                 and f.name not in ("zarr.json", ".zarray", ".zattrs")]
        assert files, case
        for f in files:
            chain.check(f.read_bytes(), nbytes)


CHAINS = {
    # case: (short text, inspect label, plain, stored byte order)
    "blosc-lz4-noshuffle": ("bytes -> blosc", "bytes -> blosc(lz4)", True, "little"),
    "crc32c": ("bytes -> zstd -> crc32c", "bytes -> zstd -> crc32c", True, "little"),
    "big-endian": ("bytes -> zstd", "bytes -> zstd", True, "big"),
    "big-endian-uint8": ("bytes", "bytes", True, None),  # one-byte items have no order
    "sharded": ("sharding", "sharding[bytes -> zstd]", False, None),
    "v2-raw": ("v2:raw", "v2:raw", True, "little"),
    "v2-blosc-zlib": ("v2:blosc", "v2:blosc", True, "little"),
    "v2-filters": ("v2:zstd", "v2:delta -> zstd", False, "little"),
    "v2-fortran": ("v2:zstd", "v2:zstd", False, "little"),
}


@pytest.mark.parametrize("case", sorted(CHAINS))
def test_classify_describes_the_chain(store_factory, case):
    path, _ = store_factory([CASES[case][0]])
    chain = classify(zarr.open_array(path / "a"))
    assert (chain.text, chain.label, chain.plain, chain.byteorder) == CHAINS[case]
    # v2 too is described as v3 would write it: filters, one serializer, then compressors
    roles = [c.role for c in chain.codecs]
    assert roles.count("array-bytes") == 1
    assert roles == sorted(roles, key=["array-array", "array-bytes", "bytes-bytes"].index)


@pytest.mark.parametrize("case", sorted(CASES))
def test_host_and_device_read_the_same_classification(store_factory, case):
    """decoder_for and device_chain_for derive from one CodecChain: the same chain name,
    the same byte order, and every chain the device takes is one the host decodes too (its
    fallback for frames nvCOMP cannot take)."""
    path, _ = store_factory([CASES[case][0]])
    arr = zarr.open_array(path / "a")
    chain = classify(arr)
    host, device = decoder_for(arr), device_chain_for(arr)
    assert (host is not None) == chain.plain
    assert device.chain == chain.text
    if host is not None:
        assert (host.chain, host.byteswap) == (chain.text, chain.byteswap)
    if isinstance(device, DeviceChain):
        assert host is not None


def test_a_wrapped_codec_is_left_to_zarr(store_factory):
    """A numcodecs codec wrapped for zarr v3 is not zarr's own ZstdCodec: neither the host
    nor the device decoder takes it, though its name reads the same."""
    from zarr.codecs.numcodecs import Zstd

    path, _ = store_factory([Var("a", (20, 4), (8, 4), compressors=Zstd(level=1))])
    arr = zarr.open_array(path / "a")
    chain = classify(arr)
    assert chain.text == "bytes -> zstd" and chain.compressors[0].numcodecs is None
    assert decoder_for(arr) is None
    got = device_chain_for(arr)
    assert isinstance(got, HostOnly) and "not one of zarr's own" in got.reason


payloads = st.tuples(st.integers(1, 300_000), st.integers(0, 2 ** 31), st.sampled_from(
    ["random", "smooth", "constant"]))


def make_payload(n, seed, kind):
    rng = np.random.default_rng(seed)
    if kind == "random":
        return rng.integers(0, 256, n, dtype=np.uint8).tobytes()
    if kind == "smooth":
        return (np.arange(n) // 7 % 251).astype(np.uint8).tobytes()
    return bytes(n)


CODECS = {
    "zstd": (numcodecs.Zstd(level=1), check_zstd_frame),
    "zstd-checksum": (numcodecs.Zstd(level=3, checksum=True), check_zstd_frame),
    "lz4": (numcodecs.LZ4(), check_lz4_frame),
    "gzip": (numcodecs.GZip(level=1), check_gzip_frame),
}


@settings(max_examples=40, deadline=None)
@given(payload=payloads, codec=st.sampled_from(sorted(CODECS)), cut=st.floats(0.0, 0.999))
def test_whole_frames_pass_and_damaged_ones_fail(payload, codec, cut):
    data = make_payload(*payload)
    enc, check = CODECS[codec]
    frame = enc.encode(data)
    check(memoryview(frame), len(data))  # a whole frame passes
    with pytest.raises(ValueError):
        check(memoryview(frame), len(data) + 1)  # the wrong decoded size is caught
    if codec != "lz4":  # a raw LZ4 block has no end marker: its decoder checks bounds
        short = frame[: int(len(frame) * cut)]
        with pytest.raises(ValueError):
            check(memoryview(short), len(data))
        with pytest.raises(ValueError):
            check(memoryview(frame + b"\0"), len(data))


def test_multi_block_zstd_frame_is_walked():
    data = make_payload(1_000_000, 1, "random")  # incompressible: raw 128 KiB blocks
    frame = numcodecs.Zstd(level=1).encode(data)
    check_zstd_frame(memoryview(frame), len(data))
    # magic 4, descriptor 1 (4-byte content size), window 1, size 4; then raw 128 KiB
    # blocks with 3-byte headers
    assert frame[4] == 0x80 and len(frame) == 10 + 8 * 3 + len(data)
    first_block_end = 10 + 3 + 131072
    with pytest.raises(ValueError, match="truncated"):  # cut at a block boundary
        check_zstd_frame(memoryview(frame[:first_block_end]), len(data))


def test_a_damaged_zstd_stream_inside_a_blosc_frame_is_caught():
    """The blosc header can be intact while a stream inside is not; nvCOMP's zstd would not
    notice, so the host walks every zstd stream of the frame."""
    from insitubatch_nodes.io.blosc_frame import parse_blosc

    x = np.cumsum(np.random.default_rng(0).standard_normal(50_000)).astype("float32")
    frame = bytearray(numcodecs.Blosc("zstd", 5, 1).encode(x))
    chain = DeviceChain("blosc", 0, "bytes -> blosc")
    chain.check(bytes(frame), x.nbytes)
    s = next(s for s in parse_blosc(bytes(frame), x.nbytes).streams if not s.raw)
    frame[s.src : s.src + 4] = b"\0\0\0\0"  # the stream's zstd magic
    with pytest.raises(ValueError, match="not a zstd frame"):
        chain.check(bytes(frame), x.nbytes)


def test_foreign_bytes_are_refused():
    with pytest.raises(ValueError, match="not a zstd frame"):
        check_zstd_frame(memoryview(b"\x00" * 64), 10)
    with pytest.raises(ValueError, match="not a gzip member"):
        check_gzip_frame(memoryview(numcodecs.Zstd().encode(b"x" * 100)), 100)
    with pytest.raises(ValueError, match="LZ4 frame says"):
        check_lz4_frame(memoryview(numcodecs.LZ4().encode(b"x" * 100)), 99)
    with pytest.raises(ValueError, match="uncompressed chunk has 3 bytes"):
        DeviceChain(None, 0, "bytes").check(b"abc", 4)
