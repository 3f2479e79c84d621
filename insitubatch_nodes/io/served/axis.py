"""Reading a stripe of a variable sampled along an axis that is not its first.

A ``StripeReader`` whose chunk coordinates are permuted into the stored order and whose
decoded chunks are copied transposed into the stripe: the stripe (sample axis first) fills
as for any variable. Chunks decode whole (no partial reads along a moved axis) and only
with the chains ``ChunkDecoder`` takes (blosc, zstd, gzip, ...), never through zarr's
``getitem``, which reads along the stored first axis.
"""

from __future__ import annotations

import numpy as np

from ...errors import ConfigError
from ...sampling.geometry import VariableGeometry
from ...store.axis_array import AxisArray
from ..partial.ranges import ChunkPart, PartSpec
from ..partial.sparse import SparseFrame
from ..read_path_base import Parts
from ..reader import StripeReader
from ..retry import ChunkDecodeError
from ..thread_buffer import ThreadBuffer

_STORED = ThreadBuffer()  # one stored chunk, decoded, per thread


class AxisStripeReader(StripeReader):
    """``StripeReader`` of ``arr.base`` served in ``arr.order`` (``geom`` is the served
    geometry: sample axis first)."""

    def __init__(self, arr: AxisArray, geom: VariableGeometry, source_url: str) -> None:
        self.order = arr.order
        self.stored_chunks = tuple(int(c) for c in arr.base.chunks)
        super().__init__(arr.base, geom, source_url)
        if self.decoder is None:
            raise ConfigError(
                f"variable {geom.name!r} of {source_url} is sampled along its axis "
                f"{self.order[0]}, and its codecs ({self.codec_chain.label}) are not ones "
                "the loader decodes itself (blosc, zstd, gzip, lz4, ...): it cannot be read "
                "along that axis; rewrite it with one of those, or sample along axis 0")
        self.direct = False  # a stored chunk is always copied, transposed
        self.blocks_ok = False
        self.whole_key = None

    def _template(self) -> tuple[str | None, tuple[int, ...]]:
        return None, (0,) * (len(self.order) - 1)

    def _stored(self, coords: tuple[int, ...]) -> tuple[int, ...]:
        """Served chunk coordinates in the stored order."""
        out = [0] * len(coords)
        for served, stored in enumerate(self.order):
            out[stored] = coords[served]
        return tuple(out)

    def chunk_key(self, coords: tuple[int, ...]) -> str:
        key = self.arr.metadata.encode_chunk_key(self._stored(coords))
        return f"{self._prefix}/{key}" if self._prefix else key

    def stored_key(self, coords: tuple[int, ...]) -> str:
        shards = self.arr.shards
        if shards is None:
            return self.chunk_key(coords)
        stored = self._stored(coords)
        grid = tuple(c * n // s for c, n, s in zip(stored, self.stored_chunks, shards,
                                                    strict=True))
        key = self.arr.metadata.encode_chunk_key(grid)
        return f"{self._prefix}/{key}" if self._prefix else key

    def chunk_parts(self, part: PartSpec | None) -> Parts | None:
        return None  # whole chunks: a part along a moved axis is not contiguous

    def place(self, data: bytes | memoryview | SparseFrame | None, inner: tuple[int, ...],
              out: np.ndarray, cp: ChunkPart | None = None) -> None:
        if data is None:
            super().place(None, inner, out)
            return
        assert self.decoder is not None and not isinstance(data, SparseFrame)
        stored = _STORED.array(self.stored_chunks, self.geom.dtype)
        try:
            self.decoder.decode_into(data, stored)
        except ChunkDecodeError as e:
            e.inner = inner  # the reader names the chunk key (it knows the stripe)
            raise
        dst, src = self.region(inner)
        out[dst] = np.transpose(stored, self.order)[src]
