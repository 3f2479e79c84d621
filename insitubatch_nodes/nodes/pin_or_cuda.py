"""PinOrCudaNode: the last stage, handing batches to torch on the right device.

Without CUDA (``device=None`` or ``"cpu"``) it is a pass-through: the batch ``GatherNode``
made is handed over as is, no copy, and no CUDA API is ever called (CPU builds of torch raise
on ``pin_memory()``).

On CUDA, each batch is staged in a ring of reused pinned host buffers (``ring.HostRing``) and
copied to the device with ``non_blocking`` copies on a dedicated stream, so the copy of batch
k+1 overlaps the model's work on batch k:

1. take the next ring slot (before the batch is made); if the copy last issued out of it is
   still running, wait for its event (with ``ring_size`` >= the prefetch depth this almost
   never waits);
2. ``GatherNode`` writes the batch's variables straight into the slot's pinned buffers
   (through the ``StagingSeam`` the graph builder handed to both stages); a batch decoded in
   place (one sample per chunk) already lies in pinned memory (the graph gives the batch
   arena a pinned allocator) and is copied to the device from there, held until its copy
   has completed; anything else in the batch (``sample_index``, tensors a transform made)
   is copied into the slot;
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
import logging
from collections import deque
from typing import Any

import numpy as np
import torch
from torchdata.nodes import BaseNode

from ..config import DEFAULT_RING_SIZE
from ..errors import ConfigError, LoaderUsageError
from ..memory.ring import HostRing, Lease
from ..memory.staging import StagingSeam
from .state import require, shutdown_source

log = logging.getLogger("insitubatch_nodes")


def resolve_device(device: str | torch.device | None) -> torch.device | None:
    """``None``/``"cpu"`` mean no copy; a CUDA device must exist (clear error otherwise)."""
    if device is None:
        return None
    dev = torch.device(device)
    if dev.type == "cpu":
        return None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise LoaderUsageError(
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

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    def register_host(self, address: int, nbytes: int) -> None:
        """Page-lock host memory mapped elsewhere (the decode workers' shared batch memory,
        ``workers/shared_memory``), once per segment, so batches copy to the device from
        where the workers decoded them."""
        err = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, 0))
        if err != 0:  # the stager then copies those batches through its pinned ring
            log.warning("insitubatch: cudaHostRegister of %d bytes of shared batch memory "
                        "failed (CUDA error %d): batches go to the GPU through a pinned copy",
                        nbytes, err)

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


class PinnedArrays:
    """An allocator of numpy arrays over pinned host memory (``BufferPool(allocate=...)``):
    the batch arena decodes into them, so ``CudaStager`` copies those batches to the device
    with no host copy. Pinning is slow; the pool recycles the arrays, so it is paid once."""

    def __init__(self, ops: Any) -> None:
        self.ops = ops

    def __call__(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return self.ops.pinned(n)[:n].numpy().view(dtype).reshape(shape)


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory ``a`` may touch intersects ``b``'s (both CPU tensors)."""
    if a.numel() == 0:
        return False
    span = sum((n - 1) * st for n, st in zip(a.shape, a.stride(), strict=True)) + 1
    a0, a1 = a.data_ptr(), a.data_ptr() + span * a.element_size()
    b0 = b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a1


