"""Decoding a window's compressed chunks on the GPU, in one batch per codec.

nvCOMP is fast only on large batches, and the window is already our unit of work, so the
fetcher collects a window's stored chunks (checked on the host, ``device_chain``) and
``WindowDecoder`` does, on one CUDA stream: pack them at 16-byte offsets into a reused
pinned buffer, one host-to-device copy (compressed size: the PCIe traffic stays small), one
batched decode per codec into one device buffer (blosc frames contribute their LZ4/zstd
streams, ``blosc_frame``, and are unshuffled after), then device copies into one tensor per
stripe. The stream is synchronised before the window is handed over, so a delivered
window is complete; ``hand_over`` ties the stripes' memory to the consumer's stream.

The batched decode itself is a ``FrameDecoder``: ``NvcompFrameDecoder`` on CUDA (NVIDIA's
``nvidia-nvcomp-cu12``/``-cu13``, extras ``gpu-cu12``/``gpu-cu13``); tests run the same code
on CPU with ``insitubatch_nodes.testing.host_frames.HostFrameDecoder``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from ..errors import ConfigError, MissingDependencyError
from ..memory.dtypes import bits, torch_dtype
from ..metrics.counters import ReadTimes
from .blosc_frame import HEADER, BloscFrame, UnsupportedFrame, parse_blosc
from .device_chain import DeviceChain
from .reader import Frames, StripeReader
from .retry import ChunkDecodeError

_ALIGN = 16  # nvCOMP wants 8-byte aligned inputs and outputs (zstd, gzip); 16 is safe
# Output alignment nvCOMP needs per stream format (its headers): blosc streams land at their
# offsets inside a chunk, so a chunk whose streams would be misaligned is decoded on the host.
_ALIGN_OUT = {"zstd": 8, "lz4": 4}


@runtime_checkable
class FrameDecoder(Protocol):
    """Decodes ``src[src_offsets[i] : + src_sizes[i]]`` into ``dst[dst_offsets[i] :
    + dst_sizes[i]]`` for every i, as one batch, queued on ``stream`` (``None`` on CPU).
    ``src`` and ``dst`` are flat uint8 tensors on ``device``."""

    device: torch.device

    def decode(self, algorithm: str, src: torch.Tensor, src_offsets: Sequence[int],
               src_sizes: Sequence[int], dst: torch.Tensor, dst_offsets: Sequence[int],
               dst_sizes: Sequence[int], stream: Any) -> None: ...


def gpu_decode_available() -> bool:
    """Whether ``decode="gpu"`` can run here: a usable CUDA device and nvCOMP installed."""
    if not torch.cuda.is_available():
        return False
    try:
        from nvidia import nvcomp  # noqa: F401
    except ImportError:
        return False
    return True


class NvcompFrameDecoder:
    """Batched decode with ``nvidia.nvcomp`` (raw zstd / LZ4 / gzip streams)."""

    ALGORITHMS = {"zstd": "Zstd", "lz4": "LZ4", "gzip": "Gzip"}

    def __init__(self, device: str | torch.device = "cuda") -> None:
        try:
            from nvidia import nvcomp
        except ImportError as e:
            major = (torch.version.cuda or "12").split(".")[0]
            raise MissingDependencyError(
                "decode='gpu' needs NVIDIA's nvCOMP Python package for this torch's CUDA "
                f"{torch.version.cuda}: pip install 'insitubatch-nodes[gpu-cu{major}]' "
                f"(nvidia-nvcomp-cu{major}); or use decode='cpu'") from e
        dev = torch.device(device)
        if dev.type != "cuda":
            raise ConfigError(f"decode='gpu' decodes on a CUDA device, got device={device!r}")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        self._nvcomp = nvcomp
        self._codecs: dict[tuple[str, int], Any] = {}

    def decode(self, algorithm: str, src: torch.Tensor, src_offsets: Sequence[int],
               src_sizes: Sequence[int], dst: torch.Tensor, dst_offsets: Sequence[int],
               dst_sizes: Sequence[int], stream: Any) -> None:
        nvcomp = self._nvcomp
        ptr = int(stream.cuda_stream)
        key = (algorithm, ptr)
        codec = self._codecs.get(key)
        if codec is None:
            codec = nvcomp.Codec(algorithm=self.ALGORITHMS[algorithm],
                                 device_id=self.device.index, cuda_stream=ptr,
                                 bitstream_kind=nvcomp.BitstreamKind.RAW)
            self._codecs[key] = codec
        srcs = nvcomp.as_arrays(src, list(src_offsets), list(src_sizes), cuda_stream=ptr)
        outs = nvcomp.as_arrays(dst, list(dst_offsets), list(dst_sizes), cuda_stream=ptr)
        result = codec.decode(srcs, out=outs)
        sizes = getattr(result, "buffer_sizes", None)
        if sizes is not None and [int(s) for s in sizes] != [int(s) for s in dst_sizes]:
            bad = next(i for i, (a, b) in enumerate(zip(sizes, dst_sizes, strict=True))
                       if int(a) != int(b))
            raise ChunkDecodeError(f"nvCOMP {algorithm} decoded frame {bad} of the batch to "
                                   f"{int(sizes[bad])} bytes, expected {int(dst_sizes[bad])}")


@dataclass(frozen=True, eq=False)
class StripeFrames:
    """One stripe's stored chunks, for ``WindowDecoder``."""

    var: int
    index: int
    frames: Frames


