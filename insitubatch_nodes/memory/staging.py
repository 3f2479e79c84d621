"""The staging seam: where ``GatherNode`` writes a batch, handed to it by the graph builder.

The last stage (``PinOrCudaNode`` on CUDA) owns reused pinned buffers; the gather can write
straight into them instead of pageable memory only if every stage between keeps the batch's
tensors. The builder knows that when it wires the graph, so it hands one ``StagingSeam`` to
both stages; neither walks the graph looking for the other.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np


class StagingTarget(Protocol):
    """What owns the final batch memory (``CudaStager``: a leased pinned ring slot)."""

    def staging_array(self, key: str, shape: tuple[int, ...],
                      dtype: np.dtype) -> np.ndarray | None: ...


class StagingSeam:
    """Shared by the stage that makes a batch and the stage that owns its final memory.

    ``array`` returns memory to write batch key ``key`` into, or ``None`` (then the maker
    allocates its own). Empty until the owner ``attach``es itself (on the first CUDA batch).
    """

    def __init__(self) -> None:
        self._target: StagingTarget | None = None

    @property
    def attached(self) -> bool:
        return self._target is not None

    def attach(self, target: StagingTarget) -> None:
        self._target = target

    def array(self, key: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray | None:
        if self._target is None:
            return None
        return self._target.staging_array(key, shape, dtype)