class CudaStager:
    """Copies batches to the device through a ring of reused pinned buffers (see module doc).

    ``open()`` leases the next slot before the batch is made, so that ``staging_array``
    can hand ``GatherNode`` pinned memory to gather into; ``__call__`` then finds those
    tensors already in place and copies only the rest. Contiguous pinned tensors from
    elsewhere (batches decoded in place into ``PinnedArrays``) are copied from where they
    lie and held until their copy completes, at most ``ring_size`` batches of them at once.
    """

    def __init__(self, ops: Any, ring_size: int = DEFAULT_RING_SIZE) -> None:
        self.ops = ops
        self.ring: HostRing[torch.Tensor] = HostRing(ring_size, ops.pinned)
        self.stream = ops.new_stream()
        self._open: Lease[torch.Tensor] | None = None
        # (event, pinned host tensors its copies read), oldest first: the tensors' memory
        # (a batch arena's, recycled once they die) must outlive the copies out of it.
        self._held: deque[tuple[Any, list[torch.Tensor]]] = deque()
        # counters, for tests and benchmarks: host bytes memcpy'd into the ring, and bytes
        # that were already there (gathered in place)
        self.bytes_copied = 0
        self.bytes_in_place = 0

    def open(self) -> None:
        """Lease the next slot for the batch about to be made (waits if its copy runs)."""
        if self._open is None:
            self._open = self.ring.acquire({}, keep_others=True)

    def cancel(self) -> None:
        """No batch came (end of epoch, error): give the open slot back untouched."""
        if self._open is not None:
            self.ring.cancel(self._open)
            self._open = None

    def staging_array(self, key: str, shape: tuple[int, ...], dtype: np.dtype,
                      ) -> np.ndarray | None:
        """A numpy array over the open slot's pinned buffer for ``key`` (``None`` when no
        slot is open): ``GatherNode`` writes the batch there instead of pageable memory."""
        if self._open is None:
            return None
        n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        buf = self.ring.grow(self._open, key, n)
        return buf[:n].numpy().view(dtype).reshape(shape)

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        # Host tensors are staged; anything else (already on a device, not a tensor) passes.
        host = {k: v for k, v in batch.items()
                if isinstance(v, torch.Tensor) and v.device.type == "cpu"}
        nbytes = {k: v.numel() * v.element_size() for k, v in host.items()}
        self._release_held()
        lease, self._open = self._open, None
        if lease is None:
            lease = self.ring.acquire(nbytes)
        out = dict(batch)
        consumer = self.ops.current_stream()
        event = None
        held: list[torch.Tensor] = []
        try:
            staged = {}
            for k, v in host.items():
                if v.is_contiguous() and self.ops.is_pinned(v) and not self._in_slot(lease, k, v):
                    staged[k] = v  # decoded in place into pinned memory: no host copy
                    held.append(v)
                    self.bytes_in_place += nbytes[k]
                    continue
                buf = self.ring.grow(lease, k, nbytes[k])
                staged[k] = dst = staging_view(buf, nbytes[k], v)
                if v.is_contiguous() and v.data_ptr() == dst.data_ptr():
                    self.bytes_in_place += nbytes[k]  # gathered into the slot already
                    continue
                if _overlaps(v, buf):  # a view of the slot in another layout
                    v = v.clone()
                dst.copy_(v)
                self.bytes_copied += nbytes[k]
            with self.ops.use_stream(self.stream):
                for k in host:
                    out[k] = self.ops.to_device(staged[k])
                event = self.ops.new_event()
                event.record(self.stream)
        finally:
            try:
                if event is None:
                    # Failed before the copies were all issued: wait for what was issued,
                    # so the slot is free when it comes round again.
                    self.stream.synchronize()
            finally:  # a synchronize that raises too (a sticky CUDA error) frees the slot
                self.ring.record(lease, event)
        if held:
            self._held.append((event, held))
        consumer.wait_event(event)
        for k in host:
            self.ops.hand_over(out[k], consumer)
        return out

    def _in_slot(self, lease: Lease[torch.Tensor], key: str, v: torch.Tensor) -> bool:
        """Whether ``v`` lies in the leased slot's buffer for ``key`` (gathered into it):
        the ring's event guards that memory, nothing need be held."""
        buf = lease.buffers.get(key)
        return buf is not None and v.data_ptr() == buf.data_ptr()

    def _release_held(self) -> None:
        """Drop the tensors whose copies completed (events complete in issue order, on one
        stream); wait for the oldest while ``ring_size`` batches are held, so in-place
        batches in flight stay as few as the ring's slots (the memory bound counts them)."""
        held = self._held
        while held and held[0][0].query():
            held.popleft()
        while len(held) >= self.ring.size:
            held.popleft()[0].synchronize()

    def synchronize(self) -> None:
        """Block until every copy issued so far has finished."""
        self.ring.synchronize()
        while self._held:
            self._held.popleft()[0].synchronize()


