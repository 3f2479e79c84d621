"""Direct numcodecs decoders for the codec chains we special-case.

zarr's own path adds its codec pipeline's Python hand-offs per chunk and copies each decoded
chunk once more; for the common chains (bytes + blosc/zstd/gzip/crc32c, zarr v2 compressors) we
decode straight into window memory instead. Anything else (sharding, transpose, filters)
returns ``None`` and is read through zarr, so no array zarr can read is refused.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numcodecs
import numcodecs.blosc
import numpy as np
import zarr
import zarr.codecs as zc

from .blosc_frame import check_header

_NATIVE = sys.byteorder


@dataclass(frozen=True)
class ChunkDecoder:
    """Decodes one stored chunk's bytes into a C-contiguous array of the chunk's shape."""

    codecs: tuple[numcodecs.abc.Codec, ...]  # bytes-to-bytes, in encode order
    byteswap: bool
    chain: str  # human-readable codec chain, for errors and inspect

    def decode_into(self, data: bytes | memoryview, out: np.ndarray) -> None:
        buf: object = data
        for i, codec in enumerate(reversed(self.codecs)):
            last = i == len(self.codecs) - 1
            if last:
                if isinstance(codec, numcodecs.Blosc):
                    check_header(buf, out.nbytes)
                    numcodecs.blosc.decompress(buf, out)
                else:
                    codec.decode(buf, out=out)  # numcodecs fills a given ``out``
            else:
                buf = codec.decode(buf)
        if not self.codecs:
            _copy_bytes(buf, out)
        if self.byteswap:
            out.byteswap(inplace=True)


def _copy_bytes(src: object, out: np.ndarray) -> None:
    raw = np.frombuffer(memoryview(src).cast("B"), dtype=np.uint8)
    dst = out.reshape(-1).view(np.uint8)
    if raw.size != dst.size:
        raise ValueError(f"decoded chunk has {raw.size} bytes, expected {dst.size}")
    dst[...] = raw


def _v3_bytes_codec(codec: object) -> numcodecs.abc.Codec | None:
    if isinstance(codec, zc.BloscCodec):
        return numcodecs.Blosc()  # blosc frames are self-describing: no parameters needed
    if isinstance(codec, zc.ZstdCodec):
        return numcodecs.Zstd(level=codec.level, checksum=codec.checksum)
    if isinstance(codec, zc.GzipCodec):
        return numcodecs.GZip(level=codec.level)
    if isinstance(codec, zc.Crc32cCodec):
        from numcodecs.checksum32 import CRC32C

        return CRC32C()
    return None


def decoder_for(arr: zarr.Array) -> ChunkDecoder | None:
    """A fast decoder for this array's codec chain, or ``None`` to use zarr's path."""
    meta = arr.metadata
    itemsize = np.dtype(arr.dtype).itemsize
    if meta.zarr_format == 3:
        codecs: Sequence[object] = meta.codecs
        if not codecs or not isinstance(codecs[0], zc.BytesCodec):
            return None  # sharding, transpose or another array-to-array/bytes codec
        endian = codecs[0].endian
        out: list[numcodecs.abc.Codec] = []
        for c in codecs[1:]:
            nc = _v3_bytes_codec(c)
            if nc is None:
                return None
            out.append(nc)
        swap = endian is not None and itemsize > 1 and endian.value != _NATIVE
        names = ["bytes"] + [type(c).__name__.replace("Codec", "").lower() for c in codecs[1:]]
        return ChunkDecoder(tuple(out), swap, " -> ".join(names))
    # zarr v2: an optional compressor, no filters, C order.
    if meta.filters or meta.order != "C":
        return None
    dt = np.dtype(arr.dtype)
    swap = itemsize > 1 and dt.byteorder not in ("=", "|") and (
        (dt.byteorder == "<") != (_NATIVE == "little"))
    comp = meta.compressor
    chain = "v2:" + (comp.codec_id if comp is not None else "raw")
    return ChunkDecoder((comp,) if comp is not None else (), swap, chain)
