"""Reading part of a chunk: only the blosc blocks holding the wanted levels are decoded (and,
on an object store, fetched), bit for bit as the whole-frame decode gives them, with the whole
frame wherever a part cannot be read, and the errors of the whole-frame path."""

from __future__ import annotations

import asyncio
import functools
import os
import struct
from concurrent.futures import ThreadPoolExecutor

import numcodecs
import numpy as np
import pytest
import zarr
import zarr.codecs as zc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import insitubatch_nodes as ib
from insitubatch_nodes.io.decode import ChunkDecoder
from insitubatch_nodes.io.partial.blocks import (
    HEADER,
    BlockPlan,
    Whole,
    coalesce,
    parse_header,
    plan_frame,
)
from insitubatch_nodes.io.partial.decode import decode_blocks
from insitubatch_nodes.io.partial.ranges import (
    PartSpec,
    byte_ranges,
    chunk_part,
    copy_wanted,
    merge,
)
from insitubatch_nodes.io.partial.sparse import SparseFrame
from insitubatch_nodes.io.reader import PartialRule, StripeReader
from insitubatch_nodes.io.retry import NO_RETRY, CorruptChunkError
from insitubatch_nodes.testing.faultproxy import FaultPlan, FaultProxy

CNAMES = ["blosclz", "lz4", "lz4hc", "zlib", "zstd"]
DTYPES = {1: "u1", 2: "i2", 4: "f4", 8: "f8"}
# GraphCast's 13 levels among ARCO-ERA5's 37.
ARCO_LEVELS = [1, 2, 3, 5, 7, 10, 20, 30, 50, 70, 100, 125, 150, 175, 200, 225, 250, 300, 350,
               400, 450, 500, 550, 600, 650, 700, 750, 775, 800, 825, 850, 875, 900, 925, 950,
               975, 1000]
GRAPHCAST = [50, 100, 150, 200, 250, 300, 400, 500, 600, 700, 850, 925, 1000]
WANTED = [ARCO_LEVELS.index(p) for p in GRAPHCAST]


