"""HostFrameDecoder: the GPU decode path's batched decoder, done with numcodecs on the CPU.

It lets the whole device-decode path (frame checks, window packing, stripe assembly,
torch gather, fallbacks, state) run and be tested on machines without a GPU, and serves
as the reference that ``NvcompFrameDecoder`` is compared with on one that has it.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import numcodecs
import torch

from ..errors import ConfigError


class HostFrameDecoder:
    """A ``FrameDecoder`` on ``torch.device("cpu")``; counts its calls and frames."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.calls: list[tuple[str, int]] = []  # (algorithm, frames) per decode call

    def decode(self, algorithm: str, src: torch.Tensor, src_offsets: Sequence[int],
               src_sizes: Sequence[int], dst: torch.Tensor, dst_offsets: Sequence[int],
               dst_sizes: Sequence[int], stream: Any) -> None:
        self.calls.append((algorithm, len(src_offsets)))
        s, d = src.numpy(), dst.numpy()
        for so, ss, do, ds in zip(src_offsets, src_sizes, dst_offsets, dst_sizes, strict=True):
            frame = s[so : so + ss].tobytes()
            out = d[do : do + ds]
            if algorithm == "zstd":
                numcodecs.Zstd().decode(frame, out=out)
            elif algorithm == "lz4":  # the device gets the raw block; numcodecs wants its prefix
                numcodecs.LZ4().decode(struct.pack("<I", ds) + frame, out=out)
            elif algorithm == "gzip":
                numcodecs.GZip().decode(frame, out=out)
            else:
                raise ConfigError(f"unknown algorithm {algorithm!r}; known: 'lz4', 'zstd', 'gzip'")
