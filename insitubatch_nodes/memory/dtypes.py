"""numpy <-> torch dtype bridging shared by the CPU gather and the device decode path."""

from __future__ import annotations

import numpy as np
import torch

from ..errors import ConfigTypeError


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    """The torch dtype ``torch.from_numpy`` gives for a numpy dtype (clear error if none)."""
    try:
        return torch.from_numpy(np.empty(0, dtype=dtype)).dtype
    except TypeError as e:
        raise ConfigTypeError(f"numpy dtype {dtype} has no torch equivalent: {e}") from None


# torch's "barebones" unsigned types lack some CUDA kernels; moving their bits through the
# signed type of the same width is exact and always supported.
_SIGNED_TWIN = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed with a dtype every copy/index kernel supports (same bytes, no copy)."""
    twin = _SIGNED_TWIN.get(t.dtype)
    return t if twin is None else t.view(twin)
