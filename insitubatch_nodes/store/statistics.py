"""Normalization statistics streamed over a split, once, chunk by chunk.

Per variable: mean, std, min and max, reduced over the sample axis and the grid, per
element of every other dim (a level, an anemoi dataset's variable axis) unless
``keep_dims`` says which to keep (``()`` pools everything into one value). Sums are
combined per chunk with Chan's parallel formula in float64, so the result matches numpy on
the whole split.
Missing values (NaN, as ERA5's sea-surface temperature over land) are left out: the
statistics are those of the finite values (numpy's ``nanmean``/``nanstd``), and the
fraction of values left out is recorded; a variable with no finite value is an error.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import zarr

from ..errors import ConfigError, StoreError, UnknownNameError
from ..sampling.windows import chunks_touching
from .anemoi import DATA, stored_statistics
from .arrays import array_in
from .channel_names import level_index, split_channel
from .cut_array import CutArray
from .served import Stored
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
    # Over a part of the grid (a region, a read group's rows): per kept dim it cut, the whole
    # grid's indices these rows are, in order (empty: the whole grid). What ``cut_stats``
    # matches against the part a loader serves.
    part: tuple[tuple[str, tuple[int, ...]], ...] = ()

    def to_dict(self) -> dict:
        return {"kept_dims": list(self.kept_dims), "count": self.count,
                "nan_fraction": self.nan_fraction, "coords": list(self.coords),
                **({"part": [[d, list(ix)] for d, ix in self.part]} if self.part else {}),
                **{k: np.asarray(getattr(self, k)).tolist() for k in ("mean", "std", "min", "max")}}

    @classmethod
    def from_dict(cls, name: str, d: Mapping[str, Any]) -> VariableStats:
        mean, std, lo, hi = (np.asarray(d[k], dtype=np.float64)
                             for k in ("mean", "std", "min", "max"))
        return cls(name, tuple(d["kept_dims"]), mean, std, lo, hi,
                   count=int(d["count"]), nan_fraction=float(d.get("nan_fraction", 0.0)),
                   coords=tuple(d.get("coords", ())),
                   part=tuple((str(k), tuple(int(i) for i in ix)) for k, ix in d.get("part", ())))

    def at(self, coord: Any) -> tuple[float, float]:
        """(mean, std) at the kept coordinate ``coord`` (``"500"`` of ``"z@500"``, or 500),
        matched by value as channels are: 500, 500.0 and "500" find a stored 500."""
        if len(self.kept_dims) != 1:
            raise UnknownNameError(f"statistics of {self.name!r} keep dims {list(self.kept_dims)}, "
                                   f"so {self.name}@{coord} names no single row; compute them with "
                                   "keep_dims=[<the level dim>]")
        written = [str(c) for c in self.coords]
        k = level_index(np.asarray(self.coords), coord) if self.coords else None
        if k is None:
            raise UnknownNameError(f"{self.name}@{coord}: {coord!r} is not a {self.kept_dims[0]} "
                                   f"these statistics of {self.name!r} hold; they hold "
                                   f"{written or f'{np.size(self.mean)} rows without coordinates'}")
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

    def mean_std(self, names: Sequence[str | tuple[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
        """Per-channel mean and std (float64, one per name, in the order given) for channels
        named as ``channels=`` takes them and ``loader.channel_names`` gives them: ``"t2m"``,
        ``"z@500"`` or ``("z", 500)`` (a level of statistics kept per level, matched by
        value), an anemoi label such as ``"2t"``."""
        means, stds = [], []
        have = {v.name for v in self.variables}
        for name in names:
            var, coord = split_channel(name, have)
            if coord is not None:
                m, s = self[var].at(coord)
            elif var not in have and (row := self._labelled(var)) is not None:
                m, s = row.at(var)  # an anemoi label, a row of "data" kept per variable
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

    def _labelled(self, label: str) -> VariableStats | None:
        """The statistics kept over a labelled axis (an anemoi dataset's ``data`` along its
        variables) that hold ``label`` as one of their rows."""
        for v in self.variables:
            if len(v.kept_dims) == 1 and label in v.coords:
                return v
        return None

    def denormalize(self, x: ArrayT, names: Sequence[str | tuple[str, Any]]) -> ArrayT:
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


# Dims that are a grid's (pooled by default): as WeatherBench2, ARCO-ERA5, anemoi and the
# usual model outputs name them.
GRID_DIMS = frozenset({"lat", "lon", "latitude", "longitude", "y", "x", "rlat", "rlon",
                       "cell", "cells", "ncells", "ncol", "values", "node", "nodes", "point",
                       "points", "grid", "station", "stations"})
# Ensemble members are draws of one field: pooled by default, as anemoi pools them.
ENSEMBLE_DIMS = frozenset({"ensemble", "member", "number", "realization"})


def default_kept_dims(dims: Sequence[str | None]) -> tuple[str, ...]:
    """The dims of a variable ``compute_stats`` keeps by default (its dims, the sample dim
    first): every named dim of a sample that is neither the grid nor an ensemble axis. The
    grid is the dims named as one (``GRID_DIMS``: latitude, longitude, y, x, cell, values,
    ...) or, when none is, the last two dims of the sample (the last, for a 1-D sample).
    So a ``(time, level, latitude, longitude)`` variable keeps ``level``, anemoi's
    ``(time, variable, ensemble, cell)`` keeps ``variable``, ``(time, lat, lon)`` none."""
    sample = list(dims[1:])
    grid = [d in GRID_DIMS for d in sample]
    if not any(grid):
        grid = [i >= len(sample) - 2 for i in range(len(sample))]
    return tuple(d for d, g in zip(sample, grid, strict=True)
                 if d is not None and not g and d not in ENSEMBLE_DIMS)


def cut_stats(stats: Stats, source: Source) -> Stats:
    """``stats`` as ``source`` serves its variables: statistics kept along dims a region or a
    read group cuts (a ``CutArray``: grid rows, cells, levels) and computed over the whole
    grid are cut alike (each point keeps its own); statistics computed over the same part
    are taken as they are; over another part, or a part where the loader serves the whole,
    they are refused naming both (``VariableStats.part`` says which part they cover)."""
    out = list(stats.variables)
    for arr, geom in zip(source.arrays, source.variables, strict=True):
        at = next((k for k, v in enumerate(out) if v.name == geom.name), None)
        if at is None:
            continue
        st = out[at]
        base = arr.base_geom if isinstance(arr, CutArray) else geom
        dims = base.dimension_names or ()
        if not st.kept_dims or any(d not in dims[1:] for d in st.kept_dims):
            continue
        served = served_part(arr, st.kept_dims)
        if st.part == served:
            continue
        if st.part:
            raise ConfigError(f"statistics of {geom.name!r} were computed over a part of its "
                              f"grid ({_part_text(st.part)}), and this loader serves "
                              f"{_part_text(served) or 'the whole grid'}: compute them over the "
                              "whole store (each point keeps its own) or over this part")
        axes = [dims.index(d) for d in st.kept_dims]
        if not isinstance(arr, CutArray) or np.shape(st.mean) != tuple(
                base.shape[a] for a in axes):
            continue  # another shape: NormalizeNode refuses it, naming both
        picks = [arr.index(a) for a in axes]

        def take(x: np.ndarray, picks: list[np.ndarray] = picks) -> np.ndarray:
            for k, index in enumerate(picks):
                x = np.take(np.asarray(x), index, axis=k)
            return x

        coords = (tuple(np.asarray(st.coords, dtype=object)[picks[0]].tolist())
                  if st.coords and len(picks) == 1 else st.coords)
        out[at] = replace(st, mean=take(st.mean), std=take(st.std), min=take(st.min),
                          max=take(st.max), coords=coords, part=served)
    return Stats(stats.split, tuple(out))


def served_part(arr: Stored, kept: Sequence[str]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Per dim of ``kept`` that ``arr`` is cut along, the whole grid's indices it serves, in
    order; empty where it serves the whole grid."""
    if not isinstance(arr, CutArray):
        return ()
    dims = arr.base_geom.dimension_names or ()
    out = []
    for d in kept:
        if d in dims[1:]:
            axis = dims.index(d)
            index = arr.index(axis)
            if not np.array_equal(index, np.arange(arr.base_geom.shape[axis])):
                out.append((d, tuple(int(i) for i in index)))
    return tuple(out)


