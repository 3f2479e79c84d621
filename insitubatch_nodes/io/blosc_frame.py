"""Parsing blosc 1 frames on the host, so that the GPU can decode their streams, and
telling which frames are as c-blosc 1 writes them, for c-blosc2 on the CPU (pure).

nvCOMP has no blosc decoder, but a blosc 1 frame is a header, a table of block offsets and,
per block, one or ``typesize`` ("split") streams, each a plain LZ4 block or zstd frame — or
stored as is — followed by a byte shuffle that is a transpose. So the host reads the
layout (a few bytes per stream), nvCOMP decodes every stream of a window in one batch, and
the device undoes the shuffle. The layout rules follow c-blosc 1.x ``blosc_d``:

- header: version, versionlz, flags, typesize, nbytes, blocksize, cbytes (16 bytes);
- flags: 0x01 byte shuffle, 0x02 stored uncompressed ("memcpyed"), 0x04 bitshuffle,
  0x10 blocks not split, bits 5-7 the codec (0 blosclz, 1 lz4/lz4hc, 2 snappy, 3 zlib, 4 zstd);
- a full block is split into ``typesize`` streams unless the flag says not, or typesize > 16,
  or blocksize / typesize < 128; the last, short block is never split;
- each stream: int32 compressed size, then the bytes; a size equal to the stream's decoded
  size means stored as is;
- a bit shuffle transposes the block's bit matrix, and only when its element count is a
  multiple of 8 (other blocks are left as they are; checked against numcodecs).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import InsitubatchError
from .retry import ChunkDecodeError

if TYPE_CHECKING:
    from typing_extensions import Buffer

HEADER = 16
_CODECS = {1: "lz4", 4: "zstd"}  # blosc codec code -> nvCOMP-decodable stream format
_NAMES = {0: "blosclz", 1: "lz4", 2: "snappy", 3: "zlib", 4: "zstd"}
_MAX_SPLITS = 16
_MIN_BUFFERSIZE = 128


@dataclass(frozen=True)
class BloscStream:
    """One stream: ``size`` bytes at ``src`` in the frame decode to ``out`` bytes at ``dst``
    of the (still shuffled) chunk; ``raw`` streams are stored as is."""

    src: int
    size: int
    dst: int
    out: int
    raw: bool


@dataclass(frozen=True)
class BloscFrame:
    """What the device needs to rebuild a chunk from a blosc 1 frame."""

    typesize: int
    blocksize: int
    shuffle: str | None  # "byte" | "bit": undone block by block after decoding
    codec: str | None  # "lz4" | "zstd"; None when the frame is stored uncompressed
    streams: tuple[BloscStream, ...]  # empty when stored uncompressed (bytes at HEADER)


class UnsupportedFrame(InsitubatchError, ValueError):
    """A sound blosc frame whose streams the device cannot decode (blosclz, snappy, zlib):
    the host decodes it instead."""


def check_header(frame: Buffer, nbytes: int) -> memoryview:
    """The frame as bytes, once its header agrees with its length and ``nbytes``.

    Blosc 1 trusts the compressed size in its header and reads that many bytes whatever the
    buffer holds: a truncated body then "decodes" into stale memory without an error (seen in
    the fault tests), so both the CPU and the device path check this first."""
    view = memoryview(frame).cast("B")
    n = view.nbytes
    if n < HEADER:
        raise ChunkDecodeError(f"blosc frame of {n} bytes is shorter than its header")
    total, cbytes = struct.unpack_from("<i", view, 4)[0], struct.unpack_from("<i", view, 12)[0]
    if cbytes != n or total != nbytes:
        raise ChunkDecodeError(f"blosc frame is damaged: {n} bytes received, header says {cbytes} "
                               f"compressed / {total} decoded (expected {nbytes})")
    return view


def parse_blosc(frame: bytes | memoryview, nbytes: int) -> BloscFrame:
    """The frame's layout, checked against its own sizes and ``nbytes``; ``ValueError`` for a
    damaged frame, ``UnsupportedFrame`` for one with blosclz, snappy or zlib streams."""
    view = check_header(frame, nbytes)
    n = view.nbytes
    flags, typesize = view[2], view[3]
    blocksize = struct.unpack_from("<i", view, 8)[0]
    shuffle = ("byte" if flags & 0x01 and typesize > 1 else "bit" if flags & 0x04 else None)
    if flags & 0x02:  # stored as is, right after the header
        if n != HEADER + nbytes:
            raise ChunkDecodeError(f"uncompressed blosc frame holds {n - HEADER} bytes, "
                                   f"expected {nbytes}")
        return BloscFrame(typesize, blocksize, None, None, ())
    code = flags >> 5
    if code not in _CODECS:
        raise UnsupportedFrame(f"blosc codec {_NAMES.get(code, code)!r} is not decoded on the "
                               "device")
    if blocksize <= 0 or typesize <= 0:
        raise ChunkDecodeError(f"blosc frame header is damaged (blocksize {blocksize}, typesize "
                               f"{typesize})")
    nblocks, leftover = divmod(nbytes, blocksize)
    nblocks += leftover > 0
    if HEADER + 4 * nblocks > n:
        raise ChunkDecodeError(f"blosc frame of {n} bytes is shorter than its {nblocks} block "
                               "offsets")
    starts = struct.unpack_from(f"<{nblocks}i", view, HEADER)
    dont_split = bool(flags & 0x10)
    streams = []
    for j, start in enumerate(starts):
        last = j == nblocks - 1 and leftover > 0
        bsize = leftover if last else blocksize
        split = (not dont_split and typesize <= _MAX_SPLITS
                 and bsize // typesize >= _MIN_BUFFERSIZE and not last)
        nsplits = typesize if split else 1
        neblock = bsize // nsplits
        pos = start
        for k in range(nsplits):
            if pos < HEADER or pos + 4 > n:
                raise ChunkDecodeError(f"blosc frame is damaged: block {j} stream {k} starts at "
                                       f"byte {pos} of {n}")
            size = struct.unpack_from("<i", view, pos)[0]
            pos += 4
            if size < 0 or pos + size > n:
                raise ChunkDecodeError(f"blosc frame is damaged: block {j} stream {k} claims "
                                       f"{size} bytes at byte {pos} of {n}")
            streams.append(BloscStream(pos, size, j * blocksize + k * neblock, neblock,
                                       size == neblock))
            pos += size
    return BloscFrame(typesize, blocksize, shuffle, _CODECS[code], tuple(streams))


def written_by_blosc1(frame: memoryview, nbytes: int) -> bool:
    """Whether the header of ``frame`` (bytes, ``nbytes`` decoded) is one c-blosc 1 writes,
    with the checks c-blosc 1 makes on it (version 2, codec version 1, no reserved bit nor
    both shuffle bits, a block size within the chunk, the first block right after the
    offsets, or a stored frame of exactly the chunk's size). ``blosc2_lib`` gives c-blosc2
    only such frames: it is laxer with a damaged header (a wrong block size or codec
    version it decodes anyway, at times into wrong values where numcodecs raises), and
    reads both shuffle bits as its own extended header (a damaged frame of that kind left
    its context decoding later, valid frames wrong while reporting success)."""
    version, versionlz, flags, typesize = frame[0], frame[1], frame[2], frame[3]
    if version != 2 or versionlz != 1 or typesize == 0:
        return False
    if flags & 0x08 or flags & 0x05 == 0x05 or flags >> 5 > 4:  # reserved bit, codec 0..4
        return False
    blocksize = int.from_bytes(frame[8:12], "little", signed=True)
    if not 0 < blocksize <= nbytes:
        return False
    if flags & 0x02:  # stored as is, right after the header
        return frame.nbytes == HEADER + nbytes
    first = HEADER + 4 * -(-nbytes // blocksize)  # the first block follows the offsets
    return (frame.nbytes > first
            and int.from_bytes(frame[HEADER:HEADER + 4], "little", signed=True) == first)
