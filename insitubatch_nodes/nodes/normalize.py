"""NormalizeNode: standardises batch tensors with split statistics, optionally casting."""

from __future__ import annotations

import numpy as np
import torch
from torchdata.nodes import BaseNode

from ..geometry import VariableGeometry
from ..layout import BatchLayout, Placement
from ..stats import Stats
from .transform import TransformNode


class NormalizeNode(TransformNode[dict[str, torch.Tensor]]):
    """``(x - mean) / std`` for every variable with statistics (inputs and ``target/``
    tensors alike), then a cast of every variable to ``dtype`` (e.g. ``torch.bfloat16``) if
    asked, with statistics or without.

    Statistics kept per channel (a ``level`` dim) broadcast over that axis of the sample.
    Other keys (``sample_index``, coordinates) pass through untouched. Stateless.
    """

    def __init__(self, source: BaseNode[dict[str, torch.Tensor]], stats: Stats,
                 variables: tuple[VariableGeometry, ...], dtype: torch.dtype | None = None,
                 eps: float = 1e-12, layout: BatchLayout | None = None) -> None:
        super().__init__(source)
        # Variables the gather stacked into "channels": normalised there, slice by slice.
        self._stacked: dict[str, list[tuple[str, Placement]]] = {}
        if layout is not None:
            for var, placements in zip(variables, layout.placements, strict=True):
                for pl in placements:
                    if pl.key != var.name:
                        self._stacked.setdefault(pl.key, []).append((var.name, pl))
        self.dtype = dtype
        self.keeps_batch_memory = dtype is None  # float32 is standardised in place
        self._names = {var.name for var in variables}
        self._params: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for var in variables:
            try:
                st = stats[var.name]
            except KeyError:
                continue
            dims = var.dimension_names or ()
            shape = [1] * (len(var.shape) - 1)
            for d in st.kept_dims:
                shape[list(dims).index(d) - 1] = -1
            mean = torch.as_tensor(np.asarray(st.mean, dtype=np.float32)).reshape(shape)
            std = torch.as_tensor(np.maximum(np.asarray(st.std, dtype=np.float32), eps))
            self._params[var.name] = (mean, std.reshape(shape))


    def _params_on(self, name: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        p = self._params[name]
        if p[0].device != device:  # batches decoded on a GPU: move once, keep
            p = self._params[name] = (p[0].to(device), p[1].to(device))
        return p

    def _stacked_key(self, value: torch.Tensor, parts: list[tuple[str, Placement]],
                     ) -> torch.Tensor:
        """Standardise each variable's channel range of a stacked tensor, in place."""
        if not any(name in self._params for name, _ in parts):
            return value if self.dtype is None else value.to(self.dtype)
        x = value if value.dtype == torch.float32 else value.to(torch.float32)
        for name, pl in parts:
            if name not in self._params:
                continue
            mean, std = self._params_on(name, x.device)
            if pl.levels is not None and mean.dim() == 3 and mean.shape[0] > 1:
                mean, std = mean[pl.levels], std[pl.levels]  # per-level statistics
            view = x[..., pl.channel, :, :]
            view.sub_(mean).div_(std)
        return x if self.dtype is None else x.to(self.dtype)

    def next(self) -> dict[str, torch.Tensor]:
        batch = next(self.source)
        for key, value in list(batch.items()):
            name = key[len("target/"):] if key.startswith("target/") else key
            if name in self._stacked:
                batch[key] = self._stacked_key(value, self._stacked[name])
                continue
            p = self._params.get(name)
            if p is None:
                if self.dtype is not None and name in self._names:
                    batch[key] = value.to(self.dtype)
                continue
            p = self._params_on(name, value.device)
            x = value if value.dtype == torch.float32 else value.to(torch.float32)
            x = x.sub_(p[0]).div_(p[1]) if x is value else (x - p[0]) / p[1]
            batch[key] = x if self.dtype is None else x.to(self.dtype)
        return batch
