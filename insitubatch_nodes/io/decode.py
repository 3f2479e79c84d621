"""Direct numcodecs decoders for the codec chains we special-case.

zarr's own path adds its codec pipeline's Python hand-offs per chunk and copies each decoded
chunk once more; for the common chains (bytes + blosc/zstd/gzip/crc32c, zarr v2 compressors,
HDF5's shuffle + zlib as virtualizarr writes them) we decode straight into window memory
instead. Anything else (sharding, transpose, filters) returns ``None`` and is read through
zarr, so no array zarr can read is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import numcodecs
import numcodecs.blosc
import numpy as np
import zarr

from . import blosc2_lib
from .blosc_frame import check_header
from .codec_chain import CodecChain, classify
from .partial.decode import decode_blocks
from .partial.ranges import Ranges
from .partial.sparse import SparseFrame
from .retry import DECODE_ERRORS, ChunkDecodeError
from .thread_buffer import ThreadBuffer

if TYPE_CHECKING:
    from typing_extensions import Buffer

# DECODE_ERRORS and gzip's BadGzipFile (an OSError): bytes in hand, so not the store's.
_CODEC_ERRORS = (*DECODE_ERRORS, OSError)
_INFLATED = ThreadBuffer()  # per decode thread: the inflate under HDF5's shuffle


Inflate = Callable[["Buffer", np.ndarray], bool]


def _imagecodecs_inflate(codec: numcodecs.abc.Codec) -> Inflate | None:
    """libdeflate (through imagecodecs, where installed) for numcodecs' ``GZip`` and
    ``Zlib``: 1.8-2.3x numcodecs' inflate on this VM (``benchmarks/bench_decoders.py``;
    numcodecs goes through Python's ``gzip`` and ``zlib`` modules). imagecodecs' blosc and zstd
    decoders measured no faster than numcodecs', nor its ``zlib_decode`` (zlib, not
    libdeflate)."""
    if not isinstance(codec, numcodecs.GZip | numcodecs.Zlib):
        return None
    try:
        import imagecodecs
    except ImportError:
        return None
    # deflate_decode reads the zlib container. Typed loosely: imagecodecs' stubs name bytes
    # in and bytearray out, and it takes any buffer both ways (an ndarray ``out`` here).
    fn: Callable[..., Any] = (imagecodecs.gzip_decode if isinstance(codec, numcodecs.GZip)
                              else imagecodecs.deflate_decode)

    def inflate(data: Buffer, out: np.ndarray) -> bool:
        flat = out.reshape(-1).view(np.uint8)
        try:
            got = fn(data, out=flat)
        except RuntimeError:  # imagecodecs' DeflateError
            return False
        return got is not None and len(got) == flat.size

    return inflate


def _blosc2_decompress(codec: numcodecs.abc.Codec) -> Inflate | None:
    """c-blosc2 with a context per decode thread (``blosc2_lib``), where python-blosc2 is
    installed, for numcodecs' ``Blosc``: 1.03-1.22x numcodecs' decode of the same frames,
    one thread or two (``benchmarks/bench_decoders.py``; the header checks that keep its
    errors numcodecs' are in ``blosc2_lib``)."""
    if not isinstance(codec, numcodecs.Blosc):
        return None
    lib = blosc2_lib.load()
    return lib.decompress_into if lib is not None else None


def _fast(codec: numcodecs.abc.Codec) -> Inflate | None:
    return _imagecodecs_inflate(codec) or _blosc2_decompress(codec)


@dataclass(frozen=True)
class ChunkDecoder:
    """Decodes one stored chunk's bytes into a C-contiguous array of the chunk's shape."""

    codecs: tuple[numcodecs.abc.Codec, ...]  # bytes-to-bytes, in encode order
    byteswap: bool
    chain: str  # human-readable codec chain, for errors and inspect
    # Per codec (encode order), a faster decoder where there is one (``_imagecodecs_inflate``)
    # that returns True when it filled a buffer of the chunk's size exactly; anything else
    # (an error, another size: a multi-member gzip stream, say) goes to numcodecs, which
    # decides whether the bytes decode at all.
    fast: tuple[Inflate | None, ...] = field(default=(), compare=False)
    libraries: str = field(default="numcodecs", compare=False)  # who decodes, for inspect
    # The archives' common chain, one blosc codec and native bytes, is decoded without the
    # general loop: ~1 us less Python per chunk, on the decode threads' GIL.
    _blosc_only: bool = field(init=False, default=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_blosc_only", len(self.codecs) == 1 and not self.byteswap
                           and isinstance(self.codecs[0], numcodecs.Blosc))

    def decode_into(self, data: bytes | memoryview, out: np.ndarray) -> None:
        """Decode received ``data`` into ``out``. Bytes that do not decode raise
        ``ChunkDecodeError`` (the codec's error as ``__cause__``): the type the retries
        treat as a possibly truncated transfer."""
        try:
            self._decode_into(data, out)
        except _CODEC_ERRORS as e:
            raise ChunkDecodeError(f"{self.chain}: {e}") from e

    @property
    def blosc_only(self) -> bool:
        """One blosc codec and native bytes: chunks that can be decoded in part
        (``decode_part_into``)."""
        return self._blosc_only

    def decode_part_into(self, data: bytes | memoryview | SparseFrame, out: np.ndarray,
                         wanted: Ranges) -> bool:
        """Decode at least the decoded-byte ranges ``wanted`` of ``data`` into ``out``:
        only the blosc blocks holding them where the chain is a lone blosc and the frame
        allows it (True), else the whole chunk (False). A ``SparseFrame`` (only some blocks
        fetched) must decode in part. Errors as ``decode_into``'s."""
        try:
            if ((isinstance(data, SparseFrame) or self._blosc_only)
                    and decode_blocks(data, out, wanted)):
                return True
            if isinstance(data, SparseFrame):  # not reached: it decodes in part or raises
                raise ChunkDecodeError("part of a blosc frame did not decode in part")
            self._decode_into(data, out)
        except _CODEC_ERRORS as e:
            raise ChunkDecodeError(f"{self.chain}: {e}") from e
        return False

    def _decode_into(self, data: bytes | memoryview, out: np.ndarray) -> None:
        if self._blosc_only:
            _blosc_into(data, out, self.fast[0] if self.fast else None)
            return
        buf: Buffer = data
        n = len(self.codecs)
        for i, codec in enumerate(reversed(self.codecs)):
            last = i == n - 1
            fast = self.fast[n - 1 - i] if self.fast else None
            if last:
                if isinstance(codec, numcodecs.Blosc):
                    _blosc_into(buf, out, fast)
                elif fast is not None and fast(buf, out):
                    pass
                elif isinstance(codec, numcodecs.Shuffle):
                    _unshuffle_into(codec, buf, out)
                elif _fills_exactly(codec, buf, out.nbytes):
                    codec.decode(buf, out=out)  # numcodecs fills a given ``out``
                else:  # size not in a header: decode, then copy with the size checked
                    _copy_bytes(codec.decode(buf), out)
            elif fast is not None:  # HDF5's zlib under its shuffle: inflates to the chunk's size
                tmp = _INFLATED.array(out.shape, out.dtype)  # valid until its next chunk
                # an ndarray is a buffer (numpy's stubs say so on Python 3.12+ only)
                buf = cast("Buffer", tmp) if fast(buf, tmp) else codec.decode(buf)
            else:
                buf = codec.decode(buf)
        if not self.codecs:
            _copy_bytes(buf, out)
        if self.byteswap:
            out.byteswap(inplace=True)


def _blosc_into(data: Buffer, out: np.ndarray, fast: Inflate | None) -> None:
    """A blosc frame into ``out``: its header checked against its length and ``out`` first
    (what neither library checks: a short body), then c-blosc2 where it takes the frame,
    else numcodecs."""
    check_header(data, out.nbytes)
    if fast is None or not fast(data, out):
        numcodecs.blosc.decompress(data, out)


def _unshuffle_into(codec: numcodecs.Shuffle, src: Buffer, out: np.ndarray) -> None:
    """HDF5's shuffle filter undone into ``out``: numcodecs writes as many bytes as it is
    given without checking ``out``'s size, so a short or long chunk is refused first."""
    n = memoryview(src).nbytes
    if n != out.nbytes:
        raise ChunkDecodeError(f"shuffled chunk has {n} bytes, expected {out.nbytes}")
    codec.decode(src, out=out)


_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def _zstd_content_size(data: Buffer) -> int | None:
    """The decoded size a zstd frame header states (RFC 8878, 3.1.1.1), or ``None`` if
    it states none. numcodecs exposes no ZSTD_getFrameContentSize, and these few bytes
    spare the hot path a decode into fresh memory and a copy."""
    head = bytes(memoryview(data).cast("B")[:18])
    if len(head) < 6 or head[:4] != _ZSTD_MAGIC:
        return None
    fhd = head[4]
    single = (fhd >> 5) & 1
    size = (1 if single else 0, 2, 4, 8)[fhd >> 6]
    at = 5 + (0 if single else 1) + (0, 1, 2, 4)[fhd & 3]
    if size == 0 or len(head) < at + size:
        return None
    return int.from_bytes(head[at:at + size], "little") + (256 if size == 2 else 0)


def _fills_exactly(codec: numcodecs.abc.Codec, data: Buffer, nbytes: int) -> bool:
    """Whether ``codec.decode(data, out=...)`` of ``nbytes`` is known to write exactly
    ``nbytes``. numcodecs' Zstd, LZ4 and GZip only check that ``out`` is large enough: a
    short chunk (metadata rewritten without its chunks) would leave the rest of ``out``
    holding an older chunk. LZ4 states the size in a prefix, checked here (a wrong one
    raises); a zstd frame states its own, so a chunk whose first frame does not state the
    chunk's size (none stated, several frames, or short) is decoded and copied with the size
    checked, as GZip is (its libdeflate path checks the size itself)."""
    if isinstance(codec, numcodecs.Zstd):
        got = _zstd_content_size(data)
        if got != nbytes:  # no size stated, or several frames (the first states its own)
            return False
    elif isinstance(codec, numcodecs.LZ4):
        head = bytes(memoryview(data).cast("B")[:4])
        got = int.from_bytes(head, "little") if len(head) == 4 else -1
    else:  # the others copy through numcodecs' ndarray_copy, which checks the size
        return not isinstance(codec, numcodecs.GZip)
    if got != nbytes:
        raise ChunkDecodeError(f"chunk decodes to {got} bytes, expected {nbytes}")
    return True


def _copy_bytes(src: Buffer, out: np.ndarray) -> None:
    raw = np.frombuffer(memoryview(src).cast("B"), dtype=np.uint8)
    dst = out.reshape(-1).view(np.uint8)
    if raw.size != dst.size:
        raise ChunkDecodeError(f"decoded chunk has {raw.size} bytes, expected {dst.size}")
    dst[...] = raw


def decoder_for(arr: zarr.Array) -> ChunkDecoder | None:
    """A fast decoder for this array's codec chain, or ``None`` to use zarr's path."""
    return decoder_from(classify(arr))


def decoder_from(chain: CodecChain) -> ChunkDecoder | None:
    """``decoder_for`` of an already classified chain: plain chunks whose every
    bytes-to-bytes codec has a numcodecs equivalent (sharding, transpose, filters and codecs
    only zarr knows return ``None``)."""
    if not chain.plain:
        return None
    codecs = []
    for c in chain.compressors:
        if c.numcodecs is None:
            return None
        codecs.append(numcodecs.get_codec(dict(c.numcodecs)))
    fast = tuple(_fast(c) for c in codecs)
    return ChunkDecoder(tuple(codecs), chain.byteswap, chain.text, fast if any(fast) else (),
                        _libraries(codecs, fast))


def _libraries(codecs: list[numcodecs.abc.Codec], fast: tuple[Inflate | None, ...]) -> str:
    """Which library decodes each codec, for ``inspect``: numcodecs unless a faster one
    took it."""
    names = []
    for c, f in zip(codecs, fast, strict=True):
        if f is None:
            names.append("numcodecs")
        elif isinstance(c, numcodecs.Blosc):
            lib = blosc2_lib.load()
            names.append(f"c-blosc2 {lib.version if lib is not None else ''}".strip())
        else:
            names.append("libdeflate (imagecodecs)")
    return ", ".join(dict.fromkeys(names)) if names else "none (raw bytes)"
