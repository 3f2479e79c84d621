"""GatherNode: turns batch draws into a batch, one coalesced gather per stripe per variable."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torchdata.nodes import BaseNode

from ..memory.dtypes import bits, torch_dtype
from ..memory.layout import BatchLayout, build_layout, row_view, sample_part
from ..memory.ledger import BufferPool
from ..memory.staging import StagingSeam
from ..metrics.counters import GatherStats
from ..sampling.geometry import VariableGeometry
from ..sampling.items import BatchDraw, GatherPart
from ..sampling.windows import SampleWindow
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

    A draw decoded in place (``BatchDraw.ready``) is a batch already made: this node waits
    for its rows (the wait counts as upstream time: it is the fetch's) and wraps them. A
    failed read raises here, and again on every ``next()`` until a reset: its draws are
    spent, so going on must not quietly serve the next batch.
    """

    SOURCE_KEY = "source"

    def __init__(self, source: BaseNode[BatchDraw], variables: Sequence[VariableGeometry],
                 pool: BufferPool | None = None, *, steps: SampleWindow | None = None,
                 coords: Mapping[str, np.ndarray] | None = None,
                 staging: StagingSeam | None = None,
                 layout: BatchLayout | None = None) -> None:
        super().__init__()
        self.source = source
        self.variables = tuple(variables)
        # With time steps, "name" holds the inputs (batch, history, ...) and
        # "target/name" the targets (batch, n_leads, ...).
        self.steps = None if steps is None or steps.is_single_step else steps
        # Per-sample coordinates (e.g. "time" as int64 ns), looked up by sample index.
        self.coords = dict(coords or {})
        self.pool = pool if pool is not None else BufferPool()
        # Where each variable lands: its own key, or a channel range of "channels" (then
        # the gather is the stacking, no later pass). Default: every variable as itself.
        self.layout = layout if layout is not None else build_layout(self.variables)
        assert self.layout is not None
        for v in self.variables:
            torch_dtype(v.dtype)  # fail at build time, naming the dtype, not mid-epoch
        self.stats = GatherStats()
        # Shared with a CUDA PinOrCudaNode downstream by the graph builder: gather into its
        # pinned ring slot instead of pageable pool memory (saves one host copy per batch).
        self.staging = staging
        self._error: BaseException | None = None  # a batch whose rows failed: raised again

    def _out(self, key: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        if self.staging is not None:
            arr = self.staging.array(key, shape, dtype)
            if arr is not None:
                return arr
        return self.pool.take(shape, dtype)

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._error = None
        self.source.reset(None if initial_state is None
                          else require(initial_state, self.SOURCE_KEY, self))

    def next(self) -> dict[str, torch.Tensor]:
        stats = self.stats
        t0 = time.perf_counter()
        try:
            if self._error is not None:
                raise self._error
            draw = next(self.source)
            ready = None if draw.ready is None else self._ready(draw)
        except BaseException:  # StopIteration included: the wait counts on both sides
            dt = time.perf_counter() - t0
            stats.upstream_s += dt
            stats.next_s += dt
            raise
        stats.upstream_s += time.perf_counter() - t0
        index = draw.sample_index
        n = index.size
        batch: dict[str, torch.Tensor] = {}
        nbytes = 0
        if ready is not None:  # decoded in place: the batch is already made
            for name, arr in ready.items():
                batch[name] = torch.from_numpy(arr)
                nbytes += arr.nbytes
        else:
            on_device = {v for v, parts in enumerate(draw.parts)
                         if parts and isinstance(parts[0].array, torch.Tensor)}
            for v in sorted(on_device):  # stripes decoded on a GPU: gathered there
                nbytes += self._gather_tensors(self.variables[v], draw.parts[v], n, batch)
            nbytes += self._gather_arrays(draw, n, batch, skip=on_device)
        batch["sample_index"] = torch.from_numpy(index.astype(np.int64, copy=False))
        for name, values in self.coords.items():
            batch[name] = torch.from_numpy(values[index])
        stats.batches += 1
        stats.samples += n
        stats.nbytes += nbytes
        stats.next_s += time.perf_counter() - t0
        return batch

    def _ready(self, draw: BatchDraw) -> dict[str, np.ndarray] | None:
        """The arrays of a batch decoded in place, once its rows landed (``None`` for draws
        to gather); a failed read is kept and raised again."""
        if draw.ready is None:
            return None
        try:
            return draw.ready.result()
        except BaseException as e:
            self._error = e
            raise

    def _gather_arrays(self, draw: BatchDraw, n: int, batch: dict[str, torch.Tensor],
                       skip: set[int]) -> int:
        """The host gather: each key of the layout allocated once, then per stripe per
        placement one copy straight into its final place (a channel range included).
        Variables in ``skip`` were gathered on a device."""
        steps = self.steps
        h = steps.history if steps is not None else 1
        used = {pl.key for v, ps in enumerate(self.layout.placements) if v not in skip
                for pl in ps}
        dsts: dict[str, tuple[np.ndarray, np.ndarray | None]] = {}
        for spec in self.layout.keys:
            if spec.name not in used:
                continue
            if steps is None:
                dsts[spec.name] = (self._out(spec.name, (n, *spec.row_shape), spec.dtype), None)
                continue
            ins = self._out(spec.name, (n, h, *spec.row_shape), spec.dtype)
            outs = (self._out(f"target/{spec.name}", (n, len(steps.lead), *spec.row_shape),
                              spec.dtype) if steps.lead else None)
            dsts[spec.name] = (ins, outs)
        for v, (parts, placements) in enumerate(zip(draw.parts, self.layout.placements,
                                                    strict=True)):
            if v in skip:
                continue
            for pl in placements:
                ins, outs = dsts[pl.key]
                if steps is None and pl.channel is None and pl.levels is None:
                    # The whole variable as its own key: each run is a contiguous row range
                    # of ``ins``, one ``take`` straight into it (the per-batch hot path).
                    for p in parts:
                        assert isinstance(p.array, np.ndarray)  # not decoded on a device
                        p.array.take(p.offsets, 0, ins[p.start : p.stop], "clip")
                    continue
                for p in parts:
                    assert isinstance(p.array, np.ndarray)  # not decoded on a device
                    if steps is None:
                        dst = ins[p.start : p.stop]
                    elif p.step < h:
                        dst = ins[p.start : p.stop, p.step]
                    else:
                        assert outs is not None
                        dst = outs[p.start : p.stop, p.step - h]
                    _take(sample_part(p.array, pl), p.offsets, row_view(dst, pl))
        nbytes = 0
        for name, (ins, outs) in dsts.items():
            batch[name] = torch.from_numpy(ins)
            nbytes += ins.nbytes
            if outs is not None:
                batch[f"target/{name}"] = torch.from_numpy(outs)
                nbytes += outs.nbytes
        return nbytes

    def _gather_tensors(self, var: VariableGeometry, parts: Sequence[GatherPart], n: int,
                        batch: dict[str, torch.Tensor]) -> int:
        """The gather for stripes decoded on a device: the batch is made there, by
        ``index_select``, with every part's offsets sent in one copy."""
        first = parts[0].array
        assert isinstance(first, torch.Tensor)  # decoded on a device: every part is
        dev, dtype = first.device, first.dtype
        offsets = np.concatenate([p.offsets for p in parts]).astype(np.int64, copy=False)
        index = torch.from_numpy(offsets).to(dev)
        win = self.steps
        pos = 0
        if win is None:
            out = torch.empty((n, *var.sample_shape), dtype=dtype, device=dev)
            work = bits(out)
            for p in parts:
                assert isinstance(p.array, torch.Tensor)
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
            assert dst is not None and isinstance(p.array, torch.Tensor)
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


def _take(src: np.ndarray, offsets: np.ndarray, dst: np.ndarray) -> None:
    """``dst[k] = src[offsets[k]]``, written in place. ``take(out=, mode="clip")`` when
    ``dst`` is contiguous (one call, the method: ``np.take`` adds two Python frames); a
    channel range of a batch is not, and ``take`` would buffer it through a temporary, so
    those rows are copied one by one (as are rows cast to a wider stacked dtype)."""
    if dst.flags.c_contiguous and dst.dtype == src.dtype:
        src.take(offsets, 0, dst, "clip")
        return
    for k, off in enumerate(offsets.tolist()):
        dst[k] = src[off]
