"""Opening a Zarr store and reading the geometry of the variables a loader will serve.

Everything downstream (splits, plans, fetches) works from the frozen ``Source`` this
returns, so a bad store, variable or dtype is reported here, once, in words.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import zarr
import zarr.storage

from ..errors import ConfigTypeError, StoreError
from ..sampling.geometry import SampleGrid, VariableGeometry, common_chunk_size
from .anemoi import DATA, is_anemoi, read_layout, select
from .arrays import array_in
from .axis_array import AxisArray, sample_first
from .discovery import NUMERIC_KINDS, check_chosen, dimension_names, discover
from .served import Member, Source
from .storage import OpenedStore, explain, open_icechunk_store, open_url, redact_url

# zarr's ZarrUserWarning for numcodecs codecs in a v3 array (message prefix)
NUMCODECS_WARNING = "Numcodecs codecs are not in the Zarr version 3 specification"
__all__ = ["Member", "Source", "open_icechunk", "open_source", "redact_url", "source_of_arrays"]


def open_source(
    url: str | os.PathLike[str] | zarr.Group | Any,
    variables: Sequence[str] | None = None,
    *,
    sample_dim: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> Source:
    """Open a Zarr group and describe the variables to serve along their common sample axis.

    ``url`` is a local path, a ``file://`` or object-store URL, a ``zarr.Group`` or a zarr
    store. Without ``variables``, the arrays led by the sample dimension are served (see
    ``discover``: the dimension leading most arrays unless ``sample_dim`` names it), and the
    numeric arrays without it are listed in ``Source.static`` for ``open_static``.
    """
    if isinstance(url, zarr.Group):
        return _describe(url, str(url.store_path), variables, sample_dim, None)
    if type(url).__name__ == "Dataset" and type(url).__module__.startswith("xarray"):
        return _from_xarray(url, variables, sample_dim, storage_options)
    if isinstance(url, (str, os.PathLike)):
        opened = open_url(url, storage_options)
    else:
        # zarr's own name for the store (``object_store://S3Store(bucket=..., prefix=...)``,
        # ``file:///path``): messages and cache scopes tell two stores apart by it.
        opened = OpenedStore(url, str(url))
    return _open_group(opened, variables, sample_dim)


def open_icechunk(
    location: Any,
    variables: Sequence[str] | None = None,
    *,
    branch: str | None = None,
    tag: str | None = None,
    snapshot_id: str | None = None,
    sample_dim: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    virtual_chunk_access: Mapping[str, Any] | None = None,
) -> Source:
    """Like ``open_source``, for an icechunk repository read at a branch (default ``main``),
    tag or snapshot id. The resolved snapshot id is kept in the source, the split manifest
    and the loader state, so a resume against a moved branch is caught.
    ``virtual_chunk_access={url_prefix: None or icechunk credentials}`` authorizes reads of
    virtual chunks (byte ranges of NetCDF/HDF5 files referenced by virtualizarr)."""
    opened = open_icechunk_store(location, branch=branch, tag=tag, snapshot_id=snapshot_id,
                                 storage_options=storage_options,
                                 virtual_chunk_access=virtual_chunk_access)
    return _open_group(opened, variables, sample_dim)


def _open_group(opened: OpenedStore, variables: Sequence[str] | None,
                sample_dim: str | None) -> Source:
    try:
        group = zarr.open_group(opened.store, mode="r")
    except Exception as e:
        raise explain(opened, e) from None
    return _describe(group, opened.display, variables, sample_dim, opened.snapshot_id)


def _from_xarray(ds: Any, variables: Sequence[str] | None, sample_dim: str | None,
                 storage_options: Mapping[str, Any] | None) -> Source:
    """Serve a Dataset opened from Zarr (``xr.open_zarr``/``engine="zarr"``) from its store,
    by dimension names; the loader reads the store itself, so the Dataset must be unsliced."""
    where = ds.encoding.get("source")
    if not where:
        raise StoreError(
            "this xarray.Dataset does not say which Zarr store it came from "
            "(ds.encoding['source'] is empty); open it with xr.open_zarr(url) or pass the URL "
            "to open_source(url, sample_dim=...) directly"
        )
    if sample_dim is None:
        first = next(iter(ds.data_vars.values()), None)
        sample_dim = "time" if "time" in ds.dims else (first.dims[0] if first is not None else None)
    if sample_dim not in ds.dims:
        raise StoreError(f"sample_dim {sample_dim!r} is not a dimension of the dataset; "
                         f"dimensions: {list(ds.dims)}")
    given = variables is not None
    if variables is None:
        variables = [n for n, v in ds.data_vars.items() if v.dims[:1] == (sample_dim,)]
    bad = [n for n in variables if n in ds.data_vars and ds[n].dims[:1] != (sample_dim,)]
    if bad:
        raise StoreError(f"variables {bad} do not have {sample_dim!r} as their first dimension")
    src = _open_group(open_url(where, storage_options), variables, sample_dim)
    if ds.sizes[sample_dim] != src.n_samples:
        raise StoreError(
            f"the dataset has {ds.sizes[sample_dim]} steps along {sample_dim!r} but its store "
            f"{src.url} has {src.n_samples}: the loader reads whole stores, so pass the "
            "unsliced dataset and choose periods with split_by_coordinate"
        )
    _check_as_stored(ds, src)
    if sample_dim in ds.coords:
        src = replace(src, sample_coord=np.asarray(ds[sample_dim].values))
    return replace(src, variables_given=given)


def _check_as_stored(ds: Any, src: Source) -> None:
    """Refuse a Dataset that is not its store as stored: the loader reads the store's
    chunks, so a selection, transpose, reversal, computation or CF decoding done in xarray
    would silently not apply. Each refusal says what differs and how to ask for it."""
    how = ("the loader reads the store itself: pass the Dataset as opened (xr.open_zarr), "
           "choose periods with split_by_coordinate, levels with channels=[(name, level)]")
    for geom in src.variables:
        var = ds[geom.name]
        dims = tuple(var.dims)
        if geom.dimension_names is not None and dims != tuple(geom.dimension_names):
            raise StoreError(f"variable {geom.name!r} of the Dataset has dimensions {dims} but "
                             f"the store {src.url} has {tuple(geom.dimension_names)} (it was "
                             f"transposed); {how}")
        if tuple(var.shape) != geom.shape:
            cut = [d for d, a, b in zip(dims, var.shape, geom.shape, strict=False) if a != b]
            raise StoreError(f"variable {geom.name!r} of the Dataset has shape "
                             f"{tuple(var.shape)} but {geom.shape} in the store {src.url}: it "
                             f"was sliced along {cut}; {how}")
        if not var.encoding or "dtype" not in var.encoding:
            raise StoreError(f"variable {geom.name!r} of the Dataset is not backed by the store "
                             f"{src.url} (its values were computed: arithmetic, astype, where "
                             "... drop the Zarr encoding), so the loader would serve the stored "
                             f"values, not these; {how}, and transform batches instead "
                             "(NormalizeNode, a TransformNode)")
        cf = [k for k in ("scale_factor", "add_offset") if k in var.encoding]
        if cf:
            raise StoreError(f"variable {geom.name!r} is stored CF-encoded ({cf} in its "
                             f"encoding): xarray shows decoded values but the loader serves "
                             f"the stored {geom.dtype} values; open it with "
                             "xr.open_zarr(..., mask_and_scale=False) to train on what is "
                             "stored, or rescale batches in a TransformNode")
    group = src.group
    for dim in ds.dims:
        if dim not in ds.coords or group is None or dim not in group.array_keys():
            continue
        stored = group[dim]
        shown = np.asarray(ds[dim].values)
        if not isinstance(stored, zarr.Array) or stored.shape != shown.shape:
            continue  # shapes were checked above through the variables
        # the sample coordinate was decoded when the source was opened
        values = src.sample_coord if dim == src.sample_dim else np.asarray(stored[:])
        if values is None or values.dtype.kind != shown.dtype.kind:
            continue  # undecodable or differently typed: nothing to compare reliably
        if not np.array_equal(values, shown):
            order = ("reversed" if np.array_equal(values[::-1], shown) else
                     "reordered or relabelled")
            raise StoreError(f"coordinate {dim!r} of the Dataset differs from the store "
                             f"{src.url} ({order}: first values {shown[:3].tolist()} vs "
                             f"{values[:3].tolist()}); {how}")


def _sample_coordinate(group: zarr.Group, sample_dim: str | None, n: int) -> np.ndarray | None:
    """The sample dimension's coordinate array, CF-decoded (e.g. hours since ...)."""
    if sample_dim is None or sample_dim not in group.array_keys():
        return None
    arr = group[sample_dim]
    if not isinstance(arr, zarr.Array) or arr.shape != (n,):
        return None
    values = np.asarray(arr[:])
    units = arr.attrs.get("units")
    calendar = arr.attrs.get("calendar", "standard")
    if isinstance(units, str) and " since " in units:
        from xarray.coding.times import decode_cf_datetime

        if calendar is not None and not isinstance(calendar, str):  # xarray fails too
            return values
        try:
            return np.asarray(decode_cf_datetime(values, units, calendar))
        except Exception:
            return values
    return values


