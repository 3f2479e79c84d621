"""NormalizeNode: standardises batch tensors with split statistics, optionally casting."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torchdata.nodes import BaseNode

from ..geometry import VariableGeometry
from ..layout import BatchLayout, Placement
from ..stats import DEFAULT_SCHEME, SCHEMES, Stats, VariableStats
from .transform import TransformNode


def check_schemes(schemes: Mapping[str, str] | None,
                  variables: tuple[VariableGeometry, ...]) -> dict[str, str]:
    """``{name or "default": scheme}`` checked: known schemes, names that are variables
    or labels (an anemoi dataset's ``2t``)."""
    if not schemes:
        return {}
    known = {v.name for v in variables} | {lb for v in variables for lb in v.labels or ()}
    for name, scheme in schemes.items():
        if scheme not in SCHEMES:
            raise ValueError(f"normalization scheme {scheme!r} for {name!r} is not one of "
                             f"{list(SCHEMES)}")
        if name != DEFAULT_SCHEME and name not in known:
            raise KeyError(f"normalization scheme given for {name!r}, which is not served; "
                           f"names: {sorted(known)} (or {DEFAULT_SCHEME!r})")
    return dict(schemes)


def _offset_scale(st: VariableStats, schemes: Mapping[str, str], name: str,
                  labels: tuple[str, ...] | None) -> tuple[np.ndarray, np.ndarray]:
    """``x -> (x - offset) / scale`` per scheme, as anemoi-training defines them: mean-std
    ``(x - mean) / std``, std ``x / std``, min-max ``(x - min) / (max - min)``, max
    ``x / max``, none ``x``; per label (channel) where the statistics are."""
    mean, std = np.asarray(st.mean, np.float64), np.asarray(st.std, np.float64)
    lo, hi = np.asarray(st.min, np.float64), np.asarray(st.max, np.float64)
    default = schemes.get(DEFAULT_SCHEME, "mean-std")
    which = (np.array([schemes.get(lb, schemes.get(name, default)) for lb in labels])
             if labels is not None else np.full(np.shape(mean), schemes.get(name, default)))
    zero, one = np.zeros_like(mean), np.ones_like(mean)
    offset = np.select([which == "mean-std", which == "min-max"], [mean, lo], zero)
    scale = np.select([which == "mean-std", which == "std", which == "min-max", which == "max"],
                      [std, std, hi - lo, hi], one)
    return offset, scale


class NormalizeNode(TransformNode[dict[str, torch.Tensor]]):
    """``(x - mean) / std`` for every variable with statistics (inputs and ``target/``
    tensors alike), then a cast of every variable to ``dtype`` (e.g. ``torch.bfloat16``) if
    asked, with statistics or without. ``schemes`` (``{name or "default": scheme}``) picks
    another of anemoi-training's schemes per variable or label: std, min-max, max, none.

    Statistics kept per channel (a ``level`` dim) broadcast over that axis of the sample.
    Other keys (``sample_index``, coordinates) pass through untouched. Stateless.
    """

    def __init__(self, source: BaseNode[dict[str, torch.Tensor]], stats: Stats,
                 variables: tuple[VariableGeometry, ...], dtype: torch.dtype | None = None,
                 eps: float = 1e-12, layout: BatchLayout | None = None,
                 schemes: Mapping[str, str] | None = None) -> None:
        super().__init__(source)
        # Variables the gather stacked into "channels" (or, split up, into their own key):
        # normalised there, slice by slice.
        self._stacked: dict[str, list[tuple[str, Placement]]] = {}
        if layout is not None:
            for var, placements in zip(variables, layout.placements, strict=True):
                for pl in placements:
                    if pl.key != var.name or not pl.whole:
                        self._stacked.setdefault(pl.key, []).append((var.name, pl))
        self.dtype = dtype
        self.keeps_batch_memory = dtype is None  # float32 is standardised in place
        self._names = {var.name for var in variables}
        self.schemes = check_schemes(schemes, variables)
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
            per_label = (var.labels is not None and st.kept_dims == (dims[1],)
                         and np.size(st.mean) == len(var.labels))
            names = var.labels if per_label and var.labels is not None else None
            offset, scale = _offset_scale(st, self.schemes, var.name, names)
            self._params[var.name] = (
                torch.as_tensor(offset.astype(np.float32)).reshape(shape),
                torch.as_tensor(np.maximum(scale, eps).astype(np.float32)).reshape(shape))

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
