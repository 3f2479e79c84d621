"""Normalization statistics streamed over a split, once, chunk by chunk.

Per variable: mean, std, min and max, reduced over every axis except the ones named in
``keep_dims`` (e.g. ``level`` for per-level channels). Sums are combined per chunk with
Chan's parallel formula in float64, so the result matches numpy on the whole split.
Missing values (NaN, as ERA5's sea-surface temperature over land) are left out: the
statistics are those of the finite values (numpy's ``nanmean``/``nanstd``), and the
fraction of values left out is recorded; a variable with no finite value is an error.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import zarr

from ..errors import StoreError, UnknownNameError
from ..sampling.windows import chunks_touching
from .anemoi import stored_statistics
from .arrays import array_in
from .source import Source
from .splits import SplitManifest

if TYPE_CHECKING:
    import torch

# Normalisation schemes (anemoi-training's), per variable or label; "default" names the rest.
SCHEMES = ("mean-std", "std", "min-max", "max", "none")
DEFAULT_SCHEME = "default"
# a numpy array or a torch tensor: denormalize gives back the kind it was given
ArrayT = TypeVar("ArrayT", np.ndarray, "torch.Tensor")


@dataclass(frozen=True, eq=False)
class VariableStats:
    """Statistics of one variable; arrays have the shape of the kept dims (or are scalars)."""

    name: str
    kept_dims: tuple[str, ...]
    mean: np.ndarray
    std: np.ndarray
    min: np.ndarray
    max: np.ndarray
    count: int  # finite values the statistics are over
    nan_fraction: float = 0.0  # of the variable's values in the split, missing (not finite)
    # The coordinate values along the (single) kept dim, e.g. the levels, when the store
    # has them: what turns a channel name such as "z@500" into a row of mean/std.
    coords: tuple[Any, ...] = ()

    def to_dict(self) -> dict:
        return {"kept_dims": list(self.kept_dims), "count": self.count,
                "nan_fraction": self.nan_fraction, "coords": list(self.coords),
                **{k: np.asarray(getattr(self, k)).tolist() for k in ("mean", "std", "min", "max")}}

    @classmethod
    def from_dict(cls, name: str, d: Mapping[str, Any]) -> VariableStats:
        mean, std, lo, hi = (np.asarray(d[k], dtype=np.float64)
                             for k in ("mean", "std", "min", "max"))
        return cls(name, tuple(d["kept_dims"]), mean, std, lo, hi,
                   count=int(d["count"]), nan_fraction=float(d.get("nan_fraction", 0.0)),
                   coords=tuple(d.get("coords", ())))

    def at(self, coord: str) -> tuple[float, float]:
        """(mean, std) at the kept coordinate written ``coord`` (``"500"`` of ``"z@500"``)."""
        if len(self.kept_dims) != 1:
            raise UnknownNameError(f"statistics of {self.name!r} keep dims {list(self.kept_dims)}, "
                                   f"so {self.name}@{coord} names no single row; compute them with "
                                   "keep_dims=[<the level dim>]")
        written = [str(c) for c in self.coords]
        if coord not in written:
            raise UnknownNameError(f"{self.name}@{coord}: {coord!r} is not a {self.kept_dims[0]} "
                                   f"these statistics of {self.name!r} hold; they hold "
                                   f"{written or f'{np.size(self.mean)} rows without coordinates'}")
        k = written.index(coord)
        return float(np.ravel(self.mean)[k]), float(np.ravel(self.std)[k])


@dataclass(frozen=True, eq=False)
class Stats:
    """Statistics of several variables over one split; JSON-serialisable."""

    split: str
    variables: tuple[VariableStats, ...]

    def __getitem__(self, name: str) -> VariableStats:
        for v in self.variables:
            if v.name == name:
                return v
        raise UnknownNameError(f"no statistics for {name!r}; have "
                               f"{[v.name for v in self.variables]}")

    def mean_std(self, names: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Per-channel mean and std (float64, one per name, in the order given) for channel
        names as ``loader.channel_names`` has them: ``"t2m"``, ``"z@500"`` (a level of
        statistics kept per level), an anemoi label such as ``"2t"``."""
        means, stds = [], []
        for name in names:
            var, sep, coord = name.partition("@")
            if sep:
                m, s = self[var].at(coord)
            else:
                v = self[var]
                if np.size(v.mean) != 1:
                    raise UnknownNameError(f"statistics of {var!r} have {np.size(v.mean)} rows ("
                                           f"kept dims {list(v.kept_dims)}): name one, e.g. "
                                           f"'{var}@{v.coords[0] if v.coords else '<level>'}'")
                m, s = float(np.ravel(v.mean)[0]), float(np.ravel(v.std)[0])
            means.append(m)
            stds.append(s)
        return np.asarray(means, dtype=np.float64), np.asarray(stds, dtype=np.float64)

    def denormalize(self, x: ArrayT, names: Sequence[str]) -> ArrayT:
        """``x`` (a prediction, channels on axis -3: ``(..., C, y, x)``, C = ``len(names)``)
        back in the store's units: ``x * std + mean`` per channel, undoing the default
        "mean-std" scheme (``loader.denormalize`` undoes whichever scheme the loader used).
        A torch tensor stays one, on its device and dtype."""
        if x.ndim < 3 or x.shape[-3] != len(names):
            raise StoreError(f"denormalize: x has shape {tuple(x.shape)}, but {len(names)} "
                             "channel names were given for its axis -3 (..., C, y, x)")
        mean, std = self.mean_std(names)
        mean, std = mean[:, None, None], std[:, None, None]
        if isinstance(x, np.ndarray):
            return x * std + mean
        return x * x.new_tensor(std) + x.new_tensor(mean)

    def to_dict(self) -> dict:
        return {"split": self.split, "variables": {v.name: v.to_dict() for v in self.variables}}

    @classmethod
    def from_dict(cls, d: Mapping) -> Stats:
        return cls(d["split"], tuple(VariableStats.from_dict(n, v)
                                     for n, v in d["variables"].items()))

    def to_json(self, path: str | os.PathLike[str]) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> Stats:
        return cls.from_dict(json.loads(Path(path).read_text()))


