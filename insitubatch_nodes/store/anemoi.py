"""anemoi datasets (the format ECMWF's anemoi-training reads), opened as they are.

An anemoi dataset is a Zarr v2 group with one ``data`` array ``(dates, variables, ensemble,
cells)``, chunked one date per chunk, beside ``dates``, ``latitudes``, ``longitudes``, the
per-variable statistics ``mean``/``stdev``/``minimum``/``maximum`` and root attributes
(``variables``, ``frequency``, ``missing_dates``, ``field_shape``). ``anemoi-datasets``
itself pins zarr 2, so users run it elsewhere and hand us the store: we read it with no
anemoi dependency, serving ``data`` with its variables as named labels of axis 1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import zarr

from ..errors import StoreError, UnknownNameError
from .arrays import array_in

DATA = "data"
DATES = "dates"
# The dimension names anemoi-datasets >= 0.4.1 writes; ``anemoi-datasets copy`` drops
# ``_ARRAY_DIMENSIONS`` but keeps the layout, so these are the default.
DIMENSIONS = ("time", "variable", "ensemble", "cell")
STATISTICS = ("mean", "stdev", "minimum", "maximum")


def is_anemoi(group: zarr.Group) -> bool:
    """A group laid out by anemoi-datasets: a 4-D ``data``, ``dates`` and the variable names
    in the root attributes (the three things anemoi's own reader relies on)."""
    names = group.attrs.get("variables")
    if not isinstance(names, (list, tuple)) or not names:
        return False
    keys = set(group.array_keys())
    if DATA not in keys or DATES not in keys:
        return False
    data = group[DATA]
    return isinstance(data, zarr.Array) and data.ndim == 4 and data.shape[1] == len(names)


@dataclass(frozen=True)
class AnemoiLayout:
    """What the root attributes and side arrays of an anemoi dataset say."""

    variables: tuple[str, ...]  # names along the variable axis, in stored order
    dimension_names: tuple[str, ...]
    dates: np.ndarray  # datetime64, one per sample
    missing: tuple[int, ...]  # sample indices of the dates listed in ``missing_dates``


def read_layout(group: zarr.Group, display: str) -> AnemoiLayout:
    """The names, dates and missing dates of an anemoi dataset (``is_anemoi`` holds)."""
    listed_names = group.attrs["variables"]
    if not isinstance(listed_names, (list, tuple)):
        raise StoreError(f"the 'variables' attribute of the anemoi dataset {display!r} is "
                         f"{listed_names!r}, not a list of names")
    names = tuple(str(v) for v in listed_names)
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise StoreError(f"the anemoi dataset {display!r} names variables {dup} twice in its "
                         "'variables' attribute")
    data = array_in(group, DATA, display)
    dims: tuple[str, ...] = DIMENSIONS
    attr = data.attrs.get("_ARRAY_DIMENSIONS") or group.attrs.get("dimensions")
    if isinstance(attr, (list, tuple)) and len(attr) == 4:
        dims = tuple(str(d) for d in attr)
    dates = np.asarray(array_in(group, DATES, display)[:])
    if not np.issubdtype(dates.dtype, np.datetime64):
        raise StoreError(f"the 'dates' array of the anemoi dataset {display!r} has dtype "
                         f"{dates.dtype}; anemoi writes datetime64")
    if dates.shape != (data.shape[0],):
        raise StoreError(f"the anemoi dataset {display!r} has {data.shape[0]} dates in "
                         f"'data' but 'dates' has shape {dates.shape}")
    missing = []
    listed = group.attrs.get("missing_dates") or []
    if not isinstance(listed, (list, tuple)):
        raise StoreError(f"the 'missing_dates' attribute of the anemoi dataset {display!r} is "
                         f"{listed!r}, not a list of dates")
    for d in listed:
        when = np.datetime64(str(d)).astype(dates.dtype)
        hit = np.flatnonzero(dates == when)
        if hit.size != 1:
            raise StoreError(f"missing date {d!r} of the anemoi dataset {display!r} is not "
                             f"one of its dates ({dates[0]} .. {dates[-1]})")
        missing.append(int(hit[0]))
    return AnemoiLayout(names, dims, dates, tuple(sorted(missing)))


def select(layout: AnemoiLayout, variables: Sequence[str] | str, display: str,
           ) -> tuple[str, ...]:
    """``variables`` checked against the dataset's own names, in the order given."""
    chosen = (variables,) if isinstance(variables, str) else tuple(variables)
    unknown = [v for v in chosen if v not in layout.variables]
    if unknown:
        raise UnknownNameError(f"unknown variable(s) {unknown} in the anemoi dataset {display!r}; "
                               f"its variables: {list(layout.variables)}")
    if len(set(chosen)) != len(chosen):
        raise StoreError(f"variables lists a name twice: {list(chosen)}")
    if not chosen:
        raise StoreError(f"variables=[] selects nothing from {display!r}")
    return chosen


def stored_statistics(group: zarr.Group, variables: Sequence[str], display: str,
                      ) -> Mapping[str, np.ndarray]:
    """The per-variable statistics anemoi-datasets stored (one value per name in
    ``variables``, the dataset's variable axis)."""
    have = set(group.array_keys())
    missing = [k for k in STATISTICS if k not in have]
    if missing:
        raise UnknownNameError(f"the anemoi dataset {display!r} has no statistics arrays {missing} "
                               f"(arrays: {sorted(have)}); compute them with ib.compute_stats")
    out = {}
    for k in STATISTICS:
        values = np.asarray(array_in(group, k, display)[:], dtype=np.float64)
        if values.shape != (len(variables),):
            raise StoreError(f"statistics array {k!r} of {display!r} has shape "
                             f"{values.shape}, not one value per variable "
                             f"({len(variables)})")
        out[k] = values
    return out
