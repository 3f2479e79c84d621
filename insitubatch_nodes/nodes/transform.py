"""TransformNode: the base of stateless per-batch stages (normalize, channels, patches...)."""

from __future__ import annotations

from typing import Any, TypeVar

from torchdata.nodes import BaseNode

from .state import require, shutdown_source

T = TypeVar("T")


class TransformNode(BaseNode[T]):
    """A stage that keeps no state of its own: it resets its source and reports the
    source's state, so any chain of transforms stays exactly resumable.

    ``keeps_batch_memory``: the stage hands the batch's tensors on in place (it may add
    keys), so the graph builder lets the upstream ``GatherNode`` gather straight into
    ``PinOrCudaNode``'s pinned ring. A stage that replaces them (a cast, stacking, patches)
    must leave it False, else the gather would fill pinned buffers nobody copies.
    """

    keeps_batch_memory = False
    SOURCE_KEY = "source"

    def __init__(self, source: BaseNode[Any]) -> None:
        super().__init__()
        self.source = source

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.source.reset(None if initial_state is None
                          else require(initial_state, self.SOURCE_KEY, self))

    def get_state(self) -> dict[str, Any]:
        return {self.SOURCE_KEY: self.source.state_dict()}

    def start_state(self, upstream: dict[str, Any]) -> dict[str, Any]:
        """The state of this stage before its first batch, over ``upstream``'s state."""
        return {self.SOURCE_KEY: upstream}

    def shutdown(self) -> None:
        """Nothing of its own to stop: pass it upstream (torchdata's protocol)."""
        shutdown_source(self.source)