class PinOrCudaNode(BaseNode[dict[str, torch.Tensor]]):
    """On CPU, a pass-through (no copy, never a CUDA-only API); on CUDA, stages each batch
    in a ring of ``ring_size`` reused pinned buffers and copies it to the device
    asynchronously on a side stream, so the copy overlaps compute.

    Size ``ring_size`` to the number of batches that can be in flight between this node and
    the GPU (the prefetch depth): a slot is rewritten only after its copy has completed, and
    the node waits for that only when the ring wraps around onto a copy still running.
    """

    SOURCE_KEY = "source"

    def __init__(self, source: BaseNode[dict[str, torch.Tensor]],
                 device: str | torch.device | None = None, *,
                 ring_size: int = DEFAULT_RING_SIZE, ops: Any = None,
                 staging: StagingSeam | None = None) -> None:
        super().__init__()
        if not isinstance(ring_size, int) or ring_size < 1:
            raise ConfigError(f"ring_size must be an integer >= 1, got {ring_size!r}")
        self.source = source
        # ``ops``: a CudaOps-like object (tests pass a CPU fake; its ``device`` is used)
        self.device: torch.device | None = (ops.device if ops is not None
                                            else resolve_device(device))
        self.ring_size = ring_size
        self._ops = ops
        self._stager: CudaStager | None = None  # made on the first CUDA batch
        # Shared with the GatherNode upstream (by the graph builder, only when every stage
        # between keeps the batch's tensors): the gather then writes into the ring slot.
        self.staging = staging

    @property
    def ring(self) -> HostRing | None:
        """The pinned ring (``None`` on the CPU path or before the first CUDA batch)."""
        return self._stager.ring if self._stager is not None else None

    @property
    def bytes_copied(self) -> int:
        """Bytes this node memcpy'd into its pinned ring on the host (0 on the CPU path)."""
        return self._stager.bytes_copied if self._stager is not None else 0

    @property
    def bytes_in_place(self) -> int:
        """Bytes sent to the device straight from where upstream made them (a ring slot the
        gather wrote, or pinned arena memory chunks were decoded into): no host copy."""
        return self._stager.bytes_in_place if self._stager is not None else 0

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.source.reset(None if initial_state is None
                          else require(initial_state, self.SOURCE_KEY, self))

    def next(self) -> dict[str, torch.Tensor]:
        if self.device is not None and self.device.type == "cuda":
            return self._cuda_next()
        batch = next(self.source)
        if self.device is None:
            return batch
        return {k: v.to(self.device) if isinstance(v, torch.Tensor) else v
                for k, v in batch.items()}

    def _cuda_next(self) -> dict[str, torch.Tensor]:
        if self._stager is None:
            ops = self._ops
            if not ops:
                if self.device is None:  # next() takes this path for a CUDA device only
                    raise LoaderUsageError("PinOrCudaNode: the CUDA path runs without a device")
                ops = CudaOps(self.device)
            self._stager = CudaStager(ops, self.ring_size)
            if self.staging is not None:
                self.staging.attach(self._stager)
        stager = self._stager
        if self.staging is not None:
            stager.open()
        try:
            batch = next(self.source)
        except BaseException:
            stager.cancel()
            raise
        return stager(batch)

    def synchronize(self) -> None:
        """Block until every copy this node issued has finished (no-op on the CPU path)."""
        if self._stager is not None:
            self._stager.synchronize()

    def get_state(self) -> dict[str, Any]:
        return {self.SOURCE_KEY: self.source.state_dict()}

    def start_state(self, upstream: dict[str, Any]) -> dict[str, Any]:
        """The state of this node before its first batch, over ``upstream``'s state."""
        return {self.SOURCE_KEY: upstream}

    def shutdown(self) -> None:
        """Wait for the copies in flight (their pinned slots must outlive them), then pass
        ``shutdown()`` upstream."""
        self.synchronize()
        shutdown_source(self.source)