def _part_text(part: tuple[tuple[str, tuple[int, ...]], ...]) -> str:
    """``latitude: 7 points from index 3`` per dim, for errors."""
    return "; ".join(f"{d}: {len(ix)} points from index {ix[0]}" for d, ix in part)


def compute_stats(source: Source, manifest: SplitManifest, split: str = "train", *,
                  variables: Sequence[str] | None = None,
                  keep_dims: Sequence[str] | None = None, progress: bool = True) -> Stats:
    """Stream ``split`` once and return mean/std/min/max per variable, per element of the
    dims kept: by default (``keep_dims=None``) every dim of a variable's samples but the
    grid and an ensemble axis (``default_kept_dims``: levels, anemoi's variable axis), so
    each channel is normalized on its own; ``keep_dims=()`` pools each variable into one
    value, ``keep_dims=["level"]`` keeps the dims named (those a variable has).
    ``variables`` (default: every variable served) may name channels' variables only."""
    manifest.check_source(source)
    if isinstance(keep_dims, str):
        keep_dims = (keep_dims,)
    names = list(variables) if variables is not None else list(source.names)
    # The store's missing dates (anemoi's missing_dates) hold no data: the loader never
    # serves them, and their fill values (NaN) made every statistic NaN.
    ids = np.setdiff1d(manifest.chunk_ids(split), chunks_touching(source.missing, source.grid))
    if ids.size == 0:
        raise StoreError(f"split {split!r} has no chunks to compute statistics over")
    # (name, array, axes reduced over, names of the dims kept)
    plans: list[tuple[str, Stored, tuple[int, ...], tuple[str, ...]]] = []
    coords: dict[str, tuple[Any, ...]] = {}
    for name in names:
        g = source.variable(name)  # an unknown name: refused here, before the long pass
        dims = g.dimension_names or tuple(f"dim_{i}" for i in range(len(g.shape)))
        keep = default_kept_dims(g.dimension_names or ()) if keep_dims is None else keep_dims
        # a kept dim is one named in keep_dims: a str, never an unnamed (None) dim
        kept_at = {i: d for i, d in enumerate(dims) if i > 0 and d is not None and d in keep}
        axes = tuple(i for i in range(len(g.shape)) if i not in kept_at)
        kept_names = tuple(kept_at.values())
        plans.append((name, source.arrays[source.names.index(name)], axes, kept_names))
        if len(kept_names) == 1:
            dim = kept_names[0]
            if g.labels is not None and list(dims).index(dim) == 1:
                coords[name] = tuple(g.labels)  # anemoi: the variable axis's names
            else:
                try:  # this variable's: its store's levels, those a region kept
                    coords[name] = tuple(source.coordinate(dim, name).tolist())
                except (KeyError, ValueError):
                    coords[name] = ()
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
    for name, arr, _, kept_names in plans:
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
                                 coords=coords.get(name, ()), part=served_part(arr, kept_names)))
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