def compute_stats(source: Source, manifest: SplitManifest, split: str = "train", *,
                  variables: Sequence[str] | None = None, keep_dims: Sequence[str] = (),
                  progress: bool = True) -> Stats:
    """Stream ``split`` once and return mean/std/min/max per variable (and kept dim)."""
    manifest.check_source(source)
    names = list(variables) if variables is not None else list(source.names)
    # The store's missing dates (anemoi's missing_dates) hold no data: the loader never
    # serves them, and their fill values (NaN) made every statistic NaN.
    ids = np.setdiff1d(manifest.chunk_ids(split), chunks_touching(source.missing, source.grid))
    if ids.size == 0:
        raise StoreError(f"split {split!r} has no chunks to compute statistics over")
    # (name, array, axes reduced over, names of the dims kept)
    plans: list[tuple[str, zarr.Array, tuple[int, ...], tuple[str, ...]]] = []
    coords: dict[str, tuple[Any, ...]] = {}
    for name in names:
        g = source.variable(name)
        dims = g.dimension_names or tuple(f"dim_{i}" for i in range(len(g.shape)))
        # a kept dim is one named in keep_dims: a str, never an unnamed (None) dim
        kept_at = {i: d for i, d in enumerate(dims) if i > 0 and d is not None and d in keep_dims}
        axes = tuple(i for i in range(len(g.shape)) if i not in kept_at)
        kept_names = tuple(kept_at.values())
        plans.append((name, source.arrays[source.names.index(name)], axes, kept_names))
        if len(kept_names) == 1 and kept_names[0] not in coords:
            try:
                coords[kept_names[0]] = tuple(source.coordinate(kept_names[0]).tolist())
            except (KeyError, ValueError):
                coords[kept_names[0]] = ()
    acc: dict[str, Moments] = {}
    it: Iterable[int] = ids.tolist()
    if progress:
        from tqdm import tqdm

        it = tqdm(it, desc=f"statistics of {split!r}", unit="chunk", file=sys.stderr)
    for c in it:
        a, b = source.grid.chunk_range(c)
        for name, arr, axes, _ in plans:
            part = _moments(np.asarray(arr[a:b], dtype=np.float64), axes)
            acc[name] = _combine(acc[name], part) if name in acc else part
    out = []
    for name, _, _, kept_names in plans:
        n, m, m2, lo, hi, total = acc[name]
        empty = np.asarray(n) == 0
        if empty.any():
            where = (f" at {list(kept_names)} index {np.argwhere(empty)[0].tolist()}"
                     if kept_names else "")
            raise StoreError(f"variable {name!r} has no finite value in split {split!r}{where} "
                             "(every value is NaN or infinite): it cannot be normalized; "
                             "leave it out (variables=[...]) or fill it in the store")
        count = int(np.sum(n))
        out.append(VariableStats(name, kept_names, np.asarray(m),
                                 np.sqrt(np.asarray(m2) / np.asarray(n)), np.asarray(lo),
                                 np.asarray(hi), count,
                                 nan_fraction=float(1.0 - count / max(1, total)),
                                 coords=coords.get(kept_names[0], ()) if len(kept_names) == 1
                                 else ()))
    return Stats(split, tuple(out))