def smooth(shape: tuple[int, ...], dtype: str, seed: int = 0) -> np.ndarray:
    """Compressible values with every level distinct (as weather fields are)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).cumsum(axis=-1) * 7 + np.arange(shape[1]).reshape(
        (1, -1) + (1,) * (len(shape) - 2)) * 50
    return x.astype(dtype) if np.dtype(dtype).kind == "f" else (x % 100).astype(dtype)


def encode(x: np.ndarray, cname: str, shuffle: int, clevel: int = 5,
           blocksize: int = 0) -> bytes:
    """One frame, compressed on this thread (numcodecs' threads ignore ``blocksize``)."""
    saved = numcodecs.blosc.use_threads
    numcodecs.blosc.use_threads = False
    try:
        return bytes(numcodecs.Blosc(cname, clevel, shuffle, blocksize=blocksize).encode(x))
    finally:
        numcodecs.blosc.use_threads = saved


def wanted_mask(shape: tuple[int, ...], levels: list[int]) -> np.ndarray:
    mask = np.zeros(shape, dtype=bool)
    mask[:, levels] = True
    return mask


# -- pure: ranges and blocks ----------------------------------------------------------------
@given(st.lists(st.integers(1, 5), min_size=2, max_size=4), st.sampled_from([1, 2, 4, 8]),
       st.data())
def test_byte_ranges_are_exactly_the_wanted_indices(shape, itemsize, data):
    shape = tuple(shape)
    levels = data.draw(st.lists(st.integers(0, shape[1] - 1), min_size=1, unique=True))
    ranges = byte_ranges(shape, itemsize, PartSpec.of(levels).ranges)
    got = np.zeros(int(np.prod(shape)) * itemsize, dtype=bool)
    for lo, hi in ranges:
        assert not got[lo:hi].any()  # disjoint
        got[lo:hi] = True
    want = np.repeat(wanted_mask(shape, levels).reshape(-1), itemsize)
    np.testing.assert_array_equal(got, want)
    assert ranges == merge(ranges)  # touching ranges joined


def test_a_part_spec_is_checked_and_maps_onto_each_chunk_along_axis_1():
    spec = PartSpec.of([7, 2, 3, 3, 9])
    assert spec.ranges == ((2, 4), (7, 8), (9, 10)) and spec.stop == 10
    with pytest.raises(ValueError, match="sorted"):
        PartSpec(((3, 4), (1, 2)))
    with pytest.raises(ValueError, match="sorted"):
        PartSpec(((1, 2), (2, 3)))  # touching: PartSpec.of joins them
    with pytest.raises(ValueError, match=">= 0"):
        PartSpec(((-1, 2),))
    # chunks of 4 along axis 1 of a 10-long array: (0-3) (4-7) (8-9, an edge chunk)
    assert chunk_part(spec, (1, 4, 2), (1, 10, 2), (0, 0), 4).axis1 == ((2, 4),)
    assert chunk_part(spec, (1, 4, 2), (1, 10, 2), (1, 0), 4).axis1 == ((3, 4),)
    assert chunk_part(spec, (1, 4, 2), (1, 10, 2), (2, 0), 4).axis1 == ((1, 2),)
    assert chunk_part(PartSpec.of([1]), (1, 4, 2), (1, 10, 2), (1, 0), 4) is None  # not read
    # the edge's valid part
    assert chunk_part(PartSpec.of([8, 9]), (1, 4, 2), (1, 10, 2), (2, 0), 4).whole


def reorder_blocks(frame: bytes, nbytes: int, seed: int) -> bytes:
    """``frame`` with its blocks stored in another order (offsets to match), as c-blosc 1
    compressing on several threads writes them: each block where it finished."""
    header = parse_header(frame, nbytes)
    n = header.nblocks
    starts = struct.unpack_from(f"<{n}i", frame, HEADER)
    order = sorted(range(n), key=starts.__getitem__)
    ends = dict(zip(order, [*(starts[j] for j in order[1:]), len(frame)], strict=True))
    blocks = {j: frame[starts[j]:ends[j]] for j in range(n)}
    new = list(np.random.default_rng(seed).permutation(n))
    out, at, offsets = bytearray(frame[:header.head_bytes]), header.head_bytes, [0] * n
    for j in new:
        offsets[j] = at
        out += blocks[j]
        at += len(blocks[j])
    struct.pack_into(f"<{n}i", out, HEADER, *offsets)
    return bytes(out)


def test_blocks_span_to_the_next_larger_offset_whatever_their_order():
    """c-blosc 1 on several threads appends blocks as they finish: offsets out of order."""
    x = smooth((1, 37, 40, 90), "f4")
    frame = reorder_blocks(encode(x, "zstd", 1, blocksize=16384), x.nbytes, seed=3)
    np.testing.assert_array_equal(np.frombuffer(numcodecs.Blosc().decode(frame), "f4"),
                                  x.reshape(-1))
    header = parse_header(frame, x.nbytes)
    assert not isinstance(header, Whole) and header.nblocks == -(-x.nbytes // 16384)
    starts = struct.unpack_from(f"<{header.nblocks}i", frame, HEADER)
    assert list(starts) != sorted(starts)
    plan = plan_frame(frame, x.nbytes, ((0, x.nbytes),), 1.0)
    assert isinstance(plan, BlockPlan)
    assert sorted(plan.spans) == list(zip(sorted(starts), [*sorted(starts)[1:], len(frame)],
                                          strict=True))
    assert sum(e - s for s, e in plan.spans) == len(frame) - header.head_bytes
    out = np.zeros_like(x)
    wanted = byte_ranges(x.shape, 4, PartSpec.of(WANTED).ranges)
    assert decode_blocks(frame, out, wanted)
    np.testing.assert_array_equal(out[:, WANTED], x[:, WANTED])


def test_coalescing_fills_the_smallest_gaps_first():
    assert coalesce(((0, 10), (12, 20), (50, 60), (61, 70)), 2) == ((0, 20), (50, 70))
    assert coalesce(((0, 10), (12, 20)), 5) == ((0, 10), (12, 20))
    assert coalesce(((0, 10), (12, 20), (30, 40)), 1) == ((0, 40),)


def test_why_a_frame_is_read_whole():
    x = smooth((1, 20, 30, 40), "f4")
    frame = encode(x, "lz4", 1, blocksize=4096)
    few, most = byte_ranges(x.shape, 4, ((3, 4),)), byte_ranges(x.shape, 4, ((0, 19),))
    assert isinstance(plan_frame(frame, x.nbytes, few), BlockPlan)
    assert "blocks" in plan_frame(frame, x.nbytes, most).reason  # > 0.8 of the blocks
    stored = encode(np.random.default_rng(0).integers(0, 256, (1, 20, 30, 40), "u1"),
                    "lz4", 0, clevel=1)
    assert stored[2] & 0x02  # incompressible: stored as is
    assert "uncompressed" in plan_frame(stored, 24000, few).reason
    bad = bytearray(frame)
    bad[0] = 3
    assert "not a blosc 1 header" in plan_frame(bytes(bad), x.nbytes, few).reason
    bad = bytearray(frame)
    struct.pack_into("<i", bad, HEADER, 99)  # block 0 not right after the offsets
    assert "damaged" in plan_frame(bytes(bad), x.nbytes, few).reason
    assert "chunk has" in plan_frame(frame, x.nbytes + 4, few).reason


def test_sparse_frames_cover_what_they_hold_and_round_trip_through_the_cache_format():
    f = SparseFrame(100, ((0, b"h" * 20), (40, b"a" * 10), (50, b"b" * 5)))
    assert f.held == ((0, 20), (40, 55)) and f.nbytes == 35
    assert f.missing(((10, 30), (45, 60))) == ((20, 30), (55, 60))
    assert f.covers(((41, 54),)) and not f.covers(((19, 21),))
    back = SparseFrame.from_bytes(f.to_bytes())
    assert back is not None and back.held == f.held and back.cbytes == 100
    buf = memoryview(bytearray(20))
    back.copy_into(buf, 2, 38, 56)
    assert bytes(buf[4:19]) == b"a" * 10 + b"b" * 5 and bytes(buf[:4]) == bytes(4)
    assert SparseFrame.from_bytes(f.to_bytes()[:-1]) is None
    assert SparseFrame.from_bytes(b"not one") is None
    wider = f.with_pieces([(15, b"c" * 45)])  # overlapping what it holds: only the rest kept
    assert wider.held == ((0, 60),) and wider.nbytes == sum(len(b) for _, b in wider.pieces)
    buf = memoryview(bytearray(60))
    wider.copy_into(buf, 0, 0, 60)
    assert bytes(buf) == b"h" * 20 + b"c" * 20 + b"a" * 10 + b"b" * 5 + b"c" * 5
    with pytest.raises(ValueError, match="overlap"):
        SparseFrame(100, ((0, b"x" * 10), (5, b"y")))


# -- partial decode equals the whole decode -----------------------------------------------
@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(CNAMES), st.sampled_from([0, 1, 2]), st.sampled_from([1, 2, 4, 8]),
       st.integers(1, 9), st.sampled_from([256, 1024, 4096, 0]), st.booleans(),
       st.tuples(st.integers(1, 2), st.integers(2, 40), st.integers(1, 16),
                 st.integers(1, 300)), st.data())
def test_partial_decode_equals_the_whole_decode_bit_for_bit(cname, shuffle, typesize, clevel,
                                                            blocksize, reorder, shape, data):
    x = smooth(shape, DTYPES[typesize], seed=data.draw(st.integers(0, 9)))
    frame = encode(x, cname, shuffle, clevel, blocksize)
    if reorder and not frame[2] & 0x02:  # blocks stored out of order, as threads write them
        frame = reorder_blocks(frame, x.nbytes, data.draw(st.integers(0, 99)))
    levels = data.draw(st.lists(st.integers(0, shape[1] - 1), min_size=1, max_size=shape[1],
                                unique=True))
    wanted = byte_ranges(shape, typesize, PartSpec.of(levels).ranges)
    sentinel = np.frombuffer(np.random.default_rng(1).bytes(x.nbytes), x.dtype).reshape(shape)
    out = sentinel.copy()
    plan = plan_frame(frame, x.nbytes, wanted, 0.9)
    assert decode_blocks(frame, out, wanted) == isinstance(plan, BlockPlan)
    whole = np.empty_like(x)
    numcodecs.Blosc().decode(frame, out=whole)
    if isinstance(plan, Whole):
        return
    mask = wanted_mask(shape, levels)
    assert out.tobytes() == np.where(mask, whole, out).tobytes()  # wanted bytes: bit for bit
    decoded = np.zeros(x.nbytes, dtype=bool)
    for lo, hi in plan.decode:
        decoded[lo:hi] = True
    raw, kept = out.reshape(-1).view("u1"), sentinel.reshape(-1).view("u1")
    np.testing.assert_array_equal(raw[~decoded], kept[~decoded])  # others left as they are
    np.testing.assert_array_equal(raw[decoded], whole.reshape(-1).view("u1")[decoded])
    # A sparse frame holding only the header, offsets and needed blocks decodes the same.
    head = plan.header.head_bytes
    sparse = SparseFrame(len(frame), ((0, frame[:head]),
                                      *((s, frame[s:e]) for s, e in plan.spans)))
    again = sentinel.copy()
    assert decode_blocks(sparse, again, wanted)
    assert again.tobytes() == out.tobytes()


@pytest.mark.parametrize("cname", CNAMES)
def test_the_chunk_decoder_decodes_in_part_only_lone_blosc_and_the_whole_frame_otherwise(cname):
    x = smooth((2, 30, 40, 100), "f4")  # 15 blocks of 64 kB (lz4's and blosclz's least)
    wanted = byte_ranges(x.shape, 4, PartSpec.of([3, 17]).ranges)
    blosc = ChunkDecoder((numcodecs.Blosc(),), False, "v2:blosc")
    out = np.zeros_like(x)
    assert blosc.blosc_only
    assert blosc.decode_part_into(encode(x, cname, 1, blocksize=1024), out, wanted)
    np.testing.assert_array_equal(out[:, [3, 17]], x[:, [3, 17]])
    for codec in (numcodecs.Zstd(), numcodecs.GZip()):
        dec = ChunkDecoder((codec,), False, "v2:other")
        out = np.zeros_like(x)
        assert not dec.blosc_only
        assert not dec.decode_part_into(codec.encode(x), out, wanted)  # whole
        np.testing.assert_array_equal(out, x)


# -- the reader, local stores ---------------------------------------------------------------
def level_store(path, zarr_format=3, chunks=(2, 37, 12, 20), codec="blosc", shape=None,
                shards=None):
    """A (time, level, y, x) float32 store, blosc zstd in blocks of 2 kB, many per chunk
    (c-blosc 1 makes lz4's and blosclz's blocks at least 64 kB: ``test_lz4_...``)."""
    shape = shape or (5, 37, 12, 20 if chunks[2] == 12 else 40)
    if codec == "blosc":
        comp = (zc.BloscCodec(cname="zstd", clevel=5, shuffle="shuffle", blocksize=2048)
                if zarr_format == 3 else numcodecs.Blosc("zstd", 5, 1, blocksize=2048))
    elif codec == "lz4":
        comp = (zc.BloscCodec(cname="lz4", clevel=5, shuffle="shuffle") if zarr_format == 3
                else numcodecs.Blosc("lz4", 5, 1))
    else:
        comp = zc.ZstdCodec() if zarr_format == 3 else numcodecs.Zstd()
    kw = {"compressors": comp} if zarr_format == 3 else {"compressor": comp}
    extra = {"dimension_names": ("time", "level", "y", "x")} if zarr_format == 3 else {}
    g = zarr.open_group(path, mode="w", zarr_format=zarr_format)
    a = g.create_array("t", shape=shape, chunks=chunks, dtype="float32", shards=shards,
                       **kw, **extra)
    data = smooth(shape, "float32")
    a[:] = data
    return data


class Reads:
    """Stripes of one variable through ``StripeReader.read`` on a loop and a pool."""

    def __init__(self, src, **rule):
        self.reader = StripeReader(src.arrays[0], src.variables[0], src.url)
        if rule:
            self.reader.partial_rule = PartialRule(**rule)
        self.loop = asyncio.new_event_loop()
        self.pool = ThreadPoolExecutor(2)

    def __call__(self, index, part, retry=NO_RETRY):
        out = np.full(self.reader.geom.stripe_shape, np.nan, self.reader.geom.dtype)
        self.loop.run_until_complete(self.reader.read(index, out, self.loop, self.pool, retry,
                                                      part=part))
        return out

    def close(self):
        self.loop.close()
        self.pool.shutdown()


def rows(data, reader, index):
    return data[reader.rows(index)]


@pytest.mark.parametrize("zarr_format", [2, 3])
@pytest.mark.parametrize("chunks", [(2, 37, 12, 20), (1, 37, 12, 20), (2, 8, 12, 20),
                                    (2, 37, 6, 20)], ids=["whole", "one-sample", "levels-split",
                                                          "grid-split"])
def test_every_read_with_a_part_gives_the_wanted_levels(tmp_path, zarr_format, chunks):
    data = level_store(tmp_path / "s.zarr", zarr_format, chunks)
    src = ib.open_source(tmp_path / "s.zarr")
    part = PartSpec.of(WANTED)
    reads = Reads(src)
    r = reads.reader
    try:
        for i in range(r.geom.n_sample_chunks):
            n = r.rows(i).stop - r.rows(i).start
            want = rows(data, r, i)[:, WANTED]
            np.testing.assert_array_equal(reads(i, part)[:n, WANTED], want)
            for out in (np.full(r.geom.stripe_shape, np.nan, "f4") for _ in range(2)):
                r.read_local(i, out, part=part)
                np.testing.assert_array_equal(out[:n, WANTED], want)
                r.read_local_retrying([i, 0], [out, out.copy()], part=part)
                np.testing.assert_array_equal(out[:n, WANTED], want)
            np.testing.assert_array_equal(reads(i, None)[:n], rows(data, r, i))  # no part
    finally:
        reads.close()
    st_ = r.partial_stats
    assert st_.partial_reads > 0
    if chunks[1] < 37:
        assert st_.skipped_reads > 0  # chunks of levels none of them wanted: not read


def test_lz4_chunks_of_arco_proportions_decode_the_graphcast_levels_in_part(tmp_path):
    """xarray's default blosc (lz4, shuffle) on a 1 degree grid: 19 blocks of 512 kB, two
    levels each; GraphCast's 13 levels lie in 15 of them."""
    data = level_store(tmp_path / "s.zarr", 2, (1, 37, 181, 360), codec="lz4",
                       shape=(2, 37, 181, 360))
    src = ib.open_source(tmp_path / "s.zarr")
    r = StripeReader(src.arrays[0], src.variables[0], src.url)
    for i in range(2):
        out = np.zeros(r.geom.stripe_shape, "f4")
        r.read_local(i, out, part=PartSpec.of(WANTED))
        np.testing.assert_array_equal(out[:, WANTED], data[i:i + 1, WANTED])
    assert (r.partial_stats.partial_reads, r.partial_stats.whole_reads) == (2, 0)


def test_local_files_read_only_the_header_and_the_wanted_blocks(tmp_path, monkeypatch):
    """A local chunk read in part reads its header and block offsets, then the blocks the
    wanted levels are in: not the whole file (a page-cache copy costs as much as decoding)."""
    import os

    from insitubatch_nodes.io import local_files

    data = level_store(tmp_path / "s.zarr", 2, (1, 37, 181, 360), codec="lz4",
                       shape=(2, 37, 181, 360))
    src = ib.open_source(tmp_path / "s.zarr")
    r = StripeReader(src.arrays[0], src.variables[0], src.url)
    read: list[int] = []
    real_preadv = os.preadv
    monkeypatch.setattr(local_files.os, "preadv", lambda fd, bufs, at: read.append(
        sum(len(b) for b in bufs)) or real_preadv(fd, bufs, at))
    monkeypatch.setattr(local_files.os, "readv", lambda fd, bufs: pytest.fail("whole file"))
    out = np.zeros(r.geom.stripe_shape, "f4")
    r.read_local(1, out, part=PartSpec.of([0, 1]))  # the first block holds both
    np.testing.assert_array_equal(out[:, [0, 1]], data[1:2, [0, 1]])
    size = (tmp_path / "s.zarr" / "t" / "1.0.0.0").stat().st_size
    assert sum(read) < size / 5


def test_a_part_leaves_unwanted_levels_of_unread_blocks_as_they_were(tmp_path):
    data = level_store(tmp_path / "s.zarr", chunks=(1, 37, 12, 20))
    src = ib.open_source(tmp_path / "s.zarr")
    r = StripeReader(src.arrays[0], src.variables[0], src.url)
    out = np.full(r.geom.stripe_shape, -1.0, "f4")
    r.read_local(0, out, part=PartSpec.of([0, 36]))
    np.testing.assert_array_equal(out[:, [0, 36]], data[:1, [0, 36]])
    assert (out[:, 10:25] == -1).all()  # never decoded
    assert r.partial_stats.partial_reads == 1 and r.partial_stats.whole_reads == 0


@pytest.mark.parametrize("case", ["zstd", "sharded", "all-levels"])
def test_chunks_that_cannot_be_read_in_part_are_read_whole(tmp_path, case):
    kw = {"codec": "zstd"} if case == "zstd" else {}
    if case == "sharded":
        kw = {"chunks": (1, 37, 6, 20), "shards": (2, 37, 12, 20)}
    data = level_store(tmp_path / "s.zarr", **kw)
    src = ib.open_source(tmp_path / "s.zarr")
    part = PartSpec.of(range(37) if case == "all-levels" else WANTED)
    reads = Reads(src)
    try:
        for i in range(reads.reader.geom.n_sample_chunks):
            n = reads.reader.rows(i).stop - reads.reader.rows(i).start
            np.testing.assert_array_equal(reads(i, part)[:n], rows(data, reads.reader, i))
    finally:
        reads.close()
    st_ = reads.reader.partial_stats
    assert st_.partial_reads == 0
    assert st_.whole_reads == (0 if case == "sharded" else 3)  # zarr's own path counts none


def test_a_part_outside_the_array_is_refused_naming_the_variable(tmp_path):
    level_store(tmp_path / "s.zarr")
    src = ib.open_source(tmp_path / "s.zarr")
    r = StripeReader(src.arrays[0], src.variables[0], src.url)
    with pytest.raises(ValueError, match="variable 't' of shape .* no indices"):
        r.read_local(0, np.empty(r.geom.stripe_shape, "f4"), part=PartSpec.of([37]))


def test_a_local_frame_read_in_part_lies_at_its_own_offsets_half_a_page_in(tmp_path):
    """The blocks a part needs are read where they lie in the file, into a buffer starting
    half a page in (the kernel's copy is 3-4x slower a few bytes off the file's page offset,
    and a decode from a page-aligned frame into a page-aligned row as much), and decoded
    there."""
    import mmap

    from insitubatch_nodes.io.local_files import _ALIGN_AT, PageBuffer, _read_part
    from insitubatch_nodes.io.partial.sparse import LaidOutFrame

    level_store(tmp_path / "s.zarr", chunks=(1, 37, 12, 20))
    path = tmp_path / "s.zarr" / "t" / "c" / "1" / "0" / "0" / "0"
    frame = path.read_bytes()
    wanted = byte_ranges((1, 37, 12, 20), 4, PartSpec.of([5, 30]).ranges)
    fd = os.open(path, os.O_RDONLY)
    try:
        got = _read_part(fd, 37 * 240 * 4, wanted)
    finally:
        os.close(fd)
    assert isinstance(got, LaidOutFrame) and got.cbytes == len(frame)
    assert np.frombuffer(got.frame, np.uint8).ctypes.data % mmap.PAGESIZE == _ALIGN_AT
    for off, piece in got.pieces:
        assert bytes(piece) == frame[off:off + len(piece)]
        assert bytes(got.frame[off:off + len(piece)]) == bytes(piece)  # where it lies
    buf = PageBuffer()
    first = buf.raw(10)
    first[:3] = b"abc"
    grown = buf.raw(1 << 20, keep=3)
    assert bytes(grown[:3]) == b"abc" and len(grown) >= 1 << 20
    assert np.frombuffer(grown, np.uint8).ctypes.data % mmap.PAGESIZE == _ALIGN_AT


def test_a_local_file_cut_inside_a_wanted_block_fails_naming_the_chunk(tmp_path):
    level_store(tmp_path / "s.zarr", chunks=(1, 37, 12, 20))
    path = tmp_path / "s.zarr" / "t" / "c" / "1" / "0" / "0" / "0"
    frame = path.read_bytes()
    plan = plan_frame(frame, 37 * 240 * 4, byte_ranges((1, 37, 12, 20), 4, ((30, 31),)))
    path.write_bytes(frame[:plan.spans[-1][0] + 10])  # ends 10 bytes into the block
    src = ib.open_source(tmp_path / "s.zarr")
    r = StripeReader(src.arrays[0], src.variables[0], src.url)
    out = np.zeros(r.geom.stripe_shape, "f4")
    with pytest.raises(CorruptChunkError, match=r"chunk 't/c/1/0/0/0' of variable 't'.* "
                       r"lacks the blocks at"):
        r.read_local_retrying([1], [out], ib.RetryPolicy(attempts=2, base_delay=0,
                                                         decode_attempts=2),
                              part=PartSpec.of([30]))


def test_blocks_sharing_an_offset_are_damaged_in_or_out_of_order():
    x = smooth((1, 37, 40, 90), "f4")
    frame = bytearray(encode(x, "zstd", 1, blocksize=16384))
    n = -(-x.nbytes // 16384)
    starts = list(struct.unpack_from(f"<{n}i", frame, HEADER))
    starts[4] = starts[3]
    struct.pack_into(f"<{n}i", frame, HEADER, *starts)
    few = byte_ranges(x.shape, 4, ((3, 4),))
    assert "blocks 3 and 4 share offset" in plan_frame(bytes(frame), x.nbytes, few).reason
    starts[0], starts[1] = starts[1], starts[0]  # out of order as well
    struct.pack_into(f"<{n}i", frame, HEADER, *starts)
    assert "share offset" in plan_frame(bytes(frame), x.nbytes, few).reason


@pytest.mark.parametrize("where", ["wanted", "unwanted"])
def test_a_damaged_block_fails_naming_the_chunk_only_where_it_is_wanted(tmp_path, where):
    data = level_store(tmp_path / "s.zarr", chunks=(1, 37, 12, 20))
    path = tmp_path / "s.zarr" / "t" / "c" / "1" / "0" / "0" / "0"
    frame = bytearray(path.read_bytes())
    wanted = byte_ranges((1, 37, 12, 20), 4, PartSpec.of([5]).ranges)
    plan = plan_frame(frame, 37 * 240 * 4, wanted)
    others = plan_frame(frame, 37 * 240 * 4, byte_ranges((1, 37, 12, 20), 4, ((30, 31),)))
    s, e = plan.spans[0] if where == "wanted" else others.spans[-1]
    frame[s + 4:e] = bytes(e - s - 4)  # the block's streams zeroed
    path.write_bytes(bytes(frame))
    src = ib.open_source(tmp_path / "s.zarr")
    r = StripeReader(src.arrays[0], src.variables[0], src.url)
    out = np.zeros(r.geom.stripe_shape, "f4")
    if where == "unwanted":  # a part never looks at it
        r.read_local(1, out, part=PartSpec.of([5]))
        np.testing.assert_array_equal(out[:, 5], data[1:2, 5])
        return
    with pytest.raises(CorruptChunkError, match=r"chunk 't/c/1/0/0/0' of variable 't'.* did "
                       r"not decode in 2 attempts"):
        r.read_local_retrying([1], [out], ib.RetryPolicy(attempts=3, base_delay=0,
                                                         decode_attempts=2),
                              part=PartSpec.of([5]))


def test_virtual_hdf5_chains_read_whole_with_a_part(tmp_path):
    """HDF5's shuffle + zlib (virtualizarr's chain): not blosc, so whole, as before."""
    g = zarr.open_group(tmp_path / "s.zarr", mode="w", zarr_format=2)
    a = g.create_array("t", shape=(4, 6, 10), chunks=(1, 6, 10), dtype="f4",
                       filters=None, compressor=numcodecs.Zlib(), **{})
    a[:] = smooth((4, 6, 10), "f4")
    src = ib.open_source(tmp_path / "s.zarr")
    r = StripeReader(src.arrays[0], src.variables[0], src.url)
    out = np.zeros(r.geom.stripe_shape, "f4")
    r.read_local(2, out, part=PartSpec.of([1, 4]))
    np.testing.assert_array_equal(out, a[2:3])
    assert r.partial_stats.whole_reads == 1


# -- the rule that decides whether a second round trip pays -----------------------------
class SlowGets:
    """A store whose every GET takes ``latency`` plus its bytes at ``bandwidth``."""

    def __init__(self, frame, latency, bandwidth):
        self.frame, self.latency, self.bandwidth = frame, latency, bandwidth
        self.got = 0

    async def _take(self, n):
        self.got += n
        await asyncio.sleep(self.latency + n / self.bandwidth)

    async def get(self, key):
        await self._take(len(self.frame))
        return self.frame

    async def get_range(self, key, start, end):
        await self._take(min(end, len(self.frame)) - start)
        return self.frame[start:end]

    async def get_ranges(self, key, ranges):
        await self._take(sum(e - s for s, e in ranges))
        return [self.frame[s:e] for s, e in ranges]


@pytest.mark.parametrize("bandwidth,pays", [(2e5, True), (5e9, False)])
def test_the_measured_rule_keeps_partial_fetches_only_where_the_round_trip_pays(bandwidth,
                                                                                 pays):
    from insitubatch_nodes.io.partial.fetch import PartialFetch

    x = smooth((1, 37, 20, 40), "f4")
    frame = encode(x, "zstd", 1, blocksize=4096)
    wanted = byte_ranges(x.shape, 4, PartSpec.of(WANTED).ranges)
    fetch = PartialFetch(PartialRule(trials=3))
    gets = SlowGets(frame, 0.01, bandwidth)
    loop = asyncio.new_event_loop()
    try:
        kinds = [type(loop.run_until_complete(fetch.fetch(gets, "k", x.nbytes, wanted)))
                 for _ in range(5)]
    finally:
        loop.close()
    assert kinds[:3] == [SparseFrame] * 3  # the trials
    assert fetch.pays(wanted) is pays
    assert kinds[3:] == ([SparseFrame] * 2 if pays else [bytes] * 2)


# -- object stores: only the header, the offsets and the needed blocks cross the wire ------
class CountingProxy(FaultProxy):
    """A fault proxy without faults that counts the chunk bytes the server sent."""

    def __init__(self, upstream):
        self.chunk_bytes = self.chunk_gets = 0
        super().__init__(upstream, FaultPlan())

    async def _forward(self, method, path, headers, body):
        status, rheaders, rbody = await super()._forward(method, path, headers, body)
        if method == "GET" and "/c/" in path:
            self.chunk_bytes += len(rbody)
            self.chunk_gets += 1
        return status, rheaders, rbody


LEVELS_SHAPE, LEVELS_CHUNKS = (3, 37, 12, 40), (1, 37, 12, 40)
NARROW, WIDER = PartSpec.of(WANTED), PartSpec.of([*WANTED, 0, 1, 2, 3])


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    from insitubatch_nodes.testing.s3server import serving

    folder = tmp_path_factory.mktemp("s3")
    good, bad = folder / "local-lev.zarr", folder / "local-bad.zarr"
    data = level_store(good, 3, LEVELS_CHUNKS, shape=LEVELS_SHAPE)
    level_store(bad, 3, LEVELS_CHUNKS, shape=LEVELS_SHAPE)
    chunk = bad / "t" / "c" / "1" / "0" / "0" / "0"
    frame = bytearray(chunk.read_bytes())
    s, e = needed(bytes(frame), NARROW).spans[0]
    frame[s + 4:e] = bytes(e - s - 4)
    chunk.write_bytes(bytes(frame))
    with serving(folder, "data", {"lev.zarr": good, "bad.zarr": bad}) as server:
        yield server, data, good


def needed(frame: bytes, part: PartSpec) -> BlockPlan:
    chunk = int(np.prod(LEVELS_CHUNKS)) * 4
    cp = chunk_part(part, LEVELS_CHUNKS, (1, 37, *LEVELS_CHUNKS[2:]),
                    (0,) * (len(LEVELS_CHUNKS) - 1), 4)
    plan = plan_frame(frame, chunk, cp.byte_ranges)
    assert isinstance(plan, BlockPlan), plan
    return plan


def frames(local) -> list[bytes]:
    return [(local / "t" / "c" / str(i) / "0" / "0" / "0").read_bytes() for i in range(3)]


def open_via(server, proxy, name="lev.zarr"):
    return ib.open_source(f"s3://data/{name}",
                          storage_options=server.options(endpoint=proxy.endpoint))


EXACT = {"head_guess": 16, "min_saved_bytes": 0, "max_requests": 1000}


def check_levels(reads, data, part, index):
    cols = [j for lo, hi in part.ranges for j in range(lo, hi)]
    np.testing.assert_array_equal(reads(index, part)[:, cols], data[index:index + 1, cols])


def test_an_object_store_sends_only_the_header_and_the_wanted_blocks(s3):
    server, data, local = s3
    with CountingProxy(server.address) as proxy:
        reads = Reads(open_via(server, proxy), **EXACT)
        try:
            for i in range(3):
                check_levels(reads, data, NARROW, i)
        finally:
            reads.close()
    want = sum(needed(f, NARROW).header.head_bytes + needed(f, NARROW).span_bytes
               for f in frames(local))
    stats = reads.reader.partial_stats
    assert proxy.chunk_bytes == want == stats.bytes_fetched
    assert (stats.partial_fetches, stats.whole_fetches, stats.partial_reads) == (3, 0, 3)
    assert stats.frame_bytes == sum(len(f) for f in frames(local))
    assert stats.fetched_fraction < 0.7


def test_a_part_of_nearly_every_block_is_fetched_whole(s3):
    server, data, local = s3
    most = PartSpec.of(range(36))
    with CountingProxy(server.address) as proxy:
        reads = Reads(open_via(server, proxy), head_guess=16)
        try:
            for i in range(3):
                check_levels(reads, data, most, i)
        finally:
            reads.close()
    whole = sum(len(f) for f in frames(local))
    stats = reads.reader.partial_stats
    assert proxy.chunk_bytes == whole == stats.bytes_fetched  # the first: header, then rest
    assert proxy.chunk_gets == 3 + 2  # the first chunk's header, offsets and rest; then one
    assert (stats.partial_fetches, stats.whole_fetches) == (0, 3)
    part = reads.reader.chunk_parts(most)[0]
    assert reads.reader.partial.pays(part.byte_ranges) is False


def test_the_chunk_cache_serves_a_part_it_holds_and_fetches_only_the_rest_of_a_wider_one(
        s3, tmp_path):
    server, data, local = s3
    cache = ib.ChunkCache(tmp_path / "cache", max_bytes="1GB")
    with CountingProxy(server.address) as proxy:
        reads = Reads(open_via(server, proxy), **EXACT)
        r = reads.reader
        r.use_cache(cache)
        try:
            for i in range(3):
                check_levels(reads, data, NARROW, i)
            cache.flush()
            first = proxy.chunk_bytes
            assert first == sum(needed(f, NARROW).header.head_bytes
                                + needed(f, NARROW).span_bytes for f in frames(local))
            for i in range(3):  # the same part again: from the cache
                check_levels(reads, data, NARROW, i)
                assert r.is_cached(i, part=NARROW) and r.is_cached(i, part=WIDER)
                out = np.zeros(r.geom.stripe_shape, "f4")
                assert r.read_cached([i], [out], part=NARROW) == []
                np.testing.assert_array_equal(out[:, WANTED], data[i:i + 1, WANTED])
                # the cached blocks do not hold the wider part: a miss, never a hole
                assert r.read_cached([i], [out], part=WIDER) == [i]
            assert proxy.chunk_bytes == first
            for i in range(3):  # wider: only the blocks not cached yet
                check_levels(reads, data, WIDER, i)
            cache.flush()
            more = sum(sum(e - s for s, e in merge(needed(f, WIDER).spans))
                       - overlap(needed(f, WIDER).spans, needed(f, NARROW).spans)
                       for f in frames(local))
            assert proxy.chunk_bytes - first == more
            second = proxy.chunk_bytes
            for i in range(3):  # both parts now from the widened entries
                check_levels(reads, data, WIDER, i)
                check_levels(reads, data, NARROW, i)
            assert proxy.chunk_bytes == second
            for i in range(3):  # no part: whole frames, cached whole, then serving any part
                np.testing.assert_array_equal(reads(i, None), data[i:i + 1])
            cache.flush()
            assert proxy.chunk_bytes - second == sum(len(f) for f in frames(local))
            third = proxy.chunk_bytes
            for i in range(3):
                check_levels(reads, data, PartSpec.of([4, 5, 6]), i)
            assert proxy.chunk_bytes == third
        finally:
            reads.close()
    assert cache.verify() == 0


def overlap(a, b) -> int:
    """Bytes the ranges ``a`` and ``b`` share."""
    return sum(max(0, min(e1, e2) - max(s1, s2)) for s1, e1 in a for s2, e2 in b)


def test_a_damaged_block_on_an_object_store_fails_naming_the_chunk(s3):
    server, _, _ = s3
    with CountingProxy(server.address) as proxy:
        reads = Reads(open_via(server, proxy, "bad.zarr"), **EXACT)
        try:
            check_levels(reads, s3[1], NARROW, 0)
            with pytest.raises(CorruptChunkError, match=r"chunk 't/c/1/0/0/0' of "
                               r"variable 't' in s3://data/bad.zarr did not decode in 2 "
                               r"attempts.*blosc block \d+ \(bytes \d+\.\.\d+ of the "
                               r"frame\) did not decode"):
                reads(1, NARROW, ib.RetryPolicy(attempts=3, base_delay=0, decode_attempts=2))
        finally:
            reads.close()


def test_an_array_whose_frames_cannot_be_read_in_part_is_fetched_whole_after_a_few():
    from insitubatch_nodes.io.partial.fetch import PartialFetch

    x = np.random.default_rng(0).integers(0, 256, (1, 37, 20, 40), "u1")
    frame = encode(x, "lz4", 0, clevel=1)
    assert frame[2] & 0x02  # stored uncompressed: no blocks to read alone
    wanted = byte_ranges(x.shape, 1, PartSpec.of(WANTED).ranges)
    fetch = PartialFetch(PartialRule(trials=2))
    gets = SlowGets(frame, 0.0, 1e12)
    loop = asyncio.new_event_loop()
    try:
        for _ in range(4):
            assert bytes(loop.run_until_complete(fetch.fetch(gets, "k", x.nbytes, wanted))) \
                == frame
    finally:
        loop.close()
    assert fetch.pays(wanted) is False
    # two trials of header + rest, then the whole frame in one GET each
    assert gets.got == 4 * len(frame) and fetch.stats.whole_fetches == 4


@st.composite
def boxes(draw):
    """A C-order chunk shape (2-4 axes) and wanted ranges along axis 1 and some later ones."""
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=2, max_size=4)))

    def ranges(n):
        cuts = sorted(draw(st.sets(st.integers(0, n), min_size=2, max_size=4)))
        return merge((a, b) for a, b in zip(cuts[::2], cuts[1::2], strict=False))

    axis1 = ranges(shape[1])
    box = tuple((a, ranges(shape[a])) for a in range(2, len(shape)) if draw(st.booleans()))
    return shape, axis1, tuple((a, rs) for a, rs in box if rs)


