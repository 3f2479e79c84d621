"""PinOrCudaNode: the last stage, handing batches to torch on the right device."""

from __future__ import annotations

from typing import Any

import torch
from torchdata.nodes import BaseNode


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


class PinOrCudaNode(BaseNode[dict[str, torch.Tensor]]):
    """On CPU, a pass-through (never calls a CUDA-only API); on CUDA, pins each batch and
    copies it to the device asynchronously on a side stream, so the copy overlaps compute.
    """

    def __init__(self, source: BaseNode[dict[str, torch.Tensor]],
                 device: str | torch.device | None = None) -> None:
        super().__init__()
        self.source = source
        self.device = resolve_device(device)
        self._stream = None

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.source.reset(initial_state["source"] if initial_state is not None else None)

    def next(self) -> dict[str, torch.Tensor]:
        batch = next(self.source)
        if self.device is None:
            return batch
        if self.device.type != "cuda":
            return {k: v.to(self.device) for k, v in batch.items()}
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        with torch.cuda.stream(self._stream):
            out = {k: v.pin_memory().to(self.device, non_blocking=True) for k, v in batch.items()}
            event = torch.cuda.Event()
            event.record(self._stream)
        torch.cuda.current_stream(self.device).wait_event(event)
        for v in out.values():
            v.record_stream(torch.cuda.current_stream(self.device))
        return out

    def get_state(self) -> dict[str, Any]:
        return {"source": self.source.state_dict()}