def _describe(group: zarr.Group, display: str, variables: Sequence[str] | None,
              sample_dim: str | None, snapshot_id: str | None) -> Source:
    """The ``Source`` of an opened group, however it was given (URL, icechunk, a Group)."""
    with warnings.catch_warnings():
        # zarr warns on every array whose codecs are numcodecs' (HDF5's shuffle + zlib in a
        # virtual NetCDF store): a caution for writers of new stores, which a reader of an
        # archive as it is can do nothing about. The loader decodes them.
        warnings.filterwarnings("ignore", NUMCODECS_WARNING)
        return _describe_group(group, display, variables, sample_dim, snapshot_id)


def _describe_group(group: zarr.Group, display: str, variables: Sequence[str] | None,
                    sample_dim: str | None, snapshot_id: str | None) -> Source:
    if is_anemoi(group):
        return _describe_anemoi(group, display, variables, snapshot_id)
    arrays = dict(group.arrays())
    if not arrays:
        raise StoreError(f"the Zarr group at {display!r} holds no arrays")

    static: tuple[str, ...] = ()
    if variables is None:
        found = discover(arrays, sample_dim)
        chosen, sample_dim, static = list(found.served), found.sample_dim, found.static
        if not chosen:
            raise StoreError(
                f"no data variables found in {display!r}"
                + (f" with first dimension {sample_dim!r}" if sample_dim else "")
                + f"; arrays present: {sorted(arrays)}"
                + (f" ({found.why_skipped()})" if found.skipped else "")
                + ". Pass variables=[...] explicitly."
            )
    else:
        if isinstance(variables, str):
            variables = [variables]
        chosen = list(variables)
        check_chosen(arrays, chosen, display, sample_dim)

    served = [_served(name, arrays[name], dimension_names(arrays[name]), sample_dim, display)
              for name in chosen]
    geoms = [g for g, _ in served]
    opened = [a for _, a in served]
    grid = _common_grid(geoms)
    n = grid.n_samples
    if sample_dim is None and geoms[0].dimension_names:
        sample_dim = geoms[0].dimension_names[0]
    if variables is not None and sample_dim is not None:
        static = tuple(n for n in discover(arrays, sample_dim).static if n not in chosen)
    return Source(url=display, variables=tuple(geoms), grid=grid, arrays=tuple(opened),
                  sample_dim=sample_dim, snapshot_id=snapshot_id,
                  sample_coord=_sample_coordinate(group, sample_dim, n), group=group,
                  static=static, variables_given=variables is not None)


