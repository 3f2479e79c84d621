"""NormalizeNode: standardises batch tensors with split statistics, optionally casting."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torchdata.nodes import BaseNode

from ..errors import ConfigError, UnknownNameError
from ..memory.layout import BatchLayout, Placement
from ..sampling.geometry import VariableGeometry
from ..store.statistics import DEFAULT_SCHEME, SCHEMES, Stats, VariableStats
from .transform import TransformNode


def check_schemes(schemes: Mapping[str, str] | None,
                  variables: tuple[VariableGeometry, ...],
                  selection: tuple[str, ...] | None = None) -> dict[str, str]:
    """``{name or "default": scheme}`` checked: known schemes, names that are variables
    or served labels (an anemoi dataset's ``2t``, among ``selection`` if it picks some)."""
    if not schemes:
        return {}
    known = {v.name for v in variables} | (
        set(selection) if selection is not None
        else {lb for v in variables for lb in v.labels or ()})
    for name, scheme in schemes.items():
        if scheme not in SCHEMES:
            raise ConfigError(f"normalization scheme {scheme!r} for {name!r} is not one of "
                             f"{list(SCHEMES)}")
        if name != DEFAULT_SCHEME and name not in known:
            raise UnknownNameError(f"normalization scheme given for {name!r}, which is not served; "
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


MASK_PREFIX = "mask/"  # batch["mask/sst"]: where the values of batch["sst"] are valid


class NormalizeNode(TransformNode[dict[str, torch.Tensor]]):
    """``(x - mean) / std`` for every variable with statistics (inputs and ``target/``
    tensors alike), then a cast of every variable to ``dtype`` (e.g. ``torch.bfloat16``) if
    asked, with statistics or without. ``schemes`` (``{name or "default": scheme}``) picks
    another of anemoi-training's schemes per variable or label: std, min-max, max, none.

    Missing values (NaN, as sea-surface temperature over land) stay NaN through the
    normalization; ``mask`` (True, or variable names) adds ``batch["mask/<key>"]`` (bool,
    True where the value is finite: for a stacked variable, over its channels), and
    ``fill_nan`` then replaces every non-finite value by that number (0.0: the mean).

    Statistics kept per channel (a ``level`` dim) broadcast over that axis of the sample.
    Other keys (``sample_index``, coordinates) pass through untouched. Stateless.
    """

    def __init__(self, source: BaseNode[dict[str, torch.Tensor]], stats: Stats,
                 variables: tuple[VariableGeometry, ...], dtype: torch.dtype | None = None,
                 eps: float = 1e-12, layout: BatchLayout | None = None,
                 schemes: Mapping[str, str] | None = None,
                 selection: tuple[str, ...] | None = None, fill_nan: float | None = None,
                 mask: bool | Sequence[str] = False) -> None:
        super().__init__(source)
        names = [var.name for var in variables]
        masked = names if mask is True else list(mask or ())
        unknown = sorted(set(masked) - set(names))
        if unknown:
            raise UnknownNameError(f"mask names {unknown}, which are not served; variables: "
                                   f"{names}")
        self.masked = frozenset(masked)
        self.fill_nan = None if fill_nan is None else float(fill_nan)
        # Variables the gather stacked into "channels" (or, split up, into their own key):
        # normalised there, slice by slice.
        self._stacked: dict[str, list[tuple[str, Placement]]] = {}
        self._layout = layout
        if layout is not None:
            for var, placements in zip(variables, layout.placements, strict=True):
                for pl in placements:
                    if pl.key != var.name or not pl.whole:
                        self._stacked.setdefault(pl.key, []).append((var.name, pl))
        self.dtype = dtype
        self.keeps_batch_memory = self.keeps_memory(dtype)
        self._names = {var.name for var in variables}
        self.schemes = check_schemes(schemes, variables, selection)
        # float64 parameters; the per-(device, dtype) copies batches use are made once.
        self._exact: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._params: dict[tuple[str, torch.device, torch.dtype],
                           tuple[torch.Tensor, torch.Tensor]] = {}
        stat_names = {v.name for v in stats.variables}
        for var in variables:
            if dtype is not None and (self._raw(var) or var.name not in stat_names):
                _check_whole_numbers(var, dtype)
            try:
                st = stats[var.name]
            except KeyError:
                if not stats.variables or self._raw(var):  # no statistics: a cast only
                    continue
                # Served raw next to normalized channels (a mean of 290 among zeros) is a
                # silent training bug: refused, with both ways out.
                have = [v.name for v in stats.variables]
                raise ConfigError(
                    f"the statistics (split {stats.split!r}) have no entry for {var.name!r}, "
                    f"which would be served raw while the others are normalized; they have "
                    f"{have}. Compute them over every served variable (ib.compute_stats("
                    f"source, manifest)), or serve it raw on purpose with "
                    f"normalize={{{var.name!r}: 'none'}}") from None
            dims = var.dimension_names or ()
            shape = [1] * (len(var.shape) - 1)
            for d in st.kept_dims:  # a kept dim keeps its length (several may be kept)
                if d not in dims[1:]:
                    raise ConfigError(f"statistics of {var.name!r} are kept over {d!r}, which "
                                     f"is not a dim of its samples {list(dims[1:])} (statistics "
                                     "of another store?); compute them on this one")
                i = list(dims).index(d)
                shape[i - 1] = var.shape[i]
            want = tuple(shape[list(dims).index(d) - 1] for d in st.kept_dims)
            got = tuple(np.shape(st.mean))
            if got != want:
                raise ConfigError(f"statistics of {var.name!r} kept over {list(st.kept_dims)} "
                                 f"have shape {got}, but the variable's {list(st.kept_dims)} "
                                 f"has {want} (statistics of another store?); compute them "
                                 "on this one")
            per_label = (var.labels is not None and st.kept_dims == (dims[1],)
                         and np.size(st.mean) == len(var.labels))
            labels = var.labels if per_label and var.labels is not None else None
            if labels is None and var.labels is not None:
                _check_label_schemes(self.schemes, var, st.kept_dims)
            offset, scale = _offset_scale(st, self.schemes, var.name, labels)
            # A zero scale (a constant field) divides by eps; a negative one ("max" of a
            # field below zero) is kept, as anemoi-training keeps it.
            scale = np.where(np.abs(scale) < eps, eps, scale)
            self._exact[var.name] = (torch.as_tensor(offset).reshape(shape),
                                     torch.as_tensor(scale).reshape(shape))

    @staticmethod
    def keeps_memory(dtype: torch.dtype | None) -> bool:
        """Whether a NormalizeNode casting to ``dtype`` hands the batch's tensors on in
        place: float32 is standardised (and filled) in place, masks are new tensors beside
        it; a cast makes new tensors."""
        return dtype is None

    def _raw(self, var: VariableGeometry) -> bool:
        """Whether ``var`` is asked to be served raw: scheme ``none`` for it, for every one
        of its labels, or by default."""
        default = self.schemes.get(DEFAULT_SCHEME, "mean-std")
        if self.schemes.get(var.name, default) == "none":
            return True
        return bool(var.labels) and all(self.schemes.get(lb, default) == "none"
                                        for lb in var.labels or ())

    def _params_on(self, name: str, device: torch.device, dtype: torch.dtype,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        key = (name, device, dtype)
        p = self._params.get(key)
        if p is None:  # batches decoded on a GPU: moved once, kept
            offset, scale = self._exact[name]
            p = self._params[key] = (offset.to(device, dtype), scale.to(device, dtype))
        return p

    def _stacked_key(self, value: torch.Tensor, parts: list[tuple[str, Placement]],
                     ) -> torch.Tensor:
        """Standardise each variable's channel range of a stacked tensor, in place."""
        if not any(name in self._exact for name, _ in parts):
            return value if self.dtype is None else value.to(self.dtype)
        work = _working_dtype(value.dtype)
        x = value if value.dtype == work else value.to(work)
        for name, pl in parts:
            if name not in self._exact:
                continue
            mean, std = _of_placement(self._params_on(name, x.device, work), pl)
            view = x[..., pl.channel, :, :]
            view.sub_(mean).div_(std)
        out = self.dtype if self.dtype is not None else _served_dtype(value.dtype)
        return x if x.dtype == out else x.to(out)

    def parameters(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(offset, scale), float64, that batch key ``key`` (a variable, a stacked key such
        as ``"channels"``, or their ``target/``) was normalized with: ``x * scale + offset``
        undoes it. Shaped to broadcast over the key's trailing axes (a stacked key's:
        ``(channels, 1, 1)``, or ``(channels, y, x)`` with statistics per grid point); a
        variable served raw has 0 and 1."""
        name = key.removeprefix("target/")
        if name in self._stacked:
            assert self._layout is not None
            row = self._layout.key(name).row_shape
            parts = [(pl, _of_placement(self._exact[var], pl))
                     for var, pl in self._stacked[name] if var in self._exact]
            per_point = any(o.dim() >= 2 and tuple(o.shape[-2:]) != (1, 1)
                            for _, (o, _) in parts)
            shape = tuple(row) if per_point else (row[0], 1, 1)
            offset = torch.zeros(shape, dtype=torch.float64)
            scale = torch.ones(shape, dtype=torch.float64)
            for pl, (o, sc) in parts:
                offset[pl.channel] = o  # broadcast: one channel, or the variable's range
                scale[pl.channel] = sc
            return offset, scale
        if name in self._exact:
            return self._exact[name]
        if name in self._names:
            return torch.zeros((), dtype=torch.float64), torch.ones((), dtype=torch.float64)
        raise UnknownNameError(f"batch key {key!r} is not normalized here; keys: "
                               f"{sorted([*self._names, *self._stacked])}")

    def _masks(self, batch: dict[str, torch.Tensor], key: str, value: torch.Tensor,
               name: str) -> None:
        """``mask/<key>`` for the masked variables in ``value`` (batch key ``key``)."""
        if name in self._stacked:
            for var, pl in self._stacked[name]:
                if var in self.masked:  # "channels" -> mask/<var>, "target/..." alike
                    part = key.removesuffix(name) + var
                    batch[MASK_PREFIX + part] = torch.isfinite(value[..., pl.channel, :, :])
        elif name in self.masked:
            batch[MASK_PREFIX + key] = torch.isfinite(value)

    def _fill(self, value: torch.Tensor) -> torch.Tensor:
        if self.fill_nan is None or not value.is_floating_point():
            return value
        return value.masked_fill_(~torch.isfinite(value), self.fill_nan)

    def next(self) -> dict[str, torch.Tensor]:
        batch = next(self.source)
        for key, value in list(batch.items()):
            name = key.removeprefix("target/")
            if name not in self._names and name not in self._stacked:
                continue  # sample_index, coordinates, static fields
            if self.masked:
                self._masks(batch, key, value, name)
            batch[key] = self._fill(self._normalized(value, name))
        return batch

    def _normalized(self, value: torch.Tensor, name: str) -> torch.Tensor:
        """``value`` (a tensor of variable ``name``, or of the stacked key ``name``)
        standardised and cast as asked; in place where it stays float32."""
        if name in self._stacked:
            return self._stacked_key(value, self._stacked[name])
        if name not in self._exact:
            return value.to(self.dtype) if self.dtype is not None else value
        work = _working_dtype(value.dtype)
        p = self._params_on(name, value.device, work)
        x = value if value.dtype == work else value.to(work)
        x = x.sub_(p[0]).div_(p[1]) if x is value else (x - p[0]) / p[1]
        out = self.dtype if self.dtype is not None else _served_dtype(value.dtype)
        return x if x.dtype == out else x.to(out)


def _of_placement(params: tuple[torch.Tensor, torch.Tensor], pl: Placement,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """A variable's (offset, scale) for the levels ``pl`` stacks, where its statistics are
    per level."""
    offset, scale = params
    if pl.levels is not None and offset.dim() == 3 and offset.shape[0] > 1:
        return offset[pl.levels], scale[pl.levels]
    return offset, scale


# The largest whole number each float type holds exactly, with every one below it.
_EXACT = {torch.bfloat16: 2 ** 8, torch.float16: 2 ** 11, torch.float32: 2 ** 24,
          torch.float64: 2 ** 53}


def _check_whole_numbers(var: VariableGeometry, dtype: torch.dtype) -> None:
    """An integer variable served raw (no statistics, or the scheme ``none``: a label
    image's ids, a class map) cast to a float type too narrow for its stored range would
    change its values (cell 300 becomes 300 or 302 in bfloat16): refused at build time."""
    stored = np.dtype(var.dtype)
    limit = _EXACT.get(dtype)
    if stored.kind not in "iu" or limit is None:
        return
    info = np.iinfo(stored)
    reach = max(abs(int(info.min)), int(info.max))
    if reach > limit:
        raise ConfigError(
            f"dtype={dtype} would cast {var.name!r} ({stored}, served raw: no statistics) to "
            f"{str(dtype).removeprefix('torch.')}, which holds whole numbers exactly only up "
            f"to {limit}, and a {stored} reaches {reach}: ids such as label values would "
            f"change. Leave dtype unset (the batch keeps {stored}; cast the other tensors in "
            f"the training step), or give {var.name!r} statistics if it holds measurements")


def _working_dtype(stored: torch.dtype) -> torch.dtype:
    """float64 for float64 data and for 32/64-bit integers (float32 cannot hold their
    values: 1e9 + noise lost the noise), float32 for the rest."""
    wide = (torch.float64, torch.int32, torch.int64, torch.uint32, torch.uint64)
    return torch.float64 if stored in wide else torch.float32


def _served_dtype(stored: torch.dtype) -> torch.dtype:
    """Without ``dtype=``: float64 stays float64, everything else is served as float32."""
    return torch.float64 if stored == torch.float64 else torch.float32


def _check_label_schemes(schemes: Mapping[str, str], var: VariableGeometry,
                         kept: tuple[str, ...]) -> None:
    """A scheme named for a label (an anemoi ``2t``) needs statistics per label; without
    them it was silently not applied."""
    named = sorted(set(schemes) & set(var.labels or ()))
    if named:
        axis = (var.dimension_names or ("", "variable"))[1]
        raise ConfigError(f"normalization schemes for {named} of {var.name!r} need its "
                         f"statistics per label (kept over {axis!r}), but they are kept over "
                         f"{list(kept)}: compute them with keep_dims=({axis!r},) or use "
                         "dataset_stats")
