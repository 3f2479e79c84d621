"""Which codec chains the GPU decode path can take, and host checks of their frames (pure).

nvCOMP decodes raw zstd, LZ4 and gzip streams (``bitstream_kind=RAW``) — and so the LZ4 /
zstd streams inside blosc frames, which ``blosc_frame`` lays out on the host — and its
zstd/gzip decoders assume valid input (a damaged frame is undefined behaviour, not an
error). So each chain is classified once per variable, and every frame is checked on the
host before it goes to the device: a truncated or foreign frame becomes a ``ValueError``
that the reader retries and names by chunk key, as on the CPU path.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import zarr

from .blosc_frame import UnsupportedFrame, parse_blosc
from .codec_chain import CodecChain, classify
from .retry import ChunkDecodeError


@dataclass(frozen=True)
class DeviceChain:
    """A chain the device can decode: ``algorithm`` (``None``: stored uncompressed) applied
    to the frame after ``skip`` leading bytes (numcodecs' LZ4 writes a 4-byte size first)."""

    algorithm: str | None  # "zstd" | "lz4" | "gzip" | "blosc" | None
    skip: int
    chain: str  # human-readable, as in ChunkDecoder.chain

    def check(self, frame: bytes | memoryview, nbytes: int) -> None:
        """Raise ``ValueError`` unless ``frame`` is a whole frame decoding to ``nbytes``."""
        view = memoryview(frame).cast("B")
        if self.algorithm is None:
            if view.nbytes != nbytes:
                raise ChunkDecodeError(f"uncompressed chunk has {view.nbytes} bytes, expected "
                                       f"{nbytes}")
        elif self.algorithm == "zstd":
            check_zstd_frame(view, nbytes)
        elif self.algorithm == "lz4":
            check_lz4_frame(view, nbytes)
        elif self.algorithm == "gzip":
            check_gzip_frame(view, nbytes)
        elif self.algorithm == "blosc":
            try:
                parsed = parse_blosc(view, nbytes)
            except UnsupportedFrame:
                return  # sound, but not for the device: the host decodes it (WindowDecoder)
            if parsed.codec == "zstd":  # nvCOMP's zstd trusts its input: walk every stream
                for b in parsed.streams:
                    if not b.raw:
                        check_zstd_frame(view[b.src : b.src + b.size], b.out)


@dataclass(frozen=True)
class HostOnly:
    """Why a chain stays on the CPU path (logged once per variable)."""

    reason: str
    chain: str


_DEVICE_ALGORITHMS = {"zstd": 0, "lz4": 4, "gzip": 0, "blosc": 0}  # name -> bytes skipped


def device_chain_for(arr: zarr.Array) -> DeviceChain | HostOnly:
    """Classify ``arr``'s codec chain for GPU decoding."""
    return device_chain_from(classify(arr))


def device_chain_from(chain: CodecChain) -> DeviceChain | HostOnly:
    """``device_chain_for`` of an already classified chain: plain little-endian chunks under
    at most one codec that nvCOMP decodes (and whose frames the host can check)."""
    names = chain.text
    serializer = chain.serializer
    if serializer is None or serializer.name != "bytes" or chain.filters:
        return HostOnly("zarr v2 filters are decoded on the host" if chain.zarr_format == 2
                        else "sharding, transpose and other array-to-array codecs are decoded "
                             "by zarr on the host", names)
    if chain.order != "C":
        return HostOnly("Fortran-ordered chunks are reordered by zarr on the host", names)
    if chain.byteorder == "big":
        return HostOnly("big-endian bytes would need a byte swap on the device", names)
    rest = chain.compressors
    if not rest:
        return DeviceChain(None, 0, names)
    if len(rest) > 1:
        return HostOnly("more than one bytes-to-bytes codec", names)
    c = rest[0]
    if c.numcodecs is None:
        return HostOnly(f"{c.name} is a wrapper or plugin codec, not one of zarr's own: zarr "
                        "decodes it on the host", names)
    if c.name not in _DEVICE_ALGORITHMS:
        return HostOnly(f"nvCOMP has no decoder for {c.name}", names)
    if c.name == "zstd" and c.checksum:
        return HostOnly("nvCOMP does not verify zstd content checksums", names)
    if c.name == "blosc":
        why = _blosc_host_only(c.cname or "")
        if why:
            return HostOnly(why, names)
    return DeviceChain(c.name, _DEVICE_ALGORITHMS[c.name], names)


def _blosc_host_only(cname: str) -> str | None:
    """Why a blosc configuration stays on the host (None: the device decodes it): nvCOMP
    decodes its LZ4 and zstd streams, not blosclz, snappy or zlib ones."""
    if cname not in ("lz4", "lz4hc", "zstd"):
        return f"blosc with {cname} streams: nvCOMP decodes only its lz4/lz4hc/zstd streams"
    return None


_ZSTD_MAGIC = 0xFD2FB528


def check_zstd_frame(view: memoryview, nbytes: int) -> None:
    """One zstd frame spanning the whole buffer: walk the block headers (cheap: one per
    128 KiB block) so a truncated or padded frame is caught before the GPU sees it."""
    n = view.nbytes
    if n < 6 or struct.unpack_from("<I", view, 0)[0] != _ZSTD_MAGIC:
        raise ChunkDecodeError(f"not a zstd frame ({n} bytes, magic number missing)")
    fhd = view[4]
    fcs_flag, single, checksum, dict_flag = fhd >> 6, (fhd >> 5) & 1, (fhd >> 2) & 1, fhd & 3
    if fhd & 0x08:
        raise ChunkDecodeError("zstd frame header has its reserved bit set")
    pos = 5 + (0 if single else 1) + (0, 1, 2, 4)[dict_flag]
    fcs_size = (1 if single else 0, 2, 4, 8)[fcs_flag]
    if pos + fcs_size > n:
        raise ChunkDecodeError(f"zstd frame of {n} bytes is shorter than its header")
    if fcs_size:
        fmt = {1: "<B", 2: "<H", 4: "<I", 8: "<Q"}[fcs_size]
        size = struct.unpack_from(fmt, view, pos)[0] + (256 if fcs_size == 2 else 0)
        if size != nbytes:
            raise ChunkDecodeError(f"zstd frame says it decodes to {size} bytes, expected {nbytes}")
    pos += fcs_size
    while True:
        if pos + 3 > n:
            raise ChunkDecodeError(f"zstd frame is truncated: {n} bytes, a block header at {pos}")
        header = view[pos] | (view[pos + 1] << 8) | (view[pos + 2] << 16)
        last, kind, size = header & 1, (header >> 1) & 3, header >> 3
        if kind == 3:
            raise ChunkDecodeError(f"zstd frame has a reserved block type at byte {pos}")
        pos += 3 + (1 if kind == 1 else size)
        if last:
            break
    end = pos + (4 if checksum else 0)
    if end != n:
        raise ChunkDecodeError(f"zstd frame is damaged: its blocks end at byte {end}, the buffer "
                               f"holds {n}")


def check_lz4_frame(view: memoryview, nbytes: int) -> None:
    """numcodecs' LZ4: a little-endian uint32 decoded size, then one raw LZ4 block."""
    if view.nbytes < 5:
        raise ChunkDecodeError(f"LZ4 frame of {view.nbytes} bytes is shorter than its header")
    size = struct.unpack_from("<I", view, 0)[0]
    if size != nbytes:
        raise ChunkDecodeError(f"LZ4 frame says it decodes to {size} bytes, expected {nbytes}")


def check_gzip_frame(view: memoryview, nbytes: int) -> None:
    """gzip member: magic and deflate method up front, decoded size mod 2**32 at the end
    (a truncated member loses its trailer, so the size no longer matches)."""
    n = view.nbytes
    if n < 18 or view[0] != 0x1F or view[1] != 0x8B or view[2] != 8:
        raise ChunkDecodeError(f"not a gzip member ({n} bytes, magic number or method missing)")
    size = struct.unpack_from("<I", view, n - 4)[0]
    if size != nbytes % (1 << 32):
        raise ChunkDecodeError(f"gzip member is damaged: its trailer says {size} bytes, expected "
                               f"{nbytes}")