def _mask(shape, axis1, box):
    """The wanted items of a C-order array, by definition."""
    keep = [np.ones(n, bool) for n in shape]
    for axis, rs in ((1, axis1), *box):
        keep[axis] = np.zeros(shape[axis], bool)
        for lo, hi in rs:
            keep[axis][lo:hi] = True
    axes = [k.reshape([-1 if j == i else 1 for j in range(len(shape))])
            for i, k in enumerate(keep)]
    return functools.reduce(np.logical_and, axes)


@given(boxes(), st.sampled_from([1, 4]))
@settings(max_examples=200, deadline=None)
def test_a_boxs_byte_ranges_are_its_items(case, itemsize):
    """byte_ranges of axis-1 indices and a box along later axes cover exactly the wanted
    items of the C-order chunk, joined where they touch."""
    shape, axis1, box = case
    if not axis1:
        return
    flat = np.broadcast_to(_mask(shape, axis1, box), shape).ravel()
    edges = np.flatnonzero(np.diff(np.concatenate([[0], flat.astype(np.int8), [0]])))
    want = tuple((int(a) * itemsize, int(b) * itemsize)
                 for a, b in zip(edges[::2], edges[1::2], strict=True))
    assert byte_ranges(shape, itemsize, axis1, box) == want


@given(boxes())
@settings(max_examples=100, deadline=None)
def test_copy_wanted_copies_the_box_and_nothing_else(case):
    shape, axis1, box = case
    if not axis1:
        return
    chunk = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    out = np.full(shape, -1.0, dtype=np.float32)
    whole = tuple(slice(0, n) for n in shape)
    copy_wanted(out, whole, chunk, whole, axis1, box)
    mask = np.broadcast_to(_mask(shape, axis1, box), shape)
    np.testing.assert_array_equal(out[mask], chunk[mask])
    assert (out[~mask] == -1).all()


def test_a_chunk_outside_the_box_is_not_read():
    spec = PartSpec(((0, 3),), box=((2, ((4, 6),)),))  # rows 4-5 of a (., 3, 8, 5) array
    args = ((1, 3, 4, 5), (1, 3, 8, 5))
    assert chunk_part(spec, *args, (0, 0, 0), 4) is None  # rows 0-3
    cp = chunk_part(spec, *args, (0, 1, 0), 4)  # rows 4-7 of which 4-5 (0-1 in the chunk)
    assert cp is not None and cp.box == ((2, ((0, 2),)),) and not cp.whole
    with pytest.raises(ValueError, match="ascending"):
        PartSpec(((0, 1),), box=((3, ((0, 1),)), (2, ((0, 1),))))
