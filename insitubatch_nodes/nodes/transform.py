"""TransformNode: the base of stateless per-batch stages (normalize, channels, patches...)."""

from __future__ import annotations

from typing import Any, TypeVar

from torchdata.nodes import BaseNode

T = TypeVar("T")


class TransformNode(BaseNode[T]):
    """A stage that keeps no state of its own: it resets its source and reports the
    source's state, so any chain of transforms stays exactly resumable.

    ``keeps_batch_memory``: the stage hands the batch's tensors on in place (it may add
    keys), so upstream ``GatherNode`` may gather straight into ``PinOrCudaNode``'s pinned
    ring. A stage that replaces them (a cast, stacking, patches) must leave it False, else
    the gather would fill pinned buffers nobody copies.
    """

    keeps_batch_memory = False

    def __init__(self, source: BaseNode[Any]) -> None:
        super().__init__()
        self.source = source

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.source.reset(initial_state["source"] if initial_state is not None else None)

    def get_state(self) -> dict[str, Any]:
        return {"source": self.source.state_dict()}
