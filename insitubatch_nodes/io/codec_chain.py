"""One description of a zarr array's codec chain, read from its metadata once (pure).

The host decoder (``decode``), the GPU classifier (``device_chain``) and ``inspect`` ask the
same questions of a chain (which codecs, in what order, with which parameters, stored in
which byte order), so they ask this description rather than each walking zarr's codec
objects its own way. zarr v2 metadata is described as v3 would write it: its filters, a
``bytes`` serializer in the dtype's byte order, then its compressor.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import zarr
import zarr.codecs as zc
from zarr.abc.codec import ArrayArrayCodec, ArrayBytesCodec, BytesBytesCodec

from ..errors import StoreError

Role = Literal["array-array", "array-bytes", "bytes-bytes"]
ByteOrder = Literal["little", "big"]
Config = tuple[tuple[str, Any], ...]  # a numcodecs config, as sorted (key, value) pairs
# zarr v3 names of wrapped numcodecs codecs we decode ourselves -> their numcodecs id: HDF5's
# deflate and shuffle as virtualizarr writes them. Names that read like zarr's own codecs
# (numcodecs.zstd, .gzip, .blosc) stay with zarr: their parameters live elsewhere.
_HDF5_WRAPPERS = {"numcodecs.zlib": "zlib", "numcodecs.shuffle": "shuffle"}


@dataclass(frozen=True)
class Codec:
    """One codec of a chain, with the parameters the decoders and the report need.

    ``numcodecs`` is set only where a numcodecs codec decodes this one's bytes exactly as
    zarr does; a codec without it (most wrappers, a foreign codec) is left to zarr to
    decode.
    """

    name: str  # "bytes", "zstd", "blosc", "sharding", ...: v3 class name; v2 codec id
    role: Role
    numcodecs: Config | None = None  # numcodecs.get_codec(dict(numcodecs)) decodes it
    checksum: bool = False  # zstd: frames carry a content checksum
    cname: str | None = None  # blosc: the compressor of its inner streams
    inner: tuple[Codec, ...] = ()  # sharding: the chain of each inner chunk

    @property
    def label(self) -> str:
        """The name with sharding's inner chain and blosc's compressor: ``blosc(zstd)``."""
        text = self.name
        if self.inner:
            text += "[" + " -> ".join(c.name for c in self.inner) + "]"
        if self.cname is not None:
            text += f"({self.cname})"
        return text


@dataclass(frozen=True)
class CodecChain:
    """A zarr array's codecs in encode order, and how its chunks' items are laid out."""

    zarr_format: int
    codecs: tuple[Codec, ...]  # v2: filters, then "bytes", then the compressor if any
    order: Literal["C", "F"]  # item order inside a chunk before the codecs (v2 only: F)
    byteorder: ByteOrder | None  # stored multi-byte items; None: 1-byte items or unknown

    @property
    def filters(self) -> tuple[Codec, ...]:
        """Array-to-array codecs (v3 transpose, v2 filters)."""
        return tuple(c for c in self.codecs if c.role == "array-array")

    @property
    def serializer(self) -> Codec | None:
        """The array-to-bytes codec: ``bytes``, or ``sharding`` and the like."""
        return next((c for c in self.codecs if c.role == "array-bytes"), None)

    @property
    def compressors(self) -> tuple[Codec, ...]:
        """Bytes-to-bytes codecs, in encode order (a v2 compressor, zstd + crc32c, ...)."""
        return tuple(c for c in self.codecs if c.role == "bytes-bytes")

    @property
    def plain(self) -> bool:
        """Chunks are the items' bytes in C order under bytes-to-bytes codecs only: the
        shape our own decoders take (no sharding, transpose, filters or Fortran order)."""
        s = self.serializer
        return s is not None and s.name == "bytes" and not self.filters and self.order == "C"

    @property
    def byteswap(self) -> bool:
        """Stored items are in the other byte order than this machine's."""
        return self.byteorder is not None and self.byteorder != sys.byteorder

    @property
    def text(self) -> str:
        """Short form, as ``ChunkDecoder.chain`` and ``DeviceChain.chain`` name it:
        ``bytes -> zstd``, ``v2:blosc``."""
        if self.zarr_format == 2:
            comp = self.compressors
            return "v2:" + (comp[0].name if comp else "raw")
        return " -> ".join(c.name for c in self.codecs)

    @property
    def label(self) -> str:
        """Long form, for ``inspect``: ``bytes -> blosc(zstd)``, ``sharding[bytes -> zstd]``,
        ``v2:delta -> zstd``."""
        if self.zarr_format == 2:
            names = [c.name for c in self.filters]
            names.append(self.compressors[0].name if self.compressors else "raw")
            return "v2:" + " -> ".join(names)
        return " -> ".join(c.label for c in self.codecs)


