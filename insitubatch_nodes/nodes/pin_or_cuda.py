"""PinOrCudaNode: the last stage, handing batches to torch on the right device.

Without CUDA (``device=None`` or ``"cpu"``) it is a pass-through: the batch ``GatherNode``
made is handed over as is, no copy, and no CUDA API is ever called (CPU builds of torch raise
on ``pin_memory()``).

On CUDA, each batch is staged in a ring of reused pinned host buffers (``ring.HostRing``) and
copied to the device with ``non_blocking`` copies on a dedicated stream, so the copy of batch
k+1 overlaps the model's work on batch k:

1. take the next ring slot; if the copy last issued out of it is still running, wait for its
   event (with ``ring_size`` >= the prefetch depth this almost never waits);
2. copy the batch into the slot's pinned buffers (host memcpy, parallel in torch);
3. on the side stream, allocate the device tensors and issue the H2D copies, then record an
   event on the side stream and store it with the slot (the slot is not written again until
   that event has completed);
4. make the consumer's current stream wait on the event (a GPU-side wait: the host does not
   block), and ``record_stream`` each device tensor on the consumer stream, so the caching
   allocator does not reuse its memory while the consumer's queued work may still read it.

Every CUDA call goes through ``CudaOps``; ``CudaStager`` holds the logic, so tests run it on
CPU with a fake ``CudaOps`` that defers the "device" copies until their event is waited on.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torchdata.nodes import BaseNode

from ..ring import HostRing, Lease

DEFAULT_RING_SIZE = 3


def resolve_device(device: str | torch.device | None) -> torch.device | None:
    """``None``/``"cpu"`` mean no copy; a CUDA device must exist (clear error otherwise)."""
    if device is None:
        return None
    dev = torch.device(device)
    if dev.type == "cpu":
        return None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            f"device={str(device)!r} was asked for, but this torch has no usable CUDA "
            f"(torch {torch.__version__}, cuda available: False). Use device=None or 'cpu'."
        )
    return dev


class CudaOps:
    """The only place the GPU path calls ``torch.cuda`` (tests substitute a CPU fake)."""

    def __init__(self, device: torch.device) -> None:
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device

    def new_stream(self) -> Any:
        return torch.cuda.Stream(device=self.device)

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream)

    def new_event(self) -> Any:
        return torch.cuda.Event()

    def pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True)

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """Allocate on the current (side) stream and copy asynchronously from pinned memory."""
        out = torch.empty(host.shape, dtype=host.dtype, device=self.device)
        out.copy_(host, non_blocking=True)
        return out

    def hand_over(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)


def staging_view(buffer: torch.Tensor, nbytes: int, like: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor shaped and typed like ``like`` over the first ``nbytes`` of a flat
    uint8 ``buffer`` (a slot's buffer may be larger: short last batch, smaller dtype)."""
    return buffer[:nbytes].view(like.dtype).view(like.shape)


class CudaStager:
    """Copies batches to the device through a ring of reused pinned buffers (see module doc)."""

    def __init__(self, ops: Any, ring_size: int = DEFAULT_RING_SIZE) -> None:
        self.ops = ops
        self.ring: HostRing[torch.Tensor] = HostRing(ring_size, ops.pinned)
        self.stream = ops.new_stream()

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        # Host tensors are staged; anything else (already on a device, not a tensor) passes.
        host = {k: v for k, v in batch.items()
                if isinstance(v, torch.Tensor) and v.device.type == "cpu"}
        nbytes = {k: v.numel() * v.element_size() for k, v in host.items()}
        lease: Lease[torch.Tensor] = self.ring.acquire(nbytes)
        out = dict(batch)
        consumer = self.ops.current_stream()
        event = None
        try:
            staged = {k: staging_view(lease.buffers[k], nbytes[k], v) for k, v in host.items()}
            for k, v in host.items():
                staged[k].copy_(v)
            with self.ops.use_stream(self.stream):
                for k in host:
                    out[k] = self.ops.to_device(staged[k])
                event = self.ops.new_event()
                event.record(self.stream)
        finally:
            if event is None:
                # Failed before the copies were all issued: wait for what was issued, so
                # the slot is free when it comes round again.
                self.stream.synchronize()
            self.ring.record(lease, event)
        consumer.wait_event(event)
        for k in host:
            self.ops.hand_over(out[k], consumer)
        return out

    def synchronize(self) -> None:
        """Block until every copy issued so far has finished."""
        self.ring.synchronize()


class PinOrCudaNode(BaseNode[dict[str, torch.Tensor]]):
    """On CPU, a pass-through (no copy, never a CUDA-only API); on CUDA, stages each batch
    in a ring of ``ring_size`` reused pinned buffers and copies it to the device
    asynchronously on a side stream, so the copy overlaps compute.

    Size ``ring_size`` to the number of batches that can be in flight between this node and
    the GPU (the prefetch depth): a slot is rewritten only after its copy has completed, and
    the node waits for that only when the ring wraps around onto a copy still running.
    """

    def __init__(self, source: BaseNode[dict[str, torch.Tensor]],
                 device: str | torch.device | None = None, *,
                 ring_size: int = DEFAULT_RING_SIZE) -> None:
        super().__init__()
        if not isinstance(ring_size, int) or ring_size < 1:
            raise ValueError(f"ring_size must be an integer >= 1, got {ring_size!r}")
        self.source = source
        self.device = resolve_device(device)
        self.ring_size = ring_size
        self._stager: CudaStager | None = None  # made on the first CUDA batch

    @property
    def ring(self) -> HostRing | None:
        """The pinned ring (``None`` on the CPU path or before the first CUDA batch)."""
        return self._stager.ring if self._stager is not None else None

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.source.reset(initial_state["source"] if initial_state is not None else None)

    def next(self) -> dict[str, torch.Tensor]:
        batch = next(self.source)
        if self.device is None:
            return batch
        if self.device.type != "cuda":
            return {k: v.to(self.device) if isinstance(v, torch.Tensor) else v
                    for k, v in batch.items()}
        if self._stager is None:
            self._stager = CudaStager(CudaOps(self.device), self.ring_size)
        return self._stager(batch)

    def synchronize(self) -> None:
        """Block until every copy this node issued has finished (no-op on the CPU path)."""
        if self._stager is not None:
            self._stager.synchronize()

    def get_state(self) -> dict[str, Any]:
        return {"source": self.source.state_dict()}
