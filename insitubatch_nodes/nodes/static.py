"""StaticFieldsNode: fields without a sample axis (land-sea mask, orography), in every batch."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torchdata.nodes import BaseNode

from ..errors import ConfigError, UnknownNameError
from ..store.arrays import array_in
from ..store.cut_array import LONGITUDES, CutArray, same_point
from ..store.discovery import discover, static_only
from ..store.source import Source
from ..store.storage import explain, open_url
from .transform import TransformNode


def open_static(url: str | os.PathLike[str] | Source, variables: Sequence[str] | None = None,
                *, storage_options: Mapping[str, Any] | None = None) -> dict[str, np.ndarray]:
    """Read whole static arrays (land-sea mask, orography) once: they are small and shared
    by every sample, so they are held in memory instead of being planned like data chunks.

    ``url`` is a store (the data's own or a second one) or an opened ``Source``; without
    ``variables``, every static field found there is read (``Source.static``: the numeric
    arrays without the sample dimension, as WeatherBench2 and ARCO-ERA5 keep them); in a
    store of static fields only (an ERA5 invariants store, no time or sample axis
    anywhere), every numeric array but the coordinates.
    """
    import zarr

    if isinstance(url, Source):
        group, display, found = url.group, url.url, url.static
        if group is None:
            raise ConfigError(f"the source {url.url!r} was not opened from a Zarr group; "
                             "pass the store's URL to open_static")
    else:
        opened = open_url(url, storage_options)
        try:
            group = zarr.open_group(opened.store, mode="r")
        except Exception as e:
            raise explain(opened, e) from None
        display, found = opened.display, None
    have = sorted(group.array_keys())
    if variables is None:
        arrays = None
        if found is None:  # only when asked: it opens every array of the group
            arrays = dict(group.arrays())
            found = discover(arrays).static
        if not found:
            # A store of static fields only (an ERA5 invariants store): no array has a
            # time or sample axis, so ``discover`` took a grid dim for the sample axis and
            # left nothing static. Every numeric array that is not a coordinate is a field.
            found = static_only(arrays if arrays is not None else dict(group.arrays()))
        if not found:
            raise ConfigError(f"no static fields (numeric arrays without the sample dimension) "
                             f"in {display}; arrays there: {have}. Name them: "
                             "open_static(url, [...])")
        variables = list(found)
    elif isinstance(variables, str):
        variables = [variables]
    missing = [v for v in variables if v not in have]
    if missing:
        raise UnknownNameError(f"unknown static variable(s) {missing} in {display}; "
                               f"arrays there: {have}")
    fields = {v: np.asarray(array_in(group, v, display)[:]) for v in variables}
    return cut_static(fields, url) if isinstance(url, Source) else fields


def align_static(fields: Mapping[str, Any], source: Source) -> dict[str, Any]:
    """Static fields given as ``xarray.DataArray`` (``xr.open_zarr(invariants)["lsm"]``),
    aligned by coordinate value to the grid the source serves: transposed to the order of
    a variable's last dims and taken at that variable's coordinate values (an invariants
    store written south to north beside data north to south, longitudes -180..180 beside
    0..360, a region), so each value lands on the point it describes; a point the field
    lacks is refused, naming it. Plain arrays are taken as they are (``check_static``
    checks their shape against the samples')."""
    import xarray as xr

    out = dict(fields)
    for name, value in fields.items():
        if not isinstance(value, xr.DataArray):
            continue
        dims = [str(d) for d in value.dims]
        var = next((v for v in source.variables if v.dimension_names
                    and len(v.dimension_names) > len(dims)
                    and sorted(map(str, v.dimension_names[-len(dims):])) == sorted(dims)), None)
        if var is None:
            have = {v.name: v.dimension_names[1:] for v in source.variables
                    if v.dimension_names}
            raise ConfigError(f"static field {name!r} has dims {tuple(dims)}, and no variable "
                              f"served by {source.url} has samples ending in those dims: "
                              f"{have}; rename its dims (DataArray.rename) to the data's")
        order = [str(d) for d in (var.dimension_names or ())[-len(dims):]]
        value = value.transpose(*order)
        picks: dict[str, np.ndarray] = {}
        for dim in order:
            if dim not in value.coords:
                continue
            try:
                want = source.coordinate(dim, var.name)
            except (UnknownNameError, ValueError):
                continue  # the data has no coordinate here: its shape decides
            picks[dim] = _positions(np.asarray(value[dim].values), want, name, dim)
        out[name] = np.ascontiguousarray(value.isel(picks).values)
    return out


def _positions(have: np.ndarray, want: np.ndarray, name: str, dim: str) -> np.ndarray:
    """Where each of ``want`` is in ``have`` (floats to 0.1 % of the spacing, so float32 and
    float64 grids match; longitudes modulo 360), refused naming the first missing."""
    if dim.lower() in LONGITUDES and have.dtype.kind in "fiu" and want.dtype.kind in "fiu":
        have, want = np.mod(have, 360.0), np.mod(want, 360.0)
    order = np.argsort(have, kind="stable")
    ranked = have[order]
    at = np.clip(np.searchsorted(ranked, want), 1, max(1, ranked.size - 1))
    lo = np.clip(at - 1, 0, ranked.size - 1)
    hi = np.clip(at, 0, ranked.size - 1)
    if ranked.dtype.kind in "fiu" and want.dtype.kind in "fiu":
        near = np.where(np.abs(ranked[hi] - want) < np.abs(ranked[lo] - want), hi, lo)
        ok = np.abs(ranked[near] - want) <= same_point(ranked, alone=1e-3)
    else:
        near = np.where(ranked[hi] == want, hi, lo)
        ok = ranked[near] == want
    if not ok.all():
        miss = want[int(np.flatnonzero(~ok)[0])].tolist()
        raise ConfigError(f"static field {name!r} has no {dim} {miss!r}, a point of the data's "
                          f"grid; its {dim} spans {have.min().tolist()!r} .. "
                          f"{have.max().tolist()!r}: give a field of this grid")
    return order[near]


def cut_static(fields: Mapping[str, Any], source: Source) -> dict[str, Any]:
    """Static fields of the whole grid cut as ``source``'s variables are (a region, a part
    of the grid): a field whose shape is the last dims of a cut variable's whole sample takes
    the same indices along them, as the statistics do (``store.statistics.cut_stats``). A
    field of the part's shape, or beside no cut variable, is left for ``check_static``."""
    cuts = [(arr, geom) for arr, geom in zip(source.arrays, source.variables, strict=True)
            if isinstance(arr, CutArray)]
    out = dict(fields)
    for name, value in fields.items():
        shape = tuple(np.shape(value))
        lead = 0
        while len(shape) - lead > 1 and shape[lead] == 1:  # a (1, y, x) field is a (y, x) one
            lead += 1
        core = shape[lead:]
        for arr, geom in cuts:
            whole, k = arr.base_geom.shape, len(core)
            if k < len(whole) and whole[-k:] == core and geom.shape[-k:] != core:
                index = np.ix_(*(arr.index(a) for a in range(len(whole) - k, len(whole))))
                at = (slice(None),) * lead + tuple(
                    torch.as_tensor(i) if isinstance(value, torch.Tensor) else i for i in index)
                out[name] = value[at]
                break
    return out


def check_static(fields: Mapping[str, Any], samples: Mapping[str, tuple[int, ...]],
                 patch_dims: int = 0) -> None:
    """Refuse, at build time, a static field that does not lie on the data's grid: its shape
    must be the last dims of some variable's sample shape (``samples``: name -> shape), and
    with patches, cover the patched dims. A field transposed, from another grid, or with
    the sample axis would otherwise be broadcast next to the data as it is."""
    for name, value in fields.items():
        shape = tuple(np.shape(value))
        while len(shape) > 1 and shape[0] == 1:  # a (1, y, x) field is a (y, x) one
            shape = shape[1:]
        fits = [v for v, s in samples.items()
                if len(shape) <= len(s) and s[len(s) - len(shape):] == shape]
        if not fits:
            raise ConfigError(
                f"static field {name!r} has shape {shape}, which is not the grid of the data: "
                f"a static field's shape must be the last dims of a sample, and the samples "
                f"are {dict(samples)}. Transpose it to the data's axis order, or open the "
                "field of this grid (open_static of the data's own store)")
        if patch_dims and len(shape) < patch_dims:
            raise ConfigError(f"static field {name!r} has shape {shape}: patches cut the last "
                             f"{patch_dims} dims of every field, and it has {len(shape)}")


class StaticFieldsNode(TransformNode[dict[str, torch.Tensor]]):
    """Adds ``"static/<name>"`` to each batch: the field broadcast to ``(batch, *shape)``
    as an expanded view (no copy per batch), float fields cast to ``dtype`` if given (not
    normalised).
    The fields live on ``device`` (moved once), so a CUDA loader does not copy B expanded
    copies of them to the GPU every batch. Stateless."""

    keeps_batch_memory = True  # only adds keys

    def __init__(self, source: BaseNode[dict[str, torch.Tensor]],
                 fields: Mapping[str, np.ndarray | torch.Tensor],
                 device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(source)
        # ``dtype``: the loader's cast (``dtype=torch.bfloat16``), so the fields concatenate
        # with the data as they come; made once, not per batch.
        self.fields = {}
        for k, v in fields.items():
            t = torch.as_tensor(np.ascontiguousarray(v))
            # float fields only: a class index or a boolean mask keeps its type
            cast = dtype if dtype is not None and t.is_floating_point() else None
            self.fields[k] = t.to(device or "cpu", dtype=cast)


    def next(self) -> dict[str, torch.Tensor]:
        batch = next(self.source)
        n = len(batch["sample_index"])
        for name, t in self.fields.items():
            batch[f"static/{name}"] = t.expand(n, *t.shape)
        return batch
