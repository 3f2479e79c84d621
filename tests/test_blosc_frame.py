"""Blosc frames laid out on the host and rebuilt from their streams give numcodecs' bytes."""

import struct

import numcodecs
import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from insitubatch_nodes.io.blosc_frame import HEADER, parse_blosc
from insitubatch_nodes.io.device_decode import bitunshuffle, unshuffle


def rebuild(frame: bytes, nbytes: int) -> bytes:
    """What the device does, on CPU: decode each stream into place, then unshuffle."""
    f = parse_blosc(frame, nbytes)
    if f.codec is None:
        return frame[HEADER : HEADER + nbytes]
    shuffled = np.zeros(nbytes, np.uint8)
    for s in f.streams:
        data = frame[s.src : s.src + s.size]
        if s.raw:
            out = data
        elif f.codec == "zstd":
            out = numcodecs.Zstd().decode(data)
        else:  # a raw LZ4 block; numcodecs wants its size prefix
            out = numcodecs.LZ4().decode(struct.pack("<I", s.out) + data)
        assert len(out) == s.out
        shuffled[s.dst : s.dst + s.out] = np.frombuffer(out, np.uint8)
    t = torch.from_numpy(shuffled)
    if f.shuffle == "byte":
        t = unshuffle(t, f.typesize, f.blocksize)
    elif f.shuffle == "bit":
        t = bitunshuffle(t, f.typesize, f.blocksize)
    return t.numpy().tobytes()


@settings(max_examples=100, deadline=None)
# Paths random draws seldom reach (most small frames are stored as is): a bit-shuffled short
# last block, and a byte-shuffled one after full blocks.
@example(dtype="float32", size=1000, cname="zstd", shuffle=2, clevel=5, blocksize=1024,
         seed=0, kind="smooth")
@example(dtype="int16", size=5003, cname="lz4", shuffle=1, clevel=5, blocksize=4096, seed=1,
         kind="smooth")
@given(dtype=st.sampled_from(["float32", "float64", "int16", "uint8", "float16", "int64"]),
       size=st.integers(1, 200_000), cname=st.sampled_from(["lz4", "lz4hc", "zstd"]),
       shuffle=st.sampled_from([0, 1, 2]), clevel=st.sampled_from([0, 1, 5, 9]),
       blocksize=st.sampled_from([0, 0, 256, 1000, 4096]), seed=st.integers(0, 9),
       kind=st.sampled_from(["smooth", "noise", "zeros"]))
def test_rebuilt_frames_equal_the_data(dtype, size, cname, shuffle, clevel, blocksize, seed,
                                       kind):
    rng = np.random.default_rng(seed)
    if kind == "smooth":
        x = (np.cumsum(rng.standard_normal(size)) * 10).astype(dtype)
    elif kind == "noise":
        x = rng.integers(0, 255, size * np.dtype(dtype).itemsize, dtype=np.uint8).view(dtype)
    else:
        x = np.zeros(size, dtype)
    frame = numcodecs.Blosc(cname=cname, shuffle=shuffle, clevel=clevel,
                            blocksize=blocksize).encode(x)
    assert rebuild(bytes(frame), x.nbytes) == x.tobytes()


def test_split_streams_and_stored_blocks_are_laid_out():
    x = np.arange(100_000, dtype="float32")
    lz4 = parse_blosc(numcodecs.Blosc("lz4", shuffle=1).encode(x), x.nbytes)
    assert lz4.codec == "lz4" and lz4.shuffle == "byte" and lz4.typesize == 4
    assert len(lz4.streams) == 4  # one block, split into a stream per byte of the type
    assert [s.dst for s in lz4.streams] == [0, 100_000, 200_000, 300_000]
    stored = parse_blosc(numcodecs.Blosc("lz4", shuffle=0).encode(x), x.nbytes)
    assert stored.codec is None and stored.streams == ()  # incompressible: memcpyed


def test_damaged_and_unsupported_frames_are_errors():
    x = np.arange(50_000, dtype="float32")
    frame = bytes(numcodecs.Blosc("zstd", shuffle=1).encode(x))
    with pytest.raises(ValueError, match="damaged"):
        parse_blosc(frame[:-3], x.nbytes)
    with pytest.raises(ValueError, match="expected 4"):
        parse_blosc(frame, 4)
    with pytest.raises(ValueError, match="shorter than its header"):
        parse_blosc(frame[:10], x.nbytes)
    bad = bytearray(frame)
    struct.pack_into("<i", bad, HEADER, len(frame) + 100)  # first block starts past the end
    with pytest.raises(ValueError, match="block 0"):
        parse_blosc(bytes(bad), x.nbytes)
    with pytest.raises(ValueError, match="blosclz"):
        parse_blosc(numcodecs.Blosc("blosclz", shuffle=1).encode(x), x.nbytes)
