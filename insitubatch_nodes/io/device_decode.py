"""Decoding a window's compressed chunks on the GPU, in one batch per codec.

nvCOMP is fast only on large batches, and the window is already our unit of work, so the
fetcher collects a window's stored chunks (checked on the host, ``device_chain``) and
``WindowDecoder`` does, on one CUDA stream: pack them at 16-byte offsets into a reused
pinned buffer, one host-to-device copy (compressed size: the PCIe traffic stays small), one
batched decode per codec into one device buffer, then device copies into one tensor per
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
from typing import Any, Protocol

import numpy as np
import torch

from ..metrics import ReadTimes
from .device_chain import DeviceChain
from .reader import Frames, StripeReader

_ALIGN = 16  # nvCOMP wants 8-byte aligned inputs and outputs (zstd, gzip); 16 is safe


class FrameDecoder(Protocol):
    """Decodes ``src[src_offsets[i] : + src_sizes[i]]`` into ``dst[dst_offsets[i] :
    + dst_sizes[i]]`` for every i, as one batch, queued on ``stream`` (``None`` on CPU).
    ``src`` and ``dst`` are flat uint8 tensors on ``device``."""

    device: torch.device

    def decode(self, algorithm: str, src: torch.Tensor, src_offsets: Sequence[int],
               src_sizes: Sequence[int], dst: torch.Tensor, dst_offsets: Sequence[int],
               dst_sizes: Sequence[int], stream: Any) -> None: ...


class NvcompFrameDecoder:
    """Batched decode with ``nvidia.nvcomp`` (raw zstd / LZ4 / gzip streams)."""

    ALGORITHMS = {"zstd": "Zstd", "lz4": "LZ4", "gzip": "Gzip"}

    def __init__(self, device: str | torch.device = "cuda") -> None:
        try:
            from nvidia import nvcomp
        except ImportError as e:
            major = (torch.version.cuda or "12").split(".")[0]
            raise ImportError(
                "decode='gpu' needs NVIDIA's nvCOMP Python package for this torch's CUDA "
                f"{torch.version.cuda}: pip install 'insitubatch-nodes[gpu-cu{major}]' "
                f"(nvidia-nvcomp-cu{major}); or use decode='cpu'") from e
        dev = torch.device(device)
        if dev.type != "cuda":
            raise ValueError(f"decode='gpu' decodes on a CUDA device, got device={device!r}")
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
            raise ValueError(f"nvCOMP {algorithm} decoded frame {bad} of the batch to "
                             f"{int(sizes[bad])} bytes, expected {int(dst_sizes[bad])}")


@dataclass(frozen=True, eq=False)
class StripeFrames:
    """One stripe's stored chunks, for ``WindowDecoder``."""

    var: int
    index: int
    frames: Frames


@dataclass(frozen=True)
class _Chunk:
    stripe: int  # position in the window's stripe list
    inner: int  # position in the reader's inner-chunk order
    algorithm: str | None
    src: int  # offset of the payload in the staging / device source buffer
    src_size: int
    dst: int  # offset of the decoded bytes in the device output buffer (-1: raw, use src)


# torch's "barebones" unsigned types lack some CUDA kernels; moving their bits through the
# signed type of the same width is exact and always supported.
_SIGNED_TWIN = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed with a dtype every copy/index kernel supports (same bytes, no copy)."""
    twin = _SIGNED_TWIN.get(t.dtype)
    return t if twin is None else t.view(twin)


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
        self._fill = {v: torch.from_numpy(np.array(r.fill_value))
                      for v, r in enumerate(self.readers)}
        self.times: ReadTimes | None = None  # the fetcher's: device time counts as decode_s
        # counters, for tests and benchmarks
        self.windows = 0
        self.batches = 0  # FrameDecoder.decode calls
        self.bytes_in = 0  # compressed bytes copied to the device
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

    def _layout(self, stripes: Sequence[StripeFrames]) -> tuple[list[_Chunk], int, int]:
        chunks, src_end, dst_end = [], 0, 0
        for s, st in enumerate(stripes):
            chain = self.chains[st.var]
            nbytes = self.readers[st.var].chunk_nbytes
            for i, frame in enumerate(st.frames):
                if frame is None:
                    continue
                size = memoryview(frame).nbytes - chain.skip
                dst = -1
                if chain.algorithm is not None:
                    dst, dst_end = dst_end, _align(dst_end + nbytes)
                chunks.append(_Chunk(s, i, chain.algorithm, src_end, size, dst))
                src_end = _align(src_end + size)
        return chunks, src_end, dst_end

    def decode(self, stripes: Sequence[StripeFrames]) -> list[torch.Tensor]:
        """One tensor per stripe (shape ``geom.stripe_shape``), on the device, complete."""
        t0 = time.perf_counter()
        chunks, src_n, dst_n = self._layout(stripes)
        with self._context():
            try:
                out = self._decode(stripes, chunks, src_n, dst_n)
            finally:
                # Also after an error: work still queued may read the staging buffer, which
                # the next window rewrites.
                if self._cuda:
                    self._stream.synchronize()
        if self.times is not None:
            self.times.add(0.0, time.perf_counter() - t0)
        self.windows += 1
        self.bytes_in += src_n
        self.bytes_out += sum(t.numel() * t.element_size() for t in out)
        return out

    def _decode(self, stripes: Sequence[StripeFrames], chunks: list[_Chunk], src_n: int,
                dst_n: int) -> list[torch.Tensor]:
        staging = self._staging_buffer(src_n)
        host = staging.numpy()
        for c in chunks:
            st = stripes[c.stripe]
            payload = memoryview(st.frames[c.inner]).cast("B")[self.chains[st.var].skip:]
            host[c.src : c.src + c.src_size] = np.frombuffer(payload, dtype=np.uint8)
        src = torch.empty(src_n, dtype=torch.uint8, device=self.device)
        src.copy_(staging[:src_n], non_blocking=self._cuda)
        dst = torch.empty(dst_n, dtype=torch.uint8, device=self.device)
        groups: dict[str, list[_Chunk]] = {}
        for c in chunks:
            if c.algorithm is not None:
                groups.setdefault(c.algorithm, []).append(c)
        for algorithm, group in groups.items():
            nbytes = [self.readers[stripes[c.stripe].var].chunk_nbytes for c in group]
            self.frames.decode(algorithm, src, [c.src for c in group],
                               [c.src_size for c in group], dst, [c.dst for c in group],
                               nbytes, self._stream)
            self.batches += 1
        return self._assemble(stripes, chunks, src, dst)

    def _assemble(self, stripes: Sequence[StripeFrames], chunks: list[_Chunk],
                  src: torch.Tensor, dst: torch.Tensor) -> list[torch.Tensor]:
        where = {(c.stripe, c.inner): c for c in chunks}
        out = []
        for s, st in enumerate(stripes):
            reader = self.readers[st.var]
            geom = reader.geom
            dtype = torch.from_numpy(np.empty(0, dtype=geom.dtype)).dtype
            stripe = torch.empty(geom.stripe_shape, dtype=dtype, device=self.device)
            nbytes = reader.chunk_nbytes
            for i, inner in enumerate(reader.inner):
                c = where.get((s, i))
                region, valid = reader.region(inner)
                if c is None:  # never written: the fill value, as in zarr
                    bits(stripe)[region] = bits(self._fill[st.var]).to(self.device)
                    continue
                data = (src[c.src : c.src + nbytes] if c.dst < 0
                        else dst[c.dst : c.dst + nbytes])
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
