"""Which arrays of a group a source serves: the sample dimension, the data arrays along
it, the static fields without it, the coordinates, and why others are left out; and the
check of a ``variables=`` list against them (what can be served, named apart from the
static fields and coordinates).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import zarr

from ..errors import StoreError, UnknownNameError

NUMERIC_KINDS = "biufc"  # dtype kinds that become tensors


def is_coordinate(name: str, arr: zarr.Array) -> bool:
    dims = dimension_names(arr)
    return dims is not None and name in dims


def dimension_names(arr: zarr.Array) -> tuple[str | None, ...] | None:
    dims = getattr(arr.metadata, "dimension_names", None)
    if dims is None:
        # zarr v2 arrays written by xarray keep their dims in an attribute.
        attr = arr.attrs.get("_ARRAY_DIMENSIONS")
        if not attr:
            return None
        if isinstance(attr, str):  # one name, not a list of letters (xarray reads it so)
            return (attr,)
        if not isinstance(attr, (list, tuple)) or not all(
                d is None or isinstance(d, str) for d in attr):
            raise StoreError(f"the _ARRAY_DIMENSIONS attribute of array {arr.name!r} is "
                             f"{attr!r}, not a list of dimension names")
        dims = attr
    return tuple(dims)


# Preferred names for the sample dimension when several dimensions lead equally many arrays.
_SAMPLE_DIM_NAMES = ("time", "valid_time", "date", "dates", "sample")


@dataclass(frozen=True)
class Discovery:
    """What ``open_source`` found in a group with no ``variables=``: the sample dimension,
    the arrays served along it, the static fields without it, and why others were left out."""

    sample_dim: str | None
    served: tuple[str, ...]
    static: tuple[str, ...]
    skipped: tuple[tuple[str, str], ...]  # (array, why)

    def why_skipped(self) -> str:
        return "; ".join(f"{n}: {why}" for n, why in self.skipped)


def discover(arrays: Mapping[str, zarr.Array], sample_dim: str | None = None) -> Discovery:
    """Sort a group's arrays as WeatherBench2 / ARCO-ERA5 (xarray) stores lay them out.

    The sample dimension, unless given, is the dimension that leads the most data arrays
    (ties: ``time`` and its usual spellings first). Arrays led by it are served; numeric
    arrays without it are static fields; coordinates (an array named like one of its own
    dimensions), scalars and non-numeric arrays are left out, each with the reason. Arrays
    with the sample dimension elsewhere than first are served when ``sample_dim`` names it
    (sampled along that axis), else left out, saying how to ask for them.
    """
    given = sample_dim is not None
    skipped: list[tuple[str, str]] = []
    data: dict[str, zarr.Array] = {}
    for name, arr in sorted(arrays.items()):
        if arr.ndim < 1:
            skipped.append((name, "a scalar"))
        elif is_coordinate(name, arr):
            continue
        elif np.dtype(arr.dtype).kind not in NUMERIC_KINDS:
            skipped.append((name, f"dtype {arr.dtype} cannot become a tensor"))
        else:
            data[name] = arr
    dims = {n: dimension_names(a) for n, a in data.items()}
    if sample_dim is None:
        leading: dict[str, int] = {}
        for d in dims.values():
            if d and d[0] is not None:
                leading[d[0]] = leading.get(d[0], 0) + 1
        if leading:
            best = max(leading.values())
            ties = sorted(k for k, c in leading.items() if c == best)
            preferred = [k for k in _SAMPLE_DIM_NAMES if k in ties]
            sample_dim = preferred[0] if preferred else ties[0]
    if sample_dim is None:  # no dimension names anywhere: every array, as stored
        return Discovery(None, tuple(data), (), tuple(skipped))
    served, static, unnamed = [], [], []
    for name, d in dims.items():
        if d is None:
            unnamed.append(name)
        elif d[0] == sample_dim:
            served.append(name)
        elif sample_dim in d and given:
            served.append(name)  # sampled along that axis, wherever it stands
        elif sample_dim in d:
            skipped.append((name, f"{sample_dim!r} is not its first dimension {d}: pass "
                                  f"sample_dim={sample_dim!r} to sample along it"))
        else:
            static.append(name)
    # Arrays without dimension names (zarr v3 written without them) are served when their
    # first axis is as long as the sample axis of the named ones.
    lengths = {data[n].shape[0] for n in served}
    for name in unnamed:
        if data[name].shape[0] in lengths:
            served.append(name)
        else:
            skipped.append((name, f"no dimension names and {data[name].shape[0]} steps, "
                                  f"not {sorted(lengths)}"))
    return Discovery(sample_dim, tuple(sorted(served)), tuple(static), tuple(skipped))


def is_time_like(dim: str, arrays: Mapping[str, zarr.Array]) -> bool:
    """Whether ``dim`` is a time or sample axis: one of the usual names (``time``,
    ``valid_time``, ``date``, ``dates``, ``sample``), or a dimension whose coordinate holds
    datetimes (datetime64, or CF-encoded: units "<unit> since <date>")."""
    if dim in _SAMPLE_DIM_NAMES:
        return True
    coord = arrays.get(dim)
    if coord is None:
        return False
    if np.dtype(coord.dtype).kind == "M":
        return True
    units = coord.attrs.get("units")
    return isinstance(units, str) and " since " in units


def static_only(arrays: Mapping[str, zarr.Array]) -> tuple[str, ...]:
    """The fields of a group that holds static fields only (an ERA5 invariants store:
    ``lsm(latitude, longitude)``, ``z(latitude, longitude)`` and the 1-D coordinates):
    every numeric array that is not a coordinate, when each of them names its dimensions
    and none of those is a time or sample axis (``is_time_like``). Empty otherwise, so a
    group with a sample axis keeps ``discover``'s reading, and one without dimension names
    is not guessed at. ``discover`` itself still takes a leading dim as the sample axis
    (``open_source`` can serve such a group along ``latitude``); ``open_static`` asks this
    when ``discover`` finds no static field."""
    fields = []
    for name, arr in sorted(arrays.items()):
        if arr.ndim < 1 or is_coordinate(name, arr):
            continue
        if np.dtype(arr.dtype).kind not in NUMERIC_KINDS:
            continue
        dims = dimension_names(arr)
        if dims is None or any(d is None or is_time_like(d, arrays) for d in dims):
            return ()
        fields.append(name)
    return tuple(fields)


def what_is_there(arrays: Mapping[str, zarr.Array], sample_dim: str | None) -> str:
    """The group's arrays by kind, for an error: what can be served, the static fields,
    the coordinates."""
    found = discover(arrays, sample_dim)
    coords = sorted(n for n, a in arrays.items() if is_coordinate(n, a))
    text = f"variables that can be served: {list(found.served)}"
    if found.static:
        text += f"; static fields (static=ib.open_static(...)): {list(found.static)}"
    if coords:
        text += f"; coordinates: {coords}"
    return text


def check_chosen(arrays: Mapping[str, zarr.Array], chosen: list[str], display: str,
                  sample_dim: str | None) -> None:
    """Refuse ``variables=`` naming an array the group lacks, a name twice, a coordinate,
    or (no ``sample_dim`` given) a static field: each names what can be served instead."""
    missing = [n for n in chosen if n not in arrays]
    if missing:
        raise UnknownNameError(f"unknown variable(s) {missing} in {display!r}; "
                               f"{what_is_there(arrays, sample_dim)}")
    if len(set(chosen)) != len(chosen):
        raise StoreError(f"variables lists a name twice: {chosen}")
    coords = [n for n in chosen if is_coordinate(n, arrays[n])]
    if coords:
        raise StoreError(f"variables={chosen} names the coordinate(s) {coords} of "
                         f"{display!r}: their values label an axis, they are not data to "
                         f"serve along one; {what_is_there(arrays, sample_dim)}")
    if sample_dim is None:
        found = discover(arrays)
        static = [n for n in chosen if n in found.static]
        if static and found.sample_dim is not None:
            raise StoreError(f"variables={chosen} names the static field(s) {static} of "
                             f"{display!r} (no {found.sample_dim!r} axis): serve them with "
                             f"static=ib.open_static(source, {static}) beside the variables, "
                             "or pass sample_dim= to serve arrays along another dim; "
                             f"{what_is_there(arrays, None)}")