@dataclass(frozen=True)
class _Stream:
    """``size`` bytes at ``at`` of a stored chunk (``stripe``, ``inner``) go to ``src`` of the
    device source buffer; ``algorithm`` decodes them to ``out`` bytes at ``dst`` of the output
    buffer, or ``None`` leaves them where they are (``dst`` < 0) or copies them there."""

    stripe: int  # position in the window's stripe list
    inner: int  # position in the reader's inner-chunk order
    at: int
    algorithm: str | None
    src: int
    size: int
    dst: int
    out: int


@dataclass(frozen=True)
class _Chunk:
    """Where one stored chunk's decoded bytes end up: at ``at`` of the output buffer
    (``in_src``: of the source buffer, for chunks stored or decoded on the host as is);
    ``blosc`` when they are still shuffled blocks; ``host`` when the host decodes it."""

    stripe: int
    inner: int
    at: int
    in_src: bool
    blosc: BloscFrame | None = None
    host: bool = False


def unshuffle(data: torch.Tensor, typesize: int, blocksize: int) -> torch.Tensor:
    """Undo blosc's byte shuffle: each block holds byte 0 of every element, then byte 1, ...
    (a (typesize, elements) transpose); a block's trailing bytes that fill no element are
    left as they are. Full blocks are done in one copy, the short last one in another."""
    n = data.numel()
    out = torch.empty_like(data)
    full = n // blocksize * blocksize
    if full:
        e = blocksize // typesize
        out[:full].view(-1, e, typesize).copy_(
            data[:full].view(-1, typesize, e).transpose(1, 2))
    e = (n - full) // typesize
    if e:
        out[full : full + e * typesize].view(e, typesize).copy_(
            data[full : full + e * typesize].view(typesize, e).t())
    rest = full + e * typesize
    if rest < n:
        out[rest:] = data[rest:]
    return out