def _stored_rows(group: zarr.Group, names: Sequence[str], url: str,
                 ) -> list[tuple[float, float, float, float, int]]:
    """(mean, stdev, minimum, maximum, count) per variable, as one anemoi store keeps them;
    statistics that are not finite are refused (normalizing would make them all NaN)."""
    stored = stored_statistics(group, names, url)
    bad = sorted({names[int(i)] for k in ("mean", "stdev", "minimum", "maximum")
                  for i in np.flatnonzero(~np.isfinite(np.asarray(stored[k], np.float64)))})
    if bad:  # normalizing with them would turn every value of those variables into NaN
        raise StoreError(f"the statistics stored in {url!r} are not finite for "
                         f"{bad} (a variable with missing values counted them); compute "
                         "them over the finite values with ib.compute_stats(source, manifest)")
    count = (np.asarray(array_in(group, "count", url)[:], dtype=np.int64)
             if "count" in group.array_keys() else np.zeros(len(names), dtype=np.int64))
    return [(float(stored["mean"][i]), float(stored["stdev"][i]), float(stored["minimum"][i]),
             float(stored["maximum"][i]), int(count[i])) for i in range(len(names))]


def dataset_stats(source: Source) -> Stats:
    """The statistics an anemoi dataset stored when it was made, as ``Stats``: one entry per
    anemoi variable (``dataset_stats(src)["2t"].mean``) and ``"data"`` per variable axis,
    which ``NormalizeNode`` (``build_loader(stats=...)``) applies channel by channel. Of a
    join, each variable's from the member serving it; of a concat, the first member's
    (anemoi-datasets' rules)."""
    if source.format != "anemoi" or source.group is None:
        raise StoreError(f"{source.url!r} is not an anemoi dataset, so it stores no "
                         "statistics; compute them with ib.compute_stats(source, manifest)")
    data = source.variables[0]
    found: dict[str, tuple[float, float, float, float, int]] = {}
    for i, var in enumerate(source.variables):
        url = source.origin(i)[0]
        group = next((m.group for m in source.members if m.url == url), source.group)
        assert var.labels is not None and group is not None
        for name, row in zip(var.labels, _stored_rows(group, var.labels, url), strict=True):
            found.pop(name, None)  # a join: the last member serving it, at its first place
            found.setdefault(name, row)
    names = tuple(dict.fromkeys(lb for v in source.variables for lb in (v.labels or ())))
    stored = {k: np.array([found[n][j] for n in names], dtype=np.float64)
              for j, k in enumerate(("mean", "stdev", "minimum", "maximum"))}
    count = np.array([found[n][4] for n in names], dtype=np.int64)
    assert data.dimension_names is not None
    whole = VariableStats(DATA, (str(data.dimension_names[1]),), stored["mean"],
                          stored["stdev"], stored["minimum"], stored["maximum"],
                          int(count.sum()), coords=tuple(names))
    each = tuple(VariableStats(name, (), np.asarray(stored["mean"][i]),
                               np.asarray(stored["stdev"][i]), np.asarray(stored["minimum"][i]),
                               np.asarray(stored["maximum"][i]), count=int(count[i]))
                 for i, name in enumerate(names))
    return Stats("stored", (whole, *each))