def _served(name: str, arr: zarr.Array, dims: tuple[str | None, ...] | None,
            sample_dim: str | None, display: str,
            ) -> tuple[VariableGeometry, zarr.Array | AxisArray]:
    """One variable's served geometry and what it is read from: the array, or the array
    sampled along ``sample_dim`` where that is not its first dimension."""
    dtype = np.dtype(arr.dtype)
    if dtype.kind not in NUMERIC_KINDS:
        raise ConfigTypeError(
            f"variable {name!r} in {display!r} has dtype {dtype} ({arr.dtype!r}); only "
            "numeric dtypes (bool, integers, floats, complex) can become tensors. Leave it "
            "out of variables=."
        )
    if arr.ndim < 1:
        raise StoreError(f"variable {name!r} in {display!r} is a scalar; it has no sample axis")
    if sample_dim is None or dims is None or dims[0] == sample_dim:
        return _geometry(name, arr, dims), arr
    if sample_dim not in dims:
        raise StoreError(
            f"variable {name!r} has dimensions {dims}, none of them the sample dimension "
            f"{sample_dim!r}: leave it out of variables= (serve it with "
            "static=ib.open_static(...) if it is a field without that axis)")
    moved = AxisArray(arr, sample_first(arr.ndim, dims.index(sample_dim)))
    return replace(_geometry(name, arr, dims), shape=moved.shape, chunks=moved.chunks,
                   shards=None, dimension_names=tuple(dims[k] for k in moved.order)), moved