def classify(arr: zarr.Array) -> CodecChain:
    """Describe ``arr``'s codec chain from its metadata (no I/O)."""
    meta = arr.metadata
    itemsize = np.dtype(arr.dtype).itemsize
    if meta.zarr_format == 3:
        codecs = tuple(_v3_codec(c, itemsize) for c in meta.codecs)
        serializer = next((c for c in meta.codecs if isinstance(c, zc.BytesCodec)), None)
        endian = serializer.endian if serializer is not None else None
        byteorder = _ENDIAN[endian.value] if endian is not None and itemsize > 1 else None
        return CodecChain(3, codecs, "C", byteorder)
    if meta.zarr_format != 2:
        raise StoreError(f"array {arr.path!r} has zarr_format={meta.zarr_format!r}; "
                         "expected 2 or 3")
    filters = tuple(Codec(f.codec_id, "array-array", _config(f)) for f in meta.filters or ())
    comp = () if meta.compressor is None else (_v2_compressor(meta.compressor),)
    order = meta.order
    if order not in ("C", "F"):
        raise StoreError(f"array {arr.path!r} has chunk order {order!r}; expected 'C' or 'F'")
    return CodecChain(2, (*filters, Codec("bytes", "array-bytes"), *comp), order,
                      _v2_byteorder(np.dtype(arr.dtype)))


def _v3_codec(c: object, itemsize: int) -> Codec:
    name = type(c).__name__.replace("Codec", "").lower()
    role: Role = ("array-array" if isinstance(c, ArrayArrayCodec)
                  else "array-bytes" if isinstance(c, ArrayBytesCodec) else "bytes-bytes")
    cname = getattr(c, "cname", None)
    inner = getattr(c, "codecs", None) or ()  # sharding's inner chain
    return Codec(name, role, _v3_numcodecs(c, itemsize),
                 checksum=bool(getattr(c, "checksum", False)),
                 cname=None if cname is None else str(getattr(cname, "value", cname)),
                 inner=tuple(_v3_codec(i, itemsize) for i in inner))


def _v3_numcodecs(c: object, itemsize: int) -> Config | None:
    """The numcodecs equivalent of zarr's own bytes-to-bytes codecs, and of the wrapped
    numcodecs zlib and shuffle that virtualizarr writes for HDF5's deflate and shuffle filters
    (zarr decodes those with that same numcodecs codec). Other wrappers: None."""
    wrapped = _HDF5_WRAPPERS.get(str(getattr(c, "codec_name", "")))
    config = getattr(c, "codec_config", None)
    if wrapped is not None and isinstance(c, BytesBytesCodec) and isinstance(config, dict):
        out = {k: v for k, v in config.items() if k != "id"}
        if wrapped == "shuffle":  # zarr fills a missing element size from the dtype
            out["elementsize"] = int(out.get("elementsize") or itemsize)
        return tuple(sorted({**out, "id": wrapped}.items()))
    if isinstance(c, zc.BloscCodec):
        return (("id", "blosc"),)  # blosc frames are self-describing: no parameters needed
    if isinstance(c, zc.ZstdCodec):
        return (("checksum", bool(c.checksum)), ("id", "zstd"), ("level", c.level))
    if isinstance(c, zc.GzipCodec):
        return (("id", "gzip"), ("level", c.level))
    if isinstance(c, zc.Crc32cCodec):
        return (("id", "crc32c"),)
    return None


def _v2_compressor(comp: Any) -> Codec:
    config = comp.get_config()
    cname = config.get("cname") if comp.codec_id == "blosc" else None
    return Codec(comp.codec_id, "bytes-bytes", _config(comp),
                 checksum=bool(config.get("checksum", False)),
                 cname=None if cname is None else str(cname))


# zarr's ``Endian`` values as the byte orders a chain names
_ENDIAN: dict[str, ByteOrder] = {"little": "little", "big": "big"}


def _config(codec: Any) -> Config:
    return tuple(sorted(codec.get_config().items()))


def _v2_byteorder(dt: np.dtype) -> ByteOrder | None:
    if dt.itemsize <= 1:
        return None
    native: ByteOrder = "little" if sys.byteorder == "little" else "big"
    orders: dict[str, ByteOrder] = {"<": "little", ">": "big", "=": native}
    return orders.get(dt.byteorder)