def bitunshuffle(data: torch.Tensor, typesize: int, blocksize: int) -> torch.Tensor:
    """Undo blosc's bit shuffle: a block of E elements is stored as 8 * typesize rows of E
    bits (row 8j + k: bit k of byte j of every element, least significant bit first); blocks
    whose E is not a multiple of 8 are stored as they are. Full blocks go in one pass."""
    n = data.numel()
    out = data.clone()
    shifts = torch.arange(8, dtype=torch.uint8, device=data.device)

    def undo(dst: torch.Tensor, src: torch.Tensor, blocks: int, bsize: int) -> None:
        e = bsize // typesize
        if e == 0 or e % 8:
            return
        bits = (src[: blocks * bsize].view(blocks, bsize).unsqueeze(-1) >> shifts) & 1
        el = bits.view(blocks, 8 * typesize, e).transpose(1, 2).reshape(blocks, e, typesize, 8)
        res = el[..., 0].clone()
        for k in range(1, 8):
            res |= el[..., k] << k
        dst[: blocks * bsize].view(blocks, e, typesize).copy_(res)

    full = n // blocksize * blocksize
    if full:
        undo(out[:full], data[:full], full // blocksize, blocksize)
    if n > full:
        undo(out[full:], data[full:], 1, n - full)
    return out


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class WindowDecoder:
    """Turns a window's checked frames into device tensors, one per stripe (module doc).

    Used from one thread only (the fetcher's device thread): it owns a stream and a pinned
    staging buffer reused across windows, which is safe because each window's stream is
    synchronised before the next one is packed.
    """

    def __init__(self, frames: FrameDecoder, readers: Sequence[StripeReader],
                 chains: dict[int, DeviceChain]) -> None:
        self.frames = frames
        self.device = frames.device
        self.readers = tuple(readers)
        self.chains = dict(chains)
        self._cuda = self.device.type == "cuda"
        self._stream: Any = None
        self._staging: torch.Tensor | None = None
        self._dtypes = [torch_dtype(r.geom.dtype) for r in self.readers]
        self._fill: dict[int, torch.Tensor] = {}  # on the device, made on first use
        self.times: ReadTimes | None = None  # the fetcher's: device time counts as decode_s
        # counters, for tests and benchmarks
        self.windows = 0
        self.bytes_out = 0  # decoded bytes

    def _context(self) -> contextlib.AbstractContextManager:
        if not self._cuda:
            return contextlib.nullcontext()
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        stack = contextlib.ExitStack()
        stack.enter_context(torch.cuda.device(self.device))
        stack.enter_context(torch.cuda.stream(self._stream))
        return stack

    def _staging_buffer(self, nbytes: int) -> torch.Tensor:
        if self._staging is None or self._staging.numel() < nbytes:
            grown = max(nbytes, int(1.5 * (self._staging.numel() if self._staging is not None
                                           else 0)))
            self._staging = torch.empty(max(grown, 1), dtype=torch.uint8, pin_memory=self._cuda)
        return self._staging

    def _layout(self, stripes: Sequence[StripeFrames],
                ) -> tuple[list[_Chunk], list[_Stream], int, int]:
        """Plan the window: which bytes go where in the staging/source buffer (16-byte
        aligned, as nvCOMP wants) and in the output buffer, and which chunks the host must
        decode itself (blosc frames whose streams would land misaligned, or whose streams
        nvCOMP cannot read)."""
        chunks: list[_Chunk] = []
        streams: list[_Stream] = []
        src_end = dst_end = 0
        for s, st in enumerate(stripes):
            chain = self.chains[st.var]
            nbytes = self.readers[st.var].chunk_nbytes
            for i, frame in enumerate(st.frames):
                if frame is None:
                    continue
                if chain.algorithm is None:  # stored as is: copied, decoded by nobody
                    size = memoryview(frame).nbytes
                    streams.append(_Stream(s, i, 0, None, src_end, size, -1, size))
                    chunks.append(_Chunk(s, i, src_end, True))
                    src_end = _align(src_end + size)
                    continue
                if chain.algorithm != "blosc":
                    size = memoryview(frame).nbytes - chain.skip
                    streams.append(_Stream(s, i, chain.skip, chain.algorithm, src_end, size,
                                           dst_end, nbytes))
                    chunks.append(_Chunk(s, i, dst_end, False))
                    src_end, dst_end = _align(src_end + size), _align(dst_end + nbytes)
                    continue
                try:
                    bf: BloscFrame | None = parse_blosc(frame, nbytes)
                except UnsupportedFrame:
                    bf = None
                codec = bf.codec if bf is not None else None
                if bf is not None and codec is None:  # stored uncompressed in the frame
                    streams.append(_Stream(s, i, HEADER, None, src_end, nbytes, -1, nbytes))
                    chunks.append(_Chunk(s, i, src_end, True))
                    src_end = _align(src_end + nbytes)
                elif (bf is None or codec is None
                      or any(b.dst % _ALIGN_OUT[codec] for b in bf.streams)):
                    chunks.append(_Chunk(s, i, src_end, True, host=True))  # rare
                    src_end = _align(src_end + nbytes)
                else:
                    for b in bf.streams:
                        streams.append(_Stream(s, i, b.src, None if b.raw else bf.codec,
                                               src_end, b.size, dst_end + b.dst, b.out))
                        src_end = _align(src_end + b.size)
                    chunks.append(_Chunk(s, i, dst_end, False, bf))
                    dst_end = _align(dst_end + nbytes)
        return chunks, streams, src_end, dst_end

    def decode(self, stripes: Sequence[StripeFrames]) -> list[torch.Tensor]:
        """One tensor per stripe (shape ``geom.stripe_shape``), on the device, complete."""
        t0 = time.perf_counter()
        layout = self._layout(stripes)
        with self._context():
            try:
                out = self._decode(stripes, *layout)
            finally:
                # Also after an error: work still queued may read the staging buffer, which
                # the next window rewrites.
                if self._cuda:
                    self._stream.synchronize()
        if self.times is not None:
            self.times.add(0.0, time.perf_counter() - t0)
        self.windows += 1
        self.bytes_out += sum(t.numel() * t.element_size() for t in out)
        return out

    def _pack(self, stripes: Sequence[StripeFrames], chunks: list[_Chunk],
              streams: list[_Stream], staging: np.ndarray) -> None:
        """Copy every stream into the staging buffer; decode the host's chunks there."""
        for p in streams:
            stored = stripes[p.stripe].frames[p.inner]
            assert stored is not None  # ``_layout`` plans written chunks only
            frame = memoryview(stored).cast("B")
            staging[p.src : p.src + p.size] = np.frombuffer(frame[p.at : p.at + p.size],
                                                            dtype=np.uint8)
        for c in chunks:
            if c.host:
                reader = self.readers[stripes[c.stripe].var]
                stored = stripes[c.stripe].frames[c.inner]
                assert reader.decoder is not None and stored is not None
                out = staging[c.at : c.at + reader.chunk_nbytes].view(reader.geom.dtype)
                reader.decoder.decode_into(stored, out.reshape(reader.geom.chunks))

    def _decode(self, stripes: Sequence[StripeFrames], chunks: list[_Chunk],
                streams: list[_Stream], src_n: int, dst_n: int) -> list[torch.Tensor]:
        staging = self._staging_buffer(src_n)
        self._pack(stripes, chunks, streams, staging.numpy())
        src = torch.empty(src_n, dtype=torch.uint8, device=self.device)
        src.copy_(staging[:src_n], non_blocking=self._cuda)
        dst = torch.empty(dst_n, dtype=torch.uint8, device=self.device)
        groups: dict[str, list[_Stream]] = {}
        for p in streams:
            if p.algorithm is not None:
                groups.setdefault(p.algorithm, []).append(p)
            elif p.dst >= 0:  # a blosc stream stored as is
                dst[p.dst : p.dst + p.out].copy_(src[p.src : p.src + p.size])
        for algorithm, group in groups.items():
            self.frames.decode(algorithm, src, [p.src for p in group], [p.size for p in group],
                               dst, [p.dst for p in group], [p.out for p in group],
                               self._stream)
        return self._assemble(stripes, chunks, src, dst)

    def _fill_value(self, var: int) -> torch.Tensor:
        fill = self._fill.get(var)
        if fill is None:
            fill = self._fill[var] = bits(torch.from_numpy(
                np.array(self.readers[var].fill_value))).to(self.device)
        return fill

    def _assemble(self, stripes: Sequence[StripeFrames], chunks: list[_Chunk],
                  src: torch.Tensor, dst: torch.Tensor) -> list[torch.Tensor]:
        where = {(c.stripe, c.inner): c for c in chunks}
        out = []
        for s, st in enumerate(stripes):
            reader = self.readers[st.var]
            geom = reader.geom
            dtype = self._dtypes[st.var]
            stripe = torch.empty(geom.stripe_shape, dtype=dtype, device=self.device)
            nbytes = reader.chunk_nbytes
            for i, inner in enumerate(reader.inner):
                c = where.get((s, i))
                region, valid = reader.region(inner)
                if c is None:  # never written: the fill value, as in zarr
                    bits(stripe)[region] = self._fill_value(st.var)
                    continue
                data = (src if c.in_src else dst)[c.at : c.at + nbytes]
                if c.blosc is not None and c.blosc.shuffle == "byte":
                    data = unshuffle(data, c.blosc.typesize, c.blosc.blocksize)
                elif c.blosc is not None and c.blosc.shuffle == "bit":
                    data = bitunshuffle(data, c.blosc.typesize, c.blosc.blocksize)
                if reader.direct:
                    stripe.view(-1).view(torch.uint8).copy_(data)
                else:
                    bits(stripe)[region] = bits(data.view(dtype).view(geom.chunks))[valid]
            out.append(stripe)
        return out

    def hand_over(self, tensors: Sequence[torch.Tensor]) -> None:
        """Called on the consumer's thread when a window is delivered: its stripes were
        allocated on the decode stream, so tell the caching allocator that the consumer's
        stream uses them too (else a freed stripe could be reused under queued reads)."""
        if not self._cuda:
            return
        consumer = torch.cuda.current_stream(self.device)
        for t in tensors:
            t.record_stream(consumer)