def _common_grid(geoms: Sequence[VariableGeometry]) -> SampleGrid:
    lengths = {g.name: g.shape[0] for g in geoms}
    if len(set(lengths.values())) > 1:
        raise StoreError(
            f"the variables' sample axes differ in length: {lengths}. All served variables must "
            "share the sample axis; choose variables= with equal first dimensions."
        )
    return SampleGrid(n_samples=geoms[0].shape[0],
                      chunk_size=common_chunk_size([g.sample_chunk for g in geoms]))


def source_of_arrays(arrays: Mapping[str, zarr.Array],
                     dims: Mapping[str, tuple[str | None, ...]], display: str,
                     sample_dim: str, *, group: zarr.Group | None = None,
                     sample_coord: np.ndarray | None = None,
                     snapshot_id: str | None = None, fmt: str = "zarr",
                     coords: Mapping[str, np.ndarray] | None = None) -> Source:
    """A source serving ``arrays`` (by name) whose dimension names are ``dims`` (given:
    formats such as OME-Zarr 0.4 keep them in their own metadata), sampled along
    ``sample_dim`` wherever it stands in each."""
    served = [_served(name, arr, tuple(dims[name]), sample_dim, display)
              for name, arr in arrays.items()]
    geoms = tuple(g for g, _ in served)
    return Source(url=display, variables=geoms, grid=_common_grid(geoms),
                  arrays=tuple(a for _, a in served), sample_dim=sample_dim,
                  snapshot_id=snapshot_id, sample_coord=sample_coord, group=group,
                  format=fmt, variables_given=True, coords=dict(coords or {}))


def _geometry(name: str, arr: zarr.Array, dims: tuple[str | None, ...] | None,
              labels: tuple[str, ...] | None = None) -> VariableGeometry:
    """How ``arr`` is laid out, decoded native-endian."""
    return VariableGeometry(
        name=name, shape=tuple(int(s) for s in arr.shape),
        chunks=tuple(int(c) for c in arr.chunks),
        dtype=np.dtype(arr.dtype).newbyteorder("="), dimension_names=dims,
        shards=tuple(int(s) for s in arr.shards) if arr.shards else None, labels=labels)


def _describe_anemoi(group: zarr.Group, display: str, variables: Sequence[str] | None,
                     snapshot_id: str | None) -> Source:
    """An anemoi dataset: ``data`` served along its dates, its variables as labels of axis
    1 (``variables=`` picks and orders them), ``dates`` as the sample coordinate."""
    layout = read_layout(group, display)
    chosen = None if variables is None else select(layout, variables, display)
    arr = array_in(group, DATA, display)
    geom = _geometry(DATA, arr, layout.dimension_names, labels=layout.variables)
    grid = SampleGrid(n_samples=geom.shape[0], chunk_size=geom.sample_chunk)
    return Source(url=display, variables=(geom,), grid=grid, arrays=(arr,),
                  sample_dim=layout.dimension_names[0], snapshot_id=snapshot_id,
                  sample_coord=layout.dates, group=group, missing=layout.missing,
                  selection=chosen, format="anemoi", variables_given=variables is not None)