# (finite count, mean, sum of squared deviations, min, max) per kept element, and the number
# of values, of what one chunk holds; an element with no finite value has count 0, mean 0
Moments = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]


def _moments(x: np.ndarray, axes: tuple[int, ...]) -> Moments:
    """The finite values' moments of ``x`` over ``axes``."""
    finite = np.isfinite(x)
    n = finite.sum(axis=axes)
    if finite.all():  # the common case, without the masks' extra passes
        m = x.mean(axis=axes)
        m2 = ((x - np.expand_dims(m, axes)) ** 2).sum(axis=axes)
        return n, m, m2, x.min(axis=axes), x.max(axis=axes), x.size
    xs = np.where(finite, x, 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        m = np.where(n > 0, xs.sum(axis=axes) / n, 0.0)
    m2 = (np.where(finite, x - np.expand_dims(m, axes), 0.0) ** 2).sum(axis=axes)
    lo = np.min(x, axis=axes, where=finite, initial=np.inf)
    hi = np.max(x, axis=axes, where=finite, initial=-np.inf)
    return n, m, m2, lo, hi, x.size


def _combine(a: Moments, b: Moments) -> Moments:
    """Chan's parallel formula, element by element; an element with no finite value on one
    side takes the other's."""
    n0, m0, s0, lo0, hi0, t0 = a
    n1, m1, s1, lo1, hi1, t1 = b
    tot = n0 + n1
    with np.errstate(invalid="ignore", divide="ignore"):
        frac = np.where(tot > 0, n1 / np.maximum(tot, 1), 0.0)
    delta = m1 - m0
    return (tot, m0 + delta * frac, s0 + s1 + delta ** 2 * n0 * frac,
            np.minimum(lo0, lo1), np.maximum(hi0, hi1), t0 + t1)


def dataset_stats(source: Source) -> Stats:
    """The statistics an anemoi dataset stored when it was made, as ``Stats``: one entry per
    anemoi variable (``dataset_stats(src)["2t"].mean``) and ``"data"`` per variable axis,
    which ``NormalizeNode`` (``build_loader(stats=...)``) applies channel by channel."""
    if source.format != "anemoi" or source.group is None:
        raise StoreError(f"{source.url!r} is not an anemoi dataset, so it stores no "
                         "statistics; compute them with ib.compute_stats(source, manifest)")
    data = source.variables[0]
    names = data.labels  # the variable axis, as read when the source was opened
    assert names is not None
    stored = stored_statistics(source.group, names, source.url)
    bad = sorted({names[i] for k in ("mean", "stdev", "minimum", "maximum")
                  for i in np.flatnonzero(~np.isfinite(np.asarray(stored[k], np.float64)))})
    if bad:  # normalizing with them would turn every value of those variables into NaN
        raise StoreError(f"the statistics stored in {source.url!r} are not finite for "
                         f"{bad} (a variable with missing values counted them); compute "
                         "them over the finite values with ib.compute_stats(source, manifest)")
    count = (np.asarray(array_in(source.group, "count", source.url)[:], dtype=np.int64)
             if "count" in source.group.array_keys() else np.zeros(len(names), dtype=np.int64))
    assert data.dimension_names is not None
    whole = VariableStats(data.name, (str(data.dimension_names[1]),), stored["mean"],
                          stored["stdev"], stored["minimum"], stored["maximum"],
                          int(count.sum()), coords=tuple(names))
    each = tuple(VariableStats(name, (), np.asarray(stored["mean"][i]),
                               np.asarray(stored["stdev"][i]), np.asarray(stored["minimum"][i]),
                               np.asarray(stored["maximum"][i]), count=int(count[i]))
                 for i, name in enumerate(names))
    return Stats("stored", (whole, *each))
