"""GatherNode: turns batch draws into a batch, one coalesced gather per stripe per variable."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torchdata.nodes import BaseNode

from ..counters import GatherStats
from ..dtypes import bits, torch_dtype
from ..geometry import VariableGeometry
from ..items import BatchDraw, GatherPart
from ..memory import BufferPool
from ..staging import StagingSeam
from ..windows import SampleWindow
from .state import require, shutdown_source


class GatherNode(BaseNode[dict[str, torch.Tensor]]):
    """Copies the drawn rows into CPU tensors that the user owns (and may keep).

    Batch memory comes from a ``BufferPool``: it is reused only after every tensor over it
    is gone, so recycling never overwrites a batch someone still holds. On the CUDA path the
    rows go straight into ``PinOrCudaNode``'s pinned ring slot instead (those host tensors
    live until the slot comes round again: transforms in between must not keep them).

    ``np.take(..., out=, mode="clip")`` writes straight into the tensor's memory; the
    default ``mode="raise"`` buffers through a temporary first. The offsets come from
    geometry, so clipping never changes a value.
    """

    SOURCE_KEY = "source"

    def __init__(self, source: BaseNode[BatchDraw], variables: Sequence[VariableGeometry],
                 pool: BufferPool | None = None, *, steps: SampleWindow | None = None,
                 coords: Mapping[str, np.ndarray] | None = None,
                 staging: StagingSeam | None = None,
                 window: SampleWindow | None = None) -> None:
        super().__init__()
        self.source = source
        self.variables = tuple(variables)
        # ``window=`` is the name earlier versions used for ``steps``.
        steps = steps if steps is not None else window
        # With time steps, "name" holds the inputs (batch, history, ...) and
        # "target/name" the targets (batch, n_leads, ...).
        self.steps = None if steps is None or steps.is_single_step else steps
        # Per-sample coordinates (e.g. "time" as int64 ns), looked up by sample index.
        self.coords = dict(coords or {})
        self.pool = pool if pool is not None else BufferPool()
        for v in self.variables:
            torch_dtype(v.dtype)  # fail at build time, naming the dtype, not mid-epoch
        self.stats = GatherStats()
        # Shared with a CUDA PinOrCudaNode downstream by the graph builder: gather into its
        # pinned ring slot instead of pageable pool memory (saves one host copy per batch).
        self.staging = staging

    def _out(self, key: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        if self.staging is not None:
            arr = self.staging.array(key, shape, dtype)
            if arr is not None:
                return arr
        return self.pool.take(shape, dtype)

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.source.reset(None if initial_state is None
                          else require(initial_state, self.SOURCE_KEY, self))

    def next(self) -> dict[str, torch.Tensor]:
        stats = self.stats
        t0 = time.perf_counter()
        try:
            draw = next(self.source)
        except BaseException:  # StopIteration included: the wait counts on both sides
            dt = time.perf_counter() - t0
            stats.upstream_s += dt
            stats.next_s += dt
            raise
        stats.upstream_s += time.perf_counter() - t0
        n = int(draw.sample_index.size)
        batch: dict[str, torch.Tensor] = {}
        nbytes = 0
        win = self.steps
        for var, parts in zip(self.variables, draw.parts, strict=True):
            if parts and isinstance(parts[0].array, torch.Tensor):
                nbytes += self._gather_tensors(var, parts, n, batch)
                continue
            if win is None:
                out = self._out(var.name, (n, *var.sample_shape), var.dtype)
                for p in parts:
                    np.take(p.array, p.offsets, axis=0, out=out[p.start : p.stop], mode="clip")
                batch[var.name] = torch.from_numpy(out)
                nbytes += out.nbytes
                continue
            h = win.history
            ins = self._out(var.name, (n, h, *var.sample_shape), var.dtype)
            outs = (self._out(f"target/{var.name}", (n, len(win.lead), *var.sample_shape),
                              var.dtype) if win.lead else None)
            for p in parts:
                dst, col = (ins, p.step) if p.step < h else (outs, p.step - h)
                np.take(p.array, p.offsets, axis=0, out=dst[p.start : p.stop, col], mode="clip")
            batch[var.name] = torch.from_numpy(ins)
            nbytes += ins.nbytes
            if outs is not None:
                batch[f"target/{var.name}"] = torch.from_numpy(outs)
                nbytes += outs.nbytes
        batch["sample_index"] = torch.from_numpy(draw.sample_index.astype(np.int64, copy=False))
        for name, values in self.coords.items():
            batch[name] = torch.from_numpy(values[draw.sample_index])
        stats.batches += 1
        stats.samples += n
        stats.nbytes += nbytes
        stats.next_s += time.perf_counter() - t0
        return batch

    def _gather_tensors(self, var: VariableGeometry, parts: Sequence[GatherPart], n: int,
                        batch: dict[str, torch.Tensor]) -> int:
        """The gather for stripes decoded on a device: the batch is made there, by
        ``index_select``, with every part's offsets sent in one copy."""
        first = parts[0].array
        dev, dtype = first.device, first.dtype
        offsets = np.concatenate([p.offsets for p in parts]).astype(np.int64, copy=False)
        index = torch.from_numpy(offsets).to(dev)
        win = self.steps
        pos = 0
        if win is None:
            out = torch.empty((n, *var.sample_shape), dtype=dtype, device=dev)
            work = bits(out)
            for p in parts:
                k = p.stop - p.start
                torch.index_select(bits(p.array), 0, index[pos : pos + k],
                                   out=work[p.start : p.stop])
                pos += k
            batch[var.name] = out
            return out.numel() * out.element_size()
        h = win.history
        ins = torch.empty((n, h, *var.sample_shape), dtype=dtype, device=dev)
        outs = (torch.empty((n, len(win.lead), *var.sample_shape), dtype=dtype, device=dev)
                if win.lead else None)
        for p in parts:
            k = p.stop - p.start
            dst, col = (ins, p.step) if p.step < h else (outs, p.step - h)
            assert dst is not None
            bits(dst)[p.start : p.stop, col] = bits(p.array).index_select(0, index[pos : pos + k])
            pos += k
        batch[var.name] = ins
        if outs is None:
            return ins.numel() * ins.element_size()
        batch[f"target/{var.name}"] = outs
        return (ins.numel() + outs.numel()) * ins.element_size()

    def get_state(self) -> dict[str, Any]:
        return {self.SOURCE_KEY: self.source.state_dict()}

    def start_state(self, upstream: dict[str, Any]) -> dict[str, Any]:
        """The state of this node before its first batch, over ``upstream``'s state."""
        return {self.SOURCE_KEY: upstream}

    def shutdown(self) -> None:
        """Nothing of its own to stop: pass it upstream (torchdata's protocol)."""
        shutdown_source(self.source)
