"""PatchNode: cuts every sample of a batch into spatial patches, each exactly once.

A patch comes from a sample already gathered from resident chunks, so patching costs no IO.
The P patches of one sample land in the same batch (a batch of B samples becomes B*P patch
samples); exactly-once holds over (sample, patch) pairs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torchdata.nodes import BaseNode

from ..errors import ConfigError
from .transform import TransformNode


def patch_origins(shape: Sequence[int], size: Sequence[int],
                  stride: Sequence[int] | None = None) -> np.ndarray:
    """Top-left corners of the patches of ``size`` over the last dims of ``shape`` (edge
    remainders that do not fit a whole patch are left out, as xbatcher does)."""
    stride = tuple(size) if stride is None else tuple(stride)
    if len(size) != len(stride) or any(s < 1 for s in (*size, *stride)):
        raise ConfigError(f"patch size {tuple(size)} and stride {stride} must be positive and "
                         "of equal length")
    if any(z > d for z, d in zip(size, shape, strict=True)):
        raise ConfigError(f"patch size {tuple(size)} does not fit in the spatial shape "
                         f"{tuple(shape)}")
    axes = [np.arange(0, d - z + 1, st) for d, z, st in zip(shape, size, stride, strict=True)]
    mesh = np.meshgrid(*axes, indexing="ij")
    return np.stack([m.ravel() for m in mesh], axis=1).astype(np.int64)


class PatchNode(TransformNode[dict[str, torch.Tensor]]):
    """Turns a batch of B samples into B*P patches of ``size`` over the last ``len(size)``
    dims of every spatial tensor; adds ``"patch"`` (the patch's top-left corner) and repeats
    per-sample tensors (``sample_index``, coordinates). Stateless."""

    def __init__(self, source: BaseNode[dict[str, torch.Tensor]], size: Sequence[int],
                 stride: Sequence[int] | None = None, spatial_shape: Sequence[int] | None = None,
                 ) -> None:
        super().__init__(source)
        self.size = tuple(int(s) for s in size)
        self.stride = None if stride is None else tuple(int(s) for s in stride)
        self._origins = (None if spatial_shape is None
                         else patch_origins(spatial_shape, self.size, self.stride))


    def next(self) -> dict[str, torch.Tensor]:
        batch = next(self.source)
        n = len(batch["sample_index"])
        k = len(self.size)
        spatial = {key: t for key, t in batch.items() if t.dim() >= 1 + k and t.shape[0] == n
                   and key != "sample_index"}
        shape = next(iter(spatial.values())).shape[-k:]
        origins = self._origins if self._origins is not None else patch_origins(
            shape, self.size, self.stride)
        p = len(origins)
        out: dict[str, torch.Tensor] = {}
        for key, t in batch.items():
            if key in spatial and tuple(t.shape[-k:]) == tuple(shape):
                views = [t[(..., *(slice(o, o + z) for o, z in zip(org, self.size,
                                                                      strict=True)))]
                         for org in origins.tolist()]
                out[key] = torch.stack(views, dim=1).flatten(0, 1)  # sample-major
            else:
                out[key] = t.repeat_interleave(p, dim=0) if t.dim() and t.shape[0] == n else t
        out["patch"] = torch.from_numpy(np.tile(origins, (n, 1)))
        return out
